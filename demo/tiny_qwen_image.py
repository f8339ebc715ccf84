"""`python -m demo.tiny_qwen_image` (`make tiny-qwen-image`): a random-init Qwen-Image pipeline, built locally, offline.

QwenImagePipeline's layout: QwenImageTransformer2DModel (an MMDiT of dual-stream blocks on 2 x 2 packed latents),
AutoencoderKLQwenImage (a 3-D causal VAE: an image is a clip of one frame; 16 latent channels normalised by the
per-channel latents_mean and latents_std of its config), Qwen2_5_VLForConditionalGeneration as the text encoder (its
last hidden states of the prompt in the pipeline's chat template), a Qwen2Tokenizer, and Qwen/Qwen-Image's own
FlowMatchEulerDiscreteScheduler config (dynamic shifting, shift_terminal 0.02). Real classes, random weights: it draws
noise, not pictures.

The tokenizer is written here: a byte-level BPE over the 256 byte symbols with the special tokens the template uses
(<|endoftext|>, <|im_start|>, <|im_end|>) and just the merges that make each word of the template's system prefix one
token, as Qwen's own vocabulary does: the pipeline drops the first 34 tokens of every encoded prompt
(prompt_template_encode_start_idx), and with these merges those 34 are exactly the template's prefix. Prompts
themselves are tokenized byte by byte.

tiny (default): 32 px images -> 8 x 8 x 16 latents (a 3-level VAE, downsampling 4) -> 16 tokens of 64 channels; a
2-block transformer 32 wide; a 2-layer Qwen2.5-VL text model 32 wide (and the smallest vision tower its config
allows, unused by a text-only pipeline); about 0.8 M parameters. The VAE's latents_mean and latents_std are measured
on random images, as the real ones were measured on pictures. QwenImagePipeline itself draws at 128 latents x the VAE
factor whatever the configs say (512 px here, 1024 px for Qwen-Image): give --height/--width 32 (sample.py) and
--resolution 32 (train_lora.py).

Shape rules the configs keep (a violation fails only at the first forward): the transformer's in_channels = 4 x the
VAE's z_dim and its out_channels = z_dim; joint_attention_dim = the text model's hidden size; sum(axes_dims_rope) =
attention_head_dim; the text model's mrope_section sums to half its head size.
"""
import argparse

# Qwen/Qwen-Image's scheduler/scheduler_config.json.
QWEN_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                            max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                            time_shift_type="exponential", invert_sigmas=False, stochastic_sampling=False,
                            use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False)

TINY = {
    "transformer": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6)),
    "vae": dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True]),
    "text": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, rope_theta=1000000.0, max_position_embeddings=1280,
                 rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"}),
    "vision": dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                   fullatt_block_indexes=[0]),
    "size": 32,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def template_prefix():
    """QwenImagePipeline's prompt template up to the prompt, and how many tokens the pipeline drops from it."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    return pipe.prompt_template_encode.split("{}")[0], pipe.prompt_template_encode_start_idx


def qwen_tokenizer():
    """-> Qwen2Tokenizer: the 256 byte symbols, merges that make each word of the template's prefix one token (left to
    right), and the template's special tokens. Checked: the prefix is as many tokens as the pipeline drops."""
    import re

    from tokenizers import Regex, pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    prefix, dropped = template_prefix()
    tokens = list(bytes_to_unicode().values())
    merges = []
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    for text in re.split("|".join(map(re.escape, SPECIAL_TOKENS)), prefix):
        for word, _ in split.pre_tokenize_str(text):
            for end in range(2, len(word) + 1):
                if word[:end] not in tokens:
                    tokens.append(word[:end])
                    merges.append((word[:end - 1], word[end - 1]))
    tokens += SPECIAL_TOKENS
    tokenizer = Qwen2Tokenizer(vocab={token: i for i, token in enumerate(tokens)}, merges=merges,
                               model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    count = len(tokenizer(prefix).input_ids)
    if count != dropped:
        raise RuntimeError(f"the template's prefix is {count} tokens, the pipeline drops {dropped}")
    return tokenizer


def build_tiny_qwen_image(configs=TINY, seed=0):
    """-> QwenImagePipeline with random weights (deterministic for a seed), on the CPU."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = qwen_tokenizer()
    torch.manual_seed(seed)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text_config = dict(configs["text"], vocab_size=len(tokenizer), bos_token_id=ids["<|endoftext|>"],
                       eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    # (the vision tower and its token ids are unused by a text-only pipeline: ids past the vocabulary)
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=configs["vision"], image_token_id=len(tokenizer),
                              video_token_id=len(tokenizer) + 1, vision_start_token_id=len(tokenizer) + 2,
                              vision_end_token_id=len(tokenizer) + 3)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    vae = AutoencoderKLQwenImage(**configs["vae"], latents_mean=[0.0] * configs["vae"]["z_dim"],
                                 latents_std=[1.0] * configs["vae"]["z_dim"])
    with torch.no_grad():
        # A trained VAE's posterior is narrow: the log-variance half of quant_conv's output set to -12 (std 0.0025),
        # so that a drawn latent is its mean plus little noise, as with the real VAE, not noise alone.
        z_dim = configs["vae"]["z_dim"]
        vae.quant_conv.weight[z_dim:] = 0
        vae.quant_conv.bias[z_dim:] = -12.0
        # each channel's mean and std over random images, as the real ones were measured on pictures
        size = configs["size"]
        latents = vae.encode(torch.rand(16, 3, 1, size, size) * 2 - 1).latent_dist.mean.transpose(0, 1).flatten(1)
    vae.register_to_config(latents_mean=[round(v, 4) for v in latents.mean(1).tolist()],
                           latents_std=[round(v, 4) for v in latents.std(1).tolist()])
    transformer = QwenImageTransformer2DModel(**configs["transformer"])
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)


def write_tiny_qwen_image(output_dir, seed=0):
    """Build and save; the folder appears under its final name only when complete. -> the number of parameters."""
    from demo.tiny_flow import save_tiny_pipeline

    pipe = build_tiny_qwen_image(seed=seed)
    card = (
        "A **random-init** Qwen-Image pipeline (QwenImagePipeline) written by `python -m demo.tiny_qwen_image`, for "
        "offline runs and tests. It draws noise, not pictures; it trains and samples at 32 px (give --resolution 32, "
        "--height 32 --width 32).\n")
    return save_tiny_pipeline(pipe, output_dir, card)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="models/tiny-qwen-image", help="The pipeline folder to write.")
    parser.add_argument("--seed", type=int, default=0, help="The seed of the random weights.")
    args = parser.parse_args()
    n = write_tiny_qwen_image(args.output_dir, args.seed)
    print(f"wrote a random-init Qwen-Image pipeline ({n / 1e6:.2f} M parameters) to {args.output_dir}")
