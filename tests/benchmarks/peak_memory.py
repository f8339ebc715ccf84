"""Run a training script as `python SCRIPT FLAGS...` would, and at its exit write the process's peak memory to the
JSON file named by $PEAK_MEMORY_FILE: {"peak_memory_mb": torch.cuda.max_memory_allocated on a GPU, else the peak
resident set size, "training_peak_memory_mb": on a GPU, the peak from the end of the first optimizer step on (the
training's own: the optimizer's state is there, a start-up's text encoders or latent caching are not), "device":
"cuda" or "cpu"}. gpu_evidence.py launches our scripts and diffusers' through it, so that both sides are measured the
same way.

$DATASET_ALIASES ({"hub/dataset": "image folder"}, JSON): `datasets.load_dataset` of such a name reads that image
folder instead (an offline machine, and a peer script that names its hub dataset in its code).

    accelerate launch --config_file accelerate_configs/single_gpu.yaml tests/benchmarks/peak_memory.py \\
        train_lora.py --mixed_precision bf16 ...
"""
import atexit
import json
import os
import resource
import runpy
import sys

_training = {"started": False}


def write_peak():
    path = os.environ.get("PEAK_MEMORY_FILE")
    if not path or os.environ.get("RANK", "0") != "0":
        return
    torch = sys.modules.get("torch")  # a script that never imported torch used no GPU
    training = None
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        since = torch.cuda.max_memory_allocated() / 2**20  # since the first optimizer step, once there was one
        training = round(since, 1) if _training["started"] else None
        peak, device = max(since, _training.get("before", 0) / 2**20), "cuda"
    else:
        peak, device = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu"
    with open(path, "w") as f:
        json.dump({"peak_memory_mb": round(peak, 1), "training_peak_memory_mb": training, "device": device}, f)


def watch_training():
    """After the first optimizer step (any torch optimizer, bitsandbytes' too): the peak so far is kept, and CUDA's
    peak counter starts again from what is held now."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def after_step(optimizer, args, kwargs):
        if not _training["started"] and torch.cuda.is_available() and torch.cuda.is_initialized():
            _training.update(started=True, before=torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    register_optimizer_step_post_hook(after_step)


def alias_datasets():
    aliases = json.loads(os.environ.get("DATASET_ALIASES") or "{}")
    if not aliases:
        return
    import datasets

    load = datasets.load_dataset

    def load_dataset(path, *args, **kwargs):
        if path in aliases:
            return load("imagefolder", data_dir=aliases[path], split=kwargs.get("split"))
        return load(path, *args, **kwargs)

    datasets.load_dataset = load_dataset


if __name__ == "__main__":
    atexit.register(write_peak)
    watch_training()
    alias_datasets()
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)  # the script's folder, as `python SCRIPT` would put it
    runpy.run_path(script, run_name="__main__")
