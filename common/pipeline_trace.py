"""What a diffusion pipeline's __call__ really does, for inspect_pipeline.py --trace: one real call, stage by stage,
with shapes and wall times, and the predicted clean image x0 at chosen steps.

The pipeline runs its own code while timed wrappers around its methods and forward hooks on its modules (each removed
afterwards) record what runs; nothing is re-implemented, so what is recorded is what ran.
"""
import functools
import time

from .cli import UserError, first_line
from .diffusion import DEFAULT_GUIDANCE_SCALE, sample_images, to_pil
from .pipeline_report import clip_frames, image_size, lora_info, pipeline_family, pipeline_guidance, unpack_latents
from .pipelines import class_label_ids
from .vae import decode_fp32


# ---------------------------------------------------------------------------------------------- the recorder
def shape(x):
    """A tensor's shape as a JSON-able list; a list of tensors (Z-Image's transformer takes and returns them) as
    [items, *their shape], None where their sizes differ; None for anything else."""
    if isinstance(x, (list, tuple)) and x and all(hasattr(item, "shape") for item in x):
        sizes = [list(item.shape) for item in x]
        return [len(x), *(d if all(s == d for s in sizes_at) else None
                          for d, *sizes_at in zip(sizes[0], *sizes[1:]))] if len({len(s) for s in sizes}) == 1 \
            else None
    return list(x.shape) if hasattr(x, "shape") else None


def scalar(t):
    """A timestep (tensor or number) as an int when it is one, else a rounded float (Euler's sigmas-based ones)."""
    value = float(t)
    return int(value) if value.is_integer() else round(value, 4)


class CallRecorder:
    """Collects `stages` (dicts in call order); remove() takes every wrapper and hook away again."""

    def __init__(self, cuda=False):
        self.cuda, self.stages, self.last_end, self._undo = cuda, [], None, []

    def clock(self):
        if self.cuda:  # GPU work is asynchronous: wait for it, or its time lands in a later stage
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, stage, ms, **info):
        entry = {"stage": stage, "ms": round(ms, 3), **info}
        self.stages.append(entry)
        return entry

    def wrap(self, owner, name, record):
        """owner.name(...) also calls record(args, kwargs, result, ms, start). The wrapper is an instance attribute
        that shadows the class's method; functools.wraps keeps the signature, which pipelines inspect (eta,
        generator)."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*a, **kw):
            start = self.clock()
            out = original(*a, **kw)
            self.last_end = self.clock()
            record(a, kw, out, (self.last_end - start) * 1e3, start)
            return out

        had = name in vars(owner)
        setattr(owner, name, wrapper)
        self._undo.append(lambda: setattr(owner, name, original) if had else delattr(owner, name))

    def hook(self, module, pre, post):
        """Forward pre-hook pre(module, args, kwargs) and hook post(module, args, kwargs, output) on a module."""
        self._undo.append(module.register_forward_pre_hook(pre, with_kwargs=True).remove)
        self._undo.append(module.register_forward_hook(post, with_kwargs=True).remove)

    def remove(self):
        while self._undo:
            self._undo.pop()()


# ---------------------------------------------------------------------------------------------- what it does
def watch_denoiser(rec, unet, scheduler, trajectory_steps, name="unet", experts=None):
    """One 'denoise' stage per denoiser call: a forward hook on the denoiser (component `name`: its inputs and output
    are kept as <name>_in, <name>_out), a wrapped scheduler.step (and what ran between them: the guidance combine),
    the timesteps (and a flow-matching scheduler's sigmas) from a wrapped set_timesteps; x0 kept at chosen steps.
    `experts` ({component name: module}, Wan 2.2 A14B's transformer and transformer_2): each hooked, each step
    records which one ran (`expert`)."""
    rec.step, rec.x0, rec.keep, rec.calls, rec.initial_noise = None, [], set(), 0, None
    # (a denoiser call before the scheduler has stepped on the last one is another pass of the same step)
    given, made, took = f"{name}_in", f"{name}_out", f"{name}_ms"
    flow = not hasattr(scheduler, "alphas_cumprod")  # a flow-matching scheduler: x_t = x0 + sigma * velocity

    def pre(module, a, kw):
        inputs = {"sample": shape(a[0] if a else kw.get("sample", kw.get("hidden_states")))}
        cond = kw.get("encoder_hidden_states", a[2] if len(a) > 2 else None)
        if cond is not None:
            inputs["encoder_hidden_states"] = shape(cond)
        for key, value in (kw.get("added_cond_kwargs") or {}).items():  # SDXL: the pooled text_embeds, time_ids
            inputs[key] = shape(value)
        for key in ("pooled_projections", "txt_ids", "img_ids", "encoder_hidden_states_mask"):  # SD3, Flux, Qwen
            if kw.get(key) is not None:
                inputs[key] = shape(kw[key])
        if kw.get("img_shapes") is not None:  # Qwen-Image: each sample's latent grid (frames, rows, columns)
            inputs["img_shapes"] = [list(map(list, grids)) for grids in kw["img_shapes"]]
        if kw.get("guidance") is not None:  # Flux.1-dev: the guidance is an input, not a second pass
            inputs["guidance"] = {"shape": shape(kw["guidance"]), "value": scalar(kw["guidance"].flatten()[0])}
        if kw.get("class_labels") is not None:
            inputs["class_labels"] = kw["class_labels"].tolist()
        if rec.step is not None and "scheduler_ms" not in rec.step:  # a 2nd pass before the step: true CFG's
            rec.step.setdefault("true_cfg_passes", []).append({given: inputs})
            rec.unet_start = rec.clock()
            return
        t = a[1] if len(a) > 1 else kw["timestep"]
        rec.step = {"stage": "denoise", "step": sum(s["stage"] == "denoise" for s in rec.stages),
                    "t": scalar(t.flatten()[0] if hasattr(t, "flatten") else t), given: inputs}
        if experts:
            rec.step["expert"] = next(key for key, value in experts.items() if value is module)
        rec.stages.append(rec.step)
        rec.unet_start = rec.clock()

    def post(module, a, kw, output):
        rec.unet_end = rec.clock()
        passes = rec.step.get("true_cfg_passes", [])
        entry = passes[-1] if passes and made not in passes[-1] else rec.step
        entry.update({took: round((rec.unet_end - rec.unet_start) * 1e3, 3), made: shape(output[0])})

    def on_step(a, kw, out, ms, start):
        model_output, t = (a[0] if a else kw["model_output"]), (a[1] if len(a) > 1 else kw["timestep"])
        sample = a[2] if len(a) > 2 else kw["sample"]
        if rec.step[made][0] != shape(model_output)[0] or "true_cfg_passes" in rec.step:  # uncond + w * (cond -
            # uncond) ran in between (Flux's and Qwen-Image's true CFG: from a pass of its own, then rescaled)
            rec.step["guidance"] = {"in": rec.step[made], "out": shape(model_output),
                                    "ms": round((start - rec.unet_end) * 1e3, 3)}
        prev = out[0] if isinstance(out, tuple) else out.prev_sample
        rec.step.update(scheduler_in=shape(model_output), scheduler_ms=round(ms, 3), latents=shape(prev))
        index, rec.calls = rec.calls, rec.calls + 1
        if index == 0:  # the scheduler sees the latents before any doubling for guidance
            rec.initial_noise = shape(sample)
        if index in rec.keep:  # schedulers return (prev_sample, pred_original_sample) when they compute x0
            x0 = out[1] if isinstance(out, tuple) and len(out) > 1 else getattr(out, "pred_original_sample", None)
            source = "pred_original_sample"
            if x0 is None and flow:  # the model predicts the velocity noise - x0
                x0, source = sample - scheduler.sigmas[index].to(sample.device) * model_output, "sigmas"
            if x0 is None:  # multistep solvers (DPM, UniPC, PNDM) do not return it: invert the noise schedule
                x0, source = x0_from_prediction(scheduler, model_output, t, sample), "alphas_cumprod"
            rec.x0.append({"step": index, "t": scalar(t), "source": source, "x0": x0[:1].detach().float().cpu()})

    def on_set_timesteps(a, kw, out, ms, start):
        timesteps = [scalar(t) for t in scheduler.timesteps]
        n, k = len(timesteps), min(trajectory_steps, len(timesteps))
        rec.keep = {round(i * (n - 1) / max(k - 1, 1)) for i in range(k)} if k else set()  # first ... last
        sigmas = {"sigmas": [round(float(s), 4) for s in scheduler.sigmas]} if flow else {}
        shift = {"mu": round(float(kw["mu"]), 4)} if kw.get("mu") is not None else {}  # Flux: the shift by image size
        rec.add("scheduler.set_timesteps", ms, num_inference_steps=n, timesteps=timesteps, **sigmas, **shift)

    for module in (experts or {name: unet}).values():
        rec.hook(module, pre, post)
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


def first_frame(path):
    """--image: an image-to-video pipeline's first frame (RGB); one line when it does not read."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as err:
        raise UserError(f"--image '{path}': cannot read it as an image ({first_line(err)}); give an image file") \
            from None


def trace_sd(pipe, args, rec, generator, steps_kept):
    """One real StableDiffusionPipeline-style call; -> (how it was recorded, images)."""
    i2v = type(pipe).__name__ == getattr(pipeline_family(pipe), "I2V_PIPELINE", None)  # (Wan image-to-video)
    if i2v and not getattr(args, "image", None):
        raise UserError(f"--trace: {type(pipe).__name__} draws from a first frame; give --image FIRST_FRAME.png")
    if getattr(args, "image", None) and not i2v:
        raise UserError(f"--image: {type(pipe).__name__} takes no first frame (an image-to-video pipeline, Wan's "
                        "WanImageToVideoPipeline, does); leave --image out")
    first = first_frame(args.image) if i2v else None
    if i2v:  # (diffusers 0.42's WanImageToVideoPipeline cleans prompts with ftfy, unguarded)
        pipeline_family(pipe).i2v_without_ftfy()
    calls = {}
    for name, component in pipe.components.items():
        if name.startswith("text_encoder") and component is not None:
            def pre(module, a, kw):
                rec.text_in, rec.text_start = shape(a[0] if a else kw["input_ids"]), rec.clock()

            def post(module, a, kw, output, name=name):
                calls[name] = calls.get(name, 0) + 1  # encode_prompt encodes the prompt, then the negative one
                last = (output.last_hidden_state if hasattr(output, "last_hidden_state") else output.hidden_states[-1]
                        if getattr(output, "logits", None) is not None and output.hidden_states else output[0])
                states = {"last_hidden_state": shape(last)}
                if getattr(output, "hidden_states", None) is not None:  # SDXL takes the penultimate layer's
                    states["hidden_states[-2]"] = shape(output.hidden_states[-2])
                if getattr(output, "text_embeds", None) is not None:  # the pooled, projected embedding (SDXL's 2nd)
                    states["text_embeds"] = shape(output.text_embeds)
                if getattr(output, "pooler_output", None) is not None:  # CLIP's pooled embedding (Flux's)
                    states["pooler_output"] = shape(output.pooler_output)
                rec.add(name, (rec.clock() - rec.text_start) * 1e3, input_ids=rec.text_in, **states,
                        text="prompt" if calls[name] == 1 else "negative prompt")
            rec.hook(component, pre, post)
    if hasattr(pipe, "_get_add_time_ids"):  # SDXL: original size, crop top-left, target size; once per call
        rec.wrap(pipe, "_get_add_time_ids", lambda a, kw, out, ms, start: rec.add(
            "_get_add_time_ids", ms, time_ids=shape(out), values=[scalar(v) for v in out[0]]))
    def on_prepare_latents(a, kw, out, ms, start):  # Flux: (packed latents, their position ids); Wan I2V: + condition
        parts = out if isinstance(out, tuple) else (out,)
        names = ("latents", "latent_image_ids")
        if i2v:  # (Wan 2.2 TI2V-5B: the first frame's latents and where they replace the noise; else the mask, 4
            # channels, and the first frame's latents followed by black frames', beside the noise as channels)
            names = ("latents", "latent_condition", "first_frame_mask") if len(parts) == 3 else ("latents", "condition")
        rec.add("prepare_latents", ms, **{name: shape(part) for name, part in zip(names, parts)},
                init_noise_sigma=float(getattr(pipe.scheduler, "init_noise_sigma", 1.0)))

    rec.wrap(pipe, "prepare_latents", on_prepare_latents)
    if i2v and getattr(pipe, "image_encoder", None) is not None:  # Wan 2.1 I2V: the first frame's CLIP embeddings
        rec.wrap(pipe, "encode_image", lambda a, kw, out, ms, start: rec.add(
            "encode_image", ms, image_embeds=shape(out), note="the image encoder's penultimate hidden states"))
    name = "unet" if hasattr(pipe, "unet") else "transformer"
    experts = None  # Wan 2.2 A14B: the expert of each step (transformer at t >= the boundary, transformer_2 below)
    if getattr(pipe, "transformer_2", None) is not None:
        experts = {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}
    watch_denoiser(rec, getattr(pipe, name), pipe.scheduler, steps_kept, name, experts)
    vae = pipe.vae.config
    shift = f" + shift_factor {vae.shift_factor}" if vae.get("shift_factor") else ""
    scale = (f"latents / scaling_factor {vae.scaling_factor}{shift}" if vae.get("scaling_factor")
             else "latents as the pipeline denormalized them")  # (Qwen-Image: per channel; FLUX.2: batch norm)
    rec.wrap(pipe.vae, "decode", lambda a, kw, out, ms, start: rec.add(
        "vae.decode", ms, latents=shape(a[0] if a else kw["z"]), image=shape(out[0]),
        note=f"in: {scale}; out: pixels in [-1, 1]"))
    # (Wan: per clip; Wan 2.1 I2V's image_processor is its CLIP encoder's)
    processor = "video_processor" if hasattr(pipe, "video_processor") else "image_processor"
    rec.wrap(getattr(pipe, processor), "postprocess", lambda a, kw, out, ms, start: rec.add(
        f"{processor}.postprocess", ms, image=shape(a[0] if a else kw["image"]),
        output=f"{len(out)} x {type(out[0]).__name__} {getattr(out[0], 'size', '')}"))

    def on_step_end(pipeline, i, t, tensors):  # the pipeline's own hook point: what it carries to the next step
        rec.step["callback_on_step_end"] = {"i": i, **{k: shape(v) for k, v in tensors.items()}}
        return {}

    height, width = image_size(pipe, args)
    inputs = [k for k in ("latents", "prompt_embeds", "add_text_embeds", "add_time_ids")
              if k in getattr(pipe, "_callback_tensor_inputs", [])]
    frames = clip_frames(pipe, args)  # a video pipeline's clip (Wan): its frames, and one clip per "image"
    count = {"num_frames": frames, "num_videos_per_prompt": args.num_images} if frames else {
        "num_images_per_prompt": args.num_images}
    try:
        images = pipe(prompt=args.prompt, num_inference_steps=args.num_inference_steps, height=height, width=width,
                      **pipeline_guidance(pipe, args.guidance_scale, args.num_images, lora_info(args)), **count,
                      generator=generator, callback_on_step_end=on_step_end,
                      callback_on_step_end_tensor_inputs=inputs, **({"image": first} if first is not None else {}))[0]
    except ValueError as err:
        raise UserError(f"{type(pipe).__name__} refused the call: {first_line(err)}") from None
    images = [clip[0] for clip in images] if frames else images  # (each clip's first frame)
    time_ids = "_get_add_time_ids, " if hasattr(pipe, "_get_add_time_ids") else ""
    how = (f"{type(pipe).__name__}.__call__, recorded by forward hooks on the text encoder(s) and {name}, wrappers "
           f"around {time_ids}prepare_latents, scheduler.set_timesteps/step, vae.decode and "
           f"{processor}.postprocess, and callback_on_step_end")
    if getattr(pipe.config, "force_zeros_for_empty_prompt", False) and any("guidance" in s for s in rec.stages):
        how += "; no negative prompt: the unconditional embeddings are zeros (force_zeros_for_empty_prompt)"
    return how, images


def trace_ddpm(pipe, args, rec, generator, steps_kept, labels):
    """DDPMPipeline has no callbacks: forward hooks on its unet and a wrapped scheduler.step record what runs."""
    import torch

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
            height, width = image_size(pipe, args)
            family = pipeline_family(pipe)
            panels = decode_fp32(pipe, unpack_latents(pipe, x0.to(device), height, width),
                                 family.latent_config(pipe.vae) if family is not None else None)
            panels = [p[0] if isinstance(p, list) else p for p in panels]  # (a clip: its first frame)
        else:
            panels = to_pil((x0 / 2 + 0.5).clamp(0, 1))
    return report, images, panels
