"""Draw images from a UNet2DModel + scheduler, unconditional or class-conditional with classifier-free guidance.

One loop for train_ddpm.py's validation and sample.py. The starting noise comes from a seeded CPU generator, so
the same seed gives the same pixels on any device; the schedulers that want it get `scale_model_input`. Guidance
is uncond + w * (cond - uncond), the unconditional prediction being the model's answer for the null class (the
last class id, learned through class dropout); at w = 1 only the conditional pass runs.
"""
import inspect

# The defaults of train_ddpm.py's validation and of sample.py: DDIM in 50 steps, guidance chosen by measurement on
# the digits demo (accuracy of a separate classifier on the samples; table in the README).
DEFAULT_SCHEDULER = "ddim"
DEFAULT_INFERENCE_STEPS = 50
DEFAULT_GUIDANCE_SCALE = 1.5

SCHEDULER_CLASSES = {
    "ddpm": "DDPMScheduler", "ddim": "DDIMScheduler", "dpm": "DPMSolverMultistepScheduler",
    "euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler", "pndm": "PNDMScheduler",
    "unipc": "UniPCMultistepScheduler",
}


def make_scheduler(name, config):
    """A sampler `name` (a SCHEDULER_CLASSES key) with the noise schedule of the training scheduler's config."""
    import diffusers

    return getattr(diffusers, SCHEDULER_CLASSES[name]).from_config(config)


def sample_images(unet, scheduler, num_images, *, class_labels=None, null_class=None, guidance_scale=1.0,
                  num_inference_steps=DEFAULT_INFERENCE_STEPS, batch_size=64, generator=None):
    """-> float tensor [num_images, C, H, W] in [0, 1] on the CPU.

    class_labels: ids (one per image) for a class-conditional UNet, None for an unconditional one.
    null_class: the id the model learned as "no class" (needed when guidance_scale != 1).
    """
    import torch  # here, not at the top: the scripts import this module's defaults before parsing their flags

    device, dtype = unet.device, unet.dtype
    channels, size = unet.config.in_channels, unet.config.sample_size
    guided = class_labels is not None and guidance_scale != 1.0
    if guided and null_class is None:
        raise ValueError("classifier-free guidance needs the null class id")
    step_kwargs = {"generator": generator} if "generator" in inspect.signature(scheduler.step).parameters else {}
    batches = []
    for start in range(0, num_images, batch_size):
        n = min(batch_size, num_images - start)
        sample = torch.randn((n, channels, size, size), generator=generator).to(device) * scheduler.init_noise_sigma
        labels = None if class_labels is None else torch.as_tensor(class_labels[start:start + n]).to(device)
        if guided:  # one forward pass for both predictions
            labels = torch.cat([labels, torch.full_like(labels, null_class)])
        scheduler.set_timesteps(num_inference_steps, device=device)  # also resets multistep solvers' history
        for t in scheduler.timesteps:
            model_input = scheduler.scale_model_input(sample, t)
            if guided:
                model_input = torch.cat([model_input, model_input])
            with torch.no_grad():
                prediction = unet(model_input.to(dtype), t, class_labels=labels).sample.float()
            if guided:
                cond, uncond = prediction.chunk(2)
                prediction = uncond + guidance_scale * (cond - uncond)
            sample = scheduler.step(prediction, t, sample, **step_kwargs).prev_sample
        batches.append((sample / 2 + 0.5).clamp(0, 1).cpu())
    return torch.cat(batches)


def to_pil(images):
    """[N, C, H, W] floats in [0, 1] -> N PIL images (RGB, or L for one channel)."""
    import torch
    from PIL import Image

    array = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in array]


def image_grid(images, ncol):
    """PIL images of one size -> one PIL image, `ncol` per row."""
    from PIL import Image

    w, h = images[0].size
    ncol = min(ncol, len(images))
    grid = Image.new("RGB", (ncol * w, -(-len(images) // ncol) * h), "white")
    for i, image in enumerate(images):
        grid.paste(image, ((i % ncol) * w, (i // ncol) * h))
    return grid
