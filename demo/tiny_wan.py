"""`python -m demo.tiny_wan` (`make tiny-wan`): a random-init Wan 2.1 text-to-video pipeline, built locally, offline.

The layout of Wan-AI/Wan2.1-T2V-1.3B-Diffusers (WanPipeline): WanTransformer3DModel (self-attention over the clip's
1 x 2 x 2 patches, cross-attention to the prompt), a UMT5EncoderModel, the 3-D causal AutoencoderKLWan (4x fewer
frames, 8x fewer pixels a side, 16 channels with per-channel latents_mean and latents_std) and
FlowMatchEulerDiscreteScheduler with shift 3 (the real base ships UniPCMultistepScheduler with flow_shift 3: the same
sigmas; Euler is the sampler the recipes draw with). Its weights are random: it produces noise, not videos.

The constructor arguments are those of diffusers' own tests (tests/pipelines/wan/test_wan.py, get_dummy_components);
the tokenizer is demo/tiny_flow.py's character-level T5 vocabulary (UMT5's tokenizer is T5's layout), written here.
The VAE's latents_mean and latents_std are measured on random clips, so that its latents have zero mean and unit
variance, as the real statistics make them.

9 frames of 32 x 32 px -> 3 x 4 x 4 x 16 latents -> 12 tokens of 1 x 2 x 2 patches; a transformer 24 wide (2 heads of
12, 2 blocks); a 2-layer UMT5 32 wide; 0.06 M parameters, 360 KB on disk. --variant ti2v: Wan 2.2 TI2V-5B's
layout, a residual VAE of 48 channels that cuts frames into 2 x 2 patches first (16x fewer pixels a side: sides are
multiples of 32) and the pipeline's per-token timesteps (expand_timesteps); 0.09 M parameters; --variant ti2v-i2v:
the same saved as WanImageToVideoPipeline, TI2V-5B's image-to-video (no image encoder: the first frame's clean
latents take the first latent frame's place); --variant i2v-a14b: Wan 2.2 I2V A14B's layout, two experts whose
transformers take 36 channels (the noise, a 4-channel mask of the first frame, the latents of the first frame followed
by black frames), switched at boundary_ratio 0.9, saved as WanImageToVideoPipeline without an image encoder.
--variant i2v: Wan 2.1 I2V's layout, the same transformer taking the 36 channels and the first frame's CLIP image
embeddings (a CLIP vision model 4 wide, its image processor at 32 px), saved as WanImageToVideoPipeline.
--variant a14b: Wan 2.2 A14B's layout, Wan 2.1's VAE and two experts of the same shape, `transformer` (high noise)
and `transformer_2` (low noise, its own random weights), switched at boundary_ratio 0.875 as the real model's (t >= 875:
`transformer`).

Shape rules the configs keep: the transformer's text_dim = UMT5's d_model; in_channels = out_channels = the VAE's
z_dim (I2V A14B: in_channels 2 z_dim + 4); an image side a multiple of 16 (the VAE's 8 x the patch's 2); a clip
4k + 1 frames.
"""
import argparse

# Wan 2.2 TI2V-5B's layout (diffusers' tests/pipelines/wan/test_wan_22.py, Wan225B): a residual VAE that cuts frames
# into 2 x 2 patches first (48 channels, 16x fewer pixels a side), the pipeline's per-token timesteps (expand_timesteps)
TI2V = {
    "vae": dict(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                dim_mult=[1, 1, 1, 1], num_res_blocks=1, scale_factor_spatial=16, scale_factor_temporal=4,
                temperal_downsample=[False, True, True]),
    "transformer_channels": 48,
}
TINY = {
    "vae": dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]),
    "transformer": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                        qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    "text": dict(d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2, relative_attention_num_buckets=8,
                 relative_attention_max_distance=32, feed_forward_proj="gated-gelu"),
    "scheduler": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
}
BOUNDARY_RATIO = 0.875  # Wan-AI/Wan2.2-T2V-A14B-Diffusers' model_index.json
I2V_BOUNDARY_RATIO = 0.9  # Wan-AI/Wan2.2-I2V-A14B-Diffusers' model_index.json
I2V_VARIANTS = ("i2v", "ti2v-i2v", "i2v-a14b")  # saved as WanImageToVideoPipeline
# Wan 2.1 I2V's image encoder (diffusers' tests/pipelines/wan/test_wan_image_to_video.py): a CLIP vision model 4 wide
TINY_CLIP = dict(hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                 intermediate_size=16, patch_size=1)


def build_tiny_wan(configs=TINY, seed=0, variant="t2v"):
    """-> WanPipeline with random weights (deterministic for a seed), its VAE's latents_mean and latents_std measured
    on random clips; variant "ti2v": Wan 2.2 TI2V-5B's VAE and per-token timesteps; "a14b": Wan 2.2 A14B's two
    experts and boundary_ratio."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    from demo.tiny_flow import t5_tokenizer

    torch.manual_seed(seed)
    tokenizer = t5_tokenizer(model_max_length=512)
    text_encoder = UMT5EncoderModel(UMT5Config(**configs["text"], vocab_size=len(tokenizer),
                                               pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=tokenizer.eos_token_id)).eval()
    ti2v = variant in ("ti2v", "ti2v-i2v")
    vae = AutoencoderKLWan(**(TI2V["vae"] if ti2v else configs["vae"]))
    with torch.no_grad():
        latents = vae.encode(torch.rand(4, 3, 9, 32, 32) * 2 - 1).latent_dist.mean
    dims = (0, 2, 3, 4)
    vae.register_to_config(latents_mean=[round(v, 4) for v in latents.mean(dims).tolist()],
                           latents_std=[round(v, 4) for v in latents.std(dims).clamp(min=1e-3).tolist()])
    channels = TI2V["transformer_channels"] if ti2v else configs["transformer"]["in_channels"]
    transformer = WanTransformer3DModel(**{**configs["transformer"], "in_channels": channels, "out_channels": channels})
    scheduler = FlowMatchEulerDiscreteScheduler(**configs["scheduler"])
    experts = {}
    if variant == "a14b":
        experts = dict(transformer_2=WanTransformer3DModel(**configs["transformer"]), boundary_ratio=BOUNDARY_RATIO)
    clip = {}
    if variant == "i2v":  # Wan 2.1 I2V: the first frame's CLIP image embeddings too (diffusers' tests' CLIP)
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        transformer = WanTransformer3DModel(**{**configs["transformer"], "in_channels": 2 * configs["vae"]["z_dim"] + 4,
                                               "image_dim": TINY_CLIP["hidden_size"]})
        clip = dict(image_encoder=CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP)).eval(),
                    image_processor=CLIPImageProcessor(crop_size=32, size=32))
    if variant == "i2v-a14b":  # the noise, a mask of 4 channels and the first frame's latents, as channels
        condition = {**configs["transformer"], "in_channels": 2 * configs["vae"]["z_dim"] + 4}
        transformer = WanTransformer3DModel(**condition)
        experts = dict(transformer_2=WanTransformer3DModel(**condition), boundary_ratio=I2V_BOUNDARY_RATIO)
    pipeline = WanImageToVideoPipeline if variant in I2V_VARIANTS else WanPipeline
    return pipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                    scheduler=scheduler, expand_timesteps=ti2v, **experts, **clip)


def write_tiny_wan(output_dir, seed=0, variant="t2v"):
    """Build and save; the folder appears under its final name only when complete. -> the number of parameters."""
    from demo.tiny_flow import save_tiny_pipeline

    pipe = build_tiny_wan(seed=seed, variant=variant)
    image = "image=first_frame, " if variant in I2V_VARIANTS else ""
    card = (
        f"A **random-init** Wan {'image' if image else 'text'}-to-video pipeline written by `python -m "
        "demo.tiny_wan`, for offline runs, tests and benchmarks. It produces noise, not videos.\n\n```python\n"
        f"video = pipe({image}prompt=prompt, height=32, width=32, num_frames=9).frames[0]\n```\n")
    return save_tiny_pipeline(pipe, output_dir, card)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="models/tiny-wan", help="The pipeline folder to write.")
    parser.add_argument("--seed", type=int, default=0, help="The seed of the random weights.")
    parser.add_argument("--variant", choices=["t2v", "i2v", "ti2v", "ti2v-i2v", "a14b", "i2v-a14b"], default="t2v",
                        help="t2v: Wan 2.1's layout; i2v: Wan 2.1 I2V's (WanImageToVideoPipeline, a CLIP image "
                             "encoder, 36 channels in); ti2v: Wan 2.2 TI2V-5B's (its VAE, per-token timesteps); "
                             "ti2v-i2v: the same saved as WanImageToVideoPipeline (its image-to-video mode: a first "
                             "frame); a14b: Wan 2.2 A14B's (two experts, boundary_ratio 0.875); i2v-a14b: Wan 2.2 I2V "
                             "A14B's (WanImageToVideoPipeline, two experts taking the first frame's latents and a "
                             "mask beside the noise, 36 channels in; boundary_ratio 0.9).")
    args = parser.parse_args()
    n = write_tiny_wan(args.output_dir, args.seed, args.variant)
    print(f"wrote a random-init tiny Wan pipeline ({n / 1e6:.2f} M parameters) to {args.output_dir}")
