"""What the latent diffusion trainers learn from a batch of clean latents: the noisy input, the timestep, the target and
each sample's loss weight, drawn at random for training or fixed for the held-out loss.

DDPM (the UNet families): a timestep drawn uniformly from the training scheduler's, noise added through its
alphas_cumprod (offset noise on request), the target its prediction type (epsilon, v or the clean sample), min-SNR
weights on request.

Flow matching (the transformer families), as diffusers' train_dreambooth_lora_sd3.py and _flux.py do it: a timestep
index drawn by --weighting_scheme (uniform, logit-normal or mode: diffusers' compute_density_for_timestep_sampling),
its sigma from the FlowMatchEulerDiscreteScheduler's training sigmas (the config's shift applied, unless the scheduler
shifts dynamically, which is for sampling), x_t = (1 - sigma) x0 + sigma noise, target noise - x0, loss weights from
compute_loss_weighting_for_sd3 (sigma_sqrt, cosmap; 1 otherwise). With precondition_outputs (SD3's script default) the
output is turned into an estimate of x0, x_t - sigma * output, and compared with x0.

Latents are [B, C, H, W] for every family (Flux packs them inside its denoiser call); losses are per-sample means.
A loss mask (--masked_loss, common/loss_masks.py) [B, 1, H, W] on the latent grid weights each element's squared error
before that mean (not divided by the mask's sum, as kohya's sd-scripts): an all-ones mask is the plain loss.
"""
from typing import NamedTuple

from .cli import UserError

WEIGHTING_SCHEMES = ["sigma_sqrt", "logit_normal", "mode", "cosmap", "none"]
# flag -> what it is; given to a family whose objective has no use for it, each is one line
DDPM_FLAGS = {"prediction_type": "a DDPM prediction type", "snr_gamma": "min-SNR weighting (DDPM timesteps)",
              "noise_offset": "offset noise (DDPM)"}
FLOW_FLAGS = {"weighting_scheme": "flow-matching timestep sampling", "logit_mean": "the logit-normal's mean",
              "logit_std": "the logit-normal's std", "mode_scale": "the mode scheme's scale",
              "precondition_outputs": "SD3's output preconditioning"}


class Noised(NamedTuple):
    noisy: object  # the denoiser's latent input
    timesteps: object  # in the training scheduler's units (DDPM: integers in [0, T); flow: sigma * T)
    target: object
    weights: object  # per sample [B], or None (all 1)
    sigmas: object  # flow matching: [B, 1, 1, 1]; DDPM: None


def add_objective_args(group):
    """The flags of both objectives (diffusers' names and defaults); a family refuses those it has no use for."""
    from .args import positive_float

    group.add_argument("--prediction_type", default=None, choices=["epsilon", "v_prediction", "sample"],
                       help="DDPM bases (SD 1.x/2.x, SDXL): the training target; default: the base scheduler's.")
    group.add_argument("--snr_gamma", type=positive_float, default=None,
                       help="DDPM bases: min-SNR loss weighting (5.0 is usual).")
    group.add_argument("--noise_offset", type=float, default=None,
                       help="DDPM bases: offset noise scale (0.05-0.1 is usual).")
    group.add_argument("--weighting_scheme", default=None, choices=WEIGHTING_SCHEMES,
                       help="Flow-matching bases (SD3, Flux.1, Qwen-Image): how timesteps are drawn or losses "
                            "weighted; default: logit_normal for SD3, none for Flux.1 and Qwen-Image (diffusers' "
                            "scripts' defaults).")
    group.add_argument("--logit_mean", type=float, default=None, help="Flow matching, logit_normal: mean (0.0).")
    group.add_argument("--logit_std", type=float, default=None, help="Flow matching, logit_normal: std (1.0).")
    group.add_argument("--mode_scale", type=float, default=None, help="Flow matching, mode: scale (1.29).")
    group.add_argument("--precondition_outputs", type=int, choices=[0, 1], default=None,
                       help="Flow matching: 1 compares x_t - sigma * output with x0 (SD3's default), 0 the output "
                            "with noise - x0 (Flux.1's default).")


def check_objective_args(args, family):
    """One line for a flag that means nothing under the family's objective; fill the flow flags' defaults (diffusers'
    scripts': the family's scheme and preconditioning, logit-normal N(0, 1), mode scale 1.29)."""
    name = family.NAME
    foreign = FLOW_FLAGS if family.OBJECTIVE == "ddpm" else DDPM_FLAGS
    for flag, what in foreign.items():
        if getattr(args, flag, None) is not None:
            raise UserError(f"--{flag} ({what}) means nothing for a {name} base, which trains with "
                            f"{'DDPM noise' if family.OBJECTIVE == 'ddpm' else 'flow matching'}: leave it out")
    if family.OBJECTIVE == "flow":
        defaults = {"logit_mean": 0.0, "logit_std": 1.0, "mode_scale": 1.29, **family.FLOW_DEFAULTS}
        for flag, value in defaults.items():
            if getattr(args, flag, None) is None:
                setattr(args, flag, value)
    elif args.noise_offset is None:
        args.noise_offset = 0.0


def make_objective(family, scheduler, args):
    """The family's objective over its training scheduler, from the (checked) flags."""
    if family.OBJECTIVE == "ddpm":
        return DDPM(scheduler, snr_gamma=args.snr_gamma, noise_offset=args.noise_offset)
    objective = FlowMatching(scheduler, args.weighting_scheme, args.logit_mean, args.logit_std, args.mode_scale,
                             bool(args.precondition_outputs), getattr(family, "TIMESTEP_RANGE", None))
    # (Wan 2.2 TI2V-5B's image-to-video: each clip's first frame kept clean, the loss on the others)
    return getattr(family, "training_objective", lambda plain: plain)(objective)


class DDPM:
    """Noise added by a DDPMScheduler (its prediction_type is the target: set it on the scheduler beforehand)."""

    def __init__(self, scheduler, snr_gamma=None, noise_offset=0.0):
        self.scheduler, self.snr_gamma, self.noise_offset = scheduler, snr_gamma, noise_offset
        self.num_train_timesteps = scheduler.config.num_train_timesteps

    def __call__(self, latents):
        """A training draw: noise (offset noise added), a uniform timestep per sample."""
        import torch

        noise = torch.randn_like(latents)
        if self.noise_offset:  # lets the model learn overall brightness (very dark / light images)
            noise += self.noise_offset * torch.randn(*latents.shape[:2], 1, 1, device=latents.device)
        timesteps = torch.randint(0, self.num_train_timesteps, (latents.shape[0],), device=latents.device)
        return self.at(latents, noise, timesteps)

    def fixed_timesteps(self, fractions):
        """Timesteps at given fractions of the schedule (the held-out loss's fixed points)."""
        import torch

        return torch.tensor([int(f * self.num_train_timesteps) for f in fractions])

    def at(self, latents, noise, timesteps, weighted=True):
        """Noised latents at given noise and timesteps."""
        from diffusers.training_utils import compute_snr

        from .diffusion import diffusion_target, min_snr_weights

        timesteps = timesteps.to(latents.device)
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        target = diffusion_target(self.scheduler, latents, noise, timesteps)
        weights = None
        if weighted and self.snr_gamma:
            weights = min_snr_weights(compute_snr(self.scheduler, timesteps), self.snr_gamma,
                                      self.scheduler.config.prediction_type)
        return Noised(noisy, timesteps, target, weights, None)

    def estimate(self, prediction, noised):
        """What the loss compares with the target: the prediction itself."""
        return prediction

    def losses(self, prediction, noised, mask=None):
        """Per-sample (weighted) mean squared error [B]; `mask` [B, 1, H, W] weights each element."""
        return weighted_mse(prediction, noised.target, noised.weights, mask)

    def describe(self):
        snr = f", min-SNR gamma {self.snr_gamma:g}" if self.snr_gamma else ""
        return f"DDPM, predicting {self.scheduler.config.prediction_type}{snr}"


class FlowMatching:
    """Rectified flow over a FlowMatchEulerDiscreteScheduler's training sigmas."""

    def __init__(self, scheduler, weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                 precondition_outputs=False, timestep_range=None):
        """timestep_range (low, high): only the schedule's timesteps t with low <= t / num_train_timesteps < high
        train (an expert's side of Wan 2.2 A14B's boundary); the weighting scheme draws over them."""
        import torch

        self.weighting_scheme, self.logit_mean, self.logit_std = weighting_scheme, logit_mean, logit_std
        self.mode_scale, self.precondition_outputs = mode_scale, precondition_outputs
        # the schedule as from_pretrained made it (set_timesteps, for sampling, would replace it)
        self.sigmas = scheduler.sigmas.detach().clone().to(torch.float32)
        self.timesteps = scheduler.timesteps.detach().clone().to(torch.float32)
        self.num_train_timesteps = scheduler.config.num_train_timesteps
        self.first, self.count = 0, len(self.timesteps)  # the schedule indices drawn from: [first, first + count)
        if timestep_range is not None:
            low, high = (bound * self.num_train_timesteps for bound in timestep_range)
            inside = ((self.timesteps >= low) & (self.timesteps < high)).nonzero().flatten()
            self.first, self.count = int(inside[0]), len(inside)  # (timesteps fall: one run of indices)

    def __call__(self, latents):
        """A training draw: noise, a timestep index per sample drawn by the weighting scheme (on the CPU, as
        diffusers' scripts draw it)."""
        import torch
        from diffusers.training_utils import compute_density_for_timestep_sampling

        noise = torch.randn_like(latents)
        u = compute_density_for_timestep_sampling(self.weighting_scheme, latents.shape[0], self.logit_mean,
                                                  self.logit_std, self.mode_scale)
        indices = self.first + (u * self.count).long().clamp(0, self.count - 1)
        return self.at(latents, noise, indices)

    def fixed_timesteps(self, fractions):
        """Schedule indices at given fractions (the held-out loss's fixed points)."""
        import torch

        return torch.tensor([self.first + min(int(f * self.count), self.count - 1) for f in fractions])

    def at(self, latents, noise, indices, weighted=True):
        """Noised latents at given noise and schedule indices."""
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        indices = indices.cpu()
        sigmas = self.sigmas[indices].to(latents.device, latents.dtype).view(-1, *[1] * (latents.ndim - 1))
        noisy = (1.0 - sigmas) * latents + sigmas * noise
        target = latents if self.precondition_outputs else noise - latents
        weights = None
        if weighted and self.weighting_scheme in ("sigma_sqrt", "cosmap"):
            weights = compute_loss_weighting_for_sd3(self.weighting_scheme, sigmas).flatten()
        return Noised(noisy, self.timesteps[indices].to(latents.device), target, weights, sigmas)

    def estimate(self, prediction, noised):
        """What the loss compares with the target: the output, or with precondition_outputs its estimate of x0,
        x_t - sigma * output (in fp32)."""
        if self.precondition_outputs:
            return prediction.float() * -noised.sigmas + noised.noisy.float()
        return prediction

    def losses(self, prediction, noised, mask=None):
        """Per-sample (weighted) mean squared error [B], on x0 estimates with precondition_outputs; `mask` [B, 1, H, W]
        weights each element."""
        return weighted_mse(self.estimate(prediction, noised), noised.target, noised.weights, mask)

    def describe(self):
        target = "x0 (preconditioned outputs)" if self.precondition_outputs else "noise - x0"
        return f"flow matching, {self.weighting_scheme} weighting, target {target}"


def weighted_mse(prediction, target, weights=None, mask=None):
    """Mean squared error over each sample (in fp32), each element's times `mask` (broadcast) when there is one, the
    sample's times its weight when there are weights: [B]."""
    import torch.nn.functional as F

    loss = F.mse_loss(prediction.float(), target.float(), reduction="none")
    if mask is not None:
        loss = loss * mask.float()
    loss = loss.mean(dim=tuple(range(1, target.ndim)))
    return loss if weights is None else loss * weights.float()
