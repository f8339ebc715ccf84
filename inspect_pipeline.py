#!/usr/bin/env python
"""See what a diffusion pipeline holds and what its __call__ really does, with shapes and wall times.

Prints the components (parameters, dtype, device, size), the scheduler, the denoiser's key config, the text encoder
and tokenizer, and the VAE (latent shape at --height/--width). --lora: what a LoRA adapts, its rank and alpha, and
how many parameters it adds. --trace: one real call, stage by stage, recorded through the pipeline's own
callback_on_step_end, forward hooks and wrappers around the methods it calls; nothing is re-implemented, so what is
shown is what runs. --save_trajectory: the predicted clean image x0 at several steps, side by side. --json: all of it.

The demo base (a tiny random-init Stable Diffusion built offline; prints noise-level numbers, real shapes):
    make inspect
    python inspect_pipeline.py models/tiny-sd --trace --num_inference_steps 4 --save_trajectory x0.png
    python inspect_pipeline.py models/tiny-sd --trace --guidance_scale 1 --json    # no guidance: batch B, not 2B
A train_ddpm.py output or checkpoint (class-conditional ones are traced through sample.py's loop, with labels):
    python inspect_pipeline.py outputs/ddpm --trace --class_label 7 --guidance_scale 2 --save_trajectory x0.png
A train_lora.py output (its base is read from lora_info.json), or any base with a LoRA:
    python inspect_pipeline.py outputs/lora --trace
    python inspect_pipeline.py models/tiny-sd --lora outputs/lora
A hub model (needs the network; on a GPU the trace takes seconds):
    python inspect_pipeline.py stable-diffusion-v1-5/stable-diffusion-v1-5 --trace --height 512 --width 512 \\
        --device cuda --dtype fp16 --prompt "an astronaut riding a horse" --save_trajectory x0.png
"""
import json
import os
import re

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
from common.pipelines import class_label_ids, model_kind, read_labels
from common.stable_diffusion import LORA_WEIGHTS, check_safetensors, read_lora_info

# common.call_recorder, the pipelines and torch are imported in main(): --help and flag errors answer at once.

def parse_args(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("model", metavar="PATH_OR_HUB_ID",
                        help="Pipeline folder, train_ddpm.py / train_lora.py output or checkpoint, or hub id.")
    parser.add_argument("--lora", default=None, help="LoRA folder or .safetensors file, loaded into the base.")
    parser.add_argument("--height", type=positive_int, default=None, help="Image height (default: the pipeline's).")
    parser.add_argument("--width", type=positive_int, default=None, help="Image width (default: the pipeline's).")
    add_device_args(parser, dtype="fp32")
    parser.add_argument("--json", action="store_true", help="Print everything as one JSON object, nothing else.")
    g = parser.add_argument_group("trace (one real call)")
    g.add_argument("--trace", action="store_true", help="Run one call and print its stages with shapes and times.")
    g.add_argument("--prompt", default="a handwritten digit seven")
    g.add_argument("--num_inference_steps", type=positive_int, default=10)
    g.add_argument("--guidance_scale", type=float, default=None,
                   help=f"Default: 7.5 for Stable Diffusion (its own default), {DEFAULT_GUIDANCE_SCALE} for a "
                        "class-conditional DDPM (sample.py's).")
    g.add_argument("--num_images", type=positive_int, default=1, help="Batch size B (num_images_per_prompt).")
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
        weights = os.path.join(args.lora, LORA_WEIGHTS) if os.path.isdir(args.lora) else args.lora
        if not os.path.isfile(weights) or not weights.endswith(".safetensors"):
            raise UserError(f"--lora '{args.lora}' is neither a .safetensors file nor a folder with {LORA_WEIGHTS}")
        check_safetensors(weights, "--lora")
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


# ---------------------------------------------------------------------------------------------- what it holds
def module_row(name, component):
    import torch

    row = {"name": name, "class": type(component).__name__ if component is not None else None}
    if isinstance(component, torch.nn.Module):
        params = list(component.parameters())
        row.update(parameters=sum(p.numel() for p in params),
                   dtype=",".join(sorted({str(p.dtype).replace("torch.", "") for p in params})),
                   device=",".join(sorted({str(p.device) for p in params})),
                   size_mb=round(sum(t.numel() * t.element_size() for t in [*params, *component.buffers()]) / 1e6, 3))
    return row


def pick(config, keys):
    return {k: (list(config[k]) if isinstance(config[k], tuple) else config[k])
            for k in keys if config.get(k) is not None}


def describe(pipe, labels, args):
    from diffusers.models.attention_processor import Attention

    report = {"components": [module_row(name, c) for name, c in pipe.components.items()]}
    s = pipe.scheduler
    report["scheduler"] = {"class": type(s).__name__, **pick(s.config, [
        "num_train_timesteps", "beta_schedule", "beta_start", "beta_end", "prediction_type", "timestep_spacing",
        "steps_offset", "clip_sample", "thresholding"]), "init_noise_sigma": float(s.init_noise_sigma),
        "order": s.order}
    name = "unet" if hasattr(pipe, "unet") else "transformer"
    model = getattr(pipe, name)
    d = {"component": name, "class": type(model).__name__, **pick(model.config, [
        "sample_size", "in_channels", "out_channels", "block_out_channels", "layers_per_block", "down_block_types",
        "cross_attention_dim", "attention_head_dim", "num_attention_heads", "num_class_embeds", "class_embed_type",
        "time_cond_proj_dim"])}
    # The config's head numbers are famously mislabelled in SD 1.x (attention_head_dim holds the head count):
    # count what the built modules really use.
    kinds = [f"{'cross' if m.is_cross_attention else 'self'}-attention ({m.heads} heads x {m.inner_dim // m.heads} "
             "dims)" for m in model.modules() if isinstance(m, Attention)]
    if kinds:
        d["attention_modules"] = [f"{kinds.count(kind)} {kind}" for kind in dict.fromkeys(kinds)]
    if labels:
        d["labels"] = labels
        d["null_class_id"] = len(labels)  # train_ddpm.py: the last embedding is "no class", for guidance
    report["denoiser"] = d
    for comp_name, comp in pipe.components.items():  # SDXL and others have text_encoder_2, tokenizer_2
        if comp_name.startswith("text_encoder") and comp is not None:
            report.setdefault("text_encoders", {})[comp_name] = {"class": type(comp).__name__, **pick(
                comp.config.to_dict(), ["hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "max_position_embeddings", "vocab_size", "projection_dim"])}
        if comp_name.startswith("tokenizer") and comp is not None:
            report.setdefault("tokenizers", {})[comp_name] = {
                "class": type(comp).__name__, "model_max_length": comp.model_max_length, "vocab_size": len(comp),
                "pad_token": comp.pad_token}
    height, width = image_size(pipe, args)
    vae = getattr(pipe, "vae", None)
    if vae is not None:
        c, factor = vae.config, pipe.vae_scale_factor
        report["vae"] = {"class": type(vae).__name__, **pick(c, ["scaling_factor", "shift_factor", "latent_channels",
                                                                 "block_out_channels"]),
                         "downsampling_factor": factor, "image_shape": [args.num_images, 3, height, width],
                         "latent_shape": [args.num_images, c.latent_channels, height // factor, width // factor]}
    else:
        report["image_shape"] = [args.num_images, model.config.in_channels, height, width]
    return report


def image_size(pipe, args):
    """The call's image size: --height/--width, checked against the VAE, or the pipeline's default."""
    size = (getattr(pipe, "unet", None) or pipe.transformer).config.sample_size
    size = (size, size) if isinstance(size, int) else tuple(size)
    if getattr(pipe, "vae", None) is None:
        if args.height or args.width:
            raise UserError(f"--height/--width: {type(pipe).__name__} samples at its UNet's sample_size {size}")
        return size
    factor = pipe.vae_scale_factor
    height, width = args.height or size[0] * factor, args.width or size[1] * factor
    for flag, value in (("--height", height), ("--width", width)):
        if value % factor:
            raise UserError(f"{flag} {value} is not divisible by {factor}, the VAE's downsampling factor")
    return height, width


def load_lora(pipe, args):
    """Load the LoRA into the base through diffusers' own loader, then describe the peft layers it created."""
    from peft.tuners.lora import LoraLayer

    if not hasattr(pipe, "load_lora_weights"):
        raise UserError(f"--lora: {type(pipe).__name__} cannot load LoRA weights")
    folder, weight_name = ((args.lora, LORA_WEIGHTS) if os.path.isdir(args.lora)
                           else (os.path.dirname(args.lora) or ".", os.path.basename(args.lora)))
    base_params = {name: sum(p.numel() for p in c.parameters()) for name, c in pipe.components.items()
                   if hasattr(c, "parameters")}
    try:
        pipe.load_lora_weights(folder, weight_name=weight_name, adapter_name="inspected")
    except (RuntimeError, ValueError, KeyError, OSError) as err:
        mismatch = re.search(r"size mismatch for (\S+): copying a param with shape torch.Size\((\[[^]]*\])\) from "
                             r"checkpoint, the shape in current model is torch.Size\((\[[^]]*\])\)", str(err))
        if mismatch:
            module, theirs, ours = mismatch.groups()
            module = module.replace(".inspected.", ".")  # the adapter name we gave it
            raise UserError(f"--lora '{args.lora}' was made for another base: {module} is {theirs} in the LoRA but "
                            f"{ours} in '{args.model}'") from None
        raise UserError(f"--lora '{args.lora}' does not load into '{args.model}': {first_line(err)}") from None
    info = read_lora_info(folder) or {}
    report = {"path": args.lora, "trained_on": info.get("base_model"), "components": {}}
    for name, component in pipe.components.items():
        layers = [(n, m) for n, m in (component.named_modules() if hasattr(component, "named_modules") else [])
                  if isinstance(m, LoraLayer) and "inspected" in m.lora_A]
        if not layers:
            continue
        targets, added = {}, 0
        for module_name, layer in layers:
            parts = module_name.split(".")
            target = ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]  # to_out.0, to_q, ...
            targets[target] = targets.get(target, 0) + 1
            for attr in ("lora_A", "lora_B", "lora_magnitude_vector"):  # the magnitude vector: DoRA
                holder = getattr(layer, attr, {})
                if "inspected" in holder:
                    added += sum(p.numel() for p in holder["inspected"].parameters())
        report["components"][name] = {
            "modules": len(layers), "targets": targets,
            "rank": sorted({layer.r["inspected"] for _, layer in layers}),
            "alpha": sorted({layer.lora_alpha["inspected"] for _, layer in layers}),
            "scaling (alpha/rank)": sorted({round(layer.scaling["inspected"], 6) for _, layer in layers}),
            "parameters_added": added, "percent_of_base": round(100 * added / base_params[name], 3)}
    if not report["components"]:
        raise UserError(f"--lora '{args.lora}' adapts no module of '{args.model}' (a LoRA for another architecture?)")
    report["parameters_added"] = sum(c["parameters_added"] for c in report["components"].values())
    # What loaded is what runs: flag where it differs from what lora_info.json promises (a file saved without
    # its adapter metadata loads with alpha = rank, silently changing the LoRA's strength).
    report["warnings"] = []
    for key, loaded in (("rank", "rank"), ("lora_alpha", "alpha")):
        values = {v for c in report["components"].values() for v in c[loaded]}
        if info.get(key) is not None and values != {info[key]}:
            report["warnings"].append(f"lora_info.json says {key} {info[key]}, but the weights load with {loaded} "
                                      f"{', '.join(map(str, sorted(values)))}")
    return report


# ---------------------------------------------------------------------------------------------- what it does
def watch_denoiser(rec, unet, scheduler, trajectory_steps):
    """One 'denoise' stage per denoiser call: a forward hook on the unet, a wrapped scheduler.step (and what ran
    between them: the guidance combine), the timesteps from a wrapped set_timesteps; x0 kept at chosen steps."""
    from common.call_recorder import scalar, shape

    rec.step, rec.x0, rec.keep, rec.calls, rec.initial_noise = None, [], set(), 0, None

    def pre(module, a, kw):
        inputs = {"sample": shape(a[0] if a else kw["sample"])}
        cond = kw.get("encoder_hidden_states", a[2] if len(a) > 2 else None)
        if cond is not None:
            inputs["encoder_hidden_states"] = shape(cond)
        if kw.get("class_labels") is not None:
            inputs["class_labels"] = kw["class_labels"].tolist()
        rec.step = {"stage": "denoise", "step": sum(s["stage"] == "denoise" for s in rec.stages),
                    "t": scalar(a[1] if len(a) > 1 else kw["timestep"]), "unet_in": inputs}
        rec.stages.append(rec.step)
        rec.unet_start = rec.clock()

    def post(module, a, kw, output):
        rec.unet_end = rec.clock()
        rec.step.update(unet_ms=round((rec.unet_end - rec.unet_start) * 1e3, 3), unet_out=shape(output[0]))

    def on_step(a, kw, out, ms, start):
        model_output, t = (a[0] if a else kw["model_output"]), (a[1] if len(a) > 1 else kw["timestep"])
        sample = a[2] if len(a) > 2 else kw["sample"]
        if rec.step["unet_out"][0] != shape(model_output)[0]:  # uncond + w * (cond - uncond) ran in between
            rec.step["guidance"] = {"in": rec.step["unet_out"], "out": shape(model_output),
                                    "ms": round((start - rec.unet_end) * 1e3, 3)}
        prev = out[0] if isinstance(out, tuple) else out.prev_sample
        rec.step.update(scheduler_in=shape(model_output), scheduler_ms=round(ms, 3), latents=shape(prev))
        index, rec.calls = rec.calls, rec.calls + 1
        if index == 0:  # the scheduler sees the latents before any doubling for guidance
            rec.initial_noise = shape(sample)
        if index in rec.keep:  # schedulers return (prev_sample, pred_original_sample) when they compute x0
            x0 = out[1] if isinstance(out, tuple) and len(out) > 1 else getattr(out, "pred_original_sample", None)
            source = "pred_original_sample"
            if x0 is None:  # multistep solvers (DPM, UniPC, PNDM) do not return it: invert the noise schedule
                x0, source = x0_from_prediction(scheduler, model_output, t, sample), "alphas_cumprod"
            rec.x0.append({"step": index, "t": scalar(t), "source": source, "x0": x0[:1].detach().float().cpu()})

    def on_set_timesteps(a, kw, out, ms, start):
        timesteps = [scalar(t) for t in scheduler.timesteps]
        n, k = len(timesteps), min(trajectory_steps, len(timesteps))
        rec.keep = {round(i * (n - 1) / max(k - 1, 1)) for i in range(k)} if k else set()  # first ... last
        rec.add("scheduler.set_timesteps", ms, num_inference_steps=n, timesteps=timesteps)

    rec.hook(unet, pre, post)
    rec.wrap(scheduler, "step", on_step)
    rec.wrap(scheduler, "set_timesteps", on_set_timesteps)


def x0_from_prediction(scheduler, model_output, t, sample):
    """x0 from x_t and the model's prediction, for a variance-preserving schedule (alphas_cumprod)."""
    a = scheduler.alphas_cumprod[int(t)].to(sample.device, sample.dtype)
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        return (sample - (1 - a) ** 0.5 * model_output) / a ** 0.5
    if kind == "v_prediction":
        return a ** 0.5 * sample - (1 - a) ** 0.5 * model_output
    return model_output  # "sample": the model predicts x0 itself


def trace_sd(pipe, args, rec, generator, steps_kept):
    """One real StableDiffusionPipeline-style call; -> (how it was recorded, images)."""
    from common.call_recorder import shape

    calls = {}
    for name, component in pipe.components.items():
        if name.startswith("text_encoder") and component is not None:
            def pre(module, a, kw):
                rec.text_in, rec.text_start = shape(a[0] if a else kw["input_ids"]), rec.clock()

            def post(module, a, kw, output, name=name):
                calls[name] = calls.get(name, 0) + 1  # encode_prompt encodes the prompt, then the negative one
                rec.add(name, (rec.clock() - rec.text_start) * 1e3, input_ids=rec.text_in,
                        last_hidden_state=shape(output[0]), text="prompt" if calls[name] == 1 else "negative prompt")
            rec.hook(component, pre, post)
    rec.wrap(pipe, "prepare_latents", lambda a, kw, out, ms, start: rec.add(
        "prepare_latents", ms, latents=shape(out), init_noise_sigma=float(pipe.scheduler.init_noise_sigma)))
    watch_denoiser(rec, pipe.unet, pipe.scheduler, steps_kept)
    rec.wrap(pipe.vae, "decode", lambda a, kw, out, ms, start: rec.add(
        "vae.decode", ms, latents=shape(a[0] if a else kw["z"]), image=shape(out[0]),
        note=f"in: latents / scaling_factor {pipe.vae.config.scaling_factor}; out: pixels in [-1, 1]"))
    rec.wrap(pipe.image_processor, "postprocess", lambda a, kw, out, ms, start: rec.add(
        "image_processor.postprocess", ms, image=shape(a[0] if a else kw["image"]),
        output=f"{len(out)} x {type(out[0]).__name__} {getattr(out[0], 'size', '')}"))

    def on_step_end(pipeline, i, t, tensors):  # the pipeline's own hook point: what it carries to the next step
        rec.step["callback_on_step_end"] = {"i": i, **{k: shape(v) for k, v in tensors.items()}}
        return {}

    height, width = image_size(pipe, args)
    inputs = [k for k in ("latents", "prompt_embeds") if k in getattr(pipe, "_callback_tensor_inputs", [])]
    try:
        images = pipe(args.prompt, num_inference_steps=args.num_inference_steps, height=height, width=width,
                      guidance_scale=7.5 if args.guidance_scale is None else args.guidance_scale,
                      num_images_per_prompt=args.num_images, generator=generator, callback_on_step_end=on_step_end,
                      callback_on_step_end_tensor_inputs=inputs).images
    except ValueError as err:
        raise UserError(f"{type(pipe).__name__} refused the call: {first_line(err)}") from None
    return (f"{type(pipe).__name__}.__call__, recorded by forward hooks on the text encoder(s) and unet, wrappers "
            "around prepare_latents, scheduler.set_timesteps/step, vae.decode and image_processor.postprocess, and "
            "callback_on_step_end"), images


def trace_ddpm(pipe, args, rec, generator, steps_kept, labels):
    """DDPMPipeline has no callbacks: forward hooks on its unet and a wrapped scheduler.step record what runs."""
    import torch

    from common.diffusion import sample_images, to_pil

    watch_denoiser(rec, pipe.unet, pipe.scheduler, steps_kept)
    hooks = "recorded by forward hooks on unet and a wrapped scheduler.step"
    num_classes = (pipe.unet.config.num_class_embeds or 1) - 1
    if num_classes <= 0:
        if args.guidance_scale not in (None, 1.0) or args.class_label is not None:
            raise UserError("--guidance_scale/--class_label: this DDPM is unconditional (no class embeddings)")
        images = pipe(batch_size=args.num_images, generator=generator,
                      num_inference_steps=args.num_inference_steps).images
        return f"DDPMPipeline.__call__, {hooks}", images
    names = labels or [str(i) for i in range(num_classes)]
    class_id = class_label_ids([names[0] if args.class_label is None else args.class_label], names)[0]
    guidance = DEFAULT_GUIDANCE_SCALE if args.guidance_scale is None else args.guidance_scale
    # DDPMPipeline.__call__ passes no class labels: run the loop that sample.py and train_ddpm.py sample with.
    result = sample_images(pipe.unet, pipe.scheduler, args.num_images, generator=generator,
                           class_labels=torch.full((args.num_images,), class_id), null_class=num_classes,
                           guidance_scale=guidance, num_inference_steps=args.num_inference_steps)
    return (f"common.diffusion.sample_images (sample.py's loop: DDPMPipeline.__call__ takes no class labels) with "
            f"the pipeline's scheduler, class '{names[class_id]}' (id {class_id}), guidance {guidance}, null class "
            f"id {num_classes}; {hooks}"), to_pil(result)


def trace(pipe, args, labels, device):
    """-> (trace report, the call's images, trajectory panels or None). Every hook is removed afterwards."""
    import torch

    from common.call_recorder import CallRecorder
    from common.diffusion import to_pil

    sd = getattr(pipe, "vae", None) is not None and hasattr(pipe, "text_encoder")
    if not sd and type(pipe).__name__ != "DDPMPipeline":
        raise UserError(f"--trace: {type(pipe).__name__} is neither a Stable Diffusion-like nor a DDPM pipeline")
    rec = CallRecorder(cuda=device.type == "cuda")
    generator = torch.Generator().manual_seed(args.seed)  # on the CPU: the same noise on any device
    kept = args.trajectory_steps if args.save_trajectory else 0
    start = rec.clock()
    try:
        how, images = (trace_sd(pipe, args, rec, generator, kept) if sd
                       else trace_ddpm(pipe, args, rec, generator, kept, labels))
    finally:
        rec.remove()
    end = rec.clock()
    if not sd:  # (x / 2 + 0.5).clamp and to PIL happen inside the call, with no hook point: timed as its rest
        rec.add("postprocess (rest of the call)", (end - rec.last_end) * 1e3,
                output=f"{len(images)} x {type(images[0]).__name__} {images[0].size}")
    report = {"how": how, "total_ms": round((end - start) * 1e3, 3), "initial_noise": rec.initial_noise,
              "guided": any("guidance" in s for s in rec.stages), "stages": rec.stages}
    panels = None
    if rec.x0:
        report["trajectory"] = [{k: v for k, v in p.items() if k != "x0"} for p in rec.x0]
        x0 = torch.cat([p["x0"] for p in rec.x0])
        if sd:  # decoded after the call, so not traced; in fp32, as fp16 VAEs decode to black
            from common.stable_diffusion import decode_fp32
            panels = decode_fp32(pipe, x0.to(device))
        else:
            panels = to_pil((x0 / 2 + 0.5).clamp(0, 1))
    return report, images, panels


# ---------------------------------------------------------------------------------------------- printing
def fmt(value):
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {fmt(v)}" for k, v in value.items())
    return ", ".join(map(fmt, value)) if isinstance(value, list) else str(value)


def print_section(title, entries, skip=("class", "component")):
    print(f"\n{title}")
    entries = {k: v for k, v in entries.items() if k not in skip}
    width = max(map(len, entries), default=0)
    for key, value in entries.items():
        print(f"  {key:<{width}}  {fmt(value)}")


def print_report(r):
    print(f"{r['model']}: {r['pipeline']}" + "".join(f"\n  ({note})" for note in r["notes"]))
    print(f"\ncomponents\n  {'name':<18}{'class':<28}{'parameters':>12}  {'dtype':<9}{'device':<8}"
          f"{'MB':>9}")
    for c in r["components"]:
        print(f"  {c['name']:<18}{c['class'] or '-':<28}" + (
            f"{c['parameters']:>12,}  {c['dtype']:<9}{c['device']:<8}{c['size_mb']:>9.3f}"
            if "parameters" in c else "").rstrip())
    print(f"  {'total':<46}{sum(c.get('parameters', 0) for c in r['components']):>12,}")
    print_section(f"scheduler: {r['scheduler']['class']}", r["scheduler"])
    print_section(f"denoiser ({r['denoiser']['component']}): {r['denoiser']['class']}", r["denoiser"])
    for name, entry in [*r.get("text_encoders", {}).items(), *r.get("tokenizers", {}).items()]:
        print_section(f"{name}: {entry['class']}", entry)
    if "vae" in r:
        print_section(f"vae: {r['vae']['class']}", r["vae"])
    if "lora" in r:
        lora = r["lora"]
        print(f"\nlora: {lora['path']} (trained on {lora['trained_on'] or 'unknown'}) adds "
              f"{lora['parameters_added']:,} parameters" + "".join(f"\n  warning: {w}" for w in lora["warnings"]))
        for name, entry in lora["components"].items():
            print_section(f"lora in {name}", entry)
    if "trace" in r:
        print_trace(r["trace"])
    if "trajectory" in r:
        t = r["trajectory"]
        print(f"\ntrajectory: {t['path']} ({t['panels']} panels, x0 from {t['source']}, first image of the batch) at "
              "steps " + ", ".join(f"{p['step']} (t={p['t']})" for p in r["trace"]["trajectory"]))


def print_trace(t):
    print(f"\ntrace: {t['how']}\n  initial noise {fmt(t['initial_noise'])}; classifier-free guidance "
          + ("on: the denoiser sees the batch twice (unconditional + conditional)" if t["guided"] else "off")
          + f"\n  {'ms':>9}  stage")
    for s in t["stages"]:
        if s["stage"] != "denoise":
            info = {k: v for k, v in s.items() if k not in ("stage", "ms")}
            if len(info.get("timesteps", [])) > 12:
                info["timesteps"] = f"{fmt(info['timesteps'][:5])[:-1]}, ..., {fmt(info['timesteps'][-3:])[1:]}"
            print(f"  {s['ms']:>9.2f}  {s['stage']}  {fmt(info)}")
            continue
        unet_in = " + ".join(f"{k} {fmt(v)}" for k, v in s["unet_in"].items())
        guidance = f" | {s['guidance']['ms']:.2f} ms guidance -> {fmt(s['guidance']['out'])}" if "guidance" in s else ""
        print(f"  {s['unet_ms']:>9.2f}  step {s['step']} t={s['t']}: unet({unet_in}) -> {fmt(s['unet_out'])}{guidance}"
              f" | {s['scheduler_ms']:.2f} ms scheduler.step -> {fmt(s['latents'])}")
    print(f"  {t['total_ms']:>9.2f}  total (wall time of the call)")


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
