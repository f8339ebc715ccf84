"""Stable Diffusion 3 and 3.5 (StableDiffusion3Pipeline): an MMDiT transformer trained by flow matching, conditioned
on two CLIP text encoders (penultimate hidden states side by side, padded to T5's width) followed by T5's hidden states
in one sequence, and both CLIPs' pooled, projected embeddings together. As diffusers' train_dreambooth_lora_sd3.py
trains it: the raw timestep, training sigmas shifted by the scheduler config's shift (3.0), logit-normal timesteps,
preconditioned outputs (x_t - sigma * output compared with x0). It runs without T5 (--drop_t5): zeros in its place.
"""
from ..diffusion import FLOW_SCHEDULER_CLASSES
from ..prompts import clip_ids, t5_ids
from ..ui_lora import DIFFUSERS_IMPLEMENTATION, prefixed_lora
from ..vae import vae_factor
from . import (
    classifier_free_guidance,
    embedding_kwargs,
    every_target,
    latents_as_they_are,
    no_empty_prompt_zeros,
    t5_text_length,
    vae_latents,
)

KEY = "sd3"
NAME = "Stable Diffusion 3"
PIPELINE = "StableDiffusion3Pipeline"
DENOISER = "transformer"
EDIT_PIPELINE = None  # no edit pipeline: no reference images
REFERENCES = 0
# What its LoRA files say of their base (kohya's ss_base_model_version, ModelSpec's modelspec.architecture, by prefix),
# and tensor names only its LoRAs have (the blocks it shares with Flux.1 tell nothing).
LORA_METADATA = {"ss_base_model_version": ("sd3",),
                 "modelspec.architecture": ("stable-diffusion-v3", "stable-diffusion-3")}
LORA_KEY_PREFIXES = ("transformer.pos_embed.", "text_encoder_3.")
OBJECTIVE = "flow"
FLOW_DEFAULTS = {"weighting_scheme": "logit_normal", "precondition_outputs": 1}  # diffusers' SD3 script's
COMPONENTS = {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
              "tokenizer": ("transformers", "CLIPTokenizer"), "tokenizer_2": ("transformers", "CLIPTokenizer"),
              "tokenizer_3": ("transformers", "T5TokenizerFast"),
              "text_encoder": ("transformers", "CLIPTextModelWithProjection"),
              "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"),
              "text_encoder_3": ("transformers", "T5EncoderModel"), "vae": ("diffusers", "AutoencoderKL"),
              "transformer": ("diffusers", "SD3Transformer2DModel")}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
LORA_TEXT_ENCODERS = ("text_encoder", "text_encoder_2")  # the CLIPs, as diffusers' script
LORA_TARGETS = ("attn.add_k_proj,attn.add_q_proj,attn.add_v_proj,attn.to_add_out,attn.to_k,attn.to_out.0,attn.to_q,"
                "attn.to_v")  # diffusers' default
TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
TIME_IDS = False
MAX_SEQUENCE_LENGTH = 77  # diffusers' SD3 script's default
TRAINING_GUIDANCE = None
OPTIONAL_COMPONENTS = ("text_encoder_3", "tokenizer_3")  # T5: --drop_t5
SAMPLERS = FLOW_SCHEDULER_CLASSES
SAMPLER, SAMPLE_STEPS, SAMPLE_GUIDANCE = "euler", 28, 7.0  # StableDiffusion3Pipeline's defaults
SAMPLE_FLAGS = ("negative_prompt", "max_sequence_length", "drop_t5")
LORA_SCALE_ARGUMENT = "joint_attention_kwargs"  # the pipeline call's argument that scales the LoRAs
PIPELINE_EXTRAS = {}
SINGLE_FILE = False  # no single-file checkpoint layout here (train_text_to_image.py --save_model_as)
SWAP_BLOCKS = ("transformer_blocks",)  # the denoiser's blocks, in the order its forward runs them
NATIVE_SIZE_FROM = "transformer"  # whose config's sample_size is the native training size
RESOLUTION_FACTOR = "the VAE's downsampling factor times the transformer's patch size"


def text_length(components, requested=None, training=False):
    """T5's prompt length: as requested, else diffusers' SD3 script's (training) or the pipeline's (256), capped by
    the T5 tokenizer's model_max_length."""
    return t5_text_length(components.get("tokenizer_3"), requested, MAX_SEQUENCE_LENGTH if training else 256)


def native_resolution(configs):
    """The transformer's sample_size in pixels (1024 for SD3 medium), what the pipeline draws by default."""
    size = configs["transformer"].get("sample_size")
    return size * vae_factor(configs["vae"]) if isinstance(size, int) else None


def resolution_factor(configs):
    return vae_factor(configs["vae"]) * configs["transformer"].get("patch_size", 2)


def size_factor(configs):
    return resolution_factor(configs)


def fit_problems(denoiser_config, configs):
    """A fresh transformer against the base's other parts: the VAE's channels, T5's width, the CLIPs' projections."""
    projections = [configs.get(name, {}).get("projection_dim") for name in ("text_encoder", "text_encoder_2")]
    checks = (("in_channels", configs["vae"].get("latent_channels"), "the VAE's latent channels"),
              ("joint_attention_dim", configs.get("text_encoder_3", {}).get("d_model"), "T5's d_model"),
              ("pooled_projection_dim", sum(projections) if None not in projections else None,
               "the two CLIP projections together"))
    return [(key, denoiser_config.get(key), want, what) for key, want, what in checks
            if want is not None and denoiser_config.get(key) != want]


def tokenize(parts, prompts, max_sequence_length=None):
    """Both CLIPs' 77 ids and T5's max_sequence_length ids (zeros without T5: they only give the length)."""
    import torch

    t5 = (t5_ids(parts["tokenizer_3"], prompts, max_sequence_length) if parts.get("tokenizer_3") is not None
          else torch.zeros(len(prompts), max_sequence_length, dtype=torch.long))
    return [clip_ids(parts["tokenizer"], prompts), clip_ids(parts["tokenizer_2"], prompts), t5]


def encode_prompts(parts, ids):
    """As StableDiffusion3Pipeline.encode_prompt: the CLIPs' penultimate states side by side, padded to T5's width,
    then T5's states (zeros without T5) in one sequence; both CLIPs' projected pooled outputs together."""
    import torch

    states, pooled = [], []
    for name, encoder_ids in zip(("text_encoder", "text_encoder_2"), ids[:2]):
        output = parts[name](encoder_ids, output_hidden_states=True)
        states.append(output.hidden_states[-2])
        pooled.append(output[0])
    clip = torch.cat(states, dim=-1)
    if parts.get("text_encoder_3") is not None:
        t5 = parts["text_encoder_3"](ids[2])[0]
    else:
        width = parts["transformer"].config.joint_attention_dim
        t5 = torch.zeros(len(ids[2]), ids[2].shape[1], width, device=clip.device, dtype=clip.dtype)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return {"prompt_embeds": torch.cat([clip, t5.to(clip.dtype)], dim=-2),
            "pooled_prompt_embeds": torch.cat(pooled, dim=-1)}


empty_prompt_zeros = no_empty_prompt_zeros


def denoise(transformer, noisy, timesteps, cond, guidance=None):
    """The transformer's raw output for noisy latents [B, C, H, W] at the scheduler's timesteps (not divided)."""
    return transformer(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=cond["prompt_embeds"],
                       pooled_projections=cond["pooled_prompt_embeds"], return_dict=False)[0]


guidance_kwargs = classifier_free_guidance


pipeline_prompt_kwargs = embedding_kwargs


def sample_size(pipe):
    size = pipe.default_sample_size * pipe.vae_scale_factor
    return size, size


unpack_latents = latents_as_they_are


text_encoder_targets = every_target


def base_metadata(denoiser_config, prediction_type):
    """kohya's and ModelSpec's names: sd3, stable-diffusion-v3-medium (3.5's have dual attention blocks)."""
    large = denoiser_config.get("num_layers", 24) >= 38
    version = "v3-5-large" if large else "v3-medium"
    return {"ss_base_model_version": "sd3", "modelspec.architecture": f"stable-diffusion-{version}/lora"}


UI_IMPLEMENTATION = DIFFUSERS_IMPLEMENTATION


def ui_lora(states, alpha, denoiser_config):
    """ComfyUI and Forge read SD3 LoRAs under diffusers' module paths (`transformer.<module>`; the CLIPs' under
    `text_encoder(_2).text_model.`), with alphas and DoRA magnitudes; the final norm's and the last block's context
    norm's halves are swapped in ComfyUI's weights (common/ui_lora.py)."""
    last = f"transformer_blocks.{denoiser_config['num_layers'] - 1}.norm1_context.linear"
    weights = prefixed_lora(states["transformer"], alpha, "transformer", swapped_halves=("norm_out.linear", last))
    for name in ("text_encoder", "text_encoder_2"):
        if name in states:
            weights.update(prefixed_lora(states[name], alpha, name, "text_model."))
    return weights


latent_config = vae_latents
