#!/usr/bin/env python
"""Draw images from any checkpoint the recipes write (and from hub pipelines), reproducibly.

Every image is a PNG whose text metadata holds its generation parameters (model, seed, steps, scheduler,
guidance, label/prompt); a grid.png sits beside them. The same command gives the same pixels.

A train_ddpm.py output or checkpoint (EMA weights when present):
    python sample.py --model outputs/ddpm --class_label all --num_images 4
A train_lora.py output or checkpoint (its base model is read from its metadata), or a base with LoRAs:
    python sample.py --model outputs/lora --prompt "a handwritten digit seven"
    python sample.py --model stable-diffusion-v1-5/stable-diffusion-v1-5 --lora outputs/lora:0.8 --prompt "..."
"""
import json
import os

from common.args import make_parser, non_negative_int, positive_float, positive_int
from common.cli import UserError, run

SCHEDULERS = ["ddpm", "ddim", "dpm", "euler", "euler_a", "pndm", "unipc"]


def parse_args(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Output/checkpoint folder of a recipe, or a pipeline.")
    parser.add_argument("--output_dir", default=None, help="Default: <model>/samples.")
    parser.add_argument("--num_images", type=positive_int, default=8, help="Images per label or prompt.")
    parser.add_argument("--batch_size", type=positive_int, default=16)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--scheduler", default=None, choices=SCHEDULERS, help="Default: the model's own.")
    parser.add_argument("--num_inference_steps", type=positive_int, default=None)
    parser.add_argument("--guidance_scale", type=positive_float, default=None)
    parser.add_argument("--device", default=None, help="Default: cuda when available, else cpu.")
    parser.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"],
                        help="Default: fp16 on CUDA, fp32 on CPU.")
    # DDPM outputs (train_ddpm.py)
    parser.add_argument("--class_label", action="append", default=None,
                        help="Class name or id (repeatable), or 'all' for a row per class.")
    parser.add_argument("--no_ema", action="store_true", help="Use the raw weights of a checkpoint, not its EMA.")
    # Stable Diffusion (train_lora.py outputs, hub pipelines)
    parser.add_argument("--prompt", action="append", default=None, help="Repeatable.")
    parser.add_argument("--negative_prompt", default=None)
    parser.add_argument("--lora", action="append", default=[], help="PATH[:SCALE], repeatable.")
    parser.add_argument("--guidance_rescale", type=float, default=0.0)
    parser.add_argument("--clip_skip", type=non_negative_int, default=None)
    parser.add_argument("--height", type=positive_int, default=None)
    parser.add_argument("--width", type=positive_int, default=None)
    return parser.parse_args(argv)


def choose_device_and_dtype(args):
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = args.dtype or ("fp16" if device.type == "cuda" else "fp32")
    return device, {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def save_images(images, params, output_dir, nrow):
    """images: list of PIL images; params: one dict per image, written into its PNG text metadata."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    os.makedirs(output_dir, exist_ok=True)
    paths = []
    for i, (image, p) in enumerate(zip(images, params)):
        info = PngInfo()
        for key, value in p.items():
            info.add_text(key, str(value))
        info.add_text("parameters", json.dumps(p, sort_keys=True))
        path = os.path.join(output_dir, f"{i:04d}.png")
        image.save(path, pnginfo=info)
        paths.append(path)
    w, h = images[0].size
    ncol = min(nrow, len(images))
    rows = (len(images) + ncol - 1) // ncol
    grid = Image.new("RGB", (ncol * w, rows * h), "white")
    for i, image in enumerate(images):
        grid.paste(image, ((i % ncol) * w, (i // ncol) * h))
    grid.save(os.path.join(output_dir, "grid.png"))
    return paths


def model_kind(path):
    """'ddpm' for train_ddpm.py outputs/checkpoints, 'sd' for Stable Diffusion pipelines and train_lora.py outputs."""
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if "unet" in names and "vae" not in names and ("scheduler" in names or "unet_ema" in names):
            return "ddpm"
        return "sd"
    if os.path.exists(path) or path.count("/") != 1:
        raise UserError(f"--model '{path}' is neither a folder nor a hub id")
    return "sd"


def sample_ddpm(args):
    """A train_ddpm.py output or checkpoint-N: unet_ema/ (unless --no_ema) or unet/, scheduler/, labels.json."""
    import torch
    from diffusers import DDPMScheduler, UNet2DModel

    from common.ddpm_sampling import (DEFAULT_GUIDANCE_SCALE, DEFAULT_INFERENCE_STEPS, DEFAULT_SCHEDULER,
                                      make_scheduler, sample_images, to_pil)

    if args.prompt or args.lora:
        raise UserError(f"--prompt/--lora are for Stable Diffusion; '{args.model}' is a train_ddpm.py model "
                        "(use --class_label)")
    ema = not args.no_ema and os.path.isdir(os.path.join(args.model, "unet_ema"))
    unet_dir = os.path.join(args.model, "unet_ema" if ema else "unet")
    try:
        unet = UNet2DModel.from_pretrained(unet_dir)
        scheduler_config = DDPMScheduler.load_config(os.path.join(args.model, "scheduler"))
    except (OSError, ValueError) as err:
        raise UserError(f"--model '{args.model}' is not a train_ddpm.py output: {str(err).splitlines()[0]}") from None

    # Class-conditional models: one row of --num_images per requested class; the null class is the last id.
    num_classes = (unet.config.num_class_embeds or 1) - 1
    class_ids, names = None, []
    if num_classes > 0:
        names = [str(i) for i in range(num_classes)]
        if os.path.isfile(os.path.join(args.model, "labels.json")):
            with open(os.path.join(args.model, "labels.json")) as f:
                names = [str(name) for name in json.load(f)]
        requested = args.class_label or ["all"]
        ids = []
        for label in requested:
            if label == "all":
                ids += range(num_classes)
            elif label in names:
                ids.append(names.index(label))
            elif label.isdigit() and int(label) < num_classes:
                ids.append(int(label))
            else:
                raise UserError(f"--class_label '{label}' is not a class of this model; its classes are: "
                                f"{', '.join(names)} (or ids 0-{num_classes - 1}, or 'all')")
        class_ids = torch.tensor(ids).repeat_interleave(args.num_images)
    elif args.class_label:
        raise UserError(f"--class_label: '{args.model}' is unconditional (trained without --class_column)")

    scheduler_name = args.scheduler or DEFAULT_SCHEDULER
    steps = args.num_inference_steps or DEFAULT_INFERENCE_STEPS
    guidance = args.guidance_scale if args.guidance_scale is not None else DEFAULT_GUIDANCE_SCALE
    device, dtype = choose_device_and_dtype(args)
    unet.to(device, dtype).eval()
    count = len(class_ids) if class_ids is not None else args.num_images
    images = sample_images(unet, make_scheduler(scheduler_name, scheduler_config), count, class_labels=class_ids,
                           null_class=num_classes, guidance_scale=guidance, num_inference_steps=steps,
                           batch_size=args.batch_size, generator=torch.Generator().manual_seed(args.seed))
    common = {"model": args.model, "weights": "ema" if ema else "raw", "seed": args.seed,
              "scheduler": scheduler_name, "num_inference_steps": steps}
    params = []
    for i in range(count):
        p = {**common, "index": i}
        if class_ids is not None:
            p.update(class_label=names[class_ids[i]], class_id=int(class_ids[i]), guidance_scale=guidance)
        params.append(p)
    ncol = args.num_images if class_ids is not None else max(1, round(count ** 0.5))
    return save_images(to_pil(images), params, args.output_dir or os.path.join(args.model, "samples"), ncol)


def sample_sd(args):
    raise UserError("Stable Diffusion sampling is not implemented yet")


def main(args):
    paths = sample_ddpm(args) if model_kind(args.model) == "ddpm" else sample_sd(args)
    print(f"wrote {len(paths)} images and grid.png to {os.path.dirname(paths[0])}")


if __name__ == "__main__":
    run(main, parse_args)
