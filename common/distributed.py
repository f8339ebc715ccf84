"""What several processes need beyond accelerate's defaults: the process group's timeout, DeepSpeed's settings from
the flags, a value that the main process alone can compute, and a check that every process reads the same data.

The timeout (--ddp_timeout): how long a process waits for the others in a collective. The main process validates,
samples and saves alone while the others wait in `accelerator.wait_for_everyone()` (and in `main_process_first()`
while it prepares the data); a wait longer than the timeout kills the run. torch's defaults are 30 minutes for gloo
(CPU) and 10 minutes for NCCL: a long validation on a GPU can cross the second.
"""
import datetime


def process_group_kwargs(ddp_timeout):
    """`Accelerator(kwargs_handlers=[...])` entry that sets the process group's timeout to `ddp_timeout` seconds, for
    every backend (accelerate passes it to `torch.distributed.init_process_group`); DeepSpeed on CPUs gets its backend
    here too (common/deepspeed_engine.py's cpu_backend)."""
    from accelerate.utils import InitProcessGroupKwargs

    from .deepspeed_engine import cpu_backend

    backend = cpu_backend()
    return InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=ddp_timeout),
                                  **({"backend": backend} if backend else {}))


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


def from_main_process(accelerator, compute):
    """compute() on the main process only, its (picklable) result returned on every process. For what only the main
    machine's disk is sure to hold, such as an output the main process wrote (train_classifier.py's best_model/):
    on machines that share no filesystem another process would find nothing there, skip a collective that the main
    process enters, and the run would wait forever."""
    value = compute() if accelerator.is_main_process else None
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


def check_same_data(accelerator, **counts):
    """Every process counts the same: counts {what: number} such as the training images and the batches of an epoch.
    Machines that each read their own copy of the data may not: a copy that differs, or a data flag given on one
    machine only, gives their processes other step counts, and the run waits forever at the first collective that
    one of them skips. One line on every process instead."""
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import gather_object

    from .cli import UserError

    views = gather_object([counts])
    for rank, other in enumerate(views):
        if other != views[0]:
            diffs = [f"{views[0][key]} {key.replace('_', ' ')} on process 0, {other[key]} on process {rank}"
                     for key in counts if other[key] != views[0][key]]
            raise UserError(f"the processes do not read the same data ({'; '.join(diffs)}): every machine needs the "
                            "same copy of the data and the same data flags")
