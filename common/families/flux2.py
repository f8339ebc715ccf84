"""FLUX.2 dev (Flux2Pipeline): FLUX.2 klein's transformer, latents and UI names (common/families/flux2_klein.py,
which a copy needs beside this module) with a guidance embedding and another text encoder: the hidden states of
Mistral3 (Mistral Small 3.1, a vision-language model; text only here) layers 10, 20 and 30 side by side, the prompt a
user turn after the pipeline's system message in Mistral's chat format. As diffusers' train_dreambooth_lora_flux2.py
trains it: the guidance input 3.5 while training (--guidance_scale), the posterior's mode, the timestep divided by
1000, unshifted training sigmas, no loss weighting, target noise - x0. The pipeline draws with the guidance as an
input (4.0 by default), no unconditional branch. Reference images (edits) as klein's.
"""
from .flux2_klein import COMPONENTS as KLEIN_COMPONENTS
from .flux2_klein import (  # noqa: F401 (FLUX.2's transformer, latents and UI file, as klein's)
    FLOW_DEFAULTS,
    LORA_KEY_PREFIXES,
    LORA_SCALE_ARGUMENT,
    LORA_TARGETS,
    LORA_TEXT_ENCODERS,
    MAX_SEQUENCE_LENGTH,
    NATIVE_SIZE_FROM,
    OBJECTIVE,
    OPTIONAL_COMPONENTS,
    PIPELINE_EXTRAS,
    REFERENCE_MIN_SIDE,
    RESOLUTION_FACTOR,
    SAMPLE_FLAGS,
    SAMPLER,
    SAMPLERS,
    SINGLE_FILE,
    TEXT_ENCODERS,
    TEXT_LORA_TARGETS,
    TIME_IDS,
    UI_IMPLEMENTATION,
    denoise,
    empty_prompt_zeros,
    latent_config,
    native_resolution,
    packed_shape,
    pipeline_prompt_kwargs,
    reference_kwargs,
    resolution_factor,
    sample_size,
    size_factor,
    stacked_states,
    text_encoder_targets,
    text_length,
    ui_lora,
    unpack_latents,
)
from .flux2_klein import fit_problems as klein_fit_problems

KEY = "flux2"
NAME = "FLUX.2 dev"
PIPELINE = "Flux2Pipeline"
DENOISER = "transformer"
EDIT_PIPELINE = PIPELINE  # it takes reference images itself (image=), as klein's
REFERENCES = 6  # BFL's recommended most for dev (docs.bfl.ai, "Reference Images per Model"; the pipeline sets none)
SWAP_BLOCKS = ("transformer_blocks", "single_transformer_blocks")  # the blocks, in the order they run
LORA_METADATA = {"modelspec.architecture": ("flux-2-dev", "Flux.2-dev")}
# Mistral3's processor (Pixtral's, which needs torchvision) or, for a base that holds only a tokenizer, the tokenizer:
# both take the pipeline's apply_chat_template call.
COMPONENTS = {**KLEIN_COMPONENTS, "tokenizer": ("transformers", "AutoProcessor"),
              "text_encoder": ("transformers", "Mistral3ForConditionalGeneration")}
TEXT_LAYERS = (10, 20, 30)  # the hidden states the pipeline stacks (its text_encoder_out_layers)
TRAINING_GUIDANCE = 3.5  # diffusers' FLUX.2 script's --guidance_scale
SAMPLE_STEPS, SAMPLE_GUIDANCE = 50, 4.0  # Flux2Pipeline's defaults
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")  # the pipeline's


def fit_problems(denoiser_config, configs):
    """As klein's, and the guidance embedding a dev base has."""
    problems = klein_fit_problems(denoiser_config, configs)
    if not denoiser_config.get("guidance_embeds", True):
        problems.append(("guidance_embeds", False, True, "FLUX.2 dev's guidance input"))
    return problems


def tokenize(parts, prompts, max_sequence_length=None):
    """As Flux2Pipeline._get_mistral_3_small_prompt_embeds: the pipeline's system message, then the prompt ("[IMG]"
    removed) as the user's turn, in Mistral's chat template, padded to max_sequence_length. -> [ids, attention mask]."""
    chats = [[{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
              {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]}]
             for prompt in prompts]
    encoded = parts["tokenizer"].apply_chat_template(
        chats, add_generation_prompt=False, tokenize=True, return_dict=True, return_tensors="pt",
        padding="max_length", truncation=True, max_length=max_sequence_length or MAX_SEQUENCE_LENGTH)
    return [encoded["input_ids"], encoded["attention_mask"]]


def encode_prompts(parts, ids):
    """Mistral3's hidden states of layers 10, 20, 30 (the pipeline's default), stacked per token."""
    return {"prompt_embeds": stacked_states(parts["text_encoder"], ids, TEXT_LAYERS)}


def guidance_kwargs(denoiser_config, scale, batch):
    """The guidance is the transformer's input (guidance-distilled), no unconditional branch."""
    return {"guidance_scale": scale}, False


def base_metadata(denoiser_config, prediction_type):
    """kohya's and ModelSpec's names: flux2, flux-2-dev."""
    return {"ss_base_model_version": "flux2", "modelspec.architecture": "flux-2-dev/lora"}
