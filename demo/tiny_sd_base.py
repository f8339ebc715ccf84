"""`make tiny-sd-base`: the tiny Stable Diffusion base trained on the digits, that the LoRA demo fine-tunes.

Three steps, each a command of the Makefile target (the model card records them):
1. `python -m demo.tiny_sd_base vae`: trains the VAE (AutoencoderKL, 32 px -> 8x8x4 latents, 0.7 M parameters) on
   the digits, each recoloured with random ink and paper colours (a quarter left white on black), so that it
   encodes coloured digits it never saw, the red-ink style included; L1 + a small KL term; then SD's
   scaling_factor = 1 / std of the training latents. It writes the starting pipeline: this VAE, the random-init
   CLIP text encoder and byte-level tokenizer of `demo.tiny_sd` (frozen, never trained), a cosine-schedule
   v-prediction DDPMScheduler, and unet_config.json (the tiny UNet, 1.1 M parameters).
2. train_text_to_image.py trains a fresh UNet from that config on the digits' captions, with caption dropout (for
   classifier-free guidance), min-SNR weights and an EMA.
3. `python -m demo.tiny_sd_base finish`: measures the result (20 samples per digit prompt, sample.py's default
   sampler, steps and guidance, scored by the digit classifier) and writes the shipped folder: the pipeline's files,
   checksums.sha256 (checked whenever a script loads the folder) and a model card with the commands, the versions
   and the measurements.
"""
import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time

PIPELINE_FILES = ("model_index.json", "scheduler", "text_encoder", "tokenizer", "unet", "vae")
VAE_CONFIG = dict(in_channels=3, out_channels=3, latent_channels=4, sample_size=32, block_out_channels=(16, 32, 64),
                  down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
                  layers_per_block=1, norm_num_groups=16)
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", prediction_type="v_prediction",
                        clip_sample=False, steps_offset=1)


def load_digits(folder):
    """-> images [N, 3, H, W] in [0, 1], labels [N]."""
    import numpy as np
    import torch
    from PIL import Image

    images, labels = [], []
    with open(os.path.join(folder, "metadata.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            images.append(np.asarray(Image.open(os.path.join(folder, row["file_name"])).convert("RGB")))
            labels.append(row["label"])
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255, torch.tensor(labels)


def random_colours(grey, generator, keep=0.25, min_contrast=0.3):
    """Digits [N, 3, H, W] (white on black) -> paper + (ink - paper) * intensity, ink and paper uniform in RGB,
    redrawn while their luminances differ by less than min_contrast; a share `keep` left white on black."""
    import torch

    n = grey.shape[0]
    ink, paper = torch.rand(n, 3, generator=generator), torch.rand(n, 3, generator=generator)
    weights = torch.tensor([0.299, 0.587, 0.114])
    for _ in range(100):
        low = ((ink - paper) @ weights).abs() < min_contrast
        if not low.any():
            break
        ink[low] = torch.rand(int(low.sum()), 3, generator=generator)
        paper[low] = torch.rand(int(low.sum()), 3, generator=generator)
    plain = torch.rand(n, generator=generator) < keep
    ink[plain], paper[plain] = 1.0, 0.0
    s = grey[:, :1]
    return paper[:, :, None, None] + (ink - paper)[:, :, None, None] * s


def train_vae(args):
    import torch
    import torch.nn.functional as F
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    from common.text_encoder_keys import add_text_model_prefix
    from demo.tiny_sd import build_random_sd, tiny_configs

    torch.manual_seed(args.seed)
    train, _ = load_digits(os.path.join(args.data_dir, "train"))
    test, _ = load_digits(os.path.join(args.data_dir, "test"))
    vae = AutoencoderKL(**VAE_CONFIG)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.learning_rate, weight_decay=0.0)
    warmup = min(50, args.max_train_steps // 10 + 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, args.max_train_steps) / args.max_train_steps)))
    generator = torch.Generator().manual_seed(args.seed)
    start = time.time()
    # The loop: a batch of recoloured digits -> encode, sample, decode -> L1 + kl_weight * KL (per pixel value).
    for step in range(1, args.max_train_steps + 1):
        index = torch.randint(len(train), (args.train_batch_size,), generator=generator)
        x = random_colours(train[index], generator) * 2 - 1
        posterior = vae.encode(x).latent_dist
        reconstruction = vae.decode(posterior.sample(generator=generator)).sample
        l1 = F.l1_loss(reconstruction, x)
        loss = l1 + args.kl_weight * posterior.kl().mean() / x[0].numel()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == args.max_train_steps:
            print(f"vae step {step}/{args.max_train_steps}: L1 {l1.item():.4f} ({time.time() - start:.0f} s)",
                  flush=True)
    vae.eval()
    with torch.no_grad():
        latents = torch.cat([vae.encode(b * 2 - 1).latent_dist.sample(generator=generator) for b in train.split(256)])
        vae.register_to_config(scaling_factor=round(1.0 / latents.std().item(), 5))
        decoded = torch.cat([vae.decode(vae.encode(b * 2 - 1).latent_dist.mean).sample for b in test.split(256)])
    mse = (decoded.add(1).div(2).clamp(0, 1) - test).square().mean().item()
    metrics = {"vae_steps": args.max_train_steps, "vae_train_time_s": round(time.time() - start, 1),
               "vae_test_psnr_db": round(-10 * math.log10(mse), 2),
               "vae_scaling_factor": vae.config.scaling_factor}
    print(metrics)

    # The starting pipeline: the trained VAE, demo.tiny_sd's random-init text encoder and tokenizer, the schedule.
    random_sd = build_random_sd(tiny_configs(), seed=0)
    unet_config = {k: v for k, v in UNet2DConditionModel.from_config(tiny_configs()["unet"]).config.items()
                   if not k.startswith("_")}
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=random_sd.text_encoder, tokenizer=random_sd.tokenizer,
                                   unet=UNet2DConditionModel(**unet_config),
                                   scheduler=DDPMScheduler(**SCHEDULER_CONFIG),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    tmp = args.output_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    add_text_model_prefix(os.path.join(tmp, "text_encoder"))
    with open(os.path.join(tmp, "unet_config.json"), "w") as f:
        json.dump(unet_config, f, indent=2)
    with open(os.path.join(tmp, "vae_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    shutil.rmtree(args.output_dir, ignore_errors=True)
    os.replace(tmp, args.output_dir)
    print(f"wrote the starting pipeline to {args.output_dir} (UNet config: {args.output_dir}/unet_config.json)")


def evaluate_base(model, judge_path, per_digit, seed=0):
    """The base alone, prompted for each digit: -> (metrics, images [10 * per_digit, 3, H, W])."""
    import diffusers
    import torch

    from common.diffusion import sampling_scheduler
    from common.families import load_family
    from demo.digit_eval import Judge, digit_prompts, generate, score

    family = load_family(model, "--model", uses="the digits' evaluation draws from")
    pipe = getattr(diffusers, family.PIPELINE).from_pretrained(model, dtype=torch.float32)
    pipe.scheduler = sampling_scheduler(family.SAMPLER, pipe.scheduler.config, family.SAMPLERS)
    pipe.set_progress_bar_config(disable=True)
    prompts, labels = digit_prompts(per_digit)
    start = time.time()
    images = generate(pipe, family, prompts, family.SAMPLE_GUIDANCE, family.SAMPLE_STEPS, seed=seed)
    result = score(images, labels, Judge(judge_path))
    return {"samples_per_digit": per_digit, "sampler": family.SAMPLER, "num_inference_steps": family.SAMPLE_STEPS,
            "guidance_scale": family.SAMPLE_GUIDANCE, "accuracy": result["content"], "per_digit": result["per_digit"],
            "style_rate": result["style_rate"], "sample_time_s": round(time.time() - start, 1)}, images


def finish(args, files=PIPELINE_FILES, card=None):
    """Measure the trained pipeline (evaluate_base), refuse it below --min_accuracy, and write the shipped folder:
    the pipeline's `files`, samples.png, checksums.sha256, base_metrics.json and the model card (`card(metrics,
    info, args)` -> its title, introduction, table rows and build time; SD's by default)."""
    import diffusers
    import torch
    import transformers

    from common.base_models import CHECKSUMS, file_sha256
    from common.diffusion import image_grid, to_pil
    from common.text_encoder_keys import add_text_model_prefix

    metrics, images = evaluate_base(args.model, args.judge, args.per_digit)
    print(json.dumps(metrics))
    if metrics["accuracy"] < args.min_accuracy:
        sys.exit(f"the base draws the prompted digit in {metrics['accuracy']:.1%} of samples, below "
                 f"--min_accuracy {args.min_accuracy:.0%}: not written (train longer, or lower --min_accuracy)")
    tmp = args.output_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in files:
        source = os.path.join(args.model, name)
        (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, os.path.join(tmp, name))
    add_text_model_prefix(os.path.join(tmp, "text_encoder"))  # the key names ComfyUI's CLIP loader reads
    n = min(args.per_digit, 10)
    grid = images.view(10, args.per_digit, *images.shape[1:])[:, :n].reshape(-1, *images.shape[1:])
    image_grid(to_pil(grid), ncol=n).save(os.path.join(tmp, "samples.png"))
    listed = sorted(os.path.relpath(os.path.join(root, f), tmp) for root, _, names in os.walk(tmp) for f in names
                    if f != "samples.png")
    with open(os.path.join(tmp, CHECKSUMS), "w") as f:
        f.writelines(f"{file_sha256(os.path.join(tmp, name))}  {name}\n" for name in listed)
    info = {}
    for folder, name in ((getattr(args, "init", None), "vae_metrics.json"), (args.model, "all_results.json")):
        path = os.path.join(folder or "", name)
        if folder and os.path.isfile(path):
            with open(path) as f:
                info.update(json.load(f))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    size = sum(os.path.getsize(os.path.join(tmp, name)) for name in listed)
    text = (card or sd_card)(metrics, info, args)
    lines = [
        text["title"], "", text["intro"], "", "![samples](samples.png)", "",
        f"Measured: the digit classifier (`{args.judge}`) recognises the prompted digit in "
        f"**{metrics['accuracy']:.1%}** of {10 * args.per_digit} samples ({args.per_digit} per digit, seeds "
        f"0-{10 * args.per_digit - 1}, {metrics['sampler']} sampler, {metrics['num_inference_steps']} steps, "
        f"guidance {metrics['guidance_scale']}: sample.py's defaults); per digit: {metrics['per_digit']}; "
        f"samples in the red-ink style: {metrics['style_rate']:.0%}.",
        "",
        "## Use it",
        "",
        f"What sample.py draws (`python sample.py --model {args.output_dir} --prompt \"a handwritten digit seven\"`; "
        "it reads these settings from this card), in diffusers:",
        "",
        "```python",
        usage_snippet(tmp, args.output_dir),
        "```",
        "",
        "| | |", "|---|---|", *text["rows"],
        f"| built with | torch {torch.__version__}, diffusers {diffusers.__version__}, transformers "
        f"{transformers.__version__}, Python {platform.python_version()}, commit {commit or 'unknown'} |",
        f"| build time | {text['build_time']} on {platform.machine()} CPU |",
        f"| size | {size / 1e6:.1f} MB in {len(listed)} files, sha256 of each in {CHECKSUMS} |",
        "",
        f"Rebuilt by (`{text['make']}`):",
        "```",
        *(" ".join(re.sub(r"\\\s*\n", " ", command).split()) for command in args.commands.split(" ;; ")),
        "```",
        "",
    ]
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(tmp, "base_metrics.json"), "w") as f:
        json.dump({**metrics, **info}, f, indent=2)
    shutil.rmtree(args.output_dir, ignore_errors=True)
    os.replace(tmp, args.output_dir)
    print(f"wrote {args.output_dir} ({size / 1e6:.1f} MB): the prompted digit in {metrics['accuracy']:.1%} of samples")


def usage_snippet(path, shown=None):
    """The model card's code: the call that draws the base at `path` (named `shown` in the code) as `finish`
    measured it, with the family's sampler, steps and guidance at the base's own size and T5 length, sample.py's
    defaults (common/sampling_defaults.py reads them back from the card)."""
    import diffusers
    import torch

    from common.families import load_family
    from common.sampling_defaults import call_kwargs, pipeline_snippet, scheduler_swap

    family = load_family(path, "--model", uses="the model card's code draws from")
    pipe = getattr(diffusers, family.PIPELINE).from_pretrained(path, dtype=torch.float32)
    call = call_kwargs(family, getattr(pipe, family.DENOISER).config, *family.sample_size(pipe), family.SAMPLE_STEPS,
                       family.SAMPLE_GUIDANCE, family.text_length(pipe.components))
    return pipeline_snippet(family, shown or path, "a handwritten digit seven", call,
                            swap=scheduler_swap(family, pipe.scheduler))


def sd_card(metrics, info, args):
    """The SD base's model card: its title, introduction, table rows and build time."""
    return {
        "title": "# tiny-sd-digits: a tiny Stable Diffusion trained on the digits",
        "intro": "A `StableDiffusionPipeline` (AutoencoderKL, UNet2DConditionModel, CLIPTextModel with a byte-level "
                 "tokenizer, DDPMScheduler) that draws the digit a prompt asks for: \"a handwritten digit seven\" "
                 "gives a 7, white on black, 32 px. The base of `make train-lora`. Built offline by `make "
                 "tiny-sd-base` (see demo/tiny_sd_base.py); nothing in it was downloaded.",
        "rows": [f"| VAE | 0.7 M parameters, {info.get('vae_steps')} steps, test PSNR {info.get('vae_test_psnr_db')} "
                 f"dB, scaling factor {info.get('vae_scaling_factor')} |",
                 f"| UNet | {info.get('trainable_parameters')} parameters, trained from scratch for "
                 f"{info.get('global_step')} steps (EMA weights), v-prediction, cosine schedule |",
                 "| text encoder | random-init 2-layer CLIP (frozen: only the UNet learns to read it) |"],
        "build_time": f"VAE {info.get('vae_train_time_s')} s, UNet {info.get('train_runtime')} s",
        "make": "make tiny-sd-base",
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    vae = steps.add_parser("vae", help="Train the VAE; write the starting pipeline and the UNet config.")
    vae.add_argument("--data_dir", default="data/digits")
    vae.add_argument("--output_dir", default="outputs/tiny-sd-base/init")
    vae.add_argument("--max_train_steps", type=int, default=1500)
    vae.add_argument("--train_batch_size", type=int, default=32)
    vae.add_argument("--learning_rate", type=float, default=2e-3)
    vae.add_argument("--kl_weight", type=float, default=1e-6)
    vae.add_argument("--seed", type=int, default=0)
    fin = steps.add_parser("finish", help="Measure the trained pipeline and write the shipped folder.")
    fin.add_argument("--model", default="outputs/tiny-sd-base/unet", help="train_text_to_image.py's output.")
    fin.add_argument("--init", default="outputs/tiny-sd-base/init", help="The `vae` step's output.")
    fin.add_argument("--judge", default="assets/digit-classifier")
    fin.add_argument("--output_dir", default="assets/tiny-sd-digits")
    fin.add_argument("--per_digit", type=int, default=20)
    fin.add_argument("--min_accuracy", type=float, default=0.9)
    fin.add_argument("--commands", default="make tiny-sd-base", help="The build's commands, ' ;; '-separated.")
    args = parser.parse_args(argv)
    import torch

    from common.cli import quiet_libraries, quiet_loading_bars

    quiet_libraries()
    quiet_loading_bars()

    torch.set_num_threads(1)  # these tiny models run no faster on two threads
    (train_vae if args.step == "vae" else finish)(args)


if __name__ == "__main__":
    main()
