"""The base pipelines the latent diffusion recipes start from, whatever their family: one-line errors for a folder
that is not a complete pipeline (or a shipped one that changed: checksums.sha256), the training resolution and the
bucket size factor from the base's configs, its components loaded with their dtypes, and the frozen models moved off
the accelerator once the caches leave them idle. The family (common/families/) is passed in; nothing here branches on
it."""
import json
import os

from .args import is_hub_id, torch_dtype
from .cli import UserError, first_line

TINY_HINT = "`make tiny-sd` writes an offline tiny one to models/tiny-sd"
SHIPPED_BASE = "assets/tiny-sd-digits"  # the tiny base trained on the digits, in the repository
SHIPPED_BASES = {SHIPPED_BASE: "make tiny-sd-base", "assets/tiny-flux-digits": "make tiny-flux-base"}  # and builds
CHECKSUMS = "checksums.sha256"  # `sha256sum -c` format: a shipped folder's files, checked before each use


def check_pipeline_folder(path, flag):
    """A local folder must hold a pipeline (model_index.json) and match its checksums.sha256, if it has one; anything
    else must look like a hub id (owner/name)."""
    if os.path.normpath(path) in SHIPPED_BASES and not os.path.isdir(path):
        raise UserError(f"{flag} '{path}' (a shipped tiny base) is missing: restore it (`git checkout -- {path}`) "
                        f"or rebuild it (`{SHIPPED_BASES[os.path.normpath(path)]}`)")
    if os.path.isdir(path):
        verify_checksums(path, flag)
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            raise UserError(f"{flag} '{path}' is not a pipeline folder (no model_index.json); {TINY_HINT}")
    elif not is_hub_id(path):
        raise UserError(f"{flag} '{path}' is neither a pipeline folder nor a hub id; {TINY_HINT}")


def check_components(path, flag, family, drop_t5, to="train"):
    """A local pipeline folder of `family` holds every component folder the family loads; its optional ones (SD3's
    T5) may be missing only with --drop_t5 (`to`: what the script does without them, "train" or "draw")."""
    dropped = family.OPTIONAL_COMPONENTS or () if drop_t5 else ()
    missing = [part for part in family.OPTIONAL_COMPONENTS or () if not os.path.isdir(os.path.join(path, part))]
    if missing and not dropped:
        raise UserError(f"{flag} '{path}' has no {', '.join(missing)} (its T5 text encoder): give --drop_t5 to {to} "
                        "without T5, or a complete pipeline folder")
    missing = [part for part in family.COMPONENTS
               if part not in dropped and not os.path.exists(os.path.join(path, part))]
    if missing:
        raise UserError(f"{flag} '{path}' is not a {family.NAME} pipeline folder (no {', '.join(missing)}); "
                        f"{TINY_HINT}")


def file_sha256(path):
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checksums(folder, flag):
    """A folder with checksums.sha256 (a shipped model) must hold every listed file unchanged."""
    listing = os.path.join(folder, CHECKSUMS)
    if not os.path.isfile(listing):
        return
    shipped = {os.path.abspath(base): build for base, build in SHIPPED_BASES.items()}.get(os.path.abspath(folder))
    fix = f"restore it (`git checkout -- {folder}`) or rebuild it (`{shipped}`)" if shipped else "restore the folder"
    with open(listing) as f:
        for line in f:
            digest, name = line.strip().split(maxsplit=1)
            file = os.path.join(folder, name.lstrip("*"))
            if not os.path.isfile(file):
                raise UserError(f"{flag} '{folder}': {name} is missing (listed in {CHECKSUMS}); {fix}")
            if file_sha256(file) != digest:
                raise UserError(f"{flag} '{folder}': {name} has changed (its sha256 differs from {CHECKSUMS}); {fix}")


def load_error(flag, path, err):
    """UserError for a pipeline (part) that failed to load: the first line of the cause, and what to try."""
    hint = TINY_HINT if not os.path.isdir(path) else "is it a complete pipeline folder?"
    return UserError(f"{flag}: cannot load the base model '{path}': {first_line(err)} ({hint})")


def component_configs(path, names, revision=None, cache_dir=None, flag="--pretrained_model_name_or_path"):
    """{name: config dict} of the base's components `names` that have a config.json: a local folder's read without
    diffusers, a hub base's fetched alone."""
    configs = {}
    for name in names:
        file = os.path.join(path, name, "config.json")
        if os.path.isdir(path):
            if os.path.isfile(file):
                with open(file) as f:
                    configs[name] = json.load(f)
            continue
        from huggingface_hub import hf_hub_download

        try:
            file = hf_hub_download(path, "config.json", subfolder=name, revision=revision, cache_dir=cache_dir)
            with open(file) as f:
                configs[name] = json.load(f)
        except (OSError, ValueError) as err:
            if name in ("vae", "unet", "transformer"):
                raise load_error(flag, path, err) from None
    return configs


def training_resolution(resolution, family, configs, source):
    """-> (the resolution to train at, the base's native one or None). The native one is the family's (SD: its VAE's
    sample_size, 512 for SD 1.5); it is the default for `resolution` None. The side must map onto whole latents (and
    patches), family.resolution_factor: the pipelines refuse, or silently change, other sizes."""
    native = family.native_resolution(configs)
    if resolution is None and native is None:
        raise UserError(f"the {family.NATIVE_SIZE_FROM} config of {source} has no sample_size to take the training "
                        "size from; give --resolution")
    resolution = resolution or native
    factor = family.resolution_factor(configs)
    if resolution % factor:
        near = sorted({max(factor, resolution // factor * factor), (resolution // factor + 1) * factor})
        raise UserError(f"--resolution {resolution} is not divisible by {factor}, {family.RESOLUTION_FACTOR} of "
                        f"{source}; use {' or '.join(map(str, near))}")
    return resolution, native


def check_local_resolution(path, resolution, family):
    """training_resolution before anything loads, for a local pipeline folder (hub ids are checked once loaded).
    -> the resolution to train at: the given one, else the folder's native one; for a hub id the given one."""
    if not os.path.isdir(path):
        return resolution
    configs = component_configs(path, ("vae", family.DENOISER))
    if "vae" not in configs:
        return resolution
    return training_resolution(resolution, family, configs, f"'{path}'")[0]


def base_resolution(path, resolution, family, revision=None, cache_dir=None):
    """training_resolution from the base's configs, local or hub (for a hub base only those files are fetched, before
    the data needs the size). -> (the resolution to train at, the native one or None)."""
    configs = component_configs(path, ("vae", family.DENOISER), revision, cache_dir)
    return training_resolution(resolution, family, configs, f"'{path}'")


def size_factor(path, family, revision=None, cache_dir=None, denoiser_config=None):
    """What every side of a training image is a multiple of under --buckets auto (family.size_factor of the base's
    configs). `denoiser_config`: a config (dict) that replaces the base's denoiser's."""
    configs = component_configs(path, ("vae", family.DENOISER), revision, cache_dir)
    if denoiser_config:
        configs[family.DENOISER] = denoiser_config
    return family.size_factor(configs)


def load_parts(family, path, flag="--pretrained_model_name_or_path", *, dtype, denoiser_dtype=None, revision=None,
               variant=None, cache_dir=None, denoiser_config=None, skip=(), quantization_config=None):
    """The base's components as the pipeline holds them ({name: model}, the plain dict that `Pipeline(**parts)`
    takes), with family.COMPONENTS' classes: the VAE in fp32 (fp16 VAEs overflow), the text encoders in `dtype`, the
    denoiser in `denoiser_dtype` (default `dtype`; a fresh one from `denoiser_config` when given, in fp32), the
    scheduler and tokenizers as saved. `skip`: components left out (None in the dict: SD3 without T5). One line when
    a part does not load."""
    import importlib

    import torch

    from .deepspeed_engine import zero3_init_disabled

    load = {"revision": revision, "cache_dir": cache_dir}
    parts = {}
    try:
        for name, (library, class_name) in family.COMPONENTS.items():
            if name in skip:
                parts[name] = None
                continue
            cls = getattr(importlib.import_module(library), class_name)
            if name == family.DENOISER and denoiser_config is not None:
                parts[name] = cls.from_config(denoiser_config)
                continue
            kwargs = dict(load, subfolder=name)
            if hasattr(cls, "parameters"):  # a model: its dtype and the weights variant
                kwargs.update(variant=variant, dtype=torch.float32 if name == "vae" else
                              (denoiser_dtype or dtype) if name == family.DENOISER else dtype)
                if name == family.DENOISER and quantization_config is not None:
                    kwargs["quantization_config"] = quantization_config
            with zero3_init_disabled():  # (ZeRO-3 partitions the prepared model itself; the frozen parts stay whole)
                parts[name] = cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        raise load_error(flag, path, err) from None
    combine = getattr(family, "combine_experts", None)  # (Wan 2.2 A14B, both experts training: one denoiser)
    return combine(parts) if combine else parts


def unused_parts(family, args):
    """The base's components a LoRA run leaves unloaded (load_parts' `skip`): T5 with --drop_t5
    (family.OPTIONAL_COMPONENTS), and a Wan 2.2 A14B base's other expert when no validation clips are drawn: only the
    pipeline's sampling runs it, and it is about 28 GB of host memory in bf16."""
    skip = tuple(family.OPTIONAL_COMPONENTS or ()) if getattr(args, "drop_t5", False) else ()
    return skip + (() if args.validation_prompt else tuple(getattr(family, "FROZEN_EXPERTS", ())))


def lora_dtypes(mixed_precision):
    """accelerator.mixed_precision -> (dtype of the frozen weights, dtype of the trainable LoRA weights).

    The LoRA weights stay fp32 under any mixed precision: with fp16 ones the grad scaler fails ("Attempting to
    unscale FP16 gradients"), and bf16 ones lose the small updates. Pass the accelerator's value, never the flag's.
    """
    return torch_dtype(mixed_precision), torch_dtype("fp32")


def idle_frozen_models(cache_latents, text_cached, validation_prompts):
    """Which frozen models the rest of the run does not use, once the caches are made: the VAE when the latents are
    cached and no validation images are decoded, the text encoders when the prompt embeddings are cached (the
    validation prompts' among them)."""
    return [name for name, idle in (("vae", cache_latents and not validation_prompts),
                                    ("text_encoders", text_cached)) if idle]


def lazy_latent_cache(args, device):
    """Whether --cache_latents encodes each image when a batch first needs it (a short run then encodes only what it
    trains on; common/image_data.py's CachedLatents), not all of them before training: unless dataloader workers read
    the batches (they could not share what they encode), or the VAE is to leave an accelerator's memory once the
    cache is made (offload_idle_models; on the CPU that move changes nothing)."""
    vae_leaves = "vae" in idle_frozen_models(args.cache_latents, False, args.validation_prompt)
    return args.dataloader_num_workers == 0 and (device.type == "cpu" or not vae_leaves)


def offload_idle_models(logger, args, vae, text_encoders, text_cached, family=None):
    """Move the frozen models that `idle_frozen_models` finds idle to the CPU (the device memory they held goes to
    training), with a log line; call it after the caches and the held-out loss are made. Returns the names moved.
    An image-to-video family's image encoder (Wan 2.1 I2V's CLIP, in PIPELINE_EXTRAS) goes with the VAE: the cache
    holds its embeddings too."""
    image_encoder = getattr(family, "PIPELINE_EXTRAS", {}).get("image_encoder")
    models = {"vae": [vae, *([image_encoder] if image_encoder is not None else [])],
              "text_encoders": [e for e in text_encoders if e is not None]}
    idle = idle_frozen_models(args.cache_latents, text_cached, args.validation_prompt)
    for name in idle:
        for model in models[name]:
            model.to("cpu")
    if idle:
        shown = {"vae": "the VAE", "text_encoders": "the text encoder" + "s" * (len(models["text_encoders"]) > 1)}
        logger.info(f"{' and '.join(shown[n] for n in idle)} moved to the CPU: the cached latents and prompt "
                    "embeddings leave nothing for them to do")
    return idle


def add_base_model_args(group, default):
    """The flags that choose and load the base (diffusers' names): the pipeline, its revision and weights variant,
    T5's prompt length, the guidance input of a guidance-distilled base, SD3 without T5, gradient checkpointing."""
    from .args import positive_float, positive_int
    from .families import FAMILIES

    group.add_argument("--pretrained_model_name_or_path", default=default,
                       help=f"A diffusers pipeline of a family in common/families/ ({', '.join(sorted(FAMILIES))}): "
                            "hub id or folder (default: the shipped tiny digits base).")
    group.add_argument("--revision", default=None, help="Hub revision of the base model.")
    group.add_argument("--variant", default=None, help="Weights variant of the base model, e.g. fp16.")
    group.add_argument("--max_sequence_length", type=positive_int, default=None,
                       help="SD3 and Flux.1 (T5's), FLUX.2 and Z-Image (their LLM's): the prompt length in tokens "
                            "(default: 77 for SD3, 512 for Flux.1, FLUX.2 and Z-Image, as diffusers' scripts; short "
                            "captions train much faster with less); Qwen-Image: the prompt's tokens after its template "
                            "(512, as diffusers' script; at most 1024).")
    group.add_argument("--guidance_scale", type=positive_float, default=None,
                       help="Flux.1-dev, FLUX.2 dev and other guidance-distilled bases: the guidance the denoiser is "
                            "given while training (default 3.5, as diffusers' Flux and FLUX.2 scripts); a base "
                            "without a guidance embedding has no such input.")
    group.add_argument("--drop_t5", action="store_true",
                       help="SD3: without its T5 text encoder (zeros in its place, as StableDiffusion3Pipeline does "
                            "with text_encoder_3=None): less memory; a folder without text_encoder_3/ needs it.")
    group.add_argument("--gradient_checkpointing", action="store_true",
                       help="Less memory, slower steps (the backward recomputes the forward).")


def check_family_args(args, family):
    """One line for a flag that means nothing for the base's family; the family's defaults filled in (objective
    flags, the training guidance; T5's length once the tokenizer is loaded: family.text_length)."""
    from .objectives import check_objective_args

    check_objective_args(args, family)
    for flag, applies, what in (("max_sequence_length", family.MAX_SEQUENCE_LENGTH, "T5's prompt length"),
                                ("guidance_scale", family.TRAINING_GUIDANCE, "a guidance-distilled base's guidance"),
                                ("drop_t5", family.OPTIONAL_COMPONENTS, "SD3 without T5")):
        if getattr(args, flag, None) and applies is None:
            raise UserError(f"--{flag} ({what}) means nothing for a {family.NAME} base: leave it out")
    if family.TRAINING_GUIDANCE:  # only a guidance-distilled denoiser (config guidance_embeds) has the input
        path = args.pretrained_model_name_or_path
        config = getattr(args, "denoiser_config", None) or component_configs(
            path, (family.DENOISER,), args.revision, args.cache_dir).get(family.DENOISER, {})
        if config.get("guidance_embeds"):
            args.guidance_scale = args.guidance_scale or family.TRAINING_GUIDANCE
        elif args.guidance_scale is not None:
            raise UserError(f"--guidance_scale {args.guidance_scale:g}: the {family.DENOISER} of '{path}' has no "
                            "guidance embedding (it is not guidance-distilled, as Flux.1-dev is), so there is no "
                            "guidance input to train with: leave it out")
    if hasattr(args, "num_frames"):  # (the scripts that train on clips: common/video.py)
        from .video import check_video_args

        check_video_args(args, family, lambda: component_configs(args.pretrained_model_name_or_path, ("vae",),
                                                                 args.revision, args.cache_dir)["vae"])


def check_base_args(args, uses):
    """parse_args' checks of --pretrained_model_name_or_path: a complete pipeline folder of a known family (or a hub
    id), the family's flags, the training resolution. -> the family module, or None for a hub base (its
    model_index.json is fetched in main, where check_family_args runs again)."""
    from .families import load_family

    path, flag = args.pretrained_model_name_or_path, "--pretrained_model_name_or_path"
    check_pipeline_folder(path, flag)
    if not os.path.isdir(path):
        return None
    family = load_family(path, flag, uses=uses)
    check_components(path, flag, family, args.drop_t5)
    check_family_args(args, family)
    args.resolution = check_local_resolution(path, args.resolution, family)
    return family
