"""`python -m common.tiny_sd`: a tiny random-init Stable Diffusion pipeline, built locally, for offline runs.

The same layout as stable-diffusion-v1-5 (UNet2DConditionModel, AutoencoderKL, CLIPTextModel, CLIPTokenizer,
DDPMScheduler with SD's betas), so `StableDiffusionPipeline.from_pretrained` loads it and train_lora.py trains on it
exactly as on the real model, but 2.4 M parameters: 32 px images -> 8x8x4 latents (a 3-level VAE with SD's two
ResNet layers per level, so that encoding costs what it costs in SD relative to the UNet), a 2-level UNet with
cross-attention at both levels, a 2-layer CLIP text encoder (77 tokens). Its weights are random: it produces noise,
not pictures. Nothing is downloaded: the tokenizer's byte-level vocabulary (no merges) is written here.
"""
import argparse
import json
import os
import shutil


def byte_level_vocab():
    """CLIP's layout with no merges: the 256 byte symbols, the same with the end-of-word mark, then BOS and EOS."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return {token: i for i, token in enumerate(tokens)}


def build_tiny_sd(unet_channels=(32, 64), text_dim=32, seed=0):
    """-> StableDiffusionPipeline with random weights (deterministic for a seed)."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(seed)
    vocab = byte_level_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=text_dim, intermediate_size=2 * text_dim, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=text_dim,
        bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"]))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64, 64),
                        down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
                        layers_per_block=2, norm_num_groups=32, sample_size=32)
    with torch.no_grad():  # scale the random VAE's latents to unit variance, as SD's 0.18215 does for its own
        std = vae.encode(torch.rand(16, 3, 32, 32) * 2 - 1).latent_dist.mean.std().item()
    vae.register_to_config(scaling_factor=round(1.0 / std, 5))
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=tuple(unet_channels),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=text_dim, attention_head_dim=4, norm_num_groups=min(unet_channels) // 2)
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear", prediction_type="epsilon", clip_sample=False,
                              steps_offset=1)
    return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def write_tiny_sd(output_dir, **kwargs):
    """Build and save; the folder appears under its final name only when complete."""
    pipe = build_tiny_sd(**kwargs)
    output_dir = output_dir.rstrip("/")
    tmp = output_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    vocab = byte_level_vocab()  # also the classic files, which older transformers versions read
    with open(os.path.join(tmp, "tokenizer", "vocab.json"), "w") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(tmp, "tokenizer", "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write("# tiny-sd\n\nA tiny **random-init** Stable Diffusion pipeline written by `python -m common.tiny_sd`, "
                "for offline smoke runs and tests. It produces noise, not pictures.\n")
    if os.path.exists(output_dir):
        shutil.rmtree(output_dir)
    os.replace(tmp, output_dir)
    return sum(p.numel() for m in (pipe.unet, pipe.vae, pipe.text_encoder) for p in m.parameters())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="models/tiny-sd")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n = write_tiny_sd(args.output_dir, seed=args.seed)
    print(f"wrote a tiny random-init Stable Diffusion pipeline ({n / 1e6:.2f} M parameters) to {args.output_dir}")
