"""The benchmark code itself (tests/benchmarks/): `make bench-gpu` runs its reference loop and the real recipe on a
tiny base on the CPU, and the SD 1.5 architecture it measures on a GPU is SD 1.5's."""
import json
import subprocess
import sys

from conftest import ROOT, offline_env


def test_sd15_architecture_has_stable_diffusion_1_5_parameter_counts():
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from demo.tiny_sd import SD15

    with torch.device("meta"):  # shapes only: nothing allocated
        models = {"unet": UNet2DConditionModel(**SD15["unet"]), "vae": AutoencoderKL(**SD15["vae"]),
                  "text": CLIPTextModel(CLIPTextConfig(**SD15["text"]))}
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    assert counts == {"unet": 859_520_964, "vae": 83_653_863, "text": 123_060_480}  # stable-diffusion-v1-5's


def test_gpu_lora_bench_runs_the_reference_and_the_recipe(digits, tiny_sd, tmp_path):
    import tomllib

    with open(ROOT / "tests/benchmarks/workloads.toml", "rb") as f:
        gpu = tomllib.load(f)["gpu"]
    args = [str(digits) if a == "data/digits" else a for a in gpu["args"]]
    config = tmp_path / "workloads.toml"
    config.write_text(f"[gpu]\nbase = {json.dumps(str(tiny_sd))}\nresolution = 32\nbatch_sizes = [2]\n"
                      f"precisions = [\"no\"]\nsteps = 40\nwarmup = 5\nargs = {json.dumps(args)}\n"
                      "[gpu.env]\nHF_HUB_OFFLINE = \"1\"\n")
    output = tmp_path / "bench" / "gpu_results.json"
    env = offline_env()
    env.pop("TQDM_DISABLE")  # the recipe is timed by its progress bar
    proc = subprocess.run(
        [sys.executable, "tests/benchmarks/gpu_lora.py", "--config", str(config), "--device", "cpu",
         "--gradient_checkpointing", "off", "--launch_config", "accelerate_configs/cpu.yaml",
         "--launch_args", "--num_cpu_threads_per_process 1", "--output", str(output)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(output.read_text())
    (run,) = results["configs"]
    assert (run["batch_size"], run["precision"], run["gradient_checkpointing"]) == (2, "no", False)
    for side in ("recipe", "reference"):
        assert run[side]["steps_per_second"] > 0 and run[side]["peak_memory_mb"] > 0
    assert run["reference"]["flops_per_step"] > 1e6  # counted: forward and backward of the UNet
    assert (tmp_path / "bench" / "gpu-no-b2" / "pytorch_lora_weights.safetensors").exists()  # the real recipe ran
    assert "| 2     | no" in proc.stdout and f"{run['reference']['steps_per_second']:.2f}" in results["table"]
