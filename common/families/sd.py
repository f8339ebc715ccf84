"""Stable Diffusion 1.x/2.x (StableDiffusionPipeline): a UNet on DDPM noise, conditioned on the last hidden states of
one CLIP text encoder. The reference family: every family module defines the names below.
"""
from ..diffusion import SCHEDULER_CLASSES
from ..prompts import clip_ids
from ..ui_lora import DIFFUSERS_IMPLEMENTATION, kohya_lora
from . import (
    classifier_free_guidance,
    embedding_kwargs,
    every_target,
    latents_as_they_are,
    no_empty_prompt_zeros,
    no_t5,
    unet_sample_size,
    unet_size_factor,
    vae_latents,
    vae_native_resolution,
    vae_resolution_factor,
)

KEY = "sd"
NAME = "Stable Diffusion 1.x/2.x"
PIPELINE = "StableDiffusionPipeline"
DENOISER = "unet"
EDIT_PIPELINE = None  # the pipeline that draws from reference images (edit LoRAs, common/references.py), if any
REFERENCES = 0  # how many reference images it takes
# What its LoRA files say of their base (kohya's ss_base_model_version, ModelSpec's modelspec.architecture, by prefix),
# and tensor names only its LoRAs have (kohya's one text encoder, lora_te_).
LORA_METADATA = {"ss_base_model_version": ("sd_v1", "sd_v2"),
                 "modelspec.architecture": ("stable-diffusion-v1", "stable-diffusion-v2")}
LORA_KEY_PREFIXES = ("lora_te_",)
OBJECTIVE = "ddpm"  # common/objectives.py
# component -> (library, class) as from_pretrained loads it; the denoiser, the VAE and the scheduler always
COMPONENTS = {"scheduler": ("diffusers", "DDPMScheduler"), "tokenizer": ("transformers", "CLIPTokenizer"),
              "text_encoder": ("transformers", "CLIPTextModel"), "vae": ("diffusers", "AutoencoderKL"),
              "unet": ("diffusers", "UNet2DConditionModel")}
TEXT_ENCODERS = ("text_encoder",)  # in the order their embeddings are put together
LORA_TEXT_ENCODERS = ("text_encoder",)  # those --train_text_encoder puts LoRA on
LORA_TARGETS = "to_k,to_q,to_v,to_out.0"
TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
TIME_IDS = False  # conditioned on each image's size (SDXL's time ids)
MAX_SEQUENCE_LENGTH = None  # no T5
TRAINING_GUIDANCE = None  # no guidance input (Flux.1-dev's guidance embedding)
OPTIONAL_COMPONENTS = None  # components a pipeline may go without (SD3's T5)
SAMPLERS = SCHEDULER_CLASSES  # --scheduler / --validation_scheduler names (common/diffusion.py)
SAMPLER, SAMPLE_STEPS, SAMPLE_GUIDANCE = "dpm", 30, 7.5  # sample.py's and the validation images' defaults
SAMPLE_FLAGS = ("negative_prompt", "guidance_rescale", "clip_skip")  # sample.py's flags its pipeline takes
LORA_SCALE_ARGUMENT = "cross_attention_kwargs"  # the pipeline call's argument that scales the LoRAs
PIPELINE_EXTRAS = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
SINGLE_FILE = True  # the original single-file checkpoint layout holds it (train_text_to_image.py --save_model_as)
# the denoiser's lists of transformer blocks, in the order its forward runs them (--blocks_to_swap, --quantize_base
# fp8); a UNet has none
SWAP_BLOCKS = ()
NATIVE_SIZE_FROM = "VAE"  # whose config's sample_size is the native training size
RESOLUTION_FACTOR = "the VAE's downsampling factor"


text_length = no_t5


native_resolution = vae_native_resolution


resolution_factor = vae_resolution_factor


size_factor = unet_size_factor


def fit_problems(denoiser_config, configs):
    """A fresh UNet (train_text_to_image.py --unet_config) against the base's other parts: [(key, has, wants, what)]."""
    return [(key, denoiser_config.get(key, default), want, what) for key, default, want, what in (
        ("cross_attention_dim", None, configs.get("text_encoder", {}).get("hidden_size"),
         "the text encoder's hidden size"),
        ("in_channels", 4, configs["vae"].get("latent_channels"), "the VAE's latent channels"))
        if want is not None and denoiser_config.get(key, default) != want]


def tokenize(parts, prompts, max_sequence_length=None):
    """Prompts -> token ids, one tensor per text encoder of TEXT_ENCODERS that the pipeline holds (CLIP: 77)."""
    return [clip_ids(parts["tokenizer"], prompts)]


def encode_prompts(parts, ids):
    """Token ids (tokenize's, on the text encoders' device) -> the UNet's conditioning, as the pipeline computes it:
    the last hidden states. parts: the pipeline's components by name (the text encoders may be prepared ones)."""
    return {"prompt_embeds": parts["text_encoder"](ids[0])[0]}


empty_prompt_zeros = no_empty_prompt_zeros


def denoise(unet, noisy, timesteps, cond, guidance=None):
    """The UNet's prediction for noisy latents [B, C, H, W] at the training scheduler's timesteps."""
    return unet(noisy, timesteps, cond["prompt_embeds"], return_dict=False)[0]


guidance_kwargs = classifier_free_guidance


pipeline_prompt_kwargs = embedding_kwargs


sample_size = unet_sample_size


unpack_latents = latents_as_they_are


text_encoder_targets = every_target


def base_metadata(denoiser_config, prediction_type):
    """What LoRA metadata says of the base: kohya's ss_base_model_version and ss_v2, ModelSpec's architecture and
    prediction type. SD 2 attends to 1024-wide text embeddings (SD 1 to 768); a v-prediction base adds kohya's `_v`."""
    v2, v = denoiser_config.get("cross_attention_dim") == 1024, prediction_type == "v_prediction"
    architecture = ("stable-diffusion-v2-768-v" if v else "stable-diffusion-v2-512") if v2 else "stable-diffusion-v1"
    return {"ss_base_model_version": ("sd_v2" if v2 else "sd_v1") + ("_v" if v else ""), "ss_v2": str(v2),
            "modelspec.architecture": f"{architecture}/lora",
            "modelspec.prediction_type": "v" if v else prediction_type}


UI_IMPLEMENTATION = DIFFUSERS_IMPLEMENTATION  # ModelSpec's name for the UI file's module names (kohya's)


def ui_lora(states, alpha, denoiser_config):
    """The UI LoRA file's tensors (ComfyUI, Forge, A1111 read kohya's names): SD 1.x/2.x's keep diffusers' module
    paths, dots as underscores, under lora_unet_ / lora_te_ (the CLIP text model under `text_model.`), with alphas
    and DoRA magnitudes (common/ui_lora.py). states: {component: peft state dict}."""
    weights = kohya_lora(states["unet"], alpha, "lora_unet")
    if "text_encoder" in states:
        weights.update(kohya_lora(states["text_encoder"], alpha, "lora_te", "text_model."))
    return weights


latent_config = vae_latents
