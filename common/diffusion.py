"""Diffusion helpers shared by the diffusion trainers, sample.py and inspect_pipeline.py: the training target and
loss weights, the samplers built from a training scheduler, and the class-conditional DDPM sampling loop.

The sampling loop draws its starting noise from a seeded CPU generator, so the same seed gives the same pixels on any
device; guidance is uncond + w * (cond - uncond), the unconditional prediction being the model's answer for the null
class (the last class id, learned through class dropout); at w = 1 only the conditional pass runs.
"""
import inspect

# The defaults of train_ddpm.py's validation and of sample.py for its outputs: DDIM in 50 steps, guidance chosen by
# measurement on the digits demo (the accuracy of a separate classifier on the samples).
DEFAULT_SCHEDULER = "ddim"
DEFAULT_INFERENCE_STEPS = 50
DEFAULT_GUIDANCE_SCALE = 1.5

SCHEDULER_CLASSES = {
    "ddpm": "DDPMScheduler", "ddim": "DDIMScheduler", "dpm": "DPMSolverMultistepScheduler",
    "euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler", "pndm": "PNDMScheduler",
    "unipc": "UniPCMultistepScheduler",
}
# What a sampler must share with the scheduler the model was trained with: the noise schedule, what the model
# predicts, and where the inference timesteps fall. Passed explicitly: `from_config` drops every key a config only
# holds by default (`_use_default_values`, e.g. SD 1.5's missing prediction_type), and the new class then uses
# its own default (epsilon; linspace spacing), which silently differs from the training scheduler's.
TRAINING_SETTINGS = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas",
                     "prediction_type", "timestep_spacing", "steps_offset", "rescale_betas_zero_snr", "shift",
                     "use_dynamic_shifting", "base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len")
# The flow-matching families' sampler: the pipelines' own (their schedulers' shifts kept)
FLOW_SCHEDULER_CLASSES = {"euler": "FlowMatchEulerDiscreteScheduler"}


def sampling_scheduler(name, training_config, classes=None):
    """A sampler `name` (a key of `classes`, default SCHEDULER_CLASSES: a family's SAMPLERS) with the training
    scheduler's settings (TRAINING_SETTINGS).

    training_config: the config of the scheduler the model was trained with (in memory or loaded from disk: the
    result is the same, so a run's validation images and sample.py's agree)."""
    import diffusers

    cls = getattr(diffusers, (classes or SCHEDULER_CLASSES)[name])
    return cls.from_config(training_config, **sampler_settings(cls, training_config))


def sampler_settings(cls, training_config):
    """The TRAINING_SETTINGS of `training_config` that the sampler class `cls` takes."""
    accepted = inspect.signature(cls.__init__).parameters
    settings = {key: training_config[key] for key in TRAINING_SETTINGS if key in training_config and key in accepted}
    if "shift" in accepted and "shift" not in training_config and training_config.get("flow_shift"):
        settings["shift"] = training_config["flow_shift"]  # (UniPC's flow-matching mode, Wan's: its name for it)
    return settings


def diffusion_target(scheduler, clean, noise, timesteps):
    """What the model learns to predict from the noisy input: the noise, v, or the clean sample."""
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return scheduler.get_velocity(clean, noise, timesteps)
    return clean


def min_snr_weights(snr, gamma, prediction_type):
    """Min-SNR-gamma (Hang et al., 2023) per-sample loss weights, expressed for the chosen target."""
    import torch

    clipped = snr.clamp(max=gamma)
    if prediction_type == "sample":
        return clipped
    weights = clipped / (snr + 1) if prediction_type == "v_prediction" else clipped / snr
    return torch.where(snr > 0, weights, torch.ones_like(weights))  # zero terminal SNR: plain MSE there


def diffusion_loss(prediction, target, scheduler, timesteps, snr_gamma=None):
    """Mean squared error over each sample, min-SNR-weighted when `snr_gamma` is given, averaged over the batch."""
    import torch.nn.functional as F
    from diffusers.training_utils import compute_snr

    loss = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=tuple(range(1, target.ndim)))
    if snr_gamma:
        loss = loss * min_snr_weights(compute_snr(scheduler, timesteps), snr_gamma, scheduler.config.prediction_type)
    return loss.mean()


def sample_images(unet, scheduler, num_images, *, class_labels=None, null_class=None, guidance_scale=1.0,
                  num_inference_steps=DEFAULT_INFERENCE_STEPS, batch_size=64, generator=None):
    """-> float tensor [num_images, C, H, W] in [0, 1] on the CPU, from a UNet2DModel.

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
        # set_timesteps first: it also resets multistep solvers' history, and it sets init_noise_sigma (Euler's is
        # the sigma of the first inference step, ~14.6 for 50 steps, not the ~20,000 of the training schedule's end)
        scheduler.set_timesteps(num_inference_steps, device=device)
        sample = torch.randn((n, channels, size, size), generator=generator).to(device) * scheduler.init_noise_sigma
        labels = None if class_labels is None else torch.as_tensor(class_labels[start:start + n]).to(device)
        if guided:  # one forward pass for both predictions
            labels = torch.cat([labels, torch.full_like(labels, null_class)])
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
