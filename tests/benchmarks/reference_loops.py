"""Reference loops for `make bench`: the practical upper bound of steps/s for each training workload.

Each is a minimal hand-written PyTorch loop on the recipe's own model (built by the recipe's own config helpers),
with the same batch size, loss, gradient clipping and AdamW settings, the data already in memory as tensors, and
nothing else: no accelerate, no dataloader, no trackers, no progress bar.

    OMP_NUM_THREADS=1 python tests/benchmarks/reference_loops.py classifier --steps 23 --warmup 3

prints one JSON line: steps_per_second and steps_per_cpu_second (after the warm-up steps), peak_rss_mb,
first_step_at (epoch seconds).
"""
import argparse
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the recipes and common/ (importing a recipe runs only its flag definitions)


def load_digits(resolution, root=os.path.join(ROOT, "data/digits/train")):
    """The digits train split as (uint8 [N, 3, R, R] resized exactly like the recipes do, labels, captions)."""
    import torch
    from PIL import Image

    from common.image_data import resize_shorter_side

    with open(os.path.join(root, "metadata.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    pixels = torch.stack([resize_shorter_side(Image.open(os.path.join(root, r["file_name"])), resolution)
                          for r in rows])
    return pixels, torch.tensor([r["label"] for r in rows]), [r["text"] for r in rows]


def adamw(model, lr, weight_decay):
    import torch

    from common.training import build_param_groups  # the recipes' groups: no decay on biases and norms

    return torch.optim.AdamW(build_param_groups(model, lr, weight_decay), fused=True)  # as the recipes


def classifier():
    """train_classifier.py's demo: the small ResNet (channels-last), 32 px, batch 64, cross-entropy."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForImageClassification, ResNetConfig

    from train_classifier import small_resnet_config

    pixels, labels, _ = load_digits(32)
    x = (pixels.float() / 255 - 0.5) / 0.5
    model = AutoModelForImageClassification.from_config(small_resnet_config(ResNetConfig, 10)).train()
    model.to(memory_format=torch.channels_last)  # as the recipe (--channels_last, its default)
    optimizer = adamw(model, 3e-3, 0.05)

    def step(idx):
        loss = F.cross_entropy(model(pixel_values=x[idx]).logits, labels[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, len(x), 64


def ddpm():
    """train_ddpm.py's demo: the default UNet2DModel, 16 px, batch 64, class dropout, min-SNR-5 MSE, EMA."""
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.training_utils import compute_snr

    from common.unet_config import default_unet_config

    pixels, labels, _ = load_digits(16)
    x = pixels.float() / 127.5 - 1
    unet = UNet2DModel.from_config({**default_unet_config((16, 32, 64), 1, 11), "sample_size": 16}).train()
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    optimizer = adamw(unet, 2e-3, 1e-6)
    params = list(unet.parameters())
    ema = [p.detach().clone() for p in params]
    count = [0]

    def step(idx):
        clean, noise = x[idx], torch.randn_like(x[idx])
        t = torch.randint(0, 1000, (len(idx),))
        class_labels = labels[idx].masked_fill(torch.rand(len(idx)) < 0.1, 10)
        pred = unet(scheduler.add_noise(clean, noise, t), t, class_labels=class_labels).sample
        snr = compute_snr(scheduler, t)
        loss = (F.mse_loss(pred, noise, reduction="none").mean(dim=(1, 2, 3)) * snr.clamp(max=5.0) / snr).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        count[0] += 1  # EMA with the recipe's warm-up: decay = 1 - (1 + step) ** -0.75
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], (1 + count[0]) ** -0.75)

    return step, len(x), 64


def lora(cache_latents):
    """train_lora.py's demo: the tiny SD UNet with LoRA r=8 on to_k,to_q,to_v,to_out.0, 32 px, batch 32; latents
    VAE-encoded once (cached) or every step, prompt embeddings computed once."""
    import torch
    import torch.nn.functional as F
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from peft import LoraConfig
    from transformers import CLIPTextModel, CLIPTokenizer

    from common.families.sd import LORA_TARGETS

    base = os.path.join(ROOT, "models/tiny-sd")
    pixels, _, captions = load_digits(32)
    x = pixels.float() / 127.5 - 1
    scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(base, subfolder="text_encoder").requires_grad_(False)
    vae = AutoencoderKL.from_pretrained(base, subfolder="vae").requires_grad_(False)
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet").requires_grad_(False)
    unet.set_attn_processor(AttnProcessor2_0())
    unet.add_adapter(LoraConfig(r=8, lora_alpha=8, init_lora_weights="gaussian",
                                target_modules=LORA_TARGETS.split(",")))
    unet.train()
    prompts = sorted(set(captions))
    with torch.no_grad():
        embeds = text_encoder(tokenizer(prompts, padding="max_length", max_length=77, truncation=True,
                                        return_tensors="pt").input_ids)[0]
    prompt_of = torch.tensor([prompts.index(c) for c in captions])

    def encode(pixel_values):
        with torch.no_grad():
            return vae.encode(pixel_values).latent_dist.parameters

    cached = torch.cat([encode(batch) for batch in x.split(32)]) if cache_latents else None
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = adamw(unet, 2e-3, 1e-2)

    def step(idx):
        latent_params = cached[idx] if cached is not None else encode(x[idx])
        latents = DiagonalGaussianDistribution(latent_params).sample() * vae.config.scaling_factor
        noise = torch.randn_like(latents)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (len(idx),))
        pred = unet(scheduler.add_noise(latents, noise, t), t, embeds[prompt_of[idx]], return_dict=False)[0]
        F.mse_loss(pred, noise).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, len(x), 32


WORKLOADS = {"classifier": classifier, "ddpm": ddpm, "lora_cached": lambda: lora(True),
             "lora_uncached": lambda: lora(False)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, required=True, help="Optimizer steps in all, warm-up included.")
    parser.add_argument("--warmup", type=int, default=3, help="Steps left out of the timing.")
    args = parser.parse_args()

    import torch

    torch.manual_seed(0)
    step, num_samples, batch_size = WORKLOADS[args.workload]()
    batches, first_step_at, start, cpu_start = [], None, None, None
    for i in range(args.steps):
        if not batches:  # a new epoch: a fresh shuffle; the last batch is short, as in the recipes
            batches = list(torch.randperm(num_samples).split(batch_size))[::-1]
        if i == args.warmup:
            start, cpu_start = time.perf_counter(), time.process_time()
        step(batches.pop())
        if i == 0:
            first_step_at = time.time()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(json.dumps({"steps_per_second": (args.steps - args.warmup) / elapsed,
                      "steps_per_cpu_second": (args.steps - args.warmup) / cpu,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "first_step_at": first_step_at}))


if __name__ == "__main__":
    main()
