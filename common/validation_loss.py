"""A held-out validation loss for the Stable Diffusion trainers (--validation_split): the mean denoising loss over
images the run never trains on, at fixed timesteps and with fixed noise, so that the curve is comparable from one
validation to the next (a rising one is over-fitting) and between runs on the same data.

Every held-out image is seen at TIMESTEPS timesteps (DDPM) or sigmas (flow matching), one in each equal slice of the
schedule, spread over the images; the latent is the mean of the VAE's latent distribution (no sampling), the noise
comes from a generator seeded once, and the loss is the objective's (common/objectives.py), unweighted, masked as
training masks it when the held-out images have loss masks (--masked_loss: the loss of what the run learns).
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
    """loss = HeldOutLoss(held_out, encode, vae_config, prompt_ids, objective, ...); loss(model, predict, embed) ->
    float (every process).

    held_out: an ImageDataset of the held-out images (no flips; buckets allowed); encode(pixels) -> the VAE's latent
    parameters; prompt_ids: each image's key for `embed` (its prompt's index); objective: the family's
    (common/objectives.py); predict(noisy, timesteps, cond) -> the denoiser's prediction; embed(ids) -> the
    conditioning dict the family's denoiser takes (SDXL's time ids included).
    """

    def __init__(self, held_out, encode, vae_config, prompt_ids, objective, accelerator, seed, batch_size):
        import torch

        from .loss_masks import latent_mask
        from .vae import mean_latents

        n, k = len(held_out), TIMESTEPS
        self.accelerator, self.batch_size, self.objective = accelerator, batch_size, objective
        generator = torch.Generator().manual_seed(seed)
        # (latent, noise, fraction of the schedule, prompt id, loss mask or None) of this process's share, by shape
        items = []
        for i in range(n):
            image = held_out[i]
            latent = mean_latents(encode(image["pixel_values"][None]).cpu().float(), vae_config)[0]  # (a clip too)
            mask = latent_mask(image["mask"][None], latent[None])[0].cpu() if "mask" in image else None
            for j in range(k):
                noise = torch.randn(latent.shape, generator=generator)  # drawn for every item on every process
                if (i * k + j) % accelerator.num_processes == accelerator.process_index:
                    items.append((latent, noise, (j + (i + 0.5) / n) / k, prompt_ids[i], mask))
        self.batches = []
        for shape in sorted({tuple(item[0].shape) for item in items}):
            same = [item for item in items if tuple(item[0].shape) == shape]
            for start in range(0, len(same), batch_size):
                latents, noise, fractions, ids, masks = zip(*same[start:start + batch_size])
                self.batches.append((torch.stack(latents), torch.stack(noise), objective.fixed_timesteps(fractions),
                                     torch.tensor(ids), None if masks[0] is None else torch.stack(masks)))
        self.count = n * k
        self.losses = {}  # step -> val/loss, as logged

    def log(self, step, model, predict, embed):
        """The loss now (see __call__), kept in `losses` and logged to the trackers as val/loss."""
        self.losses[step] = self(model, predict, embed)
        self.accelerator.log({"val/loss": self.losses[step]}, step=step)

    def results(self):
        """What all_results.json gets: the last value and the curve."""
        return {"validation_loss": self.losses[max(self.losses)], "validation_losses": self.losses}

    def __call__(self, model, predict, embed):
        """The mean loss (the objective's, unweighted) of the denoiser `model` (unwrapped; in eval mode meanwhile)
        over all items."""
        import torch

        from .loss_masks import latent_mask

        device, training = self.accelerator.device, model.training
        model.eval()
        total = torch.zeros((), device=device, dtype=torch.float64)
        with torch.no_grad(), self.accelerator.autocast():
            for latents, noise, timesteps, ids, masks in self.batches:
                noised = self.objective.at(latents.to(device), noise.to(device), timesteps, weighted=False)
                prediction = predict(noised.noisy, noised.timesteps, embed(ids))
                total += self.objective.losses(prediction, noised, latent_mask(masks, prediction)).sum()
        model.train(training)
        return (self.accelerator.reduce(total, "sum") / self.count).item()
