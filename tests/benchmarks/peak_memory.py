"""Run a training script as `python SCRIPT FLAGS...` would, and at its exit write the process's peak memory to the
JSON file named by $PEAK_MEMORY_FILE: {"peak_memory_mb": torch.cuda.max_memory_allocated on a GPU, else the peak
resident set size, "device": "cuda" or "cpu"}. gpu_evidence.py launches our scripts and diffusers' through it, so
that both sides are measured the same way.

    accelerate launch --config_file accelerate_configs/single_gpu.yaml tests/benchmarks/peak_memory.py \\
        train_lora.py --mixed_precision bf16 ...
"""
import atexit
import json
import os
import resource
import runpy
import sys


def write_peak():
    path = os.environ.get("PEAK_MEMORY_FILE")
    if not path or os.environ.get("RANK", "0") != "0":
        return
    torch = sys.modules.get("torch")  # a script that never imported torch used no GPU
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peak, device = torch.cuda.max_memory_allocated() / 2**20, "cuda"
    else:
        peak, device = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu"
    with open(path, "w") as f:
        json.dump({"peak_memory_mb": round(peak, 1), "device": device}, f)


if __name__ == "__main__":
    atexit.register(write_peak)
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)  # the script's folder, as `python SCRIPT` would put it
    runpy.run_path(script, run_name="__main__")
