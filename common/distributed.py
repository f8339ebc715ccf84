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
