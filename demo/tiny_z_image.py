"""`python -m demo.tiny_z_image` (`make tiny-z-image`): a random-init Z-Image pipeline, built locally, offline.

The layout of Tongyi-MAI/Z-Image-Turbo (ZImagePipeline): ZImageTransformer2DModel (a single-stream transformer: the
image's 2 x 2 patches and the prompt's tokens, each through its own refiner blocks, then together), a Qwen3Model text
encoder read at its penultimate layer (hidden_states[-2]) over the prompt wrapped in Qwen3's chat template, Flux.1's
16-channel AutoencoderKL with shift_factor and scaling_factor, and FlowMatchEulerDiscreteScheduler with shift 3 (no
dynamic shifting). Its weights are random: it produces noise, not pictures.

The tokenizer is written here: Qwen2Tokenizer over a byte-level BPE vocabulary with no merges (each UTF-8 byte one
token), Qwen's special tokens (<|endoftext|> for padding, <|im_start|>, <|im_end|>, <think>, </think>) and a chat
template that writes what Qwen3's writes for user messages (`<|im_start|>user\\n...<|im_end|>\\n`, then
`<|im_start|>assistant\\n`, and an empty think block when enable_thinking is false), which the pipeline applies.

32 px images -> 8 x 8 x 16 latents (a 3-level VAE) -> 16 image tokens of 2 x 2 patches; a transformer 32 wide (2 heads
of 16, RoPE axes 8 + 4 + 4) with Z-Image's 2 noise-refiner and 2 context-refiner blocks and 2 main blocks; a 2-layer
Qwen3 32 wide (4 heads, 2 key-value heads); 1.4 M parameters (the VAE 1.0 M, the transformer 0.39 M: most of it the
timestep embedder's fixed 1024-wide hidden layer), about 5.6 MB on disk.

Shape rules the configs keep (a violation fails only at the first forward): the transformer's cap_feat_dim = the text
encoder's hidden_size; in_channels = the VAE's latent channels; dim / n_heads = sum(axes_dims); axes_lens[0] > the
prompt length rounded up to 32, plus 1 (the image's first position follows the prompt's).
"""
import argparse

# Qwen3's chat template, the part a user message and the generation prompt use.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

TINY = {
    "transformer": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
                        n_refiner_layers=2, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=32,
                        rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[1536, 512, 512]),
    "text": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, rms_norm_eps=1e-6,
                 tie_word_embeddings=True),
    "vae": dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 64, 64),
                down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
                layers_per_block=1, norm_num_groups=32, sample_size=32, use_quant_conv=False,
                use_post_quant_conv=False, force_upcast=False),
    "scheduler": dict(num_train_timesteps=1000, use_dynamic_shifting=False, shift=3.0),
}


def qwen_tokenizer():
    """-> Qwen2Tokenizer over the 256 byte symbols and Qwen's special tokens, with the chat template."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + SPECIAL_TOKENS
    vocab = {token: i for i, token in enumerate(tokens)}
    return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                          additional_special_tokens=SPECIAL_TOKENS[1:], chat_template=CHAT_TEMPLATE,
                          model_max_length=131072)  # (Qwen3's)


def build_tiny_z_image(configs=TINY, seed=0):
    """-> ZImagePipeline with random weights (deterministic for a seed), its VAE's shift and scaling factors measured
    so that its latents have zero mean and unit variance, as the real factors make them."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    text_encoder = Qwen3Model(Qwen3Config(**configs["text"], vocab_size=len(tokenizer),
                                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    vae = AutoencoderKL(**configs["vae"])
    with torch.no_grad():
        size = configs["vae"]["sample_size"]
        latents = vae.encode(torch.rand(16, 3, size, size) * 2 - 1).latent_dist.mean
    shift = round(latents.mean().item(), 4)
    vae.register_to_config(shift_factor=shift, scaling_factor=round(1 / (latents - shift).std().item(), 4))
    transformer = ZImageTransformer2DModel(**configs["transformer"])
    with torch.no_grad():  # (the model leaves its padding tokens uninitialised: torch.empty)
        transformer.x_pad_token.normal_(std=0.02)
        transformer.cap_pad_token.normal_(std=0.02)
    scheduler = FlowMatchEulerDiscreteScheduler(**configs["scheduler"])
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)


def write_tiny_z_image(output_dir, seed=0):
    """Build and save; the folder appears under its final name only when complete. -> the number of parameters."""
    from demo.tiny_flow import save_tiny_pipeline

    pipe = build_tiny_z_image(seed=seed)
    card = (
        "A **random-init** Z-Image pipeline written by `python -m demo.tiny_z_image`, for offline runs, tests and "
        "benchmarks. It produces noise, not pictures.\n")
    return save_tiny_pipeline(pipe, output_dir, card)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="models/tiny-z-image", help="The pipeline folder to write.")
    parser.add_argument("--seed", type=int, default=0, help="The seed of the random weights.")
    args = parser.parse_args()
    n = write_tiny_z_image(args.output_dir, args.seed)
    print(f"wrote a random-init tiny Z-Image pipeline ({n / 1e6:.2f} M parameters) to {args.output_dir}")
