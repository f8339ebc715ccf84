"""`python -m demo.tiny_flux2 [--variant klein|dev]`: a random-init FLUX.2 pipeline, built locally, offline (`make
tiny-flux2-klein`, `make tiny-flux2`).

The real layouts, scaled down: Flux2KleinPipeline (FLUX.2 klein: a Qwen3ForCausalLM text encoder, no guidance
embedding) and Flux2Pipeline (FLUX.2 dev: a Mistral3ForConditionalGeneration text encoder with its Pixtral vision
tower, a guidance embedding), both with a Flux2Transformer2DModel, an AutoencoderKLFlux2 and FLUX.2's
FlowMatchEulerDiscreteScheduler. The tokenizers are written here: the 256 byte symbols with no merges (each character
one token), the special tokens of Qwen3's and Mistral's chat formats, and each chat template as a string (Qwen3's with
its empty thinking block; Mistral's system and user turns). The dev tokenizer holds the pipeline's system message as
one added token, so that a short prompt length keeps the prompt (the real tokenizer spends some 40 tokens on it).
FLUX.2 dev's processor (Pixtral's) needs torchvision, which does not import beside the CPU torch here: the pipeline
takes the bare tokenizer, whose apply_chat_template is the one it calls.

Both: 32 px images -> 8x8x4 VAE latents (a 3-level VAE) -> 2x2 patches: 4x4x16, normalized by the VAE's batch-norm
running statistics (measured here on random images, so that the normalization is not the identity) -> 16 image
tokens; a transformer 32 wide (2 heads of 16, RoPE over 4 axes of 4) with 1 double- and 2 single-stream blocks; the
text encoder 16 wide with as many layers as the pipeline's default hidden-state layers need (klein: 28 for layers 9,
18, 27; dev: 31 for 10, 20, 30), so that the pipelines run with their own defaults; the transformer attends to those
three layers side by side (joint_attention_dim 48). 1.1 M parameters (the VAE 0.95 M of them), 4.4 MB on disk.

Shape rules the configs keep (a violation fails only at the first forward): in_channels = 4 x the VAE's latent
channels; sum(axes_dims_rope) = attention_head_dim; joint_attention_dim = 3 x the text encoder's hidden size; the text
encoder has more layers than the largest hidden-state layer the pipeline reads.
"""
import argparse
import json
import os

# The pipeline's system message (diffusers.pipelines.flux2.system_messages.SYSTEM_MESSAGE), kept here so that the
# tokenizer can be written without importing diffusers' pipeline module.
DEV_SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                      "object relationships, object\nattribution and actions without speculation.")
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['content'] is string %}"
    "{%- set text = message['content'] %}{%- else %}{%- set text = message['content'] | selectattr('type', "
    "'equalto', 'text') | map(attribute='text') | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}{%- else %}{{- text + eos_token }}"
    "{%- endif %}{%- endfor %}")
# FLUX.2's scheduler (the published scheduler_config.json): dynamic shifting for sampling, no shift in training.
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")
TEXT_WIDTH = 16
VARIANTS = {"klein": {"pipeline": "Flux2KleinPipeline", "text_layers": 28, "guidance_embeds": False},
            "dev": {"pipeline": "Flux2Pipeline", "text_layers": 31, "guidance_embeds": True}}


def byte_symbols():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}


def qwen3_tokenizer(model_max_length=512):
    """Qwen3's tokenizer layout (Qwen2TokenizerFast: byte-level BPE, here without merges), its chat tokens and
    template."""
    from transformers import Qwen2TokenizerFast

    tokenizer = Qwen2TokenizerFast(vocab=byte_symbols(), merges=[], model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def mistral_tokenizer(model_max_length=512):
    """A byte-level tokenizer with Mistral's special tokens (<s>, </s>, <pad>, [INST], [SYSTEM_PROMPT], ...), its chat
    template, and FLUX.2 dev's system message as one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = byte_symbols()
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>", model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                                                "[/SYSTEM_PROMPT]", "[IMG]"]})
    tokenizer.add_tokens([DEV_SYSTEM_MESSAGE])
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def text_encoder(variant, tokenizer):
    """Qwen3ForCausalLM (klein) or Mistral3ForConditionalGeneration (dev), TEXT_WIDTH wide."""
    layers = VARIANTS[variant]["text_layers"]
    text = dict(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                pad_token_id=tokenizer.pad_token_id)
    if variant == "klein":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**text, tie_word_embeddings=True))
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=8, image_size=32, patch_size=8, num_channels=3)
    config = Mistral3Config(text_config=dict(text, model_type="mistral", bos_token_id=tokenizer.bos_token_id,
                                             eos_token_id=tokenizer.eos_token_id, sliding_window=None),
                            vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
                            spatial_merge_size=2, vision_feature_layer=-1)
    return Mistral3ForConditionalGeneration(config)


def measure_batch_norm(vae, size, seed):
    """Set the VAE's batch-norm running statistics to those of its patchified latent means on random images, as a
    trained VAE's hold its latents' statistics."""
    import torch

    from common.vae import patchify

    with torch.no_grad():
        images = torch.rand(16, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1
        patches = patchify(vae.encode(images).latent_dist.mean, 2)
        vae.bn.running_mean.copy_(patches.mean(dim=(0, 2, 3)))
        vae.bn.running_var.copy_(patches.var(dim=(0, 2, 3)))


def build_tiny_flux2(variant="klein", seed=0):
    """-> Flux2KleinPipeline or Flux2Pipeline with random weights (deterministic for a seed)."""
    import diffusers
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    torch.manual_seed(seed)
    tokenizer = qwen3_tokenizer() if variant == "klein" else mistral_tokenizer()
    encoder = text_encoder(variant, tokenizer)
    vae = AutoencoderKLFlux2(block_out_channels=(32, 64, 64), down_block_types=["DownEncoderBlock2D"] * 3,
                             up_block_types=["UpDecoderBlock2D"] * 3, layers_per_block=1, latent_channels=4,
                             norm_num_groups=32, sample_size=32)
    measure_batch_norm(vae, 32, seed)
    transformer = Flux2Transformer2DModel(in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                                          num_attention_heads=2, joint_attention_dim=3 * TEXT_WIDTH,
                                          timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
                                          guidance_embeds=VARIANTS[variant]["guidance_embeds"])
    pipeline_class = getattr(diffusers, VARIANTS[variant]["pipeline"])
    return pipeline_class(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=encoder,
                          tokenizer=tokenizer, transformer=transformer)


def write_tiny_flux2(output_dir, variant="dev", seed=0):
    """Build and save the tiny pipeline (`variant` "dev" or "klein") with a README. -> its parameter count."""
    pipe = build_tiny_flux2(variant, seed)
    pipe.save_pretrained(output_dir)
    parameters = sum(p.numel() for name in ("transformer", "vae", "text_encoder")
                     for p in getattr(pipe, name).parameters())
    name = "FLUX.2 klein" if variant == "klein" else "FLUX.2 dev"
    with open(os.path.join(output_dir, "README.md"), "w") as f:
        f.write(f"# {os.path.basename(os.path.normpath(output_dir))}\n\nA **random-init** tiny {name} pipeline "
                f"({VARIANTS[variant]['pipeline']}, {parameters / 1e6:.2f} M parameters) written by "
                f"`python -m demo.tiny_flux2 --variant {variant}`, for offline smoke runs: it draws noise, not "
                "pictures. See demo/tiny_flux2.py for its sizes.\n")
    with open(os.path.join(output_dir, "tiny_flux2.json"), "w") as f:
        json.dump({"variant": variant, "seed": seed, "parameters": parameters}, f)
    return parameters


def write_tiny_flux2_klein(output_dir, seed=0):
    """The tiny FLUX.2 klein pipeline (`make tiny-flux2-klein`)."""
    return write_tiny_flux2(output_dir, "klein", seed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=list(VARIANTS), default="klein",
                        help="klein (Flux2KleinPipeline) or dev (Flux2Pipeline).")
    parser.add_argument("--output_dir", default=None, help="Default: models/tiny-flux2-klein or models/tiny-flux2.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    output_dir = args.output_dir or ("models/tiny-flux2-klein" if args.variant == "klein" else "models/tiny-flux2")
    n = write_tiny_flux2(output_dir, args.variant, args.seed)
    print(f"wrote a random-init tiny FLUX.2 {args.variant} pipeline ({n / 1e6:.2f} M parameters) to {output_dir}")


if __name__ == "__main__":
    main()
