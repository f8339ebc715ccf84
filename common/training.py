"""The optimizer side of a training loop: how many optimizer steps a run makes and where a resumed run picks up, LR
schedules counted in optimizer steps, parameter groups, the check that stops a non-finite loss, and the EMA swap.

A scheduler passed through `accelerator.prepare` steps once per process for every optimizer step (and not at all
on accumulation steps), so every length given to the underlying scheduler is multiplied by `num_processes`.
A NaN/inf loss is checked once per optimizer step, before `optimizer.step()`: one host sync per step, plus one
all-reduce with several processes so that all of them decide alike (a NaN on one rank reaches every rank through the
gradient all-reduce). The check is on the loss, not the gradients: under fp16 an overflowing gradient is normal, the
grad scaler skips it.
"""
import contextlib
import json
import logging
import math
import os

from .cli import UserError

logger = logging.getLogger(__name__)


def set_cuda_backends(allow_tf32, allow_cudnn_attention):
    """The CUDA backend switches of --allow_tf32 and --allow_cudnn_attention (no effect without a GPU). cuDNN's fused
    attention stays off unless asked for: its backward failed FLUX.1 training at 1024 px on an H100 with torch 2.11
    ("an illegal memory access", or `mha_graph.execute(...).is_good()`), and PyTorch's issues give the same switch as
    the way round it (docs/reliability.md)."""
    import torch

    if allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    if not allow_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)


def plan_steps(batches_per_epoch, gradient_accumulation_steps, num_train_epochs, max_train_steps=None):
    """-> (optimizer steps per epoch, total optimizer steps, epochs).

    accelerate steps the optimizer at the end of every epoch even when the last accumulation cycle is short,
    hence the ceil. `max_train_steps` wins over `num_train_epochs` when given.
    """
    per_epoch = math.ceil(batches_per_epoch / gradient_accumulation_steps)
    total = max_train_steps if max_train_steps is not None else num_train_epochs * per_epoch
    return per_epoch, total, math.ceil(total / per_epoch)


def resume_position(global_step, steps_per_epoch, gradient_accumulation_steps, max_train_steps):
    """(epoch, batches of that epoch already seen) after `global_step` optimizer steps.

    A checkpoint at (or past) the last step -> the epoch after the last one: the loop runs no further step.
    """
    if global_step >= max_train_steps:
        return math.ceil(max_train_steps / steps_per_epoch), 0
    epoch = global_step // steps_per_epoch
    return epoch, (global_step % steps_per_epoch) * gradient_accumulation_steps


def build_lr_scheduler(name, optimizer, num_warmup_steps, num_training_steps, num_processes=1,
                       warmup_start_factor=0.1, lr_min=0.0):
    """Build scheduler `name`; steps are optimizer steps of the whole run (not counting processes)."""
    import torch

    warmup = num_warmup_steps * num_processes
    if name != "warmup_cosine":
        from diffusers.optimization import get_scheduler  # importing diffusers costs seconds: only when needed

        return get_scheduler(name, optimizer, num_warmup_steps=warmup,
                             num_training_steps=num_training_steps * num_processes)
    # Warm-up -> cosine: LR is start_factor*lr at step 0, lr at step `num_warmup_steps`,
    # and lr_min at the last optimizer step (num_training_steps - 1).
    cosine_steps = max(num_training_steps - 1 - num_warmup_steps, 1) * num_processes
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cosine_steps, eta_min=lr_min)
    if num_warmup_steps == 0:
        return cosine
    linear = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=warmup_start_factor, total_iters=warmup)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [linear, cosine], milestones=[warmup])


def parse_lr_groups(text):
    """`image_model=2e-5,text_model=4e-5` -> {"image_model": 2e-5, "text_model": 4e-5}."""
    groups = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        prefix, sep, value = item.partition("=")
        try:
            lr = float(value)
        except ValueError:
            lr = None
        if not sep or not prefix or lr is None or lr <= 0:
            raise UserError(f"--lr_groups: '{item}' is not PREFIX=LR with a positive LR (e.g. text_model=4e-5)")
        groups[prefix.strip()] = lr
    return groups


def build_param_groups(model, learning_rate, weight_decay, lr_groups=None):
    """One group per (prefix, decay/no-decay). Longest matching prefix wins; the rest use `learning_rate`."""
    import torch

    norms = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase, torch.nn.RMSNorm)
    lr_groups = lr_groups or {}
    module_names = {name for name, _ in model.named_modules()}
    for prefix in lr_groups:
        if prefix not in module_names:
            top = ", ".join(name for name, _ in model.named_children())
            raise UserError(f"--lr_groups: no module named '{prefix}'; top-level modules are: {top}")
    no_decay = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(module, norms) or param_name == "bias" or param.ndim < 2:
                no_decay.add(f"{module_name}.{param_name}" if module_name else param_name)
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matches = [p for p in lr_groups if name.startswith(p + ".")]
        prefix = max(matches, key=len) if matches else "default"
        decay = name not in no_decay
        key = f"{prefix}" if decay else f"{prefix}/no_decay"
        if key not in groups:
            groups[key] = {"name": key, "params": [], "lr": lr_groups.get(prefix, learning_rate),
                           "weight_decay": weight_decay if decay else 0.0}
        groups[key]["params"].append(param)
    return list(groups.values())


def finite_step(accelerator, loss_sum, step, skip):
    """True when optimizer step `step` may update the weights.

    A non-finite loss raises UserError (one line naming the step, exit 2), or returns False when `skip`
    (--skip_nonfinite_steps): the caller then leaves out clipping and `optimizer.step()` for this step.
    """
    import torch

    bad = (~torch.isfinite(loss_sum)).float()
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, "max")
    if not bad.item():
        return True
    if not skip:
        raise UserError(f"the loss is not finite ({loss_sum.item()}) at optimizer step {step}: stopped before that "
                        "update, the checkpoints written so far are good. Lower --learning_rate or check the data; "
                        "--skip_nonfinite_steps skips such steps instead")
    if accelerator.is_main_process:
        logger.warning(f"optimizer step {step}: the loss is not finite ({loss_sum.item()}); update skipped "
                       "(--skip_nonfinite_steps)")
    return False


@contextlib.contextmanager
def ema_weights(ema, model):
    """Inside: the model holds the EMA weights (when there is an EMA); after: its training weights again.

    model: a module (all its parameters), or a list of parameters in the order given to EMAModel (e.g. only the
    trainable LoRA weights of several models)."""
    if ema is None:
        yield
        return
    params = list(model.parameters()) if hasattr(model, "parameters") else list(model)
    ema.store(params)
    ema.copy_to(params)
    try:
        yield
    finally:
        ema.restore(params)


def add_ema_args(group):
    """The EMA flags of diffusers' train_unconditional.py (EMAModel with warm-up)."""
    from .args import positive_float, probability

    group.add_argument("--use_ema", action="store_true", help="Keep an EMA of the weights; it is what gets exported.")
    group.add_argument("--ema_max_decay", type=probability, default=0.9999)
    group.add_argument("--ema_inv_gamma", type=positive_float, default=1.0,
                       help="EMA warm-up: decay = 1 - (1 + step / inv_gamma) ** -power, at most --ema_max_decay.")
    group.add_argument("--ema_power", type=positive_float, default=3 / 4)


EMA_FLAGS = {"decay": "ema_max_decay", "inv_gamma": "ema_inv_gamma", "power": "ema_power"}


def check_resumed_ema(args, checkpoint, state_file=os.path.join("unet_ema", "config.json")):
    """A resumed EMA takes its settings from the checkpoint (EMAModel.load_state_dict), whatever the flags say:
    refuse flags that differ, and an EMA that would be dropped or missing, before anything loads.

    state_file: where, in a checkpoint, the EMA's scalar state (EMAModel.state_dict's decay, inv_gamma, power) is
    kept as JSON: unet_ema/config.json (EMAModel.save_pretrained), or train_lora.py's lora_ema.json."""
    config_file = os.path.join(checkpoint, state_file)
    folder = os.path.dirname(state_file)
    shown = f"{folder}/" if folder else state_file
    if not os.path.isfile(config_file):
        if args.use_ema:
            raise UserError(f"--use_ema: checkpoint '{checkpoint}' has no {shown} (it was trained without "
                            "--use_ema); resume without --use_ema, or train into a new --output_dir")
        return
    if not args.use_ema:
        raise UserError(f"--resume_from_checkpoint: '{checkpoint}' holds an EMA of the weights (trained with "
                        "--use_ema); resume with --use_ema and the same EMA settings")
    with open(config_file) as f:
        saved = json.load(f)
    diffs = [f"--{flag} {saved[key]:g} (now {getattr(args, flag):g})" for key, flag in EMA_FLAGS.items()
             if key in saved and not math.isclose(saved[key], getattr(args, flag))]
    if diffs:
        raise UserError(f"--resume_from_checkpoint: '{checkpoint}' was trained with {', '.join(diffs)}; resume with "
                        "the same EMA settings, or train into a new --output_dir")
