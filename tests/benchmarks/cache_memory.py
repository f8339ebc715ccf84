"""Peak memory of train_lora.py with --cache_latents at several --vae_encode_batch_size, on a CPU (performance.md).

Each row is one real run (one process, as `make train-lora` on a CPU) on the shipped tiny base. The process's
high-water mark of resident memory (VmHWM) is read when the cache starts (the models are loaded), when training
starts (the cache is made) and at the end: a cache that sets the run's peak shows as a run peak equal to the one
after caching. The run is paused (SIGSTOP) while it is read at each mark. Usage:
    python tests/benchmarks/cache_memory.py [--resolution 128] [--train_batch_size 16] [--encode 1,4,16,64]

With --sd15, the parts apart on Stable Diffusion 1.5's architecture (random weights, demo/tiny_sd.py's SD15 configs),
fp32 on the CPU, each in its own process: the resident memory a VAE encode of N 512 px images adds (no gradient, as
the cache encodes), and what one LoRA training step adds (rank 8 on the attention projections, 64x64 latents, with
and without gradient checkpointing), both over the model alone:
    python tests/benchmarks/cache_memory.py --sd15 [--cases encode:1,encode:4,step:1,step:1:ckpt]
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


MARKS = {"caching the latents": "before_cache_mb", "training images at": "after_cache_mb"}  # train_lora.py's log


def high_water_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def run(data, out, args, extra):
    """One run of train_lora.py -> {mark: VmHWM in MB}, with "run_peak_mb" at the end."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", ACCELERATE_USE_CPU="true",
               ACCELERATE_MIXED_PRECISION="no", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TQDM_DISABLE="1",
               MALLOC_MMAP_THRESHOLD_="33554432", MALLOC_TRIM_THRESHOLD_="268435456")  # as the Makefile on a CPU
    cmd = [sys.executable, str(ROOT / "train_lora.py"), "--train_data_dir", str(data), "--output_dir", str(out),
           "--resolution", str(args.resolution), "--train_batch_size", str(args.train_batch_size),
           "--max_train_samples", str(args.samples), "--max_train_steps", "2", "--report_to", "none",
           "--dataloader_num_workers", "1", *extra]  # (a worker: the cache is made before training, as on a GPU)
    marks, tail = {}, []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        tail = (tail + [line])[-40:]
        for needle, name in MARKS.items():
            if needle in line and name not in marks:
                proc.send_signal(signal.SIGSTOP)
                marks[name] = high_water_mb(proc.pid)
                proc.send_signal(signal.SIGCONT)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own resource usage: its peak resident set
    if status != 0:
        raise SystemExit("".join(tail))
    return {**marks, "run_peak_mb": usage.ru_maxrss / 1024}


def sd15_case(case):
    """One --sd15 case in this process -> the high-water mark it adds over the built model, in MB."""
    import torch

    sys.path.insert(0, str(ROOT))
    from demo.tiny_sd import SD15

    torch.manual_seed(0)
    kind, n, *flags = case.split(":")
    n = int(n)
    if kind == "encode":
        from diffusers import AutoencoderKL

        vae = AutoencoderKL(**SD15["vae"]).requires_grad_(False)
        before = high_water_mb(os.getpid())
        with torch.no_grad():
            vae.encode(torch.rand(n, 3, 512, 512) * 2 - 1).latent_dist.parameters
    else:
        from diffusers import UNet2DConditionModel
        from peft import LoraConfig

        unet = UNet2DConditionModel(**SD15["unet"]).requires_grad_(False)
        unet.add_adapter(LoraConfig(r=8, lora_alpha=8, init_lora_weights="gaussian",
                                    target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
        if "ckpt" in flags:
            unet.enable_gradient_checkpointing()
        unet.train()
        before = high_water_mb(os.getpid())
        latents, text = torch.randn(n, 4, 64, 64), torch.randn(n, 77, 768)
        unet(latents, torch.randint(0, 1000, (n,)), text).sample.pow(2).mean().backward()
    return high_water_mb(os.getpid()) - before


def sd15(cases):
    rows = []
    for case in cases.split(","):
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="33554432",
                   MALLOC_TRIM_THRESHOLD_="268435456")
        proc = subprocess.run([sys.executable, __file__, "--sd15_case", case], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        rows.append((case, round(float(proc.stdout.split()[-1]))))
        print(rows[-1], flush=True)
    print("\nSD 1.5 architecture, fp32, CPU: memory added over the model (MB)\n| case | MB |\n|---|---|")
    for case, mb in rows:
        print(f"| {case} | {mb} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--train_batch_size", type=int, default=16)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--encode", default="1,4,16,64", help="--vae_encode_batch_size values")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--sd15", action="store_true", help="the SD 1.5 parts apart (see the docstring)")
    parser.add_argument("--cases", default="encode:1,encode:4,step:1,step:1:ckpt")
    parser.add_argument("--sd15_case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sd15_case:
        print(sd15_case(args.sd15_case))
        return
    if args.sd15:
        sd15(args.cases)
        return
    sys.path.insert(0, str(ROOT))
    from demo.digits import write_digits

    extra = ["--gradient_checkpointing"] if args.gradient_checkpointing else []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "digits"
        write_digits(str(data))
        cases = [("no --cache_latents", extra)] + [
            (f"--cache_latents --vae_encode_batch_size {n}", ["--cache_latents", "--vae_encode_batch_size", n, *extra])
            for n in args.encode.split(",")]
        for i, (name, flags) in enumerate(cases):
            marks = run(data, Path(tmp) / f"out{i}", args, flags)
            rows.append({"run": name, **{k: round(v) for k, v in marks.items()}})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.resolution} px, batch {args.train_batch_size}, {args.samples} images, 2 steps"
          f"{', gradient checkpointing' if extra else ''}; VmHWM in MB\n"
          "| run | models loaded | cache made | run peak |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['run']} | {row.get('before_cache_mb', '')} | {row.get('after_cache_mb', '')} | "
              f"{row['run_peak_mb']} |")


if __name__ == "__main__":
    main()
