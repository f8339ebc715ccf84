#!/usr/bin/env python
"""Draw images from any checkpoint the recipes write (and from hub pipelines), reproducibly.

Every image is a PNG whose text metadata holds its generation parameters (model, seed, steps, scheduler,
guidance, label/prompt); a grid.png sits beside them. The same command gives the same pixels.

A train_ddpm.py output or checkpoint (EMA weights when present):
    python sample.py --model outputs/ddpm --class_label all --num_images 4
A train_lora.py output or checkpoint (its base model is read from its metadata), or a base with LoRAs; every family
of common/families/ (SD 1.x/2.x, SDXL, SD3, Flux.1, Qwen-Image, Z-Image), each through its own diffusers pipeline
(model_index.json):
    python sample.py --model outputs/lora --prompt "a handwritten digit seven"
    python sample.py --model stable-diffusion-v1-5/stable-diffusion-v1-5 --lora outputs/lora:0.8 --prompt "..."
    python sample.py --model models/tiny-sdxl --prompt "a handwritten digit seven" --num_images 4
    python sample.py --model stabilityai/stable-diffusion-xl-base-1.0 --lora outputs/lora-sdxl:0.8 --prompt "..." \
        --device cuda --dtype fp16
    python sample.py --model black-forest-labs/FLUX.1-dev --lora outputs/lora-flux --prompt "..." --device cuda \
        --dtype bf16 --height 1024 --width 1024
An edit LoRA (train_lora.py --control_data_dir) from a reference image, with its family's edit pipeline (Flux.1:
FluxKontextPipeline; FLUX.2: its own pipeline), at the reference's aspect ratio unless --height/--width say otherwise:
    python sample.py --model outputs/edit-lora --image ref.png --prompt "make it red ink on paper"

A copy also needs the module of its base's family, one of common/families/*.py (sd.py for Stable Diffusion 1.x/2.x;
FLUX.2 dev: flux2.py with flux2_klein.py).
Copy with: common/__init__.py, common/args.py, common/base_models.py, common/buckets.py, common/caption_files.py, common/cli.py, common/deepspeed_engine.py, common/diffusion.py, common/drawing.py, common/families/__init__.py, common/image_data.py, common/lora_files.py, common/loss_masks.py, common/objectives.py, common/pipelines.py, common/prompts.py, common/references.py, common/sampling_defaults.py, common/sgm_names.py, common/ui_lora.py, common/vae.py, common/video.py
"""  # noqa: E501 (the copy list stays one line, for grep)
import json
import os

from common.args import (
    add_device_args,
    check_writable,
    device_and_dtype,
    is_hub_id,
    make_parser,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from common.cli import UserError, first_line, one_line, quiet_loading_bars, run
from common.diffusion import DEFAULT_SCHEDULER, FLOW_SCHEDULER_CLASSES, SCHEDULER_CLASSES
from common.pipelines import class_label_ids, model_kind, read_labels
from common.references import (
    check_drawing_size,
    check_family_references,
    check_references,
    open_images,
)


def parse_args(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="Output/checkpoint folder of a recipe, or a pipeline (Stable Diffusion 1.x/2.x, XL or 3, "
                             "Flux.1, FLUX.2 klein or dev, Qwen-Image, Z-Image).")
    parser.add_argument("--output_dir", default=None, help="Default: <model>/samples.")
    parser.add_argument("--num_images", type=positive_int, default=8, help="Images per label or prompt.")
    parser.add_argument("--batch_size", type=positive_int, default=16)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--scheduler", default=None,
                        choices=sorted(set(SCHEDULER_CLASSES) | set(FLOW_SCHEDULER_CLASSES)),
                        help=f"Default: {DEFAULT_SCHEDULER} for train_ddpm.py outputs, dpm (DPM-Solver++) for Stable "
                             "Diffusion 1.x/2.x and XL, euler (the flow-matching Euler of their pipelines) for SD3 and "
                             "Flux.1; built with the noise schedule and prediction type (or shift) the model was "
                             "trained with.")
    parser.add_argument("--num_inference_steps", type=positive_int, default=None,
                        help="Default: the base's model card's (the call in its README.md), else the family's: 30 for "
                             "SD 1.x/2.x and SDXL, 28 for SD3 and Flux.1; 50 for train_ddpm.py outputs.")
    parser.add_argument("--guidance_scale", type=non_negative_float, default=None,
                        help="Default: the base's model card's, else the family's: 7.5 for SD 1.x/2.x and SDXL, 7.0 "
                             "for SD3, 3.5 for Flux.1-dev (its guidance input); a Flux.1 base without a guidance "
                             "embedding gets true classifier-free guidance (against the empty prompt) only when its "
                             "card or this flag asks for it; Z-Image: its own scale, 0 for none. train_ddpm.py "
                             "outputs: 1.5.")
    add_device_args(parser)
    # DDPM outputs (train_ddpm.py)
    parser.add_argument("--class_label", action="append", default=None,
                        help="Class name or id (repeatable), or 'all' for a row per class.")
    parser.add_argument("--no_ema", action="store_true",
                        help="Use the raw weights of a checkpoint, not its EMA (a final output holds only one set).")
    # text-to-image pipelines (train_lora.py and train_text_to_image.py outputs, hub pipelines)
    parser.add_argument("--prompt", action="append", default=None, help="Repeatable.")
    parser.add_argument("--negative_prompt", default=None, help="SD 1.x/2.x, SDXL, SD3, Qwen-Image and Z-Image.")
    parser.add_argument("--lora", action="append", default=[],
                        help="PATH[:SCALE], repeatable; made for the base's family (SD 1.x/2.x, SDXL, SD3, Flux.1, "
                             "FLUX.2, Qwen-Image, Z-Image). A train_lora.py LoHa or LoKr (its folder or "
                             "peft_adapter_weights.safetensors) loads through peft, as diffusers' load_lora_weights "
                             "cannot read it.")
    parser.add_argument("--image", action="append", default=[],
                        help="A reference image to edit (repeatable, as many as the base takes): draws with the "
                             "family's edit pipeline (Flux.1: FluxKontextPipeline, one image; FLUX.2: its own "
                             "pipeline, up to 4 for klein and 6 for dev, each at least 64 px a side); Wan's "
                             "image-to-video bases: the clip's first frame (WanImageToVideoPipeline).")
    parser.add_argument("--lora_scale", type=float, nargs="+", default=[1.0],
                        help="Multiplies every LoRA's scale; several values (e.g. 0 0.5 1) draw every prompt and "
                             "seed at each, a grid row per scale and prompt (0: the base alone).")
    parser.add_argument("--guidance_rescale", type=float, default=None, help="SD 1.x/2.x and SDXL (default 0).")
    parser.add_argument("--clip_skip", type=non_negative_int, default=None,
                        help="SD 1.x/2.x and SDXL: text encoder layers to skip, as the diffusers pipelines count them "
                             "(SDXL from its penultimate layer).")
    parser.add_argument("--max_sequence_length", type=positive_int, default=None,
                        help="SD3 and Flux.1 (T5's), FLUX.2 and Z-Image (their LLM's): the prompt length in tokens "
                             "(default: the pipeline's, 256 for SD3, 512 for Flux.1, FLUX.2 and Z-Image); Qwen-Image: "
                             "the prompt's tokens after its template (512, at most 1024).")
    parser.add_argument("--cfg_normalization", type=non_negative_float, default=None,
                        help="Z-Image: each guided prediction's norm kept at most this times the conditional one's (0, "
                             "the default: not limited).")
    parser.add_argument("--cfg_truncation", type=non_negative_float, default=None,
                        help="Z-Image: no guidance once the denoising is past this fraction of the way (default 1: "
                             "guidance throughout).")
    parser.add_argument("--drop_t5", action="store_true",
                        help="SD3: draw without its T5 text encoder (zeros in its place); a folder without "
                             "text_encoder_3/ needs it; the default for a LoRA trained with --drop_t5.")
    parser.add_argument("--num_frames", type=positive_int, default=None,
                        help="Wan: frames of each clip (4k + 1), written as .mp4 (animated .webp without PyAV) and an "
                             "animated preview.gif; default: a LoRA's training clips', else the base card's, else 81 "
                             "(WanPipeline's).")
    parser.add_argument("--height", type=positive_int, default=None,
                        help="Default: a LoRA's training size, else the base card's, else the base's own size.")
    parser.add_argument("--width", type=positive_int, default=None, help="As --height.")
    return parser.parse_args(argv)


def save_images(images, params, output_dir, ncol):
    """images: list of PIL images (a video family's clips: lists of frames); params: one dict per image, written into
    its PNG text metadata (clips: params.json)."""
    from PIL.PngImagePlugin import PngInfo

    from common.diffusion import image_grid

    os.makedirs(output_dir, exist_ok=True)
    if images and isinstance(images[0], list):
        return save_clips(images, params, output_dir)
    paths = []
    for i, (image, p) in enumerate(zip(images, params)):
        info = PngInfo()
        for key, value in p.items():
            info.add_text(key, str(value))
        info.add_text("parameters", json.dumps(p, sort_keys=True))
        path = os.path.join(output_dir, f"{i:04d}.png")
        image.save(path, pnginfo=info)
        paths.append(path)
    image_grid(images, ncol).save(os.path.join(output_dir, "grid.png"))
    return paths


def save_clips(clips, params, output_dir):
    """Each clip as a video file (.mp4; .webp without PyAV) and an animated preview (.gif), the parameters of every
    clip in params.json, and grid.png: a row of frames per clip."""
    from common.diffusion import image_grid
    from common.video import save_clip, video_extension

    paths = []
    for i, frames in enumerate(clips):
        paths.append(save_clip(frames, os.path.join(output_dir, f"{i:04d}{video_extension()}")))
        save_clip(frames, os.path.join(output_dir, f"{i:04d}.gif"))
    with open(os.path.join(output_dir, "params.json"), "w") as f:
        json.dump([{**p, "file": os.path.basename(path)} for p, path in zip(params, paths)], f, indent=2, default=str)
    image_grid(sum(clips, []), len(clips[0])).save(os.path.join(output_dir, "grid.png"))
    return paths


def sample_ddpm(args):
    """A train_ddpm.py output or checkpoint-N: unet_ema/ (unless --no_ema) or unet/, scheduler/, labels.json."""
    if args.prompt or args.lora or args.image:
        raise UserError(f"--prompt/--lora/--image are for text-to-image models; '{args.model}' is a train_ddpm.py "
                        "model (use --class_label)")
    if args.height or args.width:
        raise UserError(f"--height/--width are for text-to-image models; '{args.model}' is a train_ddpm.py model, "
                        "which samples at the size it was trained at")
    has_ema = os.path.isdir(os.path.join(args.model, "unet_ema"))
    if args.no_ema and not has_ema:  # a final output's unet/ holds the EMA weights when it was trained with --use_ema
        raise UserError(f"--no_ema: '{args.model}' holds one set of weights (unet/, the EMA ones when it was trained "
                        "with --use_ema); the raw weights are in its checkpoint-N folders")
    ema = has_ema and not args.no_ema
    unet_dir = os.path.join(args.model, "unet_ema" if ema else "unet")
    for required in (os.path.join(unet_dir, "config.json"), os.path.join(args.model, "scheduler")):
        if not os.path.exists(required):
            raise UserError(f"--model '{args.model}' is not a train_ddpm.py output or checkpoint (no {required})")
    with open(os.path.join(unet_dir, "config.json")) as f:
        num_class_embeds = json.load(f).get("num_class_embeds")

    # Class-conditional models: a row of --num_images per requested class; the null class is the last id.
    # (Checked before torch loads, so a wrong label is reported at once.)
    num_classes = (num_class_embeds or 1) - 1
    ids, names = [], []
    if num_classes > 0:
        names = read_labels(args.model) or [str(i) for i in range(num_classes)]
        ids = class_label_ids(args.class_label or ["all"], names, allow_all=True)
    elif args.class_label:
        raise UserError(f"--class_label: '{args.model}' is unconditional (trained without --class_column)")
    check_writable(output_dir(args), "--output_dir")

    import torch
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.utils import logging as diffusers_logging

    quiet_loading_bars(["diffusers"])

    from common.diffusion import (
        DEFAULT_GUIDANCE_SCALE,
        DEFAULT_INFERENCE_STEPS,
        sample_images,
        sampling_scheduler,
        to_pil,
    )

    device, dtype = device_and_dtype(args.device, args.dtype)
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # unet_ema/config.json also holds the EMA's decay settings: not a problem
    try:
        unet = UNet2DModel.from_pretrained(unet_dir, torch_dtype=dtype).to(device).eval()
        training_scheduler = DDPMScheduler.from_pretrained(os.path.join(args.model, "scheduler"))
    except (OSError, ValueError) as err:
        raise UserError(f"--model '{args.model}': cannot load its UNet or scheduler: "
                        f"{first_line(err)}") from None
    finally:
        diffusers_logging.set_verbosity(verbosity)

    class_ids = torch.tensor(ids).repeat_interleave(args.num_images) if ids else None
    scheduler_name = args.scheduler or DEFAULT_SCHEDULER
    steps = args.num_inference_steps or DEFAULT_INFERENCE_STEPS
    guidance = args.guidance_scale if args.guidance_scale is not None else DEFAULT_GUIDANCE_SCALE
    count = len(class_ids) if ids else args.num_images
    scheduler = sampling_scheduler(scheduler_name, training_scheduler.config)
    images = sample_images(unet, scheduler, count, class_labels=class_ids, null_class=num_classes,
                           guidance_scale=guidance, num_inference_steps=steps, batch_size=args.batch_size,
                           generator=torch.Generator().manual_seed(args.seed))
    common = {"model": args.model, "weights": "ema" if ema else "raw", "seed": args.seed,
              "scheduler": scheduler_name, "num_inference_steps": steps}
    params = []
    for i in range(count):
        p = {**common, "index": i}
        if ids:
            p.update(class_label=names[class_ids[i]], class_id=int(class_ids[i]), guidance_scale=guidance)
        params.append(p)
    ncol = args.num_images if ids else max(1, round(count ** 0.5))
    return save_images(to_pil(images), params, output_dir(args), ncol)


# sample.py's flags that only some families' pipelines take (common/families/: SAMPLE_FLAGS)
FAMILY_FLAGS = ("num_frames", "negative_prompt", "guidance_rescale", "clip_skip", "max_sequence_length", "drop_t5",
                "cfg_normalization", "cfg_truncation")
# the pipelines' own, written into the images' metadata
DEFAULTS = {"negative_prompt": "", "guidance_rescale": 0.0, "cfg_normalization": 0.0, "cfg_truncation": 1.0}


def sample_pipeline(args):
    """A text-to-image pipeline of a known family (hub id or folder) with --lora PATH[:SCALE]..., or a train_lora.py
    output or checkpoint-N (its base is read from its lora_info.json). Image j of every prompt starts from seed + j."""
    from common.base_models import check_pipeline_folder
    from common.families import check_lora_base, family_module, family_of
    from common.lora_files import (
        LORA_WEIGHTS,
        PEFT_WEIGHTS,
        check_lora_format,
        check_safetensors,
        describe_lora,
        load_peft_adapters,
        lora_file_metadata,
        lora_weights_file,
        peft_adapter_configs,
        read_lora_info,
    )

    if args.class_label or args.no_ema:
        raise UserError(f"--class_label/--no_ema are for train_ddpm.py models; '{args.model}' is a text-to-image "
                        "pipeline")
    if not args.prompt:
        raise UserError("give at least one --prompt (repeatable) for a text-to-image model")
    references = open_images(args.image, "--image") if args.image else None  # (edit LoRAs)
    loras = [parse_lora(spec) for spec in args.lora]
    info = read_lora_info(args.model) if os.path.isdir(args.model) else None
    base = info["base_model"] if info else args.model
    if info:
        loras.insert(0, (args.model, 1.0))
        args.drop_t5 = args.drop_t5 or bool(info.get("drop_t5"))  # a LoRA trained without T5 is drawn without it
    base_flag = f"base model of {args.model} (lora_info.json)" if info else "--model"
    check_pipeline_folder(base, base_flag)
    base_version = {"revision": info.get("revision"), "variant": info.get("variant")} if info else {}
    uses = "sample.py draws from"
    family = family_module(family_of(base, base_flag, uses=uses)) if os.path.isdir(base) else None  # a hub id's: below
    if family:
        check_sample_flags(args, family, base, base_flag)
    local = {}  # path -> (metadata, tensor names) of each local LoRA file
    for path, _ in loras:
        if os.path.isdir(path) and not lora_weights_file(path):
            raise UserError(f"--lora '{path}': no {LORA_WEIGHTS} (nor a LoHa's or LoKr's {PEFT_WEIGHTS}) in that "
                            "folder")
        if not os.path.exists(path) and not is_hub_id(path):
            raise UserError(f"--lora '{path}': no such file or folder")
        if os.path.exists(path):  # a damaged or non-safetensors file: at once, not after the base has loaded
            keys = check_safetensors(lora_weights_file(path), "--lora")
            check_lora_format(path, keys, "--lora", peft_loader="sample.py")  # a LoHa's UI file: what to give
            local[path] = lora_file_metadata(path), keys
            check_lora_base("--lora", path, *local[path], base, family and family.KEY)  # SDXL on SD 1.5, ...
    check_writable(output_dir(args), "--output_dir")
    for path, scale in loras:  # what each LoRA file says of its training, before the long part
        if path in local:
            lines = describe_lora(local[path][0]) or ["no training metadata in the file"]
            print(f"LoRA {path} (scale {scale:g}):" + "".join(f"\n  {line}" for line in lines), flush=True)

    import warnings

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    quiet_loading_bars()

    from common.diffusion import sampling_scheduler
    from common.drawing import load_pipeline
    from common.sampling_defaults import sampling_defaults

    if family is None:  # a hub base: its model_index.json alone, before the weights
        family = family_module(family_of(base, base_flag, revision=base_version.get("revision"), uses=uses))
        check_sample_flags(args, family, base, base_flag)
        for path in local:
            check_lora_base("--lora", path, *local[path], base, family.KEY)
    device, dtype = device_and_dtype(args.device, args.dtype)
    dropped = (family.OPTIONAL_COMPONENTS or ()) if args.drop_t5 else ()
    pipe = load_pipeline(family, base, "--model", dtype, drop=dropped, edit=bool(references),  # (its VAE in fp32)
                         **base_version)
    if info and info.get("prediction_type"):  # the LoRA was trained to predict something else than its base
        pipe.scheduler.register_to_config(prediction_type=info["prediction_type"])
    pipe.scheduler = sampling_scheduler(args.scheduler or family.SAMPLER, pipe.scheduler.config, family.SAMPLERS)
    names = [f"lora{i}" for i in range(len(loras))]
    experts = getattr(pipe, "transformer_2", None) is not None  # Wan 2.2 A14B
    verbosity = diffusers_logging.get_verbosity(), transformers_logging.get_verbosity()
    diffusers_logging.set_verbosity(diffusers_logging.CRITICAL)  # it logs the error below in full as well
    transformers_logging.set_verbosity_error()  # a 2nd adapter "misses" the 1st one's keys: a false alarm
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # several LoRAs: wanted
            for name, (path, _) in zip(names, loras):
                if path in local and peft_adapter_configs(path):  # a LoHa or LoKr: through peft
                    load_peft_adapters(pipe, path, name)
                    continue
                folder, weight_name = (path, None) if not path.endswith(".safetensors") else os.path.split(path)
                # Wan 2.2 A14B's LoRAs: into the expert their lora_info.json (or the file's metadata) names
                expert = experts and family.lora_expert(path, local.get(path, ({},))[0])
                if experts and expert is None:
                    print(f"LoRA {path}: it does not say which expert of this Wan 2.2 A14B base it is for (no "
                          "lora_info.json beside it, no lora-high or lora-low in its metadata): loaded into the "
                          "high-noise expert `transformer`, as diffusers' load_lora_weights does", flush=True)
                pipe.load_lora_weights(folder or ".", weight_name=weight_name, adapter_name=name,
                                       **({"load_into_transformer_2": True} if expert == "low" else {}))
                if expert == "both":  # the low expert's, under the same adapter name (one scale for both)
                    pipe.load_lora_weights(os.path.join(folder, "low"), adapter_name=name,
                                           load_into_transformer_2=True)
    except (RuntimeError, ValueError, KeyError, OSError) as err:
        raise UserError(f"--lora '{path}' does not fit the base model '{base}' (a LoRA for another model?): "
                        f"{one_line(err)}") from None
    finally:
        diffusers_logging.set_verbosity(verbosity[0])
        transformers_logging.set_verbosity(verbosity[1])
    present = {name for adapters in pipe.get_list_adapters().values() for name in adapters} if names else set()
    for name, (path, _) in zip(names, loras):  # diffusers loads a LoRA whose keys match no layer without a word
        if name not in present:
            raise UserError(f"--lora '{path}' adapts no layer of the base model '{base}': none of its keys name a "
                            "module of this base (a LoRA for another architecture?)")
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)

    # the defaults: the LoRA's training size and T5 length (lora_info.json), the base's card, the family's
    defaults = sampling_defaults(family, base, getattr(pipe, family.DENOISER).config, info)
    steps = args.num_inference_steps or defaults["num_inference_steps"]
    guidance = args.guidance_scale if args.guidance_scale is not None else defaults["guidance_scale"]
    if "num_frames" in family.SAMPLE_FLAGS:  # a video family's clip length: as the LoRA trained, else the pipeline's
        args.num_frames = args.num_frames or defaults["num_frames"] or family.SAMPLE_FRAMES
        family.check_frames(args.num_frames, pipe.vae.config, "--num_frames")
    if "max_sequence_length" in family.SAMPLE_FLAGS:  # T5's length: as the LoRA trained, else the base's
        args.max_sequence_length = family.text_length(pipe.components, args.max_sequence_length
                                                      or defaults["max_sequence_length"])
    extra = {flag: getattr(args, flag) for flag in family.SAMPLE_FLAGS if flag != "drop_t5"}
    common = {"model": args.model, "base_model": base, "lora": ",".join(f"{p}:{s:g}" for p, s in loras),
              "scheduler": args.scheduler or family.SAMPLER, "num_inference_steps": steps,
              "guidance_scale": guidance, **{k: DEFAULTS.get(k) if v is None else v for k, v in extra.items()},
              **({"image": ",".join(args.image)} if references else {})}
    images, params = [], []
    for lora_scale in args.lora_scale if names else [1.0]:
        if names:
            pipe.set_adapters(names, adapter_weights=[lora_scale * scale for _, scale in loras])
        scale = {"lora_scale": lora_scale} if names else {}
        images, params = draw(pipe, family, args, images, params, {**common, **scale}, steps, guidance, extra,
                              (defaults["height"], defaults["width"]), references)
    return save_images(images, params, output_dir(args), args.num_images)


def check_sample_flags(args, family, base, flag):
    """One line for a flag that the family's pipeline does not take, and for a local folder that misses a component
    (SD3's T5 without --drop_t5)."""
    from common.base_models import check_components, component_configs

    for name in FAMILY_FLAGS:
        if getattr(args, name) not in (None, False) and name not in family.SAMPLE_FLAGS:
            raise UserError(f"--{name} means nothing for a {family.NAME} base ({base}): leave it out")
    check_family_references(family, len(args.image), "--image", base)  # as many as its edit pipeline takes
    if hasattr(family, "check_first_frame"):  # (Wan: TI2V-5B's image-to-video draws from a first frame, --image)
        family.check_first_frame(base, flag, bool(args.image))
    if args.image:  # each at least what the edit pipeline packs into one token
        factor = family.resolution_factor(component_configs(base, ("vae", family.DENOISER), flag=flag))
        check_references(open_images(args.image, "--image"), args.image, "--image", family, factor)
        check_drawing_size(family, args.height, args.width, factor)
    if args.scheduler and args.scheduler not in family.SAMPLERS:
        raise UserError(f"--scheduler {args.scheduler}: {family.NAME} bases sample with "
                        f"{', '.join(sorted(family.SAMPLERS))}")
    if os.path.isdir(base):
        check_components(base, flag, family, args.drop_t5, to="draw")


def draw(pipe, family, args, images, params, common, steps, guidance, extra, size, references=None):
    """Every prompt x --num_images seeds, in batches (from `references`, PIL images, with the edit pipeline);
    appends to images and params. size: the default (height, width), None for the family's sample size."""
    from common.drawing import draw_images
    from common.sampling_defaults import reference_size

    configs = {"vae": pipe.vae.config, family.DENOISER: getattr(pipe, family.DENOISER).config}
    factor = family.resolution_factor(configs)  # the pipeline would refuse, or change, another size
    default_height, default_width = family.sample_size(pipe)
    default_height, default_width = size[0] or default_height, size[1] or default_width
    if references:  # at the reference's aspect ratio
        default_height, default_width = reference_size(references[0], default_height, default_width, factor)
    height, width = args.height or default_height, args.width or default_width
    for flag, value in (("--height", height), ("--width", width)):
        if value % factor:
            near = sorted({max(factor, value // factor * factor), (value // factor + 1) * factor})
            raise UserError(f"{flag} {value} is not divisible by {factor}, {family.RESOLUTION_FACTOR}; use "
                            f"{' or '.join(map(str, near))}")
    getattr(family, "check_size", lambda *_: None)(configs, height, width)  # (Wan: what its rotary table places)
    if args.clip_skip:  # SD takes hidden state -(clip_skip + 1) of its encoder, SDXL -(clip_skip + 2) of both
        encoders = [getattr(pipe, name) for name in family.TEXT_ENCODERS]
        layers = min(e.config.num_hidden_layers for e in encoders)
        most = layers - 1 if len(encoders) == 2 else layers
        if args.clip_skip > most:
            raise UserError(f"--clip_skip {args.clip_skip}: the text encoder of this base has {layers} layers; give "
                            f"at most {most}")
    kwargs = {k: v for k, v in extra.items() if v is not None and k != "negative_prompt"}
    if references:  # resized to the drawing's size
        check_drawing_size(family, height, width, factor)
        kwargs.update(family.reference_kwargs(references, height, width))
    jobs = [(prompt, j) for prompt in args.prompt for j in range(args.num_images)]
    for start in range(0, len(jobs), args.batch_size):
        batch = jobs[start:start + args.batch_size]
        images += draw_images(pipe, family, [prompt for prompt, _ in batch], [args.seed + j for _, j in batch], height,
                              width, steps, guidance, args.negative_prompt, **kwargs)
        params += [{**common, "prompt": prompt, "seed": args.seed + j, "index": j, "height": height, "width": width}
                   for (prompt, j) in batch]
    return images, params


def output_dir(args):
    """--output_dir, else <model>/samples for a folder, else outputs/samples/<owner>--<name> for a hub id."""
    if args.output_dir:
        return args.output_dir
    if os.path.isdir(args.model):
        return os.path.join(args.model, "samples")
    return os.path.join("outputs", "samples", args.model.replace("/", "--"))


def parse_lora(spec):
    """PATH[:SCALE] -> (path, scale); a path may itself hold colons."""
    path, sep, scale = spec.rpartition(":")
    if sep:
        try:
            return path, float(scale)
        except ValueError:
            pass
    return spec, 1.0


def main(args):
    kind = model_kind(args.model, "--model")
    paths = sample_ddpm(args) if kind in ("ddpm", "checkpoint") else sample_pipeline(args)
    kind = "images" if paths[0].endswith(".png") else "clips (and their .gif previews)"
    print(f"wrote {len(paths)} {kind} and grid.png to {os.path.dirname(paths[0])}")


if __name__ == "__main__":
    run(main, parse_args)
