"""What a run reports: trackers (--report_to tensorboard|wandb|all|none, with a config TensorBoard accepts), images
logged to them, all_results.json (what a run did and how fast), and a README.md model card beside the model."""
import json
import os
import resource
import sys
import time

import torch

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


def peak_memory_mb(device=None):
    """Peak CUDA memory on a GPU, else the process's peak resident set size."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def write_all_results(output_dir, *, global_step, start_time, steps_run, samples_per_step, final_loss, device,
                      num_processes=1, metrics=None):
    """steps_run counts the optimizer steps of this process's lifetime (a resumed run counts only its own)."""
    runtime = time.time() - start_time
    results = {
        "global_step": global_step,
        "train_runtime": round(runtime, 3),
        "train_steps_per_second": round(steps_run / runtime, 4) if runtime > 0 else None,
        "train_samples_per_second": round(steps_run * samples_per_step / runtime, 3) if runtime > 0 else None,
        "peak_memory_mb": round(peak_memory_mb(device), 1),
        "final_loss": final_loss,
        "num_processes": num_processes,
        **(metrics or {}),
    }
    path = os.path.join(output_dir, "all_results.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=2)
    os.replace(path + ".tmp", path)
    return results


def write_model_card(output_dir, title, summary, facts, usage, images=()):
    """facts: {label: value} listed as bullets; usage: a code block; images: paths relative to output_dir."""
    lines = [f"# {title}", "", summary, ""]
    lines += [f"- **{key}**: {value}" for key, value in facts.items()]
    lines += ["", "## Use it", "", "```python", usage.strip(), "```", ""]
    lines += [f"![{os.path.basename(path)}]({path})" for path in images]
    with open(os.path.join(output_dir, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
