"""The model families the latent diffusion recipes train and sample, and which family a base or a LoRA belongs to.

A family is a module of this package with the same small set of names (see sd.py, the reference): what its pipeline
holds, how it loads, how it embeds prompts, how its denoiser is called, what it learns (common/objectives.py) and how
its LoRAs are saved. The recipes (train_lora.py, train_text_to_image.py, sample.py, inspect_pipeline.py) call those
names and keep no family branches of their own. This module is the only code that reads a base's model_index.json.

A recipe copied into another project needs, besides the common/ files its docstring lists, only the module of its
base's family: `family_module` imports the one a base needs, by name, when it is first asked for.
"""
import importlib
import json
import os

from ..cli import UserError, first_line

# The registry: model_index.json's pipeline class -> the family module that trains and draws it, one line a family.
# The most specific family first: a LoRA file that names no base is matched against the families in this order.
# Everything else about a family (its name, denoiser, the names in its LoRA files) is in its own module.
FAMILIES = {"StableDiffusionXLPipeline": "sdxl", "Flux2KleinPipeline": "flux2_klein", "Flux2Pipeline": "flux2",
            "FluxPipeline": "flux", "FluxKontextPipeline": "flux", "StableDiffusion3Pipeline": "sd3",
            "QwenImagePipeline": "qwen_image", "ZImagePipeline": "z_image", "WanPipeline": "wan",
            "WanImageToVideoPipeline": "wan", "StableDiffusionPipeline": "sd"}
# Known bases a family refuses, with its module's NO_REFERENCES as the reason.
REFUSED = {"QwenImageEditPipeline": "qwen_image", "QwenImageEditPlusPipeline": "qwen_image"}
UNET_PREFIXES = ("unet.", "lora_unet_down_blocks_", "lora_unet_up_blocks_", "lora_unet_mid_block_")
TRANSFORMER_PREFIXES = ("transformer.", "lora_transformer_")


def read_model_index(path, flag, revision=None, cache_dir=None):
    """A base's model_index.json as a dict: a local folder's read as JSON (no diffusers import), a hub base's fetched
    alone. One line for a missing or unreadable one."""
    index_file = os.path.join(path, "model_index.json")
    try:
        if os.path.isfile(index_file):
            with open(index_file) as f:
                index = json.load(f)
        elif os.path.isdir(path):
            raise UserError(f"{flag} '{path}' has no model_index.json: give a diffusers pipeline folder (a "
                            "from_pretrained/save_pretrained layout)")
        else:
            from diffusers import DiffusionPipeline

            index = DiffusionPipeline.load_config(path, revision=revision, cache_dir=cache_dir)
    except (OSError, ValueError) as err:
        if os.path.isdir(path):
            raise UserError(f"{flag} '{path}': its model_index.json does not read ({first_line(err)})") from None
        raise UserError(f"{flag}: cannot load the base model '{path}': {first_line(err)} (`make tiny-sd` writes an "
                        "offline tiny one to models/tiny-sd)") from None
    if not isinstance(index, dict):
        raise UserError(f"{flag} '{path}': its model_index.json is not a JSON object")
    return index


def family_of(path, flag, revision=None, cache_dir=None, uses="train_lora.py trains"):
    """The family name ("sd", "sdxl", "sd3", "flux") of the base at `path`, from its model_index.json's pipeline
    class; any other class is one line (`uses`: who refuses it, e.g. "sample.py draws from")."""
    name = read_model_index(path, flag, revision, cache_dir).get("_class_name")
    if name in REFUSED:  # a known base that its family's module refuses, with its reason
        raise UserError(f"{flag} '{path}' is a {name} base: {family_module(REFUSED[name]).NO_REFERENCES}")
    if name not in FAMILIES:
        raise UserError(f"{flag} '{path}': its model_index.json names the pipeline class {name!r}; {uses} "
                        f"{', '.join(FAMILIES)} bases")
    return FAMILIES[name]


def folder_family(path):
    """The family name of a local pipeline folder, or None (another pipeline, a hub id, no folder), without an
    error."""
    try:
        with open(os.path.join(path, "model_index.json")) as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    return FAMILIES.get(index.get("_class_name")) if isinstance(index, dict) else None


def family_module(name):
    """The module of family `name`, imported on first use (a recipe copied with only its base's family module runs)."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith(f"{__name__}."):
            raise
        missing = err.name.rpartition(".")[2]  # this family's module, or a family module it builds on
        pipelines = ", ".join(p for p, module in FAMILIES.items() if module == name) or name
        needs = f"common/families/{name}.py needs common/families/{missing}.py" if missing != name else \
            f"this copy of the recipes has no common/families/{name}.py"
        raise UserError(f"{needs}, the module of {pipelines} bases: copy it beside common/families/__init__.py") \
            from None


def load_family(path, flag, revision=None, cache_dir=None, uses="train_lora.py trains", expert=False):
    """family_module(family_of(...)): the module of the base at `path`; `expert`: where the script trains a LoRA of
    an expert (Wan 2.2 A14B), --wan_expert's value (None: not given), and the result is the family as it trains that
    expert (the module's expert_family; itself for a base with one denoiser)."""
    module = family_module(family_of(path, flag, revision, cache_dir, uses))
    pick = getattr(module, "expert_family", None)
    return pick(path, expert, revision, cache_dir) if pick and expert is not False else module


def known_families():
    """The family modules this copy of the recipes has, in FAMILIES' order (a copy may hold only its base's)."""
    modules = []
    for name in dict.fromkeys(FAMILIES.values()):
        try:
            modules.append(family_module(name))
        except UserError:
            continue
    return modules


def family_name(name):
    """A family's name for people ("Flux.1"), or its module name when this copy does not have its module."""
    try:
        return family_module(name).NAME
    except UserError:
        return name


def matched_prefix(key, prefixes):
    """The first of `prefixes` a tensor name starts with (a `*` in a prefix stands for any block number), or None."""
    import fnmatch

    return next((prefix for prefix in prefixes
                 if (fnmatch.fnmatchcase(key, prefix + "*") if "*" in prefix else key.startswith(prefix))), None)


def lora_family(metadata, keys, prefer=None):
    """-> (family name, why) of the base a LoRA file was made for, or (None, None) when the file does not tell: from
    its metadata (each family's LORA_METADATA: kohya's ss_base_model_version, ModelSpec's modelspec.architecture)
    when present, else from tensor names only one family has (each family's LORA_KEY_PREFIXES; a prefix that several
    families declare, as FLUX.2 dev and klein do, names the family `prefer` when it is one of them)."""
    families = known_families()
    for key in ("ss_base_model_version", "modelspec.architecture"):
        value = metadata.get(key, "")
        for family in families:
            if value and value.startswith(family.LORA_METADATA.get(key, ())):
                return family.KEY, f"its metadata says {key} {value}"
    for family in families:
        for key in keys:
            prefix = matched_prefix(key, family.LORA_KEY_PREFIXES)
            if prefix is None:
                continue
            shared = next((f for f in families if f.KEY == prefer and prefix in f.LORA_KEY_PREFIXES), family)
            return shared.KEY, f"its key {key} is {shared.NAME}'s"
    return None, None


def denoiser_kind(keys):
    """"unet" or "transformer": what a LoRA file's tensor names adapt (diffusers', kohya's, ComfyUI's names), or
    None."""
    if any(k.startswith(UNET_PREFIXES) for k in keys):
        return "unet"
    if any(k.startswith(TRANSFORMER_PREFIXES) for k in keys):
        return "transformer"
    return None


def check_lora_base(flag, path, metadata, keys, base, base_family):
    """A LoRA file that says it was made for another family than `base_family` (None: unknown) is one line, before
    anything loads."""
    family, why = lora_family(metadata, keys, prefer=base_family)
    if family is None and base_family is not None:  # no family named: a UNet LoRA on a transformer base, or back
        kind, base_kind = denoiser_kind(keys), family_module(base_family).DENOISER
        if kind and kind != base_kind:
            raise UserError(f"{flag} '{path}' adapts a {kind} (its keys start {sorted(keys)[0].split('.')[0]}...), "
                            f"but the base model '{base}' ({family_name(base_family)}) has a {base_kind}; give a LoRA "
                            "made for this base")
    if family and base_family in FAMILIES.values() and family != base_family:
        raise UserError(f"{flag} '{path}' is a {family_name(family)} LoRA ({why}), but the base model '{base}' is "
                        f"{family_name(base_family)}; give a LoRA made for this base, or a {family_name(family)} "
                        "base")


# What several families share, named by each family module that has it (`guidance_kwargs = classifier_free_guidance`).
def classifier_free_guidance(denoiser_config, scale, batch):
    """A pipeline call's guidance at `scale`: classifier-free, the unconditional branch above 1. -> (the call's
    arguments, whether it needs the unconditional embeddings)."""
    return {"guidance_scale": scale}, scale > 1


def embedding_kwargs(cond, uncond):
    """A pipeline call's arguments for embeddings computed beforehand (cond; uncond: the empty prompt's, or None)."""
    kwargs = {"prompt_embeds": cond["prompt_embeds"]}
    if "pooled_prompt_embeds" in cond:
        kwargs["pooled_prompt_embeds"] = cond["pooled_prompt_embeds"]
    if uncond is not None:
        kwargs["negative_prompt_embeds"] = uncond["prompt_embeds"]
        if "pooled_prompt_embeds" in uncond:
            kwargs["negative_pooled_prompt_embeds"] = uncond["pooled_prompt_embeds"]
    return kwargs


def vae_latents(vae):
    """What turns the VAE's latents into the denoiser's, for common/vae.py's normalize and denormalize: the VAE's own
    config (shift_factor and scaling_factor, or per-channel latents_mean and latents_std). A family whose pipeline
    does more (FLUX.2's 2 x 2 patches and batch-norm statistics) gives its own dict of the same keys."""
    return dict(vae.config)


def latents_as_they_are(pipe, latents, height, width):
    """A pipeline's output_type="latent" result is already [B, C, h, w] for the VAE."""
    return latents


def every_target(name, encoder, targets):
    """Every module of the text encoder that matches the targets gets LoRA."""
    return list(targets)


def no_t5(components, requested=None, training=False):
    """No T5: CLIP's 77 tokens."""
    return None


def no_empty_prompt_zeros(index):
    """The pipeline embeds "" for the unconditional branch (caption dropout trains on that embedding)."""
    return False


def t5_text_length(tokenizer, requested, default):
    """T5's prompt length: the requested one, else `default`, capped by the T5 tokenizer's model_max_length (a base
    trained on short prompts says so there, as the tiny digits base does)."""
    if requested:
        return requested
    return min(default, getattr(tokenizer, "model_max_length", None) or default)


def vae_native_resolution(configs):
    """The base's own image size: its VAE's sample_size (512 for SD 1.5, 1024 for SDXL and Flux.1), or None."""
    from ..vae import vae_sample_size

    return vae_sample_size(configs["vae"])


def vae_resolution_factor(configs):
    """What an image side must be a multiple of: the VAE's downsampling factor (8)."""
    from ..vae import vae_factor

    return vae_factor(configs["vae"])


def unet_sample_size(pipe):
    """(height, width) the pipeline draws at by default: its UNet's sample_size in pixels."""
    size = pipe.unet.config.sample_size * pipe.vae_scale_factor
    return size, size


def unet_size_factor(configs):
    """What every side of a training image is a multiple of for buckets: the VAE's downsampling times the UNet's (64
    for SD 1.5 and SDXL: 8 x 8; 8 for the tiny base), so that every level of the UNet sees whole pixels."""
    from ..vae import vae_factor

    return vae_factor(configs["vae"]) * 2 ** (len(configs["unet"]["block_out_channels"]) - 1)
