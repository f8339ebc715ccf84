"""Z-Image (ZImagePipeline; Z-Image-Turbo and the undistilled Z-Image): a single-stream transformer trained by flow
matching, conditioned on the penultimate hidden states of a Qwen3 text encoder over the prompt in Qwen3's chat
template, each prompt cut to its own tokens (the transformer takes a list of variable-length embeddings, and a list of
latents [C, 1, H, W], which it cuts into 2 x 2 patches itself). As diffusers' train_dreambooth_lora_z_image.py trains
it: training sigmas shifted by the scheduler config's shift (3.0, no dynamic shifting), no loss weighting, the
transformer given (1000 - t) / 1000 and its output negated, target noise - x0. The pipeline guides with a negative
prompt (CFG pos + w (pos - neg), on for w > 0; Z-Image-Turbo is distilled to draw with w = 0).

The prompt cache needs one shape for every prompt: the embeddings are kept padded to --max_sequence_length with their
attention mask beside them (`prompt_mask`), and cut back to the pipeline's lists where the transformer and the pipeline
take them.
"""
from ..diffusion import FLOW_SCHEDULER_CLASSES
from ..ui_lora import DIFFUSERS_IMPLEMENTATION, prefixed_lora
from ..vae import vae_factor, vae_sample_size
from . import (
    every_target,
    latents_as_they_are,
    no_empty_prompt_zeros,
    t5_text_length,
    vae_latents,
    vae_native_resolution,
)

KEY = "z_image"
NAME = "Z-Image"
PIPELINE = "ZImagePipeline"
DENOISER = "transformer"
REFERENCES = 0  # reference images (edit LoRAs): not yet for this family (docs/train_lora.md)
EDIT_PIPELINE = None
SWAP_BLOCKS = ("layers",)  # the main blocks, in the order its forward runs them (the small refiners stay)
# What its LoRA files say of their base (kohya's ss_base_model_version; ModelSpec's architecture, musubi-tuner's
# "Z-Image"), and tensor names only its LoRAs have: its refiner blocks and main `layers` under diffusers' prefix,
# ComfyUI's and ai-toolkit's `diffusion_model.`, kohya's `lora_unet_`.
LORA_METADATA = {"ss_base_model_version": ("z_image", "zimage"), "modelspec.architecture": ("Z-Image", "z-image")}
LORA_KEY_PREFIXES = tuple(f"{prefix}{block}" for prefix in ("transformer.", "diffusion_model.")
                          for block in ("layers.", "noise_refiner.", "context_refiner.")) + (
    "lora_unet_layers_", "lora_unet_noise_refiner_", "lora_unet_context_refiner_")
OBJECTIVE = "flow"
FLOW_DEFAULTS = {"weighting_scheme": "none", "precondition_outputs": 0}  # diffusers' Z-Image script's
COMPONENTS = {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
              "tokenizer": ("transformers", "Qwen2Tokenizer"), "text_encoder": ("transformers", "Qwen3Model"),
              "vae": ("diffusers", "AutoencoderKL"), "transformer": ("diffusers", "ZImageTransformer2DModel")}
TEXT_ENCODERS = ("text_encoder",)  # Qwen3 (4 B parameters in Z-Image)
LORA_TEXT_ENCODERS = ()  # an LLM: no LoRA on it (diffusers' script trains none either)
LORA_TARGETS = "to_k,to_q,to_v,to_out.0"  # diffusers' script's default: every block's attention
TEXT_LORA_TARGETS = ()
TIME_IDS = False
MAX_SEQUENCE_LENGTH = 512  # Qwen3's prompt length: diffusers' script's and the pipeline's default
TRAINING_GUIDANCE = None
OPTIONAL_COMPONENTS = None
SAMPLERS = FLOW_SCHEDULER_CLASSES
SAMPLER, SAMPLE_STEPS, SAMPLE_GUIDANCE = "euler", 50, 5.0  # ZImagePipeline's defaults
SAMPLE_FLAGS = ("negative_prompt", "max_sequence_length", "cfg_normalization", "cfg_truncation")
LORA_SCALE_ARGUMENT = "joint_attention_kwargs"  # the pipeline call's argument that scales the LoRAs
PIPELINE_EXTRAS = {}
SINGLE_FILE = False  # no single-file checkpoint layout here (train_text_to_image.py --save_model_as)
NATIVE_SIZE_FROM = "VAE"  # whose config's sample_size is the native training size
RESOLUTION_FACTOR = "the VAE's downsampling factor times 2 (the transformer's 2 x 2 patches)"


def text_length(components, requested=None, training=False):
    """Qwen3's prompt length: as requested, else 512 (diffusers' script's and the pipeline's), capped by the
    tokenizer's model_max_length."""
    return t5_text_length(components.get("tokenizer"), requested, MAX_SEQUENCE_LENGTH)


native_resolution = vae_native_resolution  # (ZImagePipeline itself defaults to 1024 px)


def resolution_factor(configs):
    patch = (configs.get("transformer", {}).get("all_patch_size") or [2])[0]
    return vae_factor(configs["vae"]) * patch


def size_factor(configs):
    return resolution_factor(configs)


def fit_problems(denoiser_config, configs):
    """A fresh transformer against the base's other parts: the VAE's channels, Qwen3's width."""
    checks = (("in_channels", configs["vae"].get("latent_channels"), "the VAE's latent channels"),
              ("cap_feat_dim", configs.get("text_encoder", {}).get("hidden_size"), "the text encoder's hidden size"))
    return [(key, denoiser_config.get(key), want, what) for key, want, what in checks
            if want is not None and denoiser_config.get(key) != want]


def tokenize(parts, prompts, max_sequence_length=None):
    """As ZImagePipeline._encode_prompt: each prompt as a user message in the tokenizer's chat template (with the
    generation prompt, thinking enabled), then max_sequence_length ids and their attention mask."""
    tokenizer = parts["tokenizer"]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=True) for prompt in prompts]
    tokens = tokenizer(texts, padding="max_length", max_length=max_sequence_length, truncation=True,
                       return_tensors="pt")
    return [tokens.input_ids, tokens.attention_mask]


def encode_prompts(parts, ids):
    """Qwen3's penultimate hidden states, as the pipeline computes them, kept padded (zeros past each prompt) with
    their mask: one shape for every prompt."""
    input_ids, mask = ids
    states = parts["text_encoder"](input_ids=input_ids, attention_mask=mask.bool(),
                                   output_hidden_states=True).hidden_states[-2]
    mask = mask.to(states.dtype)
    return {"prompt_embeds": states * mask[..., None], "prompt_mask": mask}


empty_prompt_zeros = no_empty_prompt_zeros


def prompt_list(cond):
    """The padded embeddings back to the pipeline's list of [tokens, width] tensors, one per prompt."""
    return [embeds[mask.bool()] for embeds, mask in zip(cond["prompt_embeds"], cond["prompt_mask"])]


def denoise(transformer, noisy, timesteps, cond, guidance=None):
    """The velocity noise - x0 for noisy latents [B, C, H, W], as the pipeline and diffusers' script compute it: each
    latent a [C, 1, H, W] item of a list, the timestep given as (1000 - t) / 1000, the output negated."""
    import torch

    out = transformer(list(noisy.unsqueeze(2).unbind(0)), (1000 - timesteps) / 1000, prompt_list(cond),
                      return_dict=False)[0]
    return -torch.stack(out).squeeze(2)


def guidance_kwargs(denoiser_config, scale, batch):
    """The pipeline's own guidance: pos + scale * (pos - neg) against the negative (default empty) prompt, on for
    scale > 0. -> (the call's arguments, whether it needs the unconditional embeddings)."""
    return {"guidance_scale": scale}, scale > 0


def pipeline_prompt_kwargs(cond, uncond):
    """A pipeline call's arguments for embeddings computed beforehand: the lists it takes."""
    kwargs = {"prompt_embeds": prompt_list(cond)}
    if uncond is not None:
        kwargs["negative_prompt_embeds"] = prompt_list(uncond)
    return kwargs


def sample_size(pipe):
    """(height, width) drawn by default: the VAE's sample_size (ZImagePipeline's own default is 1024 px)."""
    size = vae_sample_size(pipe.vae.config) or 1024
    return size, size


unpack_latents = latents_as_they_are  # (the pipeline's latent output is the denoiser's [B, C, h, w])


text_encoder_targets = every_target


def base_metadata(denoiser_config, prediction_type):
    """kohya's and ModelSpec's names (ModelSpec's as musubi-tuner writes it)."""
    return {"ss_base_model_version": "z_image", "modelspec.architecture": "Z-Image/lora"}


UI_IMPLEMENTATION = DIFFUSERS_IMPLEMENTATION


def ui_lora(states, alpha, denoiser_config):
    """ComfyUI reads Z-Image LoRAs under diffusers' module paths (`diffusion_model.<module>`, as ai-toolkit writes
    them), mapping to_q, to_k and to_v onto slices of its fused qkv weight (comfy/utils.py z_image_to_diffusers);
    diffusers' loader reads the same names (and their alphas) back."""
    return prefixed_lora(states["transformer"], alpha, "diffusion_model")


def latent_config(vae):
    """The VAE's shift_factor and scaling_factor; trained on the latent distribution's mode, not a sample, as
    diffusers' Z-Image script does (`latent_dist.mode()`)."""
    return {**vae_latents(vae), "latent_mode": True}
