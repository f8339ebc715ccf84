"""Validation images of the text-to-image trainers (a video family's: clips, as animated GIFs), for any family: the
family's pipeline built around the weights being trained, drawn from the cached prompt embeddings when the text
encoders are frozen (they may have left the accelerator), decoded by the VAE in fp32, saved under samples/step-N/ and
logged to the trackers. Edit LoRAs: the family's edit pipeline draws from the reference images, and the base draws too
(adapters off, same seeds): the trackers get reference | base | LoRA side by side."""
import os


def validation_images(args, accelerator, family, parts, scheduler, step, sizes=None, embeddings=None,
                      references=None):
    """Images of --validation_prompt from the current weights (main process; the others wait), saved under
    samples/step-N/ and logged to the trackers (a row per prompt, and per size: `sizes` [(height, width)], default
    the family's own sample size). parts: the pipeline's components, by their names (the trained ones unwrapped);
    scheduler: the training scheduler, whose settings the sampler takes (--validation_scheduler); embeddings(prompt)
    -> the family's conditioning of a prompt (cached; "" is the unconditional one), or None: the pipeline encodes
    the prompts itself. references: the reference images (PIL) of an edit LoRA's prompts, or None."""
    import diffusers
    import torch

    from .diffusion import image_grid, sampling_scheduler
    from .reporting import log_image
    from .video import save_clip

    if references:  # (edit LoRAs)
        from .references import adapters_off, side_by_side
        from .sampling_defaults import reference_size

    paths = []
    if accelerator.is_main_process:
        sampler = sampling_scheduler(args.validation_scheduler or family.SAMPLER, scheduler.config, family.SAMPLERS)
        pipeline = family.EDIT_PIPELINE if references else family.PIPELINE
        parts = {**parts, **getattr(family, "expert_parts", dict)(parts)}  # (Wan A14B, both experts: each its own)
        pipe = getattr(diffusers, pipeline)(**parts, scheduler=sampler, **family.PIPELINE_EXTRAS)
        frozen = [parts[name] for name in getattr(family, "FROZEN_EXPERTS", ())]  # (Wan A14B: the other expert)
        for model in frozen:  # on the device while it draws only
            model.requires_grad_(False).to(accelerator.device)
        pipe.set_progress_bar_config(disable=True)
        models = [model for model in parts.values() if isinstance(model, torch.nn.Module)]
        modes = [model.training for model in models]
        for model in models:
            model.eval()
        folder = os.path.join(args.output_dir, "samples", f"step-{step}")
        os.makedirs(folder, exist_ok=True)
        denoiser = parts[family.DENOISER]
        guidance, unconditional = family.guidance_kwargs(denoiser.config, args.validation_guidance_scale,
                                                         args.num_validation_images)
        if references and not sizes:  # as sample.py draws an edit LoRA: the training size, the reference's aspect
            factor = family.resolution_factor({"vae": pipe.vae.config, family.DENOISER: denoiser.config})
            sizes = [reference_size(references[0], args.resolution, args.resolution, factor)]
        for p, prompt in enumerate(args.validation_prompt):
            if embeddings is not None:
                uncond = embeddings("") if unconditional else None
                text = family.pipeline_prompt_kwargs(*[None if c is None else {
                    k: v.to(accelerator.device).expand(args.num_validation_images, *v.shape[1:])
                    for k, v in c.items()} for c in (embeddings(prompt), uncond)])
                text.update({k: v for k, v in guidance.items() if k != "negative_prompt"})
            else:  # (at the T5 length the run trains with)
                text = {"prompt": [prompt] * args.num_validation_images, **guidance}
                if "max_sequence_length" in family.SAMPLE_FLAGS:
                    text["max_sequence_length"] = args.max_sequence_length
            for s, (height, width) in enumerate(sizes or [family.sample_size(pipe)]):
                if references:
                    text.update(family.reference_kwargs(references, height, width))
                images = draw(pipe, family, args, accelerator, text, height, width)
                size = f"-{width}x{height}" if s else ""  # the first size keeps the plain names
                clips = images and isinstance(images[0], list)  # (a video family's: each a list of frames)
                for j, image in enumerate(images):
                    paths.append(os.path.join(folder, f"{p}-{j}{size}.{'gif' if clips else 'png'}"))
                    if clips:
                        save_clip(image, paths[-1])
                    else:
                        image.save(paths[-1])
                grid = image_grid(sum(images, []), ncol=len(images[0])) if clips else image_grid(images, len(images))
                if references and getattr(family, "FIRST_FRAME", False):  # (Wan image-to-video: a clip's)
                    references[0].save(args.reference_paths[0])  # (the card's snippet's: common/references.py)
                elif references:  # a row per image: the reference(s), the base's output (same seed), the LoRA's
                    with adapters_off(models):
                        base = draw(pipe, family, args, accelerator, text, height, width)
                    grid = side_by_side(references, base, images, height, width)
                    paths.append(os.path.join(folder, f"{p}-side_by_side{size}.png"))
                    grid.save(paths[-1])
                log_image(accelerator, f"validation/{p}{size}", grid, step)
        for model, mode in zip(models, modes):
            model.train(mode)
        for model in frozen:
            model.to("cpu")
    accelerator.wait_for_everyone()
    return paths


def draw(pipe, family, args, accelerator, kwargs, height, width):
    """--num_validation_images images of one prompt (kwargs: the pipeline call's), image j from seed + j."""
    import torch

    from .vae import decode_fp32
    from .video import frame_kwargs

    generators = [torch.Generator().manual_seed(args.seed + j) for j in range(args.num_validation_images)]
    with torch.no_grad(), accelerator.autocast():
        latents = pipe(**kwargs, num_inference_steps=args.validation_inference_steps, generator=generators,
                       height=height, width=width, output_type="latent",
                       **frame_kwargs(family, getattr(args, "num_frames", None)))[0]
    return decode_fp32(pipe, family.unpack_latents(pipe, latents, height, width), family.latent_config(pipe.vae))


def add_validation_image_args(group, validation_steps):
    """The validation-image flags of the text-to-image trainers (diffusers' names); the family gives the defaults
    left None (check_validation_image_args)."""
    from .args import non_negative_float, positive_int
    from .diffusion import FLOW_SCHEDULER_CLASSES, SCHEDULER_CLASSES

    group.add_argument("--validation_prompt", action="append", default=[], help="Repeatable.")
    group.add_argument("--num_validation_images", type=positive_int, default=2, help="Images per prompt.")
    group.add_argument("--validation_steps", type=positive_int, default=validation_steps,
                       help="Every N optimizer steps, and at the end.")
    group.add_argument("--validation_scheduler", default=None,
                       choices=sorted(set(SCHEDULER_CLASSES) | set(FLOW_SCHEDULER_CLASSES)),
                       help="Sampler of the validation images (sample.py's default too): dpm (DPM-Solver++) for SD "
                            "1.x/2.x and SDXL, euler (the pipelines' flow-matching Euler) for SD3, Flux.1, Qwen-Image "
                            "and Z-Image.")
    group.add_argument("--validation_inference_steps", type=positive_int, default=20)
    group.add_argument("--validation_guidance_scale", type=non_negative_float, default=None,
                       help="Default: sample.py's (the base's model card's, else the family's): 7.5 for SD 1.x/2.x "
                            "and SDXL, 7.0 for SD3, 3.5 for Flux.1-dev (its guidance input); a Flux.1 base without a "
                            "guidance embedding: true CFG 3.5 where the run trains the whole transformer with caption "
                            "dropout, else none; 4.0 for Qwen-Image (true CFG), 5.0 for Z-Image (0: none).")


def check_validation_image_args(args, family, unconditional=False):
    """The sampler must be one of the family's; by default the guidance sample.py draws the result with
    (common/sampling_defaults.py: the base's card, else the family's; `unconditional`: the run trains the empty
    prompt into the whole denoiser, so a base guided by true CFG gets it)."""
    from .base_models import component_configs
    from .cli import UserError
    from .sampling_defaults import sampling_defaults

    if args.validation_scheduler and args.validation_scheduler not in family.SAMPLERS:
        raise UserError(f"--validation_scheduler {args.validation_scheduler}: {family.NAME} bases sample with "
                        f"{', '.join(sorted(family.SAMPLERS))}")
    base = args.pretrained_model_name_or_path
    if args.validation_prompt and hasattr(family, "check_size") and getattr(args, "buckets", "off") != "auto":
        size = family.DEFAULT_SIZE  # (Wan: the pipeline's default, which a tiny base's rotary table may not place)
        family.check_size(component_configs(base, ("vae", family.DENOISER), args.revision, args.cache_dir), *size,
                          "--validation_prompt draws at the pipeline's default size,",
                          "give --buckets auto to draw at the training size (--resolution)")
    if args.validation_guidance_scale is None:
        config = getattr(args, "denoiser_config", None) or component_configs(
            base, (family.DENOISER,), args.revision, args.cache_dir)[family.DENOISER]
        args.validation_guidance_scale = sampling_defaults(family, base, config, None, unconditional)["guidance_scale"]
