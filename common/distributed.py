"""The process group's timeout (--ddp_timeout): how long a process waits for the others in a collective.

The main process validates, samples and saves alone while the others wait in `accelerator.wait_for_everyone()` (and
in `main_process_first()` while it prepares the data); a wait longer than the timeout kills the run. torch's defaults
are 30 minutes for gloo (CPU) and 10 minutes for NCCL: a long validation on a GPU can cross the second.
"""
import datetime


def process_group_kwargs(ddp_timeout):
    """`Accelerator(kwargs_handlers=[...])` entry that sets the process group's timeout to `ddp_timeout` seconds, for
    every backend (accelerate passes it to `torch.distributed.init_process_group`)."""
    from accelerate.utils import InitProcessGroupKwargs

    return InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=ddp_timeout))


def match_deepspeed_config(accelerator, gradient_accumulation_steps, max_grad_norm):
    """Under DeepSpeed, accumulation and clipping are values of DeepSpeed's config, not of the script: fill the
    config's `auto` (or missing) ones from --gradient_accumulation_steps and --max_grad_norm. A value the accelerate
    config sets otherwise is a UserError: accelerate would keep DeepSpeed's accumulation with a warning (and the
    script's step counts would be wrong), and fill an `auto` clipping with 1.0 whatever --max_grad_norm says."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    from .cli import UserError

    config, mismatches = plugin.deepspeed_config, []
    for key, flag, value in (("gradient_accumulation_steps", "--gradient_accumulation_steps",
                              gradient_accumulation_steps), ("gradient_clipping", "--max_grad_norm", max_grad_norm)):
        current = config.get(key)
        if current in (None, "auto"):
            config[key] = value
        elif float(current) != float(value):
            mismatches.append(f"{key}: {current} where {flag} is {value}")
    if mismatches:
        raise UserError(f"the accelerate config's DeepSpeed settings disagree with the flags "
                        f"({'; '.join(mismatches)}): leave them out of the yaml (they come from the flags) or give the "
                        "same values")
