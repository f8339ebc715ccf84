"""The trainers' optimizer: --optimizer adamw|adamw8bit|prodigy|adafactor, its checks (one-line errors before torch
loads where possible) and its construction on the scripts' parameter groups.

Every optimizer takes the groups of `training.build_param_groups` as they are: each group's own learning rate and
weight decay (none on biases and norm weights), and its "name" for the logs. The LR scheduler drives all four, so
an optimizer with a learning-rate logic of its own runs at the fixed rate the schedule sets (Adafactor), or reads
--learning_rate as a factor on its own estimate (Prodigy). A checkpoint's optimizer state resumes only into the same
optimizer: each group records which one wrote it.
"""
import os
from importlib.util import find_spec

from .cli import UserError

OPTIMIZERS = {  # --optimizer -> (the class, the package that holds it, how to install it)
    "adamw": ("torch.optim.AdamW", "torch", "make install"),
    "adamw8bit": ("bitsandbytes.optim.AdamW8bit", "bitsandbytes",
                  "`make install-extras` (or `pip install bitsandbytes`)"),
    "prodigy": ("prodigyopt.Prodigy", "prodigyopt", "`make install` (or `pip install prodigyopt`)"),
    "adafactor": ("transformers.optimization.Adafactor", "transformers", "`make install`"),
}
PRODIGY_LR_RANGE = (0.1, 10.0)  # --learning_rate multiplies Prodigy's estimate: 1.0 is the usual value
# Its authors' advice for diffusion models (prodigyopt's README), with or without a warm-up: Adam's bias correction,
# and safeguard_warmup, which keeps the learning rate out of the estimate's denominator. The bias correction alone
# calls for it: Prodigy multiplies it into the learning rate, where it starts near 0.3, dips to 0.15 and reaches
# 0.8 only after 1000 steps (betas 0.9, 0.999), the slow start that the README says overestimates the step size.
PRODIGY_OPTIONS = {"use_bias_correction": True, "safeguard_warmup": True}
GROUP_KEY = "optimizer"  # in every parameter group, so in the saved state: which --optimizer wrote it
CPU_8BIT = ("--optimizer adamw8bit needs a CUDA GPU (bitsandbytes' 8-bit states live there); use adamw on CPU")


def add_optimizer_args(parser):
    """The "optimizer" group: --optimizer and --prodigy_d_coef (the training group has --learning_rate and the
    --adam_* flags)."""
    from .args import positive_float

    group = parser.add_argument_group("optimizer")
    group.add_argument(
        "--optimizer", default="adamw", choices=list(OPTIMIZERS),
        help="adamw: torch's AdamW, fused on CPU and CUDA. adamw8bit: bitsandbytes' 8-bit AdamW, the optimizer "
             "states in a quarter of the memory (CUDA only; `make install-extras`). prodigy: Adam with a step size "
             "it estimates itself; --learning_rate scales the estimate: give 1.0 (0.1-10), the same for every "
             "parameter group. adafactor: factored second moments, no first moment (the least memory), at the "
             "schedule's learning rate. --adam_beta1/2 and --adam_epsilon apply to adamw, adamw8bit and prodigy; "
             "--adam_weight_decay to all four.")
    group.add_argument("--prodigy_d_coef", type=positive_float, default=1.0,
                       help="prodigy: factor on its step-size estimate, the way its authors advise to tune it "
                            "(0.5-2 usual).")
    return group


def check_optimizer_args(args):
    """The checks that need no model: the package, CUDA for adamw8bit, Prodigy's learning rate, and a resumed
    checkpoint written by another optimizer. Imports torch only for adamw8bit (is there a GPU) and on resume."""
    from .checkpoints import resolve_resume

    name = args.optimizer
    if name == "adamw8bit" and not cuda_in_use():
        raise UserError(CPU_8BIT)
    require_package(name)
    if name == "prodigy":
        check_prodigy_lr(args.learning_rate, "--learning_rate")
    checkpoint = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    saved = checkpoint and saved_optimizer(checkpoint)
    if saved and saved != name:
        raise UserError(f"--resume_from_checkpoint: {checkpoint} holds the state of --optimizer {saved} (now "
                        f"{name}); resume with --optimizer {saved}, or train into a new --output_dir")


def cuda_in_use():
    """Whether this run may train on a CUDA GPU: torch sees one and accelerate is not told to use the CPU
    (`accelerate launch` with a `use_cpu: true` config, or ACCELERATE_USE_CPU, sets that variable)."""
    if os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes", "y", "on"):
        return False
    import torch

    return torch.cuda.is_available()


def require_package(name):
    package = OPTIMIZERS[name][1]
    if find_spec(package) is None:
        raise UserError(f"--optimizer {name} needs the {package} package, which is not installed: "
                        f"run {OPTIMIZERS[name][2]}")


def check_prodigy_lr(lr, what):
    low, high = PRODIGY_LR_RANGE
    if not low <= lr <= high:
        raise UserError(f"--optimizer prodigy: {what} {lr:g} is far from 1. Prodigy estimates the step size itself "
                        f"and the learning rate scales that estimate: give --learning_rate 1.0 (the usual value; "
                        f"{low:g}-{high:g}), and tune with --prodigy_d_coef")


def saved_optimizer(checkpoint):
    """The --optimizer whose state `checkpoint` holds (accelerate's optimizer.bin), or None when it has none.

    Read memory-mapped: the tensors are not loaded. A state without the record is AdamW's, the only optimizer before
    there was a choice."""
    path = os.path.join(checkpoint, "optimizer.bin")
    if not os.path.isfile(path):
        return None
    import torch

    try:
        groups = torch.load(path, map_location="cpu", mmap=True, weights_only=True)["param_groups"]
    except Exception:  # unreadable: load_checkpoint reports it, in one line, when the run resumes
        return None
    return groups[0].get(GROUP_KEY, "adamw") if groups else None


def build_optimizer(args, param_groups, device):
    """--optimizer on `param_groups` (dicts with params, lr, weight_decay, name). `device`: where the parameters
    train (accelerator.device)."""
    import torch

    name = args.optimizer
    if name == "adamw8bit" and device.type != "cuda":
        raise UserError(CPU_8BIT)
    require_package(name)
    param_groups = [{**group, GROUP_KEY: name} for group in param_groups]
    betas = (args.adam_beta1, args.adam_beta2)
    if name == "adamw":
        # fused: one kernel for all parameters instead of a loop over tensors (timings: docs/performance.md).
        return torch.optim.AdamW(param_groups, betas=betas, eps=args.adam_epsilon,
                                 fused=device.type in ("cpu", "cuda"))
    if name == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(param_groups, betas=betas, eps=args.adam_epsilon)
    if name == "prodigy":
        from prodigyopt import Prodigy

        rates = {}  # lr -> {the groups' names, without their /no_decay halves}
        for group in param_groups:
            rates.setdefault(group["lr"], {})[group.get("name", "params").split("/")[0]] = None
        if len(rates) > 1:  # Prodigy itself stops at its first step with a RuntimeError
            listed = ", ".join(f"{', '.join(names)} {lr:g}" for lr, names in rates.items())
            raise UserError(f"--optimizer prodigy: the parameter groups have different learning rates ({listed}); "
                            "Prodigy estimates one step size for all of them: give every group the same learning "
                            "rate, or use another --optimizer")
        check_prodigy_lr(param_groups[0]["lr"], "the learning rate")
        return Prodigy(param_groups, betas=betas, eps=args.adam_epsilon, d_coef=args.prodigy_d_coef,
                       **PRODIGY_OPTIONS)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(param_groups, scale_parameter=False, relative_step=False, warmup_init=False)
    raise ValueError(f"unknown optimizer {name!r}")
