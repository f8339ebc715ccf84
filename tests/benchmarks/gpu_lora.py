"""`make bench-gpu`: LoRA on a Stable-Diffusion-1.5-architecture UNet at 512 px on one GPU (`make bench-gpu-sdxl`:
SDXL's at 1024 px), the recipe against a hand-written reference loop: steps/s, peak GPU memory and model FLOP
utilisation (MFU).

    python tests/benchmarks/gpu_lora.py                      # the [gpu] matrix of workloads.toml
    python tests/benchmarks/gpu_lora.py --workload gpu_sdxl  # the [gpu_sdxl] one: SDXL at 1024 px
    python tests/benchmarks/gpu_lora.py --batch_sizes 4 --precisions bf16 --gradient_checkpointing off

The base is SD 1.5's architecture with random weights, built locally from its public configs (`python -m
demo.tiny_sd --architecture sd15`, done here when missing): nothing is downloaded, and speed and memory are those
of the real model. For each batch size x precision x gradient checkpointing:
- recipe: train_lora.py launched as users launch it (`accelerate launch --config_file single_gpu.yaml`), on the
  digits at --resolution 512 with --cache_latents; steps/s from its progress bar between the warm-up and the end
  (as `make bench`), peak GPU memory from its all_results.json (what the whole run held: VAE, text encoder, the
  latent caching included);
- reference: the same UNet, LoRA (rank 8 on to_k,to_q,to_v,to_out.0, fp32 weights over a frozen fp16/bf16 base),
  SDPA, autocast, grad scaler (fp16), clipping and fused AdamW in a bare PyTorch loop on random latents and text
  embeddings (SDXL: and pooled embeddings and time ids) already on the GPU, with no host sync inside the timed
  steps: the practical upper bound.
MFU = the model FLOPs of one training step (counted by torch.utils.flop_counter on the reference step, without
gradient checkpointing's recomputation) x steps/s / the GPU's dense fp16/bf16 peak (datasheet). The 8192^3 bf16
matrix product's measured rate is reported beside it. Results: outputs/bench/gpu_results.json, and a table.
"""
import argparse
import datetime
import importlib.metadata
import itertools
import json
import os
import platform
import sys
import time
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import run_bench  # noqa: E402  (tests/benchmarks/run_bench.py: the recipe timing of `make bench`)

# Dense (no sparsity) fp16/bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s; matched in the device name.
PEAK_TFLOPS = {"H200": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.1,
               "L4": 121.0, "A10G": 70.0, "RTX 4090": 165.2}


def peak_tflops(device_name):
    return next((tflops for key, tflops in PEAK_TFLOPS.items() if key in device_name), None)


def matmul_tflops(device):
    """Measured bf16 rate of an 8192^3 matrix product on random data (median of 10 after 3 warm-ups)."""
    import torch

    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    return 2 * 8192**3 / sorted(times)[len(times) // 2] / 1e12


def load_lora_unet(base, precision, device, rank, targets):
    """The frozen base UNet in the precision's dtype with SDPA, fp32 LoRA adapters: as train_lora.py builds it."""
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    from common.base_models import lora_dtypes

    weight_dtype, lora_dtype = lora_dtypes(precision)
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet", dtype=weight_dtype).requires_grad_(False)
    unet.to(device).set_attn_processor(AttnProcessor2_0())
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=targets))
    cast_training_params(unet, dtype=lora_dtype)
    return unet.train()


def reference_step(unet, scheduler, batch_size, precision, device):
    """-> step(): one optimizer step of the reference loop on random latents and embeddings already on the device."""
    import torch
    import torch.nn.functional as F

    from common.base_models import lora_dtypes

    size, width = unet.config.sample_size, unet.config.cross_attention_dim
    latents = [torch.randn(batch_size, 4, size, size, device=device) for _ in range(4)]
    embeds = torch.randn(batch_size, 77, width, device=device, dtype=unet.dtype)
    added = None  # SDXL: the pooled text embedding and the six time ids
    if unet.config.addition_embed_type == "text_time":
        pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        pixels = 8 * size
        added = {"text_embeds": torch.randn(batch_size, pooled, device=device, dtype=unet.dtype),
                 "time_ids": torch.tensor([[pixels, pixels, 0, 0, pixels, pixels]] * batch_size, device=device,
                                          dtype=unet.dtype)}
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-2, fused=True)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    dtype, autocast = lora_dtypes(precision)[0], precision in ("fp16", "bf16")
    count = itertools.count()

    def step():
        clean = latents[next(count) % len(latents)]
        noise = torch.randn_like(clean)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (batch_size,), device=device)
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            pred = unet(scheduler.add_noise(clean, noise, t), t, embeds, added_cond_kwargs=added, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), noise)
        if scaler:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def synchronize(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference_run(unet, scheduler, batch_size, precision, gradient_checkpointing, steps, warmup, device):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from common.reporting import peak_memory_mb

    if gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    else:
        unet.disable_gradient_checkpointing()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step = reference_step(unet, scheduler, batch_size, precision, device)
    for _ in range(warmup):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps - warmup):
        step()
    synchronize(device)
    rate = (steps - warmup) / (time.perf_counter() - start)
    peak = peak_memory_mb(device)
    unet.disable_gradient_checkpointing()  # model FLOPs: without the recomputation
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return {"steps_per_second": rate, "samples_per_second": rate * batch_size, "peak_memory_mb": round(peak, 1),
            "flops_per_step": counter.get_total_flops(), **kernel_profile(step, rate, device)}


def kernel_profile(step, rate, device, steps=3):
    """On a GPU: kernels a step, and the share of the step's time that the GPU spends in kernels (torch.profiler).
    A small share at a fast step is a host-bound loop: Python and the dispatcher, not the GPU, set the pace."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_s = sum(e.time_range.elapsed_us() for e in kernels) / steps / 1e6
    return {"kernels_per_step": round(len(kernels) / steps), "gpu_busy_share": round(busy_s * rate, 3)}


def recipe_run(base, batch_size, precision, gradient_checkpointing, g, launch, env, name, root):
    w = {"script": "train_lora.py", "batch_size": batch_size, "steps": g["steps"], "warmup": g["warmup"],
         "args": [*g["args"], "--pretrained_model_name_or_path", base, "--resolution", str(g["resolution"]),
                  "--train_batch_size", str(batch_size), "--mixed_precision", precision,
                  *(["--gradient_checkpointing"] if gradient_checkpointing else [])]}
    r = run_bench.recipe_run(name, w, {"launch": launch}, run_bench.accelerate_cli(), env, 0, root)
    return {"steps_per_second": r["steps_per_second"], "samples_per_second": r["samples_per_second"],
            "peak_memory_mb": r["peak_rss_mb"], "first_step_s": r["first_step_s"], "wall_s": r["wall_s"]}


def machine_facts(device):
    import torch

    facts = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
             "platform": platform.platform(), "python": platform.python_version(),
             "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
             **{pkg: importlib.metadata.version(pkg) for pkg in ("torch", "accelerate", "diffusers", "peft")}}
    if device.type == "cuda":
        facts.update(cuda=torch.version.cuda, peak_tflops_datasheet=peak_tflops(facts["device"]),
                     matmul_bf16_tflops_measured=round(matmul_tflops(device), 1))
    return facts


def table(results):
    header = ["batch", "precision", "grad ckpt", "recipe steps/s", "reference steps/s", "ratio", "samples/s",
              "peak GPU GiB recipe (ref)", "TFLOP/step", "MFU recipe (ref)"]
    rows = []
    for r in results["configs"]:
        rec, ref = r.get("recipe"), r["reference"]
        tflop = ref["flops_per_step"] / 1e12
        mfu = [(x["steps_per_second"] * tflop / r["peak_tflops"]) if x and r["peak_tflops"] else None
               for x in (rec, ref)]
        pct = ["-" if m is None else f"{100 * m:.1f} %" for m in mfu]
        rows.append([r["batch_size"], r["precision"], "on" if r["gradient_checkpointing"] else "off",
                     f"{rec['steps_per_second']:.2f}" if rec else "-", f"{ref['steps_per_second']:.2f}",
                     f"{rec['steps_per_second'] / ref['steps_per_second']:.3f}" if rec else "-",
                     f"{(rec or ref)['samples_per_second']:.1f}",
                     f"{rec['peak_memory_mb'] / 1024:.2f} ({ref['peak_memory_mb'] / 1024:.2f})" if rec
                     else f"- ({ref['peak_memory_mb'] / 1024:.2f})", f"{tflop:.2f}", f"{pct[0]} ({pct[1]})"])
    return run_bench.markdown_table(header, rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(HERE, "workloads.toml"))
    parser.add_argument("--workload", default="gpu", help="The table of --config: gpu (SD 1.5) or gpu_sdxl.")
    parser.add_argument("--base", default=None, help="Default: the config's (built there when missing).")
    parser.add_argument("--batch_sizes", default=None, help="e.g. 1,4 (default: the config's).")
    parser.add_argument("--precisions", default=None, help="e.g. fp16,bf16 (default: the config's).")
    parser.add_argument("--gradient_checkpointing", default="off,on", help="off, on, or off,on.")
    parser.add_argument("--resolution", type=int, default=None, help="Default: the config's (512).")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run on a tiny base.")
    parser.add_argument("--launch_config", default="accelerate_configs/single_gpu.yaml")
    parser.add_argument("--launch_args", default="", help='More `accelerate launch` flags for the recipe, e.g. '
                        '"--dynamo_backend inductor".')
    parser.add_argument("--no_recipe", action="store_true", help="The reference loop only.")
    parser.add_argument("--output", default=os.path.join(run_bench.OUT, "gpu_results.json"))
    args = parser.parse_args()
    with open(args.config, "rb") as f:
        g = tomllib.load(f)[args.workload]
    for key in ("base", "resolution", "steps", "warmup"):
        g[key] = getattr(args, key) or g[key]
    batch_sizes = [int(b) for b in (args.batch_sizes or ",".join(map(str, g["batch_sizes"]))).split(",")]
    precisions = (args.precisions or ",".join(g["precisions"])).split(",")
    checkpointing = [{"off": False, "on": True}[x] for x in args.gradient_checkpointing.split(",")]

    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU visible; `make bench` is the CPU benchmark")
    base = os.path.join(ROOT, g["base"]) if not os.path.isabs(g["base"]) else g["base"]
    if not os.path.isdir(base):
        from demo.tiny_sd import write_tiny_sd

        start = time.perf_counter()  # (every weight drawn at once on the device, bf16: seconds on a GPU)
        n = write_tiny_sd(base, g.get("architecture", "sd15"), device=args.device, fast=args.device != "cpu")
        print(f"built the random-init {g.get('architecture', 'sd15')} architecture ({n / 1e6:.0f} M parameters) in "
              f"{time.perf_counter() - start:.0f} s: {base}", flush=True)
    data = g["args"][g["args"].index("--train_data_dir") + 1] if "--train_data_dir" in g["args"] else None
    if data and not os.path.isfile(os.path.join(ROOT, data, "train", "metadata.jsonl")):  # (no `make data`)
        from demo.digits import write_digits

        write_digits(os.path.join(ROOT, data))
    root = os.path.dirname(os.path.abspath(args.output))  # the recipes' output folders and logs: beside it
    os.makedirs(os.path.join(root, "logs"), exist_ok=True)
    env = dict(os.environ, **g["env"])
    env.pop("TQDM_DISABLE", None)  # the progress bar is what the recipe is timed by
    from diffusers import DDPMScheduler

    from common.families.sd import LORA_TARGETS  # the recipe's default LoRA targets on a UNet

    scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")  # the base's own noise schedule

    results = {"machine": machine_facts(device), "configs": [],
               "settings": {**{k: g[k] for k in ("base", "resolution", "steps", "warmup", "args")},
                            "launch_args": args.launch_args}}
    peak = results["machine"].get("peak_tflops_datasheet")

    def save():
        results["table"] = table(results) if results["configs"] else ""
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)

    for precision in precisions:  # the reference loops: one process, the base loaded once per precision
        unet = load_lora_unet(base, precision, device, rank=8, targets=LORA_TARGETS.split(","))
        for batch_size, gc in itertools.product(batch_sizes, checkpointing):
            ref = reference_run(unet, scheduler, batch_size, precision, gc, g["steps"], g["warmup"], device)
            results["configs"].append({"batch_size": batch_size, "precision": precision, "gradient_checkpointing": gc,
                                       "peak_tflops": peak, "reference": ref})
            busy = f", GPU in kernels {100 * ref['gpu_busy_share']:.0f} % of a step" if "gpu_busy_share" in ref else ""
            print(f"reference {precision} batch {batch_size} checkpointing {gc}: {ref['steps_per_second']:.2f} "
                  f"steps/s, {ref['peak_memory_mb'] / 1024:.2f} GiB, {ref['flops_per_step'] / 1e12:.2f} TFLOP a step"
                  f"{busy}", flush=True)
            save()
        del unet
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.no_recipe:
        launch = ["launch", "--config_file", args.launch_config, *args.launch_args.split()]
        for r in results["configs"]:
            name = f"{args.workload}-{r['precision']}-b{r['batch_size']}{'-gc' if r['gradient_checkpointing'] else ''}"
            r["recipe"] = recipe_run(base, r["batch_size"], r["precision"], r["gradient_checkpointing"], g, launch,
                                     env, name, root)
            print(f"recipe {name}: {r['recipe']['steps_per_second']:.2f} steps/s, "
                  f"{r['recipe']['peak_memory_mb'] / 1024:.2f} GiB, first step at {r['recipe']['first_step_s']:.1f} s",
                  flush=True)
            save()
    save()
    m = results["machine"]
    print(f"\n{m['device']}, torch {m['torch']}, {m['date']}; dense peak {m.get('peak_tflops_datasheet')} TFLOP/s "
          f"(datasheet), bf16 8192^3 matmul {m.get('matmul_bf16_tflops_measured')} TFLOP/s (measured)\n")
    print(results["table"])
    print(f"\nwritten to {args.output}")


if __name__ == "__main__":
    main()
