"""all_results.json: what a run did and how fast, in one file beside the model."""
import json
import os
import resource
import sys
import time

import torch


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
