"""What a diffusion pipeline holds, for inspect_pipeline.py: its components (parameters, dtype, device, size), the
scheduler, the denoiser's key config, the text encoders and tokenizers, the VAE and the latent shape at the call's
image size; what a LoRA loaded through diffusers' own loader adapts; and the text report of all of it (and of a
trace, common/pipeline_trace.py)."""
import os
import re

from .cli import UserError, first_line
from .lora_files import LORA_WEIGHTS, lora_file_metadata, read_lora_info


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
        "steps_offset", "clip_sample", "thresholding", "shift", "use_dynamic_shifting", "base_shift", "max_shift",
        "base_image_seq_len", "max_image_seq_len"]), "init_noise_sigma": float(getattr(s, "init_noise_sigma", 1.0)),
        "order": s.order}
    name = "unet" if hasattr(pipe, "unet") else "transformer"
    model = getattr(pipe, name)
    d = {"component": name, "class": type(model).__name__, **pick(model.config, [
        "sample_size", "in_channels", "out_channels", "block_out_channels", "layers_per_block", "down_block_types",
        "cross_attention_dim", "attention_head_dim", "num_attention_heads", "num_class_embeds", "class_embed_type",
        "time_cond_proj_dim", "addition_embed_type", "addition_time_embed_dim",
        "projection_class_embeddings_input_dim",  # SDXL: the pooled text embedding and time ids, added
        "patch_size", "num_layers", "num_single_layers", "joint_attention_dim", "pooled_projection_dim",
        "caption_projection_dim", "guidance_embeds", "axes_dims_rope"])}  # SD3, Flux's transformers
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
                                        "max_position_embeddings", "vocab_size", "projection_dim",
                                        "d_model", "num_layers", "num_heads"])}  # (T5's names)
        if comp_name.startswith("tokenizer") and comp is not None:
            report.setdefault("tokenizers", {})[comp_name] = {
                "class": type(comp).__name__, "model_max_length": comp.model_max_length, "vocab_size": len(comp),
                "pad_token": comp.pad_token}
    height, width = image_size(pipe, args)
    vae = getattr(pipe, "vae", None)
    if vae is not None:
        c, factor = vae.config, vae_scale(pipe)
        family = pipeline_family(pipe)
        frames = clip_frames(pipe, args)  # a video family's clip: [B, 3, F, H, W] -> [B, C, f, h, w]
        clip = [frames] if frames else []
        latent_clip = [family.latent_frames(frames, c)] if frames else []
        report["vae"] = {"class": type(vae).__name__, **pick(c, ["scaling_factor", "shift_factor", "latent_channels",
                                                                 "z_dim", "block_out_channels", "latents_mean",
                                                                 "latents_std"]),
                         "downsampling_factor": factor, "image_shape": [args.num_images, 3, *clip, height, width],
                         "latent_shape": [args.num_images, c.get("latent_channels") or c.get("z_dim"),  # (3-D VAEs)
                                          *latent_clip, height // factor, width // factor]}
        if family is not None and hasattr(family, "packed_shape"):  # Flux: the transformer sees 2 x 2 patches
            report["vae"]["packed_latent_shape"] = family.packed_shape(report["vae"]["latent_shape"])
    else:
        report["image_shape"] = [args.num_images, model.config.in_channels, height, width]
    return report


def vae_scale(pipe):
    """The VAE's downsampling factor as the pipeline holds it (Wan's: vae_scale_factor_spatial)."""
    from .vae import vae_factor

    return getattr(pipe, "vae_scale_factor", None) or vae_factor(dict(pipe.vae.config))


def clip_frames(pipe, args):
    """A video family's clip length for the call (--num_frames, else a LoRA's training clips', else the family's
    default), None for an image pipeline."""
    family = pipeline_family(pipe)
    if not getattr(family, "VIDEO", False):
        if getattr(args, "num_frames", None):
            raise UserError(f"--num_frames: {type(pipe).__name__} draws images, not clips; leave it out")
        return None
    frames = getattr(args, "num_frames", None) or lora_info(args).get("num_frames") or family.SAMPLE_FRAMES
    family.check_frames(frames, pipe.vae.config)
    return frames


def lora_info(args):
    """The lora_info.json of --lora (a folder, or beside a file), {} without one."""
    lora = getattr(args, "lora", None)
    return (read_lora_info(lora if os.path.isdir(lora) else os.path.dirname(lora) or ".") or {}) if lora else {}


def pipeline_family(pipe):
    """The family module (common/families/) of a pipeline of one, else None."""
    from .families import FAMILIES, family_module

    name = FAMILIES.get(type(pipe).__name__)
    return family_module(name) if name else None


def image_size(pipe, args):
    """The call's image size: --height/--width, checked against the VAE (and a family's patches), or the pipeline's
    default (a family's own: common/families/ sample_size)."""
    family = pipeline_family(pipe)
    if getattr(pipe, "vae", None) is None:
        size = pipe.unet.config.sample_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        if args.height or args.width:
            raise UserError(f"--height/--width: {type(pipe).__name__} samples at its UNet's sample_size {size}")
        return size
    factor, why = vae_scale(pipe), "the VAE's downsampling factor"
    if family is not None:
        denoiser = getattr(pipe, family.DENOISER)
        factor = family.resolution_factor({"vae": pipe.vae.config, family.DENOISER: denoiser.config})
        default, why = family.sample_size(pipe), family.RESOLUTION_FACTOR
        trained = lora_info(args).get("resolution")  # as sample.py draws a LoRA: at its training size
        default = (trained, trained) if trained else default
    else:
        size = (getattr(pipe, "unet", None) or pipe.transformer).config.sample_size
        default = (size * factor, size * factor) if isinstance(size, int) else (size[0] * factor, size[1] * factor)
    height, width = args.height or default[0], args.width or default[1]
    for flag, value in (("--height", height), ("--width", width)):
        if value % factor:
            raise UserError(f"{flag} {value} is not divisible by {factor}, {why}")
    if family is not None:  # (Wan: what the transformer's rotary table places)
        configs = {"vae": pipe.vae.config, family.DENOISER: getattr(pipe, family.DENOISER).config}
        getattr(family, "check_size", lambda *_: None)(configs, height, width)
    return height, width


def pipeline_guidance(pipe, scale, batch, info=None):
    """A call's guidance arguments at `scale` (default: sample.py's, from the base's card or its family; else Stable
    Diffusion's 7.5), as the family gives them (common/families/: guidance_kwargs), and T5's length as sample.py
    gives it (info: a LoRA's lora_info.json, whose T5 length it trained with comes first)."""
    from .sampling_defaults import sampling_defaults

    family = pipeline_family(pipe)
    if family is None:
        return {"guidance_scale": 7.5 if scale is None else scale}
    config = getattr(pipe, family.DENOISER).config
    defaults = sampling_defaults(family, getattr(pipe, "name_or_path", None) or "", config, info)
    scale = defaults["guidance_scale"] if scale is None else scale
    length = family.text_length(pipe.components, defaults["max_sequence_length"])
    return {**family.guidance_kwargs(config, scale, batch)[0], **({"max_sequence_length": length} if length else {})}


def unpack_latents(pipe, latents, height, width):
    """A call's latents as the VAE takes them (Flux's packed ones unpacked)."""
    family = pipeline_family(pipe)
    return family.unpack_latents(pipe, latents, height, width) if family is not None else latents


def load_lora(pipe, args):
    """Load the LoRA into the base through diffusers' own loader, then describe the peft layers it created."""
    from peft.tuners.lora import LoraLayer

    if not hasattr(pipe, "load_lora_weights"):
        raise UserError(f"--lora: {type(pipe).__name__} cannot load LoRA weights")
    folder, weight_name = ((args.lora, LORA_WEIGHTS) if os.path.isdir(args.lora)
                           else (os.path.dirname(args.lora) or ".", os.path.basename(args.lora)))
    base_params = {name: sum(p.numel() for p in c.parameters()) for name, c in pipe.components.items()
                   if hasattr(c, "parameters")}
    info = read_lora_info(folder) or {}
    family = pipeline_family(pipe)  # (Wan A14B: the expert the LoRA names, a file's own)
    expert = getattr(pipe, "transformer_2", None) is not None and family.lora_expert(
        args.lora, lora_file_metadata(os.path.join(folder, weight_name)))
    low = {"load_into_transformer_2": True} if expert == "low" else {}
    try:
        pipe.load_lora_weights(folder, weight_name=weight_name, adapter_name="inspected", **low)
        if expert == "both":  # and the low expert's, from low/
            pipe.load_lora_weights(os.path.join(folder, "low"), adapter_name="inspected", load_into_transformer_2=True)
    except (RuntimeError, ValueError, KeyError, OSError) as err:
        mismatch = re.search(r"size mismatch for (\S+): copying a param with shape torch.Size\((\[[^]]*\])\) from "
                             r"checkpoint, the shape in current model is torch.Size\((\[[^]]*\])\)", str(err))
        if mismatch:
            module, theirs, ours = mismatch.groups()
            module = module.replace(".inspected.", ".")  # the adapter name we gave it
            raise UserError(f"--lora '{args.lora}' was made for another base: {module} is {theirs} in the LoRA but "
                            f"{ours} in '{args.model}'") from None
        raise UserError(f"--lora '{args.lora}' does not load into '{args.model}': {first_line(err)}") from None
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
        name = "unet" if "unet_in" in s else "transformer"
        given = " + ".join(f"{k} {fmt(v)}" for k, v in s[f"{name}_in"].items())
        guidance = f" | {s['guidance']['ms']:.2f} ms guidance -> {fmt(s['guidance']['out'])}" if "guidance" in s else ""
        guidance = "".join(f" | {p[f'{name}_ms']:.2f} ms another pass (true CFG's negative prompt) -> "
                           f"{fmt(p[f'{name}_out'])}" for p in s.get("true_cfg_passes", [])) + guidance
        expert = s.get("expert", name)  # (Wan 2.2 A14B: transformer or transformer_2)
        print(f"  {s[f'{name}_ms']:>9.2f}  step {s['step']} t={s['t']}: {expert}({given}) -> {fmt(s[f'{name}_out'])}"
              f"{guidance} | {s['scheduler_ms']:.2f} ms scheduler.step -> {fmt(s['latents'])}")
    print(f"  {t['total_ms']:>9.2f}  total (wall time of the call)")

