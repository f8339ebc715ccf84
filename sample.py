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
    raise UserError("DDPM sampling is not implemented yet")


def sample_sd(args):
    raise UserError("Stable Diffusion sampling is not implemented yet")


def main(args):
    paths = sample_ddpm(args) if model_kind(args.model) == "ddpm" else sample_sd(args)
    print(f"wrote {len(paths)} images and grid.png to {os.path.dirname(paths[0])}")


if __name__ == "__main__":
    run(main, parse_args)
