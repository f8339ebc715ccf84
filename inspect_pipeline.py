#!/usr/bin/env python
"""See what a diffusion pipeline holds and what its __call__ really does, with shapes and wall times.

Prints the components (parameters, dtype, device, size), the scheduler, the denoiser's key config, the text encoders
and tokenizers, and the VAE (latent shape at --height/--width). --lora: what a LoRA adapts, its rank and alpha, and
how many parameters it adds. --trace: one real call, stage by stage, recorded through the pipeline's own
callback_on_step_end, forward hooks and wrappers around the methods it calls; nothing is re-implemented, so what is
shown is what runs. --save_trajectory: the predicted clean image x0 at several steps, side by side. --json: all of it.

The demo base (a tiny random-init Stable Diffusion built offline; prints noise-level numbers, real shapes):
    make inspect
    python inspect_pipeline.py models/tiny-sd --trace --num_inference_steps 4 --save_trajectory x0.png
    python inspect_pipeline.py models/tiny-sd --trace --guidance_scale 1 --json    # no guidance: batch B, not 2B
An SDXL pipeline (`make tiny-sdxl`): the trace shows both text encoders, the pooled embedding and the time ids:
    python inspect_pipeline.py models/tiny-sdxl --trace --num_inference_steps 4
A train_ddpm.py output or checkpoint (class-conditional ones are traced through sample.py's loop, with labels):
    python inspect_pipeline.py outputs/ddpm --trace --class_label 7 --guidance_scale 2 --save_trajectory x0.png
A train_lora.py output (its base is read from lora_info.json), or any base with a LoRA:
    python inspect_pipeline.py outputs/lora --trace
    python inspect_pipeline.py models/tiny-sd --lora outputs/lora
A hub model (needs the network; on a GPU the trace takes seconds):
    python inspect_pipeline.py stable-diffusion-v1-5/stable-diffusion-v1-5 --trace --height 512 --width 512 \\
        --device cuda --dtype fp16 --prompt "an astronaut riding a horse" --save_trajectory x0.png

Copy with: common/__init__.py, common/args.py, common/base_models.py, common/cli.py, common/deepspeed_engine.py, common/diffusion.py, common/families/__init__.py, common/lora_files.py, common/objectives.py, common/pipeline_report.py, common/pipeline_trace.py, common/pipelines.py, common/prompts.py, common/sampling_defaults.py, common/sgm_names.py, common/ui_lora.py, common/vae.py, common/video.py
"""  # noqa: E501 (the copy list stays one line, for grep)
import json
import os

from common.args import (
    add_device_args,
    check_writable,
    device_and_dtype,
    make_parser,
    non_negative_int,
    positive_int,
)
from common.cli import UserError, first_line, run
from common.diffusion import DEFAULT_GUIDANCE_SCALE
from common.families import check_lora_base, folder_family
from common.lora_files import LORA_WEIGHTS, check_lora_format, check_safetensors, lora_file_metadata, read_lora_info
from common.pipeline_report import describe, load_lora, print_report
from common.pipeline_trace import trace
from common.pipelines import model_kind, read_labels

# diffusers and torch are imported in main() and the functions it calls: --help and flag errors answer at once.


def parse_args(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("model", metavar="PATH_OR_HUB_ID",
                        help="Pipeline folder, train_ddpm.py / train_lora.py output or checkpoint, or hub id.")
    parser.add_argument("--lora", default=None, help="LoRA folder or .safetensors file, loaded into the base.")
    parser.add_argument("--height", type=positive_int, default=None, help="Image height (default: the pipeline's).")
    parser.add_argument("--width", type=positive_int, default=None, help="Image width (default: the pipeline's).")
    parser.add_argument("--num_frames", type=positive_int, default=None,
                        help="Video pipelines (Wan): frames of the clip (default: a LoRA's training clips', else the "
                             "pipeline's 81).")
    add_device_args(parser, dtype="fp32")
    parser.add_argument("--json", action="store_true", help="Print everything as one JSON object, nothing else.")
    g = parser.add_argument_group("trace (one real call)")
    g.add_argument("--trace", action="store_true", help="Run one call and print its stages with shapes and times.")
    g.add_argument("--prompt", default="a handwritten digit seven")
    g.add_argument("--num_inference_steps", type=positive_int, default=10)
    g.add_argument("--guidance_scale", type=float, default=None,
                   help=f"Default: sample.py's (the base's model card's, else 7.5 for Stable Diffusion and SDXL, 7.0 "
                        f"for SD3, 3.5 for Flux.1-dev), {DEFAULT_GUIDANCE_SCALE} for a class-conditional DDPM.")
    g.add_argument("--num_images", type=positive_int, default=1, help="Batch size B (num_images_per_prompt).")
    g.add_argument("--image", metavar="FIRST_FRAME.png", default=None,
                   help="An image-to-video pipeline's first frame (Wan's WanImageToVideoPipeline), which its call "
                        "needs.")
    g.add_argument("--class_label", default=None, help="Class-conditional DDPM: class name or id (default: id 0).")
    g.add_argument("--seed", type=non_negative_int, default=0)
    g.add_argument("--save_trajectory", metavar="FILE.png", default=None,
                   help="Implies --trace: x0 predicted at --trajectory_steps steps, decoded, in one row.")
    g.add_argument("--trajectory_steps", type=positive_int, default=None,
                   help="Panels in the trajectory picture (default: 5, or every step when there are fewer).")
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args):
    """Everything that needs no torch, so that a mistake is reported at once."""
    args.kind = model_kind(args.model)
    if args.kind == "lora":  # a train_lora.py output names its base
        if args.lora:
            raise UserError(f"'{args.model}' is a LoRA; give its base as PATH_OR_HUB_ID and --lora {args.model}")
        base = (read_lora_info(args.model) or {}).get("base_model")
        if not base:
            raise UserError(f"'{args.model}' is a LoRA without lora_info.json; give its base as PATH_OR_HUB_ID "
                            f"and --lora {args.model}")
        args.lora, args.model = args.model, base
        args.kind = model_kind(base)
    if args.lora:
        check_lora_format(args.lora, [], "--lora")  # a LoHa or LoKr of train_lora.py: diffusers cannot load it
        weights = os.path.join(args.lora, LORA_WEIGHTS) if os.path.isdir(args.lora) else args.lora
        if not os.path.isfile(weights) or not weights.endswith(".safetensors"):
            raise UserError(f"--lora '{args.lora}' is neither a .safetensors file nor a folder with {LORA_WEIGHTS}")
        keys = check_safetensors(weights, "--lora")  # an SDXL LoRA on SD 1.5 or the reverse: before anything loads
        check_lora_format(args.lora, keys, "--lora")
        check_lora_base("--lora", args.lora, lora_file_metadata(weights), keys, args.model,
                        folder_family(args.model))
    if args.image and not args.trace:
        raise UserError("--image: the first frame of a --trace call; add --trace")
    if args.save_trajectory:
        args.trace = True
        if not args.save_trajectory.lower().endswith(".png"):
            raise UserError(f"--save_trajectory '{args.save_trajectory}': give a .png file name")
        check_writable(os.path.dirname(args.save_trajectory) or ".", "--save_trajectory", args.save_trajectory)
        if args.trajectory_steps is None:
            args.trajectory_steps = min(5, args.num_inference_steps)
        elif args.trajectory_steps > args.num_inference_steps:
            raise UserError(f"--trajectory_steps {args.trajectory_steps} is more than --num_inference_steps "
                            f"{args.num_inference_steps}")


def load_pipeline(args, torch_dtype):
    import diffusers

    notes = []
    try:
        if args.kind != "checkpoint":
            pipe = diffusers.DiffusionPipeline.from_pretrained(args.model, dtype=torch_dtype)
        else:  # train_ddpm.py checkpoint-N: unet/ (+ unet_ema/), scheduler/, no model_index.json
            weights = "unet_ema" if os.path.isdir(os.path.join(args.model, "unet_ema")) else "unet"  # as sample.py
            unet = diffusers.UNet2DModel.from_pretrained(os.path.join(args.model, weights), dtype=torch_dtype)
            notes.append(f"a checkpoint: weights from {weights}/")
            folder = os.path.join(args.model, "scheduler")
            if not os.path.isdir(folder):
                notes.append("no scheduler/: DDPMScheduler's defaults")
            scheduler = diffusers.DDPMScheduler.from_pretrained(folder) if os.path.isdir(folder) else None
            pipe = diffusers.DDPMPipeline(unet=unet, scheduler=scheduler or diffusers.DDPMScheduler())
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise UserError(f"cannot load a pipeline from '{args.model}': {first_line(err)}") from None
    labels = read_labels(args.model) if os.path.isdir(args.model) else None
    return pipe, labels, notes


def main(args):
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # "requires torchvision, falling back to PIL": not our concern
    from diffusers.utils import logging as diffusers_logging
    from PIL.PngImagePlugin import PngInfo

    from common.diffusion import image_grid

    # diffusers logs what we report in one line (a LoRA that does not fit, an offline hub) at length, and warns that
    # unet_ema/config.json holds the EMA's settings: errors reach the user through UserError instead.
    diffusers_logging.set_verbosity(diffusers_logging.CRITICAL)
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    device, dtype = device_and_dtype(args.device, args.dtype)
    pipe, labels, notes = load_pipeline(args, dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    report = {"model": args.model, "pipeline": type(pipe).__name__, "notes": notes, **describe(pipe, labels, args)}
    if args.lora:
        report["lora"] = load_lora(pipe, args)
        report["notes"].append("the LoRA is loaded (scale 1.0) for the trace")
    if args.trace:
        report["trace"], _, panels = trace(pipe, args, labels, device)
        if panels:
            info = PngInfo()
            info.add_text("trajectory", json.dumps(report["trace"]["trajectory"]))  # the step and t of each panel
            os.makedirs(os.path.dirname(os.path.abspath(args.save_trajectory)), exist_ok=True)
            image_grid(panels, ncol=len(panels)).save(args.save_trajectory, pnginfo=info)
            report["trajectory"] = {"path": args.save_trajectory, "panels": len(panels),
                                    "panel_size": list(panels[0].size),
                                    "source": report["trace"]["trajectory"][0]["source"]}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return report


if __name__ == "__main__":
    run(main, parse_args)
