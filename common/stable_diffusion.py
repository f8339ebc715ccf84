"""Stable Diffusion bases and their LoRAs: one-line errors for a folder that is not a pipeline, the training
resolution, an fp32 VAE decode, lora_info.json (which ties a LoRA to its base, so sample.py finds the base from the
LoRA alone), the LoRA checkpoint hooks (the peft adapter state), diffusers' pytorch_lora_weights.safetensors, the
kohya key format that A1111, ComfyUI and diffusers' own loader read, and the training metadata in the files' headers
(kohya's ss_* keys, ModelSpec's) with a summary of it for people."""
import json
import os

from .args import is_hub_id, torch_dtype
from .cli import UserError, first_line
from .sdxl import sgm_module_name

LORA_INFO = "lora_info.json"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' name: pipe.load_lora_weights(folder) finds it
PARTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
TINY_HINT = "`make tiny-sd` writes an offline tiny one to models/tiny-sd"
SHIPPED_BASE = "assets/tiny-sd-digits"  # the tiny base trained on the digits, in the repository
CHECKSUMS = "checksums.sha256"  # `sha256sum -c` format: a shipped folder's files, checked before each use


def check_sd_pipeline(path, flag):
    """A local folder must hold a StableDiffusionPipeline (and match its checksums.sha256, if it has one); anything
    else must look like a hub id (owner/name)."""
    if os.path.normpath(path) == SHIPPED_BASE and not os.path.isdir(path):
        raise UserError(f"{flag} '{path}' (the shipped tiny base) is missing: restore it (`git checkout -- {path}`) "
                        "or rebuild it (`make tiny-sd-base`)")
    if os.path.isdir(path):
        verify_checksums(path, flag)
        missing = [part for part in ("model_index.json", *PARTS) if not os.path.exists(os.path.join(path, part))]
        if missing:
            raise UserError(f"{flag} '{path}' is not a Stable Diffusion pipeline folder "
                            f"(no {', '.join(missing)}); {TINY_HINT}")
    elif not is_hub_id(path):
        raise UserError(f"{flag} '{path}' is neither a pipeline folder nor a hub id; {TINY_HINT}")


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
    fix = (f"restore it (`git checkout -- {folder}`) or rebuild it (`make tiny-sd-base`)"
           if os.path.abspath(folder) == os.path.abspath(SHIPPED_BASE) else "restore the folder")
    with open(listing) as f:
        for line in f:
            digest, name = line.strip().split(maxsplit=1)
            file = os.path.join(folder, name.lstrip("*"))
            if not os.path.isfile(file):
                raise UserError(f"{flag} '{folder}': {name} is missing (listed in {CHECKSUMS}); {fix}")
            if file_sha256(file) != digest:
                raise UserError(f"{flag} '{folder}': {name} has changed (its sha256 differs from {CHECKSUMS}); {fix}")


def check_resolution(resolution, vae_config, source):
    """Square training images must map onto whole latents: the side divisible by the VAE's downsampling factor
    (8 for Stable Diffusion; the pipeline refuses other sizes when sampling)."""
    factor = 2 ** (len(vae_config.get("block_out_channels", (0,) * 4)) - 1)
    if resolution % factor:
        near = sorted({max(factor, resolution // factor * factor), (resolution // factor + 1) * factor})
        raise UserError(f"--resolution {resolution} is not divisible by {factor}, the VAE's downsampling factor of "
                        f"{source}; use {' or '.join(map(str, near))}")


def training_resolution(resolution, vae_config, source):
    """-> (the resolution to train at, the base's native one). The native one is its VAE's sample_size (512 for SD
    1.5, 32 for the tiny base; None when the config has none); it is the default for `resolution` None."""
    native = vae_config.get("sample_size")
    native = native if isinstance(native, int) else None
    if resolution is None and native is None:
        raise UserError(f"the VAE config of {source} has no sample_size to take the training size from; "
                        "give --resolution")
    resolution = resolution or native
    check_resolution(resolution, vae_config, source)
    return resolution, native


def check_local_resolution(path, resolution):
    """training_resolution before anything loads, for a local pipeline folder (hub ids are checked once loaded).
    -> the resolution to train at: the given one, else the folder's native one; for a hub id the given one (or None)."""
    config_file = os.path.join(path, "vae", "config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            resolution, _ = training_resolution(resolution, json.load(f), f"'{path}'")
    return resolution


def base_resolution(path, resolution, revision=None, cache_dir=None):
    """training_resolution from the base's VAE config, local or hub (for a hub base only that file is fetched, before
    the data needs the size). -> (the resolution to train at, the native one or None)."""
    from diffusers import AutoencoderKL

    try:
        config = AutoencoderKL.load_config(path, subfolder="vae", revision=revision, cache_dir=cache_dir)
    except (OSError, ValueError) as err:
        raise load_error("--pretrained_model_name_or_path", path, err) from None
    return training_resolution(resolution, config, f"'{path}'")


def size_factor(path, revision=None, cache_dir=None, unet_config=None):
    """What every side of a training image is a multiple of under --buckets auto: the VAE's downsampling times the
    UNet's (64 for Stable Diffusion: 8 x 8; 8 for the tiny base), so that every level of the UNet sees whole pixels.
    `unet_config`: a UNet config (dict) that replaces the base's UNet. A local folder is read without diffusers."""
    files = [os.path.join(path, sub, "config.json") for sub in ("vae", "unet")]
    try:
        if all(os.path.isfile(f) for f in files):
            configs = []
            for f in files:
                with open(f) as handle:
                    configs.append(json.load(handle))
            vae, unet = configs
        else:
            from diffusers import AutoencoderKL, UNet2DConditionModel

            vae = AutoencoderKL.load_config(path, subfolder="vae", revision=revision, cache_dir=cache_dir)
            unet = UNet2DConditionModel.load_config(path, subfolder="unet", revision=revision, cache_dir=cache_dir)
    except (OSError, ValueError) as err:
        raise load_error("--pretrained_model_name_or_path", path, err) from None
    unet = unet_config or unet
    return 2 ** (len(vae["block_out_channels"]) - 1) * 2 ** (len(unet["block_out_channels"]) - 1)


def safetensors_header(path, flag):
    """The JSON header of a .safetensors file (an 8-byte length, then a table of tensors and `__metadata__`), read
    without torch so that a wrong or damaged file is reported at once."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100 * 2**20:
                raise ValueError("no safetensors header")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("no safetensors header")
    except (OSError, ValueError) as err:
        raise UserError(f"{flag} '{path}' is not a readable .safetensors file ({err}); give a LoRA saved as "
                        "safetensors (diffusers, peft or kohya format)") from None
    return header


def check_safetensors(path, flag):
    """A .safetensors file whose header reads. -> the tensor names it holds."""
    return [name for name in safetensors_header(path, flag) if name != "__metadata__"]


def load_error(flag, path, err):
    """UserError for a pipeline (part) that failed to load: the first line of the cause, and what to try."""
    hint = TINY_HINT if not os.path.isdir(path) else "is it a complete Stable Diffusion pipeline?"
    return UserError(f"{flag}: cannot load Stable Diffusion from '{path}': {first_line(err)} ({hint})")


def write_lora_info(folder, info):
    """info: base_model, revision, variant, rank, lora_alpha, target_modules, ... (JSON-able)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LORA_INFO)
    with open(path + ".tmp", "w") as f:
        json.dump(info, f, indent=2)
    os.replace(path + ".tmp", path)


def read_lora_info(folder):
    """The lora_info.json of a train_lora.py output or checkpoint folder, or None."""
    path = os.path.join(folder, LORA_INFO)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def decode_fp32(pipe, latents):
    """Latents -> PIL images with the pipeline's VAE in fp32 (an fp16 VAE overflows into black images: SD's, and
    SDXL's above all), through the pipeline's safety checker when it has one, as its own output_type="pil" would."""
    import torch

    vae = pipe.vae if pipe.vae.dtype == torch.float32 else pipe.vae.to(torch.float32)
    with torch.no_grad():
        image = vae.decode(latents.float() / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)).sample
        nsfw = None
        if hasattr(pipe, "run_safety_checker"):  # SDXL's pipeline has no safety checker
            image, nsfw = pipe.run_safety_checker(image, image.device, pipe.unet.dtype)
    denormalize = None if nsfw is None else [not flagged for flagged in nsfw]
    return pipe.image_processor.postprocess(image.float(), output_type="pil", do_denormalize=denormalize)


ADAPTER_FILE = "adapter_model.safetensors"
KOHYA_WEIGHTS = "pytorch_lora_weights_kohya.safetensors"


def save_lora_state(model, path):
    """Checkpoint save hook (`register_state_hooks(save_fn=...)`): the adapter's weights only, peft names."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(state, os.path.join(path, ADAPTER_FILE))


def lora_dtypes(mixed_precision):
    """accelerator.mixed_precision -> (dtype of the frozen weights, dtype of the trainable LoRA weights).

    The LoRA weights stay fp32 under any mixed precision: with fp16 ones the grad scaler fails ("Attempting to
    unscale FP16 gradients"), and bf16 ones lose the small updates. Pass the accelerator's value, never the flag's.
    """
    return torch_dtype(mixed_precision), torch_dtype("fp32")


def load_lora_state(model, path, dtype):
    """Checkpoint load hook: really set the adapter (a silent no-op would resume from the initial LoRA), then
    upcast it again to the trainable dtype."""
    from diffusers.training_utils import cast_training_params
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(os.path.join(path, ADAPTER_FILE)), adapter_name="default")
    problems = list(result.unexpected_keys) + [k for k in result.missing_keys if "lora_" in k]
    if problems:
        raise UserError(f"--resume_from_checkpoint: {path} does not fit this LoRA ({problems[0]} ...)")
    cast_training_params(model, dtype=dtype)


LORA_EMA_WEIGHTS = "lora_ema.safetensors"  # in a checkpoint of a --use_ema run: the EMA of the LoRA weights
LORA_EMA_STATE = "lora_ema.json"  # beside it: EMAModel's scalar state (optimization_step, decay, ...)


def save_lora_ema(ema, names, folder):
    """Checkpoint `extra_save`: an EMAModel of the LoRA weights as safetensors, each shadow under its parameter's
    name (`names`, in the order given to EMAModel), and its scalar state as JSON; no pickle."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    state = ema.state_dict()
    shadows = state.pop("shadow_params")
    save_file({name: p.detach().cpu().contiguous() for name, p in zip(names, shadows, strict=True)},
              os.path.join(folder, LORA_EMA_WEIGHTS))
    with open(os.path.join(folder, LORA_EMA_STATE), "w") as f:
        json.dump({**state, "cur_decay_value": ema.cur_decay_value}, f, indent=2)


def load_lora_ema(ema, names, folder, device):
    """Checkpoint `extra_load`: the EMAModel back as save_lora_ema wrote it, its shadows in fp32 on `device`."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(os.path.join(folder, LORA_EMA_WEIGHTS))
    with open(os.path.join(folder, LORA_EMA_STATE)) as f:
        state = json.load(f)
    if sorted(weights) != sorted(names) or any(weights[n].shape != p.shape for n, p in zip(names, ema.shadow_params)):
        odd = sorted(set(weights) ^ set(names)) or [n for n, p in zip(names, ema.shadow_params)
                                                       if weights[n].shape != p.shape]
        raise UserError(f"--resume_from_checkpoint: {folder}/{LORA_EMA_WEIGHTS} does not fit this LoRA ({odd[0]} ...)")
    cur_decay_value = state.pop("cur_decay_value", None)
    ema.load_state_dict({**state, "shadow_params": [weights[n].to(device, torch.float32) for n in names]})
    ema.cur_decay_value = cur_decay_value


def save_lora_weights(folder, lora_models, info, metadata=None):
    """lora_models: {"unet": ..., "text_encoder": ...} (peft-adapted, unwrapped). Writes
    pytorch_lora_weights.safetensors with `StableDiffusionPipeline.save_lora_weights` (the adapter configs ride
    along as diffusers' metadata, so alpha and DoRA load back), beside it the file for the UIs (ComfyUI, Forge,
    A1111: kohya's names with alphas and DoRA magnitudes, common/ui_lora.py) and lora_info.json. `metadata` ({str:
    str}, common/lora_metadata.py's lora_metadata) goes into the header of both files. Main process only."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from .ui_lora import DIFFUSERS_IMPLEMENTATION, SGM_IMPLEMENTATION, kohya_lora

    states = {name: get_peft_model_state_dict(model) for name, model in lora_models.items()}
    configs = {name: model.peft_config["default"].to_dict() for name, model in lora_models.items()}
    sdxl = is_sdxl_unet(lora_models["unet"].config)
    # The UI file first: a LoRA it cannot hold is one line before anything is written. SDXL: the sgm UNet's module
    # names and lora_te1/lora_te2, as kohya's SDXL files have them; CLIP under its `text_model.` level, which
    # transformers 5 dropped and kohya keeps.
    rename = (lambda module: sgm_module_name(module, lora_models["unet"].config)) if sdxl else None
    ui_weights = kohya_lora(states["unet"], info["lora_alpha"], "lora_unet", rename=rename)
    for name, prefix in (("text_encoder", "lora_te1" if sdxl else "lora_te"), ("text_encoder_2", "lora_te2")):
        if name in states:
            ui_weights.update(kohya_lora(states[name], info["lora_alpha"], prefix, "text_model."))
    text_layers = {f"{name}_lora_layers": {text_encoder_key(key): value for key, value in
                                           convert_state_dict_to_diffusers(states[name]).items()}
                   for name in ("text_encoder", "text_encoder_2") if name in states}
    header = {"format": "pt", **(metadata or {})}
    # diffusers writes its adapter metadata only with its own save function: the same entry, written here beside ours
    adapter_configs = {f"{name}.{key}": value for name, config in configs.items() for key, value in config.items()}
    header[LORA_ADAPTER_METADATA_KEY] = json.dumps(adapter_configs, indent=2, sort_keys=True, default=sorted)
    (StableDiffusionXLPipeline if sdxl else StableDiffusionPipeline).save_lora_weights(
        # The UNet's keys stay in peft's format (lora_A/lora_B): converted, attention layers get diffusers' old
        # names (lora.down/lora.up) while convolutions keep peft's, and the loader then drops the attention ones
        # without an error (a LoRA on attention and convolutions would load half applied).
        folder, weight_name=LORA_WEIGHTS, unet_lora_layers=states["unet"], **text_layers,
        save_function=lambda weights, path: save_file(weights, path, metadata=header))
    ui_header = {"format": "pt", **(metadata or {})}  # (no adapter configs: diffusers refuses them beside alphas)
    if "modelspec.implementation" in ui_header:  # whose module names the file uses, as kohya's files say
        ui_header["modelspec.implementation"] = SGM_IMPLEMENTATION if sdxl else DIFFUSERS_IMPLEMENTATION
    save_file(ui_weights, os.path.join(folder, KOHYA_WEIGHTS), metadata=ui_header)
    write_lora_info(folder, info)


def is_sdxl_unet(unet_config):
    """An SDXL UNet: conditioned on the pooled text embedding and the time ids as well."""
    return unet_config.get("addition_embed_type") == "text_time"


def lora_file_metadata(path):
    """The `__metadata__` of a LoRA .safetensors file (or of a folder's pytorch_lora_weights.safetensors), without
    torch; {} for a hub id or a file without any."""
    file = os.path.join(path, LORA_WEIGHTS) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        return {}
    metadata = safetensors_header(file, "--lora").get("__metadata__")
    return {str(key): str(value) for key, value in metadata.items()} if isinstance(metadata, dict) else {}


def describe_lora(metadata):
    """A few lines for people from a LoRA file's metadata: train_lora.py's keys, else kohya's ss_* and ModelSpec's
    (LoRAs from kohya's sd-scripts and the tools that follow it). [] when it holds none of them."""
    get = metadata.get
    lines = []
    base, version = get("base_model") or get("ss_sd_model_name"), get("ss_base_model_version")
    resolution = get("modelspec.resolution") or get("ss_resolution")
    if base or version or resolution:
        lines.append(f"base model: {base or 'unknown'}" + (f" ({version})" if version else "")
                     + (f", trained at {resolution}" if resolution else ""))
    rank, alpha = get("rank") or get("ss_network_dim"), get("lora_alpha") or get("ss_network_alpha")
    if rank:
        targets = get("target_modules")
        lines.append(f"rank {rank}, alpha {alpha or rank}" + (f", on {targets.replace(',', ', ')}" if targets else "")
                     + ((" and both text encoders" if (version or "").startswith("sdxl") else " and the text encoder")
                        if get("text_encoder_target_modules") else ""))
    steps, total = get("ss_steps"), get("ss_max_train_steps")
    if steps or total:
        dataset = get("dataset") or ", ".join(json_keys(get("ss_dataset_dirs")))
        images = get("ss_num_train_images")
        lines.append(f"trained {steps or '?'}" + (f" of {total}" if total and total != steps else "") + " steps"
                     + (f" on {dataset}" if dataset else "") + (f" ({images} images)" if images else "")
                     + (f", learning rate {get('ss_learning_rate')}" if get("ss_learning_rate") else "")
                     + (f", {get('ss_optimizer')}" if get("ss_optimizer") else ""))
    trigger = get("modelspec.trigger_phrase") or get("trigger")
    if trigger:
        lines.append(f"trigger: {trigger} (put it in the prompt)")
    return lines


def json_keys(text):
    """The keys of a JSON object in a metadata string (kohya's ss_dataset_dirs); [] for anything else."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return []
    return list(value) if isinstance(value, dict) else []


def text_encoder_key(key):
    """A text-encoder key as diffusers' training scripts write it for CLIP, under `text_model.`: transformers 4's
    CLIPTextModel has that level, transformers 5's does not (diffusers' loader strips it for such a model). A DoRA
    magnitude as `...lora_magnitude_vector.weight`, the name transformers' load_adapter (where `load_lora_weights`
    sends the text encoder's keys) matches: peft's own name lacks the `.weight`, and load_adapter drops it."""
    key = key if key.startswith("text_model.") else "text_model." + key
    return key + ".weight" if key.endswith(".lora_magnitude_vector") else key


def idle_frozen_models(cache_latents, text_cached, validation_prompts):
    """Which frozen models the rest of the run does not use, once the caches are made: the VAE when the latents are
    cached, the text encoder when the prompt embeddings are; neither when validation images are drawn (the pipeline
    encodes the prompts and decodes the latents). The held-out loss encodes its images and prompts when it is built,
    before this."""
    if validation_prompts:
        return []
    return [name for name, idle in (("vae", cache_latents), ("text_encoder", text_cached)) if idle]


def offload_idle_models(accelerator, logger, args, vae, text_encoder, text_cached):
    """Move the frozen models that `idle_frozen_models` finds idle to the CPU (the device memory they held goes to
    training), with a log line; call it after the caches and the held-out loss are made. Saving the pipeline
    afterwards reads them from the CPU. text_encoder: one, or a list (SDXL's two). Returns the names moved."""
    models = {"vae": [vae], "text_encoder": text_encoder if isinstance(text_encoder, list) else [text_encoder]}
    idle = idle_frozen_models(args.cache_latents, text_cached, args.validation_prompt)
    for name in idle:
        for model in models[name]:
            model.to("cpu")
    if idle:
        shown = {"vae": "the VAE", "text_encoder": "the text encoder"}
        logger.info(f"{' and '.join(shown[n] for n in idle)} moved to the CPU: the cached latents and prompt "
                    "embeddings leave nothing for them to do (no --validation_prompt)")
    return idle


def validation_images(args, accelerator, parts, scheduler, step, sizes=None):
    """Images of the validation prompts from the current weights (main process; the others wait), saved under
    samples/step-N/ and logged to the trackers (a row per prompt, and per size: `sizes` [(height, width)], default
    the pipeline's own). parts: the pipeline's vae, unet, tokenizer(s) and text encoder(s) (unwrapped), by their
    pipeline names; with a text_encoder_2 an SDXL pipeline. The VAE decodes in fp32, outside autocast."""
    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    from .diffusion import image_grid, sampling_scheduler
    from .reporting import log_image

    paths = []
    if accelerator.is_main_process:
        scheduler = sampling_scheduler(args.validation_scheduler, scheduler.config)
        if "text_encoder_2" in parts:
            pipe = StableDiffusionXLPipeline(**parts, scheduler=scheduler)
        else:
            pipe = StableDiffusionPipeline(**parts, scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                           requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        models = [model for model in parts.values() if isinstance(model, torch.nn.Module)]
        modes = [model.training for model in models]
        for model in models:
            model.eval()
        folder = os.path.join(args.output_dir, "samples", f"step-{step}")
        os.makedirs(folder, exist_ok=True)
        for p, prompt in enumerate(args.validation_prompt):
            for s, (height, width) in enumerate(sizes or [(None, None)]):
                generators = [torch.Generator().manual_seed(args.seed + j) for j in range(args.num_validation_images)]
                with torch.no_grad(), accelerator.autocast():
                    latents = pipe([prompt] * len(generators), num_inference_steps=args.validation_inference_steps,
                                   guidance_scale=args.validation_guidance_scale, generator=generators,
                                   height=height, width=width, output_type="latent").images
                images = decode_fp32(pipe, latents)
                size = f"-{width}x{height}" if s else ""  # the first size keeps the plain names
                for j, image in enumerate(images):
                    paths.append(os.path.join(folder, f"{p}-{j}{size}.png"))
                    image.save(paths[-1])
                log_image(accelerator, f"validation/{p}{size}", image_grid(images, ncol=len(images)), step)
        for model, mode in zip(models, modes):
            model.train(mode)
    accelerator.wait_for_everyone()
    return paths
