"""The VAE's side of the latent diffusion recipes, the same for every family: images to the latent distribution in
fp32 with autocast off (an fp16 VAE, SDXL's above all, overflows into NaN latents, and a cached NaN latent poisons a
whole run), latents to the denoiser's scale and back (the config's shift_factor and scaling_factor; the per-channel
latents_mean/latents_std of SDXL-derived VAEs such as Playground's and of Qwen-Image's, as their pipelines apply them;
FLUX.2's 2 x 2 patches normalized by its batch-norm statistics: the dict a family's latent_config gives), and a
pipeline's latents decoded in fp32. A 3-D causal VAE (Qwen-Image's, Wan's) sees an image as a clip of one frame."""


def vae_factor(vae_config):
    """The VAE's downsampling factor (8 for Stable Diffusion, Flux and Qwen-Image; a 3-D VAE's as its pipelines
    count it, one halving per temporal level)."""
    if is_video_vae(vae_config):  # (Wan 2.2's: 2 x 2 patches before its levels, scale_factor_spatial 16)
        return vae_config.get("scale_factor_spatial") or 2 ** len(vae_config["temperal_downsample"])
    return 2 ** (len(vae_config.get("block_out_channels", (0,) * 4)) - 1)


def vae_sample_size(vae_config):
    """The VAE config's sample_size (the image size the base was made for: 512 for SD 1.5), or None."""
    size = vae_config.get("sample_size")
    return size if isinstance(size, int) else None


def is_video_vae(vae_config):
    """A 3-D causal VAE (Qwen-Image's AutoencoderKLQwenImage, Wan's AutoencoderKLWan: diffusers spells their
    temporal downsampling `temperal_downsample`), which takes [B, C, frames, H, W]."""
    return "temperal_downsample" in vae_config


def encode_params(vae, pixels):
    """Pixels in [-1, 1] -> the parameters (mean, log-variance) of the VAE's latent distribution, computed in fp32
    with autocast off whatever the run's mixed precision. Images [B, 3, H, W] through a 3-D VAE go in as one frame and
    come out as [B, 2C, h, w]; clips [B, F, 3, H, W] (the data's layout) go in as [B, 3, F, H, W] and come out as
    [B, 2C, f, h, w]."""
    import torch

    one_frame = pixels.ndim == 4 and is_video_vae(vae.config)
    pixels = pixels[:, :, None] if one_frame else pixels.transpose(1, 2) if pixels.ndim == 5 else pixels
    device = vae.device  # (once: diffusers looks for offloading hooks in every submodule each time)
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        params = vae.encode(pixels.to(device, torch.float32)).latent_dist.parameters
    return params[:, :, 0] if one_frame else params


def _mean_std(config, latents):
    import torch

    mean, std = config.get("latents_mean"), config.get("latents_std")
    if mean is None or std is None:
        return None, None
    shape = (1, -1, *[1] * (latents.ndim - 2))
    return (torch.tensor(mean, dtype=latents.dtype, device=latents.device).view(shape),
            torch.tensor(std, dtype=latents.dtype, device=latents.device).view(shape))


def patchify(latents, patch):
    """[B, C, H, W] -> [B, C * patch^2, H / patch, W / patch], each channel's patch side by side (FLUX.2's layout)."""
    b, c, h, w = latents.shape
    return (latents.view(b, c, h // patch, patch, w // patch, patch).permute(0, 1, 3, 5, 2, 4)
            .reshape(b, c * patch * patch, h // patch, w // patch))


def unpatchify(latents, patch):
    """patchify's inverse."""
    b, c, h, w = latents.shape
    return (latents.reshape(b, c // (patch * patch), patch, patch, h, w).permute(0, 1, 4, 2, 5, 3)
            .reshape(b, c // (patch * patch), h * patch, w * patch))


def normalize(vae_config, latents):
    """VAE latents -> the denoiser's latents: (x - latents_mean) * scaling_factor / latents_std when the config has
    per-channel statistics, else (x - shift_factor) * scaling_factor (a missing scaling_factor is 1); with
    `latent_patch` (FLUX.2), the latents are first cut into patches of that side, whose channels the statistics
    describe."""
    patch = vae_config.get("latent_patch")
    latents = patchify(latents, patch) if patch else latents
    scale = vae_config.get("scaling_factor") or 1.0
    mean, std = _mean_std(vae_config, latents)
    if mean is not None:
        return (latents - mean) * scale / std
    return (latents - (vae_config.get("shift_factor") or 0.0)) * scale


def denormalize(vae_config, latents):
    """The inverse of `normalize`: the denoiser's latents -> what the VAE decodes."""
    scale = vae_config.get("scaling_factor") or 1.0
    mean, std = _mean_std(vae_config, latents)
    if mean is not None:
        latents = latents * std / scale + mean
    else:
        latents = latents / scale + (vae_config.get("shift_factor") or 0.0)
    patch = vae_config.get("latent_patch")
    return unpatchify(latents, patch) if patch else latents


def sample_latents(params, vae_config, mode="sample"):
    """Latents drawn from the distribution's parameters (each step afresh, for training), normalized; mode "mode":
    its mean (--vae_encode_mode, diffusers' name), as also when the family's latent_config says `latent_mode`
    (diffusers' Z-Image and FLUX.2 scripts train on it). Contiguous: randn_like draws differ for channels-last
    tensors."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    distribution = DiagonalGaussianDistribution(params.float().contiguous())
    use_mode = mode == "mode" or vae_config.get("latent_mode")
    return normalize(vae_config, distribution.mode() if use_mode else distribution.sample())


def mean_latents(params, vae_config):
    """The distribution's mean (no sampling), normalized: what the held-out loss measures on (params [2C, h, w] of
    one image, or a batch's: [B, 2C, h, w], clips [B, 2C, f, h, w])."""
    mean = params.float().chunk(2, dim=0 if params.ndim == 3 else 1)[0]
    return normalize(vae_config, mean[None])[0] if mean.ndim == 3 else normalize(vae_config, mean)


def decode_fp32(pipe, latents, latent_config=None):
    """The denoiser's latents [B, C, h, w] -> PIL images with the pipeline's VAE in fp32 (an fp16 VAE overflows into
    black images), through the pipeline's safety checker when it has one, as its own output_type="pil" would; a
    video family's clips [B, C, f, h, w] -> a list of frames (PIL images) per clip, as its output_type="pil".
    latent_config: the family's (family.latent_config(pipe.vae)); default the VAE's config."""
    import torch

    vae = pipe.vae if pipe.vae.dtype == torch.float32 else pipe.vae.to(torch.float32)
    with torch.no_grad(), torch.autocast(vae.device.type, enabled=False):
        latents = denormalize(latent_config or dict(vae.config), latents.float()).to(vae.device)
        one_frame = latents.ndim == 4 and is_video_vae(vae.config)
        image = vae.decode(latents[:, :, None] if one_frame else latents).sample
        image = image[:, :, 0] if one_frame else image
        if image.ndim == 5:  # clips [B, 3, F, H, W]
            return pipe.video_processor.postprocess_video(image.float(), output_type="pil")
        nsfw = None
        if getattr(pipe, "safety_checker", None) is not None:
            image, nsfw = pipe.run_safety_checker(image, image.device, pipe.safety_checker.dtype)
    denormalize_pixels = None if nsfw is None else [not flagged for flagged in nsfw]
    processor = getattr(pipe, "image_processor", None) or pipe.video_processor
    return processor.postprocess(image.float(), output_type="pil", do_denormalize=denormalize_pixels)
