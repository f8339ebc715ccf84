"""A held-out validation loss for the Stable Diffusion trainers (--validation_split): the mean denoising loss over
images the run never trains on, at fixed timesteps and with fixed noise, so that the curve is comparable from one
validation to the next (a rising one is over-fitting) and between runs on the same data.

Every held-out image is seen at TIMESTEPS timesteps, one in each equal slice of [0, T), spread over the images; the
latent is the mean of the VAE's latent distribution (no sampling) and the noise comes from a generator seeded once.
The images are shared out between processes and the sums reduced, so the value does not depend on the process count
beyond float rounding.
"""
from .cli import UserError

TIMESTEPS = 4  # per held-out image


def load_with_validation(args, **load_kwargs):
    """-> (train, held-out or None) `datasets.Dataset`s for --validation_split (a share carved from train with a
    fixed seed, or a named split of the dataset)."""
    import argparse

    from .image_data import load_image_dataset

    if args.validation_split is None:
        return load_image_dataset(args, carve_eval=False, **load_kwargs)[0], None
    if isinstance(args.validation_split, float):
        train, held_out, _ = load_image_dataset(args, validation_split=args.validation_split, **load_kwargs)
        return train, held_out
    named = argparse.Namespace(**{**vars(args), "eval_split": args.validation_split})
    train, held_out = load_image_dataset(named, carve_eval=False, **load_kwargs)
    if held_out is None:
        raise UserError(f"--validation_split '{args.validation_split}' is not a split of the dataset; give a share "
                        "of the training images instead, e.g. 0.05")
    return train, held_out


class HeldOutLoss:
    """loss = HeldOutLoss(held_out, encode, vae_config, prompt_ids, ...); loss(unet, embed) -> float (every process).

    held_out: an ImageDataset of the held-out images (no flips; buckets allowed); encode(pixels) -> the VAE's latent
    parameters; prompt_ids: each image's key for `embed` (its prompt's index); embed(ids) -> encoder hidden states,
    or (encoder hidden states, the UNet's added_cond_kwargs) for SDXL.
    """

    def __init__(self, held_out, encode, vae_config, prompt_ids, num_train_timesteps, accelerator, seed,
                 batch_size):
        import torch

        n, k = len(held_out), TIMESTEPS
        self.accelerator, self.batch_size = accelerator, batch_size
        generator = torch.Generator().manual_seed(seed)
        shift, scale = vae_config.shift_factor or 0.0, vae_config.scaling_factor
        items = []  # (latent, noise, timestep, prompt id) of this process's share, grouped by shape below
        for i in range(n):
            params = encode(held_out[i]["pixel_values"][None])[0].cpu().float()
            latent = (params.chunk(2)[0] - shift) * scale  # the distribution's mean: no sampling
            for j in range(k):
                noise = torch.randn(latent.shape, generator=generator)  # drawn for every item on every process
                timestep = int((j + (i + 0.5) / n) / k * num_train_timesteps)
                if (i * k + j) % accelerator.num_processes == accelerator.process_index:
                    items.append((latent, noise, timestep, prompt_ids[i]))
        self.batches = []
        for shape in sorted({tuple(item[0].shape) for item in items}):
            same = [item for item in items if tuple(item[0].shape) == shape]
            for start in range(0, len(same), batch_size):
                latents, noise, timesteps, ids = zip(*same[start:start + batch_size])
                self.batches.append((torch.stack(latents), torch.stack(noise), torch.tensor(timesteps),
                                     torch.tensor(ids)))
        self.count = n * k
        self.losses = {}  # step -> val/loss, as logged

    def log(self, step, unet, embed, scheduler):
        """The loss now (see __call__), kept in `losses` and logged to the trackers as val/loss."""
        self.losses[step] = self(unet, embed, scheduler)
        self.accelerator.log({"val/loss": self.losses[step]}, step=step)

    def results(self):
        """What all_results.json gets: the last value and the curve."""
        return {"validation_loss": self.losses[max(self.losses)], "validation_losses": self.losses}

    def __call__(self, unet, embed, scheduler):
        """The mean loss (MSE against the scheduler's target, unweighted) of `unet` (unwrapped) over all items."""
        import torch
        import torch.nn.functional as F

        from .diffusion import diffusion_target

        device, training = self.accelerator.device, unet.training
        unet.eval()
        total = torch.zeros((), device=device, dtype=torch.float64)
        with torch.no_grad(), self.accelerator.autocast():
            for latents, noise, timesteps, ids in self.batches:
                latents, noise, timesteps = latents.to(device), noise.to(device), timesteps.to(device)
                noisy = scheduler.add_noise(latents, noise, timesteps)
                target = diffusion_target(scheduler, latents, noise, timesteps)
                condition = embed(ids)
                hidden, added = condition if isinstance(condition, tuple) else (condition, None)
                pred = unet(noisy, timesteps, hidden, added_cond_kwargs=added, return_dict=False)[0]
                total += F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3)).sum()
        unet.train(training)
        return (self.accelerator.reduce(total, "sum") / self.count).item()
