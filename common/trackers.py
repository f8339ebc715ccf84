"""Tracker set-up for --report_to tensorboard|wandb|all|none, with a config TensorBoard accepts."""
import os
import time

from .cli import UserError


def log_with(report_to):
    """Value for `Accelerator(log_with=...)`; checks that wandb is importable when asked for."""
    if report_to == "none":
        return None
    if report_to in ("wandb", "all"):
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UserError("--report_to wandb needs the wandb package: pip install wandb (or --report_to tensorboard)")
        if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
            os.environ["WANDB_MODE"] = "offline"  # no account configured: log locally, sync later
    return ["tensorboard", "wandb"] if report_to == "all" else [report_to]


def sanitize_config(config):
    """TensorBoard's hparams take only bool/int/float/str: None -> "none", lists -> "a,b", paths -> str."""
    clean = {}
    for key, value in config.items():
        if isinstance(value, bool | int | float | str):
            clean[key] = value
        elif value is None:
            clean[key] = "none"
        elif isinstance(value, list | tuple):
            clean[key] = ",".join(map(str, value))
        else:
            clean[key] = str(value)
    return clean


def init_trackers(accelerator, args):
    """Start the trackers with the run's flags as config; the caller ends them with `accelerator.end_training()`."""
    if args.report_to == "none":
        return
    run_name = args.run_name or time.strftime("%Y%m%d-%H%M%S")
    logging_dir = os.path.join(args.output_dir, args.logging_dir)
    accelerator.init_trackers(
        args.tracker_project_name,
        config=sanitize_config(vars(args)),
        init_kwargs={"wandb": {"name": run_name, "dir": logging_dir}},
    )


def log_image(accelerator, tag, image, step):
    """Log one PIL image (a validation grid) to every active tracker; call it on the main process."""
    import numpy as np

    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image(tag, np.asarray(image), step, dataformats="HWC")
        elif tracker.name == "wandb":
            import wandb

            tracker.log({tag: wandb.Image(image)}, step=step)
