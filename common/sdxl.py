"""What Stable Diffusion XL adds to SD 1.x/2.x for a LoRA recipe: the base's pipeline class (from model_index.json),
its prompt embedding (two CLIP text encoders: both penultimate hidden states side by side, and the second's pooled,
projected embedding), and the kohya names of its UNet's modules (kohya's SDXL files name the original "sgm" UNet's
modules, input_blocks/middle_block/output_blocks, which A1111 and ComfyUI map; diffusers' loader maps them back).

The six size "time ids" of each training image (original size, crop top-left, target size) come from
common/image_data.py's ImageDataset.time_ids."""
import json
import os
import re

from .cli import UserError

PIPELINE_CLASSES = {"StableDiffusionPipeline": "sd", "StableDiffusionXLPipeline": "sdxl"}
KIND_NAMES = {"sd": "Stable Diffusion 1.x/2.x", "sdxl": "Stable Diffusion XL"}
TEXT_ENCODERS = {"sd": ("text_encoder",), "sdxl": ("text_encoder", "text_encoder_2")}


def pipeline_kind(path, flag, revision=None, cache_dir=None, uses="train_lora.py trains"):
    """-> "sd" (StableDiffusionPipeline: SD 1.x/2.x) or "sdxl" (StableDiffusionXLPipeline), from the base's
    model_index.json (a local folder's without diffusers; a hub base's fetched alone); any other class is one line
    (`uses`: who refuses it, "sample.py draws from")."""
    index_file = os.path.join(path, "model_index.json")
    try:
        if os.path.isfile(index_file):
            with open(index_file) as f:
                index = json.load(f)
        else:
            from diffusers import DiffusionPipeline

            index = DiffusionPipeline.load_config(path, revision=revision, cache_dir=cache_dir)
    except (OSError, ValueError) as err:
        from .stable_diffusion import load_error

        raise load_error(flag, path, err) from None
    name = index.get("_class_name") if isinstance(index, dict) else None
    if name not in PIPELINE_CLASSES:
        raise UserError(f"{flag} '{path}': its model_index.json names the pipeline class {name!r}; {uses} "
                        f"{' and '.join(PIPELINE_CLASSES)} bases (SD 1.x/2.x and SDXL)")
    return PIPELINE_CLASSES[name]


# Keys only an SDXL LoRA has: the second text encoder (diffusers' name; kohya's lora_te1_/lora_te2_), the sgm UNet's
# blocks (kohya's SDXL names; its SD 1.x/2.x files use diffusers' down_blocks/up_blocks) and the UNet's added
# embedding of the pooled text and the time ids (add_embedding; label_emb in sgm). Only SD 1.x/2.x's kohya files
# name their one text encoder lora_te_.
SDXL_KEYS = ("text_encoder_2.", "lora_te1_", "lora_te2_", "lora_unet_input_blocks_", "lora_unet_middle_block_",
             "lora_unet_output_blocks_", "lora_unet_label_emb_", "unet.add_embedding.", "add_embedding.")


def lora_kind(metadata, keys):
    """-> (kind, why): the base a LoRA file was made for, "sd" (SD 1.x/2.x) or "sdxl", and how that shows; (None,
    None) when the file does not tell. From its metadata (kohya's ss_base_model_version, ModelSpec's
    modelspec.architecture) when present, else from its tensor names."""
    version = metadata.get("ss_base_model_version", "")
    architecture = metadata.get("modelspec.architecture", "")
    for key, value, sdxl, sd in (("ss_base_model_version", version, ("sdxl",), ("sd_v1", "sd_v2")),
                                 ("modelspec.architecture", architecture, ("stable-diffusion-xl",),
                                  ("stable-diffusion-v1", "stable-diffusion-v2"))):
        if value.startswith(sdxl) or value.startswith(sd):
            return ("sdxl" if value.startswith(sdxl) else "sd"), f"its metadata says {key} {value}"
    sdxl_key = next((key for key in keys if key.startswith(SDXL_KEYS)), None)
    if sdxl_key:
        return "sdxl", f"its key {sdxl_key} is SDXL's"
    sd_key = next((key for key in keys if key.startswith("lora_te_")), None)
    if sd_key:
        return "sd", f"its key {sd_key} names SD 1.x/2.x's one text encoder"
    return None, None


def folder_kind(path):
    """"sd" or "sdxl" for a local pipeline folder whose model_index.json names StableDiffusionPipeline or
    StableDiffusionXLPipeline; None for anything else (another pipeline, a hub id), without an error."""
    try:
        with open(os.path.join(path, "model_index.json")) as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    return PIPELINE_CLASSES.get(index.get("_class_name")) if isinstance(index, dict) else None


def check_lora_base(flag, path, metadata, keys, base, base_kind):
    """A LoRA file that says it was made for the other kind of base than `base_kind` ("sd"/"sdxl"; None: unknown)
    is one line, before anything loads."""
    kind, why = lora_kind(metadata, keys)
    if kind and base_kind in KIND_NAMES and kind != base_kind:
        raise UserError(f"{flag} '{path}' is a {KIND_NAMES[kind]} LoRA ({why}), but the base model '{base}' is "
                        f"{KIND_NAMES[base_kind]}; give a LoRA made for this base, or a {KIND_NAMES[kind]} base")


def embed_prompts(text_encoders, input_ids):
    """Token ids (one tensor per text encoder) -> (encoder hidden states, pooled embedding or None), as the pipelines
    embed a prompt: SD's last hidden state; SDXL's penultimate hidden states of both encoders, concatenated, and the
    second encoder's projected pooled output (`text_embeds`)."""
    import torch

    if len(text_encoders) == 1:
        return text_encoders[0](input_ids[0])[0], None
    states, pooled = [], None
    for encoder, ids in zip(text_encoders, input_ids, strict=True):
        output = encoder(ids, output_hidden_states=True)
        states.append(output.hidden_states[-2])
        pooled = output[0]  # CLIPTextModelWithProjection's text_embeds (the last encoder's)
    return torch.cat(states, dim=-1), pooled


def text_encoder_targets(name, encoder, kind, targets):
    """The modules of text encoder `name` that get LoRA: those matching `targets`, except, for SDXL's first encoder,
    those of its last layer, whose output nothing reads (the UNet takes the penultimate hidden states, the pooled
    embedding comes from the second encoder): LoRA there would never train, and several processes (DDP) stop on
    parameters that get no gradient."""
    if not (kind == "sdxl" and name == "text_encoder"):
        return targets
    last = f"layers.{encoder.config.num_hidden_layers - 1}."
    return [module for module, _ in encoder.named_modules()
            if any(module.endswith("." + t) for t in targets) and last not in module]


RESNET_PARTS = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
                "conv_shortcut": "skip_connection", "norm1": "in_layers.0", "norm2": "out_layers.0"}
TOP_LEVEL = {"conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
             "time_embedding.linear_1": "time_embed.0",
             "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
             "add_embedding.linear_2": "label_emb.0.2"}


def sgm_module_name(module, unet_config):
    """A diffusers UNet module path of an SDXL base -> the same module's path in the sgm UNet (what kohya's SDXL LoRA
    files name): down block b's layer l is input_blocks[1 + b * (L + 1) + l] (L: layers per block), its downsampler
    the block's last input block; the mid block is middle_block 0-2; up block b's layer l is
    output_blocks[b * (L + 1) + l], its upsampler that block's index 2 (1 without attention). In each, index 0 is the
    ResNet (whose layers have other names), 1 the transformer."""
    for name, sgm in TOP_LEVEL.items():
        if module == name or module.startswith(name + "."):
            return sgm + module[len(name):]
    per_block = unet_config["layers_per_block"] + 1
    match = re.fullmatch(r"(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)",
                         module)
    mid = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", module)
    if match:
        kind, block, part, layer, rest = match.groups()
        block, layer = int(block), int(layer)
        if kind == "down_blocks":
            if part == "downsamplers":
                return f"input_blocks.{1 + block * per_block + per_block - 1}.0.{rest.replace('conv', 'op', 1)}"
            index, inner = 1 + block * per_block + layer, 0 if part == "resnets" else 1
        else:
            if part == "upsamplers":
                has_attention = "CrossAttn" in unet_config["up_block_types"][block]
                return f"output_blocks.{block * per_block + per_block - 1}.{2 if has_attention else 1}.{rest}"
            index, inner = block * per_block + layer, 0 if part == "resnets" else 1
        prefix = "input_blocks" if kind == "down_blocks" else "output_blocks"
        return f"{prefix}.{index}.{inner}.{resnet_part(rest) if part == 'resnets' else rest}"
    if mid:
        part, layer, rest = mid.groups()
        if part == "attentions":
            return f"middle_block.1.{rest}"
        return f"middle_block.{2 * int(layer)}.{resnet_part(rest)}"
    raise ValueError(f"kohya export: no sgm name for the SDXL UNet module '{module}'")


def resnet_part(rest):
    first, _, tail = rest.partition(".")
    return RESNET_PARTS.get(first, first) + (f".{tail}" if tail else "")
