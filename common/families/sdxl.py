"""Stable Diffusion XL (StableDiffusionXLPipeline): SD's UNet and DDPM noise, conditioned on two CLIP text encoders
(both penultimate hidden states side by side, the second's pooled, projected embedding) and each image's size "time
ids" (original size, crop top-left, target size: common/image_data.py's ImageDataset.time_ids). kohya's SDXL LoRA
files name the original "sgm" UNet's modules (input_blocks/middle_block/output_blocks), which A1111 and ComfyUI map.
"""
from ..diffusion import SCHEDULER_CLASSES
from ..prompts import clip_ids
from ..sgm_names import sgm_module_name
from ..ui_lora import SGM_IMPLEMENTATION, kohya_lora
from . import (
    classifier_free_guidance,
    embedding_kwargs,
    latents_as_they_are,
    no_t5,
    unet_sample_size,
    unet_size_factor,
    vae_latents,
    vae_native_resolution,
    vae_resolution_factor,
)

KEY = "sdxl"
NAME = "Stable Diffusion XL"
PIPELINE = "StableDiffusionXLPipeline"
DENOISER = "unet"
EDIT_PIPELINE = None  # no edit pipeline: no reference images
REFERENCES = 0
# What its LoRA files say of their base (kohya's ss_base_model_version, ModelSpec's modelspec.architecture, by prefix),
# and tensor names only its LoRAs have: the second text encoder (kohya's lora_te1_/lora_te2_), the sgm UNet's blocks
# and the added embedding.
LORA_METADATA = {"ss_base_model_version": ("sdxl",), "modelspec.architecture": ("stable-diffusion-xl",)}
LORA_KEY_PREFIXES = ("text_encoder_2.", "lora_te1_", "lora_te2_", "lora_unet_input_blocks_", "lora_unet_middle_block_",
                     "lora_unet_output_blocks_", "lora_unet_label_emb_", "unet.add_embedding.", "add_embedding.")
OBJECTIVE = "ddpm"
COMPONENTS = {"scheduler": ("diffusers", "DDPMScheduler"), "tokenizer": ("transformers", "CLIPTokenizer"),
              "tokenizer_2": ("transformers", "CLIPTokenizer"), "text_encoder": ("transformers", "CLIPTextModel"),
              "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"), "vae": ("diffusers", "AutoencoderKL"),
              "unet": ("diffusers", "UNet2DConditionModel")}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
LORA_TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
LORA_TARGETS = "to_k,to_q,to_v,to_out.0"
TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
TIME_IDS = True
MAX_SEQUENCE_LENGTH = None  # no T5
TRAINING_GUIDANCE = None  # no guidance input (Flux.1-dev's guidance embedding)
OPTIONAL_COMPONENTS = None  # components a pipeline may go without (SD3's T5)
SAMPLERS = SCHEDULER_CLASSES  # --scheduler / --validation_scheduler names (common/diffusion.py)
SAMPLER, SAMPLE_STEPS, SAMPLE_GUIDANCE = "dpm", 30, 7.5
SAMPLE_FLAGS = ("negative_prompt", "guidance_rescale", "clip_skip")  # sample.py's flags its pipeline takes
LORA_SCALE_ARGUMENT = "cross_attention_kwargs"  # the pipeline call's argument that scales the LoRAs
PIPELINE_EXTRAS = {}
SINGLE_FILE = True  # the original single-file checkpoint layout holds it (train_text_to_image.py --save_model_as)
SWAP_BLOCKS = ()  # a UNet: no lists of blocks (--blocks_to_swap, --quantize_base fp8)
NATIVE_SIZE_FROM = "VAE"  # whose config's sample_size is the native training size
RESOLUTION_FACTOR = "the VAE's downsampling factor"


text_length = no_t5


native_resolution = vae_native_resolution


resolution_factor = vae_resolution_factor


size_factor = unet_size_factor


def fit_problems(denoiser_config, configs):
    """A fresh UNet against the base's other parts: it attends to both encoders' states side by side."""
    hidden = [configs.get(name, {}).get("hidden_size") for name in TEXT_ENCODERS]
    return [(key, denoiser_config.get(key, default), want, what) for key, default, want, what in (
        ("cross_attention_dim", None, sum(hidden) if None not in hidden else None,
         "the two text encoders' hidden sizes together"),
        ("in_channels", 4, configs["vae"].get("latent_channels"), "the VAE's latent channels"))
        if want is not None and denoiser_config.get(key, default) != want]


def tokenize(parts, prompts, max_sequence_length=None):
    return [clip_ids(parts["tokenizer"], prompts), clip_ids(parts["tokenizer_2"], prompts)]


def encode_prompts(parts, ids):
    """Both encoders' penultimate hidden states, concatenated, and the second's projected pooled output."""
    import torch

    states, pooled = [], None
    for encoder, encoder_ids in zip([parts[name] for name in TEXT_ENCODERS], ids, strict=True):
        output = encoder(encoder_ids, output_hidden_states=True)
        states.append(output.hidden_states[-2])
        pooled = output[0]  # CLIPTextModelWithProjection's text_embeds (the last encoder's)
    return {"prompt_embeds": torch.cat(states, dim=-1), "pooled_prompt_embeds": pooled}


def empty_prompt_zeros(index):
    """SDXL's pipeline samples the unconditional branch with zeros, not the embedding of "", unless its config says
    otherwise (force_zeros_for_empty_prompt, True by default): caption dropout trains on the same zeros."""
    return index.get("force_zeros_for_empty_prompt", True) is not False


def denoise(unet, noisy, timesteps, cond, guidance=None):
    added = {"text_embeds": cond["pooled_prompt_embeds"], "time_ids": cond["time_ids"]}
    return unet(noisy, timesteps, cond["prompt_embeds"], added_cond_kwargs=added, return_dict=False)[0]


guidance_kwargs = classifier_free_guidance


pipeline_prompt_kwargs = embedding_kwargs


sample_size = unet_sample_size


unpack_latents = latents_as_they_are


def text_encoder_targets(name, encoder, targets):
    """No LoRA on the first encoder's last layer, whose output nothing reads (the UNet takes the penultimate hidden
    states, the pooled embedding comes from the second encoder): LoRA there would never train, and several processes
    (DDP) stop on parameters that get no gradient."""
    if name != "text_encoder":
        return list(targets)
    last = f"layers.{encoder.config.num_hidden_layers - 1}."
    return [module for module, _ in encoder.named_modules()
            if any(module.endswith("." + t) for t in targets) and last not in module]


def base_metadata(denoiser_config, prediction_type):
    v = prediction_type == "v_prediction"
    return {"ss_base_model_version": "sdxl_base_v1-0" + ("_v" if v else ""), "ss_v2": "False",
            "modelspec.architecture": "stable-diffusion-xl-v1-base/lora",
            "modelspec.prediction_type": "v" if v else prediction_type}


UI_IMPLEMENTATION = SGM_IMPLEMENTATION  # kohya's SDXL files name Stability's own UNet's modules


def ui_lora(states, alpha, denoiser_config):
    """kohya's SDXL names: the sgm UNet's module paths under lora_unet_, the two text encoders under lora_te1_ and
    lora_te2_ (their CLIP text models under `text_model.`), dots as underscores; alphas and DoRA magnitudes."""
    weights = kohya_lora(states["unet"], alpha, "lora_unet", rename=lambda m: sgm_module_name(m, denoiser_config))
    for name, prefix in (("text_encoder", "lora_te1"), ("text_encoder_2", "lora_te2")):
        if name in states:
            weights.update(kohya_lora(states[name], alpha, prefix, "text_model."))
    return weights


latent_config = vae_latents
