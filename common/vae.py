"""The VAE's side of the latent diffusion recipes, the same for every family: images to the latent distribution in
fp32 with autocast off (an fp16 VAE, SDXL's above all, overflows into NaN latents, and a cached NaN latent poisons a
whole run), latents to the denoiser's scale and back (the config's shift_factor and scaling_factor; the per-channel
latents_mean/latents_std of SDXL-derived VAEs such as Playground's, as diffusers' SDXL pipeline applies them), and a
pipeline's latents decoded in fp32."""


def vae_factor(vae_config):
    """The VAE's downsampling factor (8 for Stable Diffusion and Flux)."""
    return 2 ** (len(vae_config.get("block_out_channels", (0,) * 4)) - 1)


def vae_sample_size(vae_config):
    """The VAE config's sample_size (the image size the base was made for: 512 for SD 1.5), or None."""
    size = vae_config.get("sample_size")
    return size if isinstance(size, int) else None


def encode_params(vae, pixels):
    """Pixels in [-1, 1] -> the parameters (mean, log-variance) of the VAE's latent distribution, computed in fp32
    with autocast off whatever the run's mixed precision."""
    import torch

    with torch.no_grad(), torch.autocast(vae.device.type, enabled=False):
        return vae.encode(pixels.to(vae.device, torch.float32)).latent_dist.parameters


def _mean_std(config, latents):
    import torch

    mean, std = config.get("latents_mean"), config.get("latents_std")
    if mean is None or std is None:
        return None, None
    shape = (1, -1, *[1] * (latents.ndim - 2))
    return (torch.tensor(mean, dtype=latents.dtype, device=latents.device).view(shape),
            torch.tensor(std, dtype=latents.dtype, device=latents.device).view(shape))


def normalize(vae_config, latents):
    """VAE latents -> the denoiser's latents: (x - latents_mean) * scaling_factor / latents_std when the config has
    per-channel statistics, else (x - shift_factor) * scaling_factor."""
    mean, std = _mean_std(vae_config, latents)
    if mean is not None:
        return (latents - mean) * vae_config["scaling_factor"] / std
    return (latents - (vae_config.get("shift_factor") or 0.0)) * vae_config["scaling_factor"]


def denormalize(vae_config, latents):
    """The inverse of `normalize`: the denoiser's latents -> what the VAE decodes."""
    mean, std = _mean_std(vae_config, latents)
    if mean is not None:
        return latents * std / vae_config["scaling_factor"] + mean
    return latents / vae_config["scaling_factor"] + (vae_config.get("shift_factor") or 0.0)


def sample_latents(params, vae_config):
    """Latents drawn from the distribution's parameters (each step afresh, for training), normalized. Contiguous:
    randn_like draws differ for channels-last tensors."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    return normalize(vae_config, DiagonalGaussianDistribution(params.float().contiguous()).sample())


def mean_latents(params, vae_config):
    """The distribution's mean (no sampling), normalized: what the held-out loss measures on."""
    return normalize(vae_config, params.float().chunk(2, dim=-3)[0])


def decode_fp32(pipe, latents):
    """The denoiser's latents [B, C, h, w] -> PIL images with the pipeline's VAE in fp32 (an fp16 VAE overflows into
    black images), through the pipeline's safety checker when it has one, as its own output_type="pil" would."""
    import torch

    vae = pipe.vae if pipe.vae.dtype == torch.float32 else pipe.vae.to(torch.float32)
    with torch.no_grad(), torch.autocast(vae.device.type, enabled=False):
        image = vae.decode(denormalize(vae.config, latents.float()).to(vae.device)).sample
        nsfw = None
        if getattr(pipe, "safety_checker", None) is not None:
            image, nsfw = pipe.run_safety_checker(image, image.device, pipe.safety_checker.dtype)
    denormalize_pixels = None if nsfw is None else [not flagged for flagged in nsfw]
    return pipe.image_processor.postprocess(image.float(), output_type="pil", do_denormalize=denormalize_pixels)
