"""Random-init Stable Diffusion 3 and Flux.1 pipelines for offline runs: the configs and the builder behind
`python -m demo.tiny_sd --architecture tiny-sd3|tiny-flux|sd3|flux` (`make tiny-sd3`, `make tiny-flux`).

The real layouts: StableDiffusion3Pipeline (SD3Transformer2DModel, two CLIPTextModelWithProjection, T5EncoderModel,
a 16-channel AutoencoderKL with shift_factor and scaling_factor, FlowMatchEulerDiscreteScheduler with shift 3) and
FluxPipeline (FluxTransformer2DModel with Flux.1-dev's guidance embedding, CLIPTextModel, T5EncoderModel, the same
VAE layout, the scheduler with dynamic shifting). Both tokenizers are written here: CLIP's byte-level vocabulary
(demo/tiny_sd.py) and, for T5, a character-level Unigram vocabulary in T5's layout (<pad> 0, </s> 1, <unk> 2, the
pieces, then 100 sentinels), saved as tokenizer.json, which T5TokenizerFast loads.

tiny-sd3, tiny-flux: 32 px images -> 8x8x16 latents (a 3-level VAE) -> 16 image tokens (SD3: 2x2 patches; Flux: 2x2
packing), transformers 32 wide (SD3: 2 blocks; Flux: 1 double- and 2 single-stream blocks), 2-layer CLIP and T5
encoders; 1.3 M and 1.2 M parameters, about 5 MB each on disk. The native resolution, 32 px, is in the configs where
diffusers reads it: SD3's pipeline defaults to the transformer's sample_size (8) x the VAE factor (4); Flux's pipeline
defaults to 128 x the VAE factor whatever the config says, so it is the VAE's sample_size (32), as real Flux's 1024.
sd3, flux: the architectures of stabilityai/stable-diffusion-3-medium-diffusers and black-forest-labs/FLUX.1-dev
(their model_index.json and component configs), saved in bfloat16 as the published weights are 16-bit, for GPU
benchmarks; build them on a GPU (--device cuda). Their transformers have the published 2,028,328,000 and
11,901,408,320 parameters; the T5 and CLIP embedding tables keep their published rows (tests/test_tiny_flow.py).

Shape rules the configs keep (a violation fails only at the first forward): Flux's in_channels = 4 x the VAE's
latent channels (2x2 packing); sum(axes_dims_rope) = attention_head_dim; joint_attention_dim = T5's d_model;
pooled_projection_dim = the CLIP hidden size (Flux) or the sum of both CLIP projections (SD3); SD3's
caption_projection_dim = its width (heads x head dim), T5's d_model >= the two CLIP hidden sizes together (the
pipeline pads the CLIP states to T5's width), pos_embed_max_size >= latent size / patch size.
"""
import os
import shutil
import string

from demo.tiny_sd import SD15, SDXL, byte_level_vocab, clip_config

# google/t5-v1_1-xxl's encoder, the text_encoder_3 of SD3 and text_encoder_2 of Flux.1 (4.76 G parameters).
T5_XXL = dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128)
# The VAE of both (16 latent channels, no quant convs); the two differ in shift_factor and scaling_factor only.
VAE_16 = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
              down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
              layers_per_block=2, norm_num_groups=32, sample_size=1024, use_quant_conv=False,
              use_post_quant_conv=False, force_upcast=True)

SD3_MEDIUM = {
    "pipeline": "sd3",
    "transformer": dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                        attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                        caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192),
    "vae": dict(VAE_16, scaling_factor=1.5305, shift_factor=0.0609),
    "text": SD15["text"],  # CLIP ViT-L/14, with its projection
    "text_2": SDXL["text_2"],  # OpenCLIP ViT-bigG/14, with its projection
    "t5": T5_XXL,
    "scheduler": dict(num_train_timesteps=1000, shift=3.0),
}

FLUX_DEV = {
    "pipeline": "flux",
    "transformer": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                        guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
    "vae": dict(VAE_16, scaling_factor=0.3611, shift_factor=0.1159),
    "text": SD15["text"],  # CLIP ViT-L/14, pooled output only
    "t5": T5_XXL,
    "scheduler": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                      max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096),
}

def tiny_configs(pipeline):
    """SD3's or Flux.1's layout scaled down (widths 32, 2 layers, 32 px images); the VAE's factors are measured."""
    vae = dict(VAE_16, block_out_channels=(32, 64, 64), down_block_types=["DownEncoderBlock2D"] * 3,
               up_block_types=["UpDecoderBlock2D"] * 3, layers_per_block=1, sample_size=32, force_upcast=False)
    clip = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=77, projection_dim=32, hidden_act="quick_gelu")
    t5 = dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, feed_forward_proj="gated-gelu",
              relative_attention_num_buckets=32, relative_attention_max_distance=128)
    if pipeline == "flux":
        return {"pipeline": "flux", "vae": vae, "text": clip, "t5": t5, "scheduler": FLUX_DEV["scheduler"],
                "transformer": dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
                                    pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))}
    clip_2 = dict(clip, hidden_size=48, intermediate_size=96, projection_dim=48, hidden_act="gelu")
    return {"pipeline": "sd3", "vae": vae, "text": clip, "text_2": clip_2, "t5": dict(t5, d_model=96),
            "scheduler": SD3_MEDIUM["scheduler"],
            "transformer": dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                                attention_head_dim=8, num_attention_heads=4, joint_attention_dim=96,
                                caption_projection_dim=32, pooled_projection_dim=80, pos_embed_max_size=16)}


CONFIGS = {"tiny-sd3": lambda: tiny_configs("sd3"), "tiny-flux": lambda: tiny_configs("flux"),
           "sd3": lambda: SD3_MEDIUM, "flux": lambda: FLUX_DEV}


def save_tiny_pipeline(pipe, output_dir, card):
    """Save `pipe` with `card` (markdown, after a title of the folder's name) as its README.md; the folder appears under
    its final name only when complete. -> the number of parameters."""
    output_dir = output_dir.rstrip("/")
    tmp = output_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write(f"# {os.path.basename(output_dir)}\n\n{card}")
    if os.path.exists(output_dir):
        shutil.rmtree(output_dir)
    os.replace(tmp, output_dir)
    return sum(p.numel() for m in pipe.components.values() if hasattr(m, "parameters") for p in m.parameters())


def t5_tokenizer(model_max_length=512):
    """-> T5TokenizerFast over a Unigram vocabulary of printable ASCII characters: words split into characters after
    T5's "▁" word mark; other characters become <unk>, as many do in T5's own vocabulary."""
    from transformers import T5TokenizerFast

    chars = [c for c in string.printable if c not in string.whitespace]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)] + [(c, -4.0) for c in chars]
    return T5TokenizerFast(vocab=pieces, extra_ids=100, model_max_length=model_max_length)


def shift_and_scale_vae(vae):
    """Move a random VAE's latents to zero mean and unit variance, as the real factors do."""
    import torch

    with torch.no_grad():
        size = vae.config.sample_size
        param = next(vae.parameters())
        x = torch.rand(16, 3, size, size, device=param.device, dtype=param.dtype) * 2 - 1
        latents = vae.encode(x).latent_dist.mean.float()
    shift = round(latents.mean().item(), 4)
    vae.register_to_config(shift_factor=shift, scaling_factor=round(1 / (latents - shift).std().item(), 4))


def build_model(build, device="cpu", dtype=None, empty=False):
    """build() in its final dtype on `device` (a large model initialises far faster on a GPU), then moved to the CPU,
    so that only one model at a time takes memory on the device; `empty`: its weights on the meta device and its
    buffers as built, for demo.tiny_sd's `materialize` to fill."""
    import torch

    if empty:
        from demo.tiny_sd import empty_weights

        with empty_weights():
            return build()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype or default_dtype)
    try:
        with torch.device(device):
            model = build().to(dtype or default_dtype)  # buffers a model makes in float32 too
    finally:
        torch.set_default_dtype(default_dtype)
    return model if device == "meta" else model.cpu()


def build_random_flow(configs, seed=0, device="cpu", dtype=None, empty=False):
    """-> StableDiffusion3Pipeline or FluxPipeline with random weights (deterministic for a seed and device), on the
    CPU; on device "meta" nothing is allocated (for counting parameters and tracing shapes). `empty`: the models'
    weights on the meta device and their buffers as built, for demo.tiny_sd's `materialize` to fill."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    vocab = byte_level_vocab()
    t5_tok = t5_tokenizer()
    t5_config = T5Config(**{"vocab_size": len(t5_tok), **configs["t5"]}, pad_token_id=t5_tok.pad_token_id,
                         eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=t5_tok.pad_token_id)
    sd3 = configs["pipeline"] == "sd3"
    def make(build):
        return build_model(build, device, dtype, empty)

    clip_class = CLIPTextModelWithProjection if sd3 else CLIPTextModel
    parts = {"text_encoder": make(lambda: clip_class(clip_config(configs["text"], vocab))),
             "tokenizer": CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)}
    if sd3:
        parts["text_encoder_2"] = make(lambda: CLIPTextModelWithProjection(clip_config(configs["text_2"], vocab)))
        parts["tokenizer_2"] = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    t5_name = "3" if sd3 else "2"
    parts["text_encoder_" + t5_name] = make(lambda: T5EncoderModel(t5_config))
    parts["tokenizer_" + t5_name] = t5_tok
    vae = make(lambda: AutoencoderKL(**configs["vae"]))
    if "scaling_factor" not in configs["vae"] and not empty:
        shift_and_scale_vae(vae)
    transformer_class = SD3Transformer2DModel if sd3 else FluxTransformer2DModel
    transformer = make(lambda: transformer_class(**configs["transformer"]))
    scheduler = FlowMatchEulerDiscreteScheduler(**configs["scheduler"])
    pipeline_class = StableDiffusion3Pipeline if sd3 else FluxPipeline
    return pipeline_class(transformer=transformer, vae=vae, scheduler=scheduler, image_encoder=None,
                          feature_extractor=None, **parts)
