"""Images from a text-to-image pipeline of any family, as sample.py draws them: the pipeline loaded with its VAE in
fp32, one generator per image (so an image does not depend on the batch it is drawn in), latents decoded by that VAE.
train_lora.py draws DreamBooth's class images with it too."""


def load_pipeline(family, base, flag, dtype, drop=(), edit=False, **source):
    """The family's pipeline from `base` in `dtype` (`edit`: its edit pipeline, which draws from reference images),
    its VAE in fp32 whatever `dtype` says (an fp16 VAE decodes into black images, SDXL's above all); `drop`:
    components left out (None); source: revision, variant, cache_dir. A base that does not load: one line naming
    `flag`."""
    import diffusers
    import torch

    from .base_models import load_error

    try:
        vae_class = getattr(diffusers, family.COMPONENTS["vae"][1])
        vae = vae_class.from_pretrained(base, subfolder="vae", dtype=torch.float32, **source)
        pipeline = getattr(diffusers, family.EDIT_PIPELINE if edit else family.PIPELINE)
        return pipeline.from_pretrained(base, vae=vae, dtype=dtype, **source, **{name: None for name in drop})
    except (OSError, ValueError) as err:
        raise load_error(flag, base, err) from None


def draw_images(pipe, family, prompts, seeds, height, width, steps, guidance, negative_prompt=None, **kwargs):
    """One batch: prompts[i] from torch.Generator().manual_seed(seeds[i]) -> PIL images. kwargs: the family's other
    pipeline arguments (max_sequence_length, clip_skip, ...)."""
    import torch

    from .vae import decode_fp32

    kwargs.update(family.guidance_kwargs(getattr(pipe, family.DENOISER).config, guidance, len(prompts))[0])
    if negative_prompt:
        kwargs["negative_prompt"] = [negative_prompt] * len(prompts)
    with torch.no_grad():
        latents = pipe(prompt=list(prompts), height=height, width=width, num_inference_steps=steps,
                       generator=[torch.Generator().manual_seed(seed) for seed in seeds], output_type="latent",
                       **kwargs)[0]
    return decode_fp32(pipe, family.unpack_latents(pipe, latents, height, width), family.latent_config(pipe.vae))
