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

# model_index.json's pipeline class -> family module name
FAMILIES = {"StableDiffusionPipeline": "sd", "StableDiffusionXLPipeline": "sdxl",
            "StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux"}
NAMES = {"sd": "Stable Diffusion 1.x/2.x", "sdxl": "Stable Diffusion XL", "sd3": "Stable Diffusion 3",
         "flux": "Flux.1"}
DENOISERS = {"sd": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer"}  # each module's DENOISER
TWO_CLIPS = ("sdxl", "sd3")  # the families whose --train_text_encoder LoRAs are on two CLIP text encoders
# What a LoRA file's metadata says of its base (kohya's ss_base_model_version, ModelSpec's modelspec.architecture),
# by prefix, most specific first.
VERSION_PREFIXES = (("sdxl", "sdxl"), ("sd_v1", "sd"), ("sd_v2", "sd"), ("sd3", "sd3"), ("flux1", "flux"))
ARCHITECTURE_PREFIXES = (("stable-diffusion-xl", "sdxl"), ("stable-diffusion-v1", "sd"), ("stable-diffusion-v2", "sd"),
                         ("stable-diffusion-v3", "sd3"), ("stable-diffusion-3", "sd3"), ("flux-1", "flux"))
# Tensor names that only one family's LoRAs have (diffusers', kohya's and ComfyUI's names): SDXL's second text encoder
# (lora_te1_/lora_te2_ in kohya's files) and the sgm UNet's blocks and added embedding; Flux's single-stream blocks
# and its kohya names (double_blocks/single_blocks); SD 1.x/2.x's one text encoder under kohya's lora_te_. A file that
# names only blocks both SD3 and Flux have tells nothing.
KEY_PREFIXES = (
    ("sdxl", ("text_encoder_2.", "lora_te1_", "lora_te2_", "lora_unet_input_blocks_", "lora_unet_middle_block_",
              "lora_unet_output_blocks_", "lora_unet_label_emb_", "unet.add_embedding.", "add_embedding.")),
    ("flux", ("transformer.single_transformer_blocks.", "lora_unet_double_blocks_", "lora_unet_single_blocks_",
              "transformer.x_embedder.", "transformer.time_text_embed.guidance_embedder.")),
    ("sd3", ("transformer.pos_embed.", "text_encoder_3.")),
    ("sd", ("lora_te_",)),
)
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
    if name not in FAMILIES:
        raise UserError(f"{flag} '{path}': its model_index.json names the pipeline class {name!r}; {uses} "
                        f"{', '.join(FAMILIES)} bases ({', '.join(NAMES.values())})")
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
        if err.name != f"{__name__}.{name}":
            raise
        raise UserError(f"this copy of the recipes has no common/families/{name}.py, the module of "
                        f"{NAMES.get(name, name)} bases: copy it beside common/families/__init__.py") from None


def load_family(path, flag, revision=None, cache_dir=None, uses="train_lora.py trains"):
    """family_module(family_of(...)): the module of the base at `path`."""
    return family_module(family_of(path, flag, revision, cache_dir, uses))


def lora_family(metadata, keys):
    """-> (family name, why) of the base a LoRA file was made for, or (None, None) when the file does not tell: from
    its metadata (kohya's ss_base_model_version, ModelSpec's modelspec.architecture) when present, else from tensor
    names only one family has."""
    for key, prefixes in (("ss_base_model_version", VERSION_PREFIXES),
                          ("modelspec.architecture", ARCHITECTURE_PREFIXES)):
        value = metadata.get(key, "")
        for prefix, family in prefixes:
            if value.startswith(prefix):
                return family, f"its metadata says {key} {value}"
    for family, prefixes in KEY_PREFIXES:
        key = next((k for k in keys if k.startswith(prefixes)), None)
        if key:
            return family, f"its key {key} is {NAMES[family]}'s"
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
    family, why = lora_family(metadata, keys)
    if family is None and base_family is not None:  # no family named: a UNet LoRA on a transformer base, or back
        kind, base_kind = denoiser_kind(keys), DENOISERS[base_family]
        if kind and kind != base_kind:
            raise UserError(f"{flag} '{path}' adapts a {kind} (its keys start {sorted(keys)[0].split('.')[0]}...), "
                            f"but the base model '{base}' ({NAMES[base_family]}) has a {base_kind}; give a LoRA made "
                            "for this base")
    if family and base_family in NAMES and family != base_family:
        raise UserError(f"{flag} '{path}' is a {NAMES[family]} LoRA ({why}), but the base model '{base}' is "
                        f"{NAMES[base_family]}; give a LoRA made for this base, or a {NAMES[family]} base")


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
