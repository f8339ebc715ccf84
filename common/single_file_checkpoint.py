"""A Stable Diffusion pipeline as one single-file checkpoint: the original (CompVis / Stability) key layout in one
.safetensors file, what ComfyUI's and A1111/Forge's checkpoint loaders read and diffusers' `from_single_file` reads
back. The UNet under `model.diffusion_model.` (the ldm/sgm UNet's names: common/sgm_names.py), the VAE
under `first_stage_model.`; the text encoder under `cond_stage_model.transformer.text_model.` (OpenAI's CLIP, SD 1.x,
in transformers' names) or `cond_stage_model.model.` (OpenCLIP's layout, SD 2.x); SDXL's two under
`conditioner.embedders.0.transformer.text_model.` and `conditioner.embedders.1.model.`. Every weight keeps its
values: keys are renamed, the VAE's attention projections become 1x1 convolutions, OpenCLIP's q, k and v one fused
projection, its text projection the transpose of transformers' (a matrix applied from the right)."""
import json
import logging
import os
import re

from .cli import UserError
from .sgm_names import sgm_module_name

UNET_PREFIX, VAE_PREFIX = "model.diffusion_model.", "first_stage_model."
CLIP_PREFIX = {"sd": "cond_stage_model.transformer.text_model.",
               "sdxl": "conditioner.embedders.0.transformer.text_model."}
OPEN_CLIP_PREFIX = {"sd": "cond_stage_model.model.", "sdxl": "conditioner.embedders.1.model."}
LAYOUT = "the original Stable Diffusion layout (what ComfyUI and A1111 read)"

# What the original UNet has: ResNet levels with or without cross-attention, one mid block (ResNet, attention,
# ResNet), SDXL's added embedding of the pooled text and the size ids. Any other part has no name there.
DOWN_BLOCKS, UP_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D"), ("CrossAttnUpBlock2D", "UpBlock2D")
UNET_DEFAULTS = {"mid_block_type": "UNetMidBlock2DCrossAttn", "class_embed_type": None, "num_class_embeds": None,
                 "encoder_hid_dim": None, "time_cond_proj_dim": None, "time_embedding_type": "positional",
                 "dual_cross_attention": False, "only_cross_attention": False, "resnet_time_scale_shift": "default",
                 "timestep_post_act": None, "time_embedding_dim": None, "class_embeddings_concat": False}

# The architectures the UIs recognise in a checkpoint (ComfyUI: comfy/supported_models.py's SD15, SD20, SDXL; their
# configs as in the public diffusers folders) and what they then assume of the parts a checkpoint does not store.
STANDARD = {
    "SD 1.x": {"unet": dict(cross_attention_dim=768, block_out_channels=[320, 640, 1280, 1280], layers_per_block=2,
                            attention_head_dim=8, use_linear_projection=False), "scaling_factor": 0.18215},
    "SD 2.x": {"unet": dict(cross_attention_dim=1024, block_out_channels=[320, 640, 1280, 1280], layers_per_block=2,
                            attention_head_dim=[5, 10, 20, 20], use_linear_projection=True),
               "scaling_factor": 0.18215},
    "SDXL": {"unet": dict(cross_attention_dim=2048, block_out_channels=[320, 640, 1280], layers_per_block=2,
                          attention_head_dim=[5, 10, 20], transformer_layers_per_block=[1, 2, 10],
                          use_linear_projection=True, addition_embed_type="text_time"), "scaling_factor": 0.13025},
}
SD_SCHEDULE = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}

logger = logging.getLogger(__name__)


def layers_per_block(config, flag, what="the UNet"):
    """The original layout numbers its blocks with one count of layers per level."""
    layers = config.get("layers_per_block", 2 if what == "the UNet" else 1)
    if isinstance(layers, (list, tuple)):
        if len(set(layers)) != 1:
            raise UserError(f"{flag}: {what}'s layers_per_block {list(layers)} differs from level to level, and "
                            f"{LAYOUT} has one count for all levels")
        layers = layers[0]
    return layers


def check_unet_config(config, flag):
    """A UNet2DConditionModel config whose weights all have a name in the original layout; else one line."""
    wrong = [f"{key} {config[key]!r}" for key, default in UNET_DEFAULTS.items()
             if key in config and config[key] != default]
    wrong += [f"a {name}" for name in config.get("down_block_types", ()) if name not in DOWN_BLOCKS]
    wrong += [f"a {name}" for name in config.get("up_block_types", ()) if name not in UP_BLOCKS]
    if config.get("addition_embed_type") not in (None, "text_time"):
        wrong.append(f"addition_embed_type {config['addition_embed_type']!r}")
    if wrong:
        raise UserError(f"{flag}: the UNet has {', '.join(wrong)}, which {LAYOUT} cannot hold; it holds SD 1.x/2.x "
                        "and SDXL UNets (CrossAttn/plain Down and Up blocks, UNetMidBlock2DCrossAttn)")
    layers_per_block(config, flag)


def check_vae_config(config, flag):
    kinds = set(config.get("down_block_types", ())) | set(config.get("up_block_types", ()))
    if config.get("_class_name", "AutoencoderKL") != "AutoencoderKL" or kinds - {"DownEncoderBlock2D",
                                                                                  "UpDecoderBlock2D"}:
        raise UserError(f"{flag}: the VAE ({config.get('_class_name')} with {sorted(kinds)}) is not Stable "
                        f"Diffusion's AutoencoderKL, which {LAYOUT} holds")
    layers_per_block(config, flag, "the VAE")


def check_text_config(config, flag, name="text_encoder"):
    architectures = config.get("architectures") or [config.get("model_type")]
    if not set(architectures) & {"CLIPTextModel", "CLIPTextModelWithProjection", "clip_text_model"}:
        raise UserError(f"{flag}: {name} is {architectures[0]}, not a CLIP text encoder, which {LAYOUT} holds")


def check_single_file_base(base, flag, unet_config=None):
    """Before training: the configs of a local pipeline folder (the UNet's: `unet_config` when given) fit the
    layout. A hub base's are checked when its models are converted."""
    def read(part):
        file = os.path.join(base, part, "config.json")
        if not os.path.isfile(file):
            return None
        with open(file) as f:
            return json.load(f)

    unet_config = unet_config or read("unet")
    if unet_config is not None:
        check_unet_config(unet_config, flag)
    if os.path.isdir(base):
        check_vae_config(read("vae") or {}, flag)
        for name in ("text_encoder", "text_encoder_2"):
            config = read(name)
            if config is not None:
                check_text_config(config, flag, name)


def unet_weights(state, config, flag):
    """diffusers UNet2DConditionModel weights -> the ldm/sgm UNet's, under model.diffusion_model."""
    check_unet_config(config, flag)
    config = {**config, "layers_per_block": layers_per_block(config, flag)}
    out = {}
    for key, tensor in state.items():
        module, _, param = key.rpartition(".")
        try:
            name = sgm_module_name(module, config)
        except ValueError:
            name = None
        if name is None or f"{UNET_PREFIX}{name}.{param}" in out:  # (a second mid-block attention would collide)
            raise UserError(f"{flag}: the UNet's weight {key} has no place in {LAYOUT}")
        out[f"{UNET_PREFIX}{name}.{param}"] = tensor
    return out


def vae_weights(state, config, flag):
    """diffusers AutoencoderKL weights -> the ldm VAE's (encoder.down.{i}.block.{j}; decoder.up.{i}, numbered like
    the encoder's levels, so in the reverse of diffusers' up_blocks; mid.block_1/attn_1/block_2), under
    first_stage_model."""
    check_vae_config(config, flag)
    levels = len(config["block_out_channels"])
    out = {}
    for key, tensor in state.items():
        name = key
        for pattern, repl in (
                (r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block."),
                (r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
                (r"^decoder\.up_blocks\.(\d+)\.resnets\.", lambda m: f"decoder.up.{levels - 1 - int(m[1])}.block."),
                (r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                 lambda m: f"decoder.up.{levels - 1 - int(m[1])}.upsample."),
                (r"\.mid_block\.resnets\.(\d+)\.", lambda m: f".mid.block_{int(m[1]) + 1}."),
                (r"\.mid_block\.attentions\.0\.", ".mid.attn_1."),
                (r"\.conv_shortcut\.", ".nin_shortcut."), (r"\.conv_norm_out\.", ".norm_out.")):
            name = re.sub(pattern, repl, name)
        attention = re.fullmatch(r"(.*\.attn_1\.)(group_norm|to_q|to_k|to_v|to_out\.0)\.(weight|bias)", name)
        if attention:
            head, part, param = attention.groups()
            part = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}[part]
            name = f"{head}{part}.{param}"
            if param == "weight" and part != "norm":  # a linear layer there, a 1x1 convolution in ldm
                tensor = tensor.reshape(*tensor.shape, 1, 1)
        if not re.fullmatch(r"(encoder|decoder)\.(conv_in|conv_out|norm_out|(down|up)\.\d+\.(block\.\d+\.(norm1|conv1|"
                            r"norm2|conv2|nin_shortcut)|downsample\.conv|upsample\.conv)|mid\.(block_[12]\.(norm1|"
                            r"conv1|norm2|conv2|nin_shortcut)|attn_1\.(norm|q|k|v|proj_out)))\.(weight|bias)"
                            r"|(post_)?quant_conv\.(weight|bias)", name):
            raise UserError(f"{flag}: the VAE's weight {key} has no place in {LAYOUT}")
        out[VAE_PREFIX + name] = tensor
    return out


def clip_weights(state, prefix):
    """transformers' CLIPTextModel weights (with or without their `text_model.` prefix: transformers 5 drops it) ->
    the same names under `prefix` (OpenAI CLIP's place in the original layout)."""
    return {prefix + key.removeprefix("text_model."): tensor for key, tensor in state.items()
            if not key.endswith("position_ids")}


def open_clip_weights(state, prefix, flag):
    """transformers' CLIP text weights -> OpenCLIP's text tower (token_embedding, positional_embedding,
    transformer.resblocks.{i} with a fused attn.in_proj, ln_final, text_projection) under `prefix`."""
    renames = (("embeddings.token_embedding.weight", "token_embedding.weight"),
               ("embeddings.position_embedding.weight", "positional_embedding"),
               ("final_layer_norm.", "ln_final."), ("encoder.layers.", "transformer.resblocks."),
               ("self_attn.out_proj.", "attn.out_proj."), ("layer_norm1.", "ln_1."), ("layer_norm2.", "ln_2."),
               ("mlp.fc1.", "mlp.c_fc."), ("mlp.fc2.", "mlp.c_proj."))
    out, qkv = {}, {}
    for key, tensor in state.items():
        key = key.removeprefix("text_model.")
        if key.endswith("position_ids"):
            continue
        if key == "text_projection.weight":
            out[prefix + "text_projection"] = tensor.t().contiguous()
            continue
        for old, new in renames:
            key = key.replace(old, new)
        fused = re.fullmatch(r"(transformer\.resblocks\.\d+\.)self_attn\.([qkv])_proj\.(weight|bias)", key)
        if fused:
            layer, part, param = fused.groups()
            qkv.setdefault((layer, param), {})[part] = tensor
            continue
        if "self_attn" in key or not key.startswith(("token_embedding", "positional_embedding", "ln_final",
                                                     "transformer.resblocks.")):
            raise UserError(f"{flag}: the text encoder's weight {key} has no place in OpenCLIP's layout")
        out[prefix + key] = tensor
    import torch

    for (layer, param), parts in qkv.items():
        out[f"{prefix}{layer}attn.in_proj_{param}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def is_open_clip(config):
    """OpenCLIP's text towers (SD 2.x's, SDXL's second) use GELU, OpenAI's CLIP (SD 1.x's) quick GELU: each UI builds
    the model that goes with the layout, so the activation decides the layout."""
    return config.hidden_act == "gelu"


def single_file_weights(unet, vae, text_encoders, flag="--save_model_as safetensors"):
    """diffusers models (a StableDiffusionPipeline's or StableDiffusionXLPipeline's UNet, VAE and one or two text
    encoders) -> {original key: tensor} (the same tensors, renamed; a few reshaped or fused)."""
    import torch

    out = unet_weights(unet.state_dict(), dict(unet.config), flag)
    out.update(vae_weights(vae.state_dict(), dict(vae.config), flag))
    if len(text_encoders) == 2:  # SDXL: OpenAI's CLIP ViT-L, then OpenCLIP's ViT-bigG with its projection
        out.update(clip_weights(text_encoders[0].state_dict(), CLIP_PREFIX["sdxl"]))
        # the position ids as Stability's SDXL checkpoints and ComfyUI's saver write them (a buffer transformers no
        # longer saves)
        positions = text_encoders[0].config.max_position_embeddings
        out[CLIP_PREFIX["sdxl"] + "embeddings.position_ids"] = torch.arange(positions).expand(1, -1)
        out.update(open_clip_weights(text_encoders[1].state_dict(), OPEN_CLIP_PREFIX["sdxl"], flag))
    elif is_open_clip(text_encoders[0].config):
        prefix = OPEN_CLIP_PREFIX["sd"]
        out.update(open_clip_weights(text_encoders[0].state_dict(), prefix, flag))
        layers = text_encoders[0].config.num_hidden_layers
        if (layers, text_encoders[0].config.hidden_size) == (23, 1024):
            # SD 2's text encoder: OpenCLIP ViT-H/14 without the last of its 24 layers (SD 2 reads the
            # penultimate), the tower the UIs build. Its 24th layer here is all zeros, an identity (both residual
            # branches add nothing): the UIs compute what diffusers does at whichever layer they read (ComfyUI's
            # CLIPSetLastLayer, A1111's CLIP skip), and no key is missing. diffusers ignores that layer on reading.
            first = f"{prefix}transformer.resblocks.0."
            out.update({f"{prefix}transformer.resblocks.{layers}.{key[len(first):]}": torch.zeros_like(tensor)
                        for key, tensor in list(out.items()) if key.startswith(first)})
    else:
        out.update(clip_weights(text_encoders[0].state_dict(), CLIP_PREFIX["sd"]))
    return out


def family(unet_config):
    """-> the UIs' name for the UNet's architecture ("SD 1.x", "SD 2.x", "SDXL"), or None when it is none of them."""
    for name, standard in STANDARD.items():
        levels = len(standard["unet"]["block_out_channels"])
        if all(_per_level(unet_config.get(key, 1 if key == "transformer_layers_per_block" else None), levels)
               == _per_level(value, levels) for key, value in standard["unet"].items()):
            return name
    return None


def _per_level(value, levels):
    """A setting given once or per level (diffusers accepts both) -> per level."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * levels
    return list(value) if isinstance(value, (list, tuple)) else value


def ui_notes(unet_config, vae_config, scheduler_config):
    """What ComfyUI and A1111 will assume of this pipeline that its checkpoint cannot tell them, where the
    pipeline differs (diffusers' from_single_file with config=<the pipeline folder> reads the folder's configs)."""
    name = family(unet_config)
    if name is None:
        return [f"the UNet ({unet_config.get('block_out_channels')} channels, cross-attention width "
                f"{unet_config.get('cross_attention_dim')}) is not SD 1.x's, SD 2.x's or SDXL's architecture, the "
                "ones ComfyUI and A1111 recognise in a checkpoint"]
    notes = []
    schedule = {key: scheduler_config.get(key) for key in SD_SCHEDULE}
    if schedule != SD_SCHEDULE:
        notes.append(f"the UIs sample with Stable Diffusion's noise schedule {SD_SCHEDULE}, not this one's {schedule}")
    scaling = vae_config.get("scaling_factor")
    if scaling != STANDARD[name]["scaling_factor"]:
        notes.append(f"the UIs scale latents by {name}'s {STANDARD[name]['scaling_factor']}, not by this VAE's "
                     f"{scaling}")
    if scheduler_config.get("prediction_type") == "v_prediction" and name == "SD 1.x":
        notes.append("ComfyUI loads an SD 1.x checkpoint as epsilon-prediction: put a ModelSamplingDiscrete node "
                     "(v_prediction) after the loader")
    return notes


def architecture(unet_config, prediction_type):
    """ModelSpec's modelspec.architecture of the checkpoint."""
    if unet_config.get("addition_embed_type") == "text_time":
        return "stable-diffusion-xl-v1-base"
    if unet_config.get("cross_attention_dim") == 1024:
        return "stable-diffusion-v2-768-v" if prediction_type == "v_prediction" else "stable-diffusion-v2-512"
    return "stable-diffusion-v1"


def save_single_file(pipe, path, title=None, flag="--save_model_as safetensors"):
    """Write `pipe` (StableDiffusionPipeline or StableDiffusionXLPipeline) as one single-file checkpoint at `path`,
    atomically; a v-prediction model carries ComfyUI's `v_pred` marker (and `ztsnr` for a zero-terminal-SNR
    schedule), as ComfyUI's own checkpoint saver writes them. Logs what the UIs will assume that the file cannot
    tell them. -> the ModelSpec metadata written."""
    import torch
    from safetensors.torch import save_file

    encoders = [m for m in (pipe.text_encoder, getattr(pipe, "text_encoder_2", None)) if m is not None]
    weights = single_file_weights(pipe.unet, pipe.vae, encoders, flag)
    scheduler = dict(pipe.scheduler.config)
    prediction = scheduler.get("prediction_type", "epsilon")
    if prediction == "v_prediction":
        weights["v_pred"] = torch.tensor([])
        if scheduler.get("rescale_betas_zero_snr"):
            weights["ztsnr"] = torch.tensor([])
    size = pipe.unet.config.sample_size * 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    metadata = {"modelspec.sai_model_spec": "1.0.0",
                "modelspec.architecture": architecture(dict(pipe.unet.config), prediction),
                "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
                "modelspec.title": title or os.path.splitext(os.path.basename(path))[0],
                "modelspec.resolution": f"{size}x{size}",
                "modelspec.prediction_type": "v" if prediction == "v_prediction" else prediction}
    tmp = path + ".tmp"
    try:
        save_file({k: v.detach().contiguous() for k, v in weights.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    notes = ui_notes(dict(pipe.unet.config), dict(pipe.vae.config), scheduler)
    if notes:
        logger.warning(f"{path}: diffusers' from_single_file reads it with config=<the pipeline folder>; in ComfyUI "
                       f"and A1111: {'; '.join(notes)}")
    return metadata


def single_file_path(output_dir):
    """Where a run's single file goes: OUTPUT_DIR/<OUTPUT_DIR's name>.safetensors (the name the UIs list)."""
    return os.path.join(output_dir, os.path.basename(os.path.abspath(output_dir)) + ".safetensors")
