"""Qwen-Image (QwenImagePipeline): an MMDiT of dual-stream blocks trained by flow matching on 2 x 2 packed latents of a
3-D causal VAE (an image is one frame; 16 channels normalised by the per-channel latents_mean and latents_std of its
config, no scaling factor), conditioned on the last hidden states of Qwen2.5-VL over the prompt in the pipeline's chat
template, the template's own tokens dropped (prompt_template_encode_start_idx), with their attention mask. As
diffusers' train_dreambooth_lora_qwen_image.py trains it: the transformer takes the timestep divided by 1000 and each
image's latent grid (img_shapes, for its rotary positions), sigmas drawn uniformly (weighting scheme none) from the
scheduler's training sigmas, target noise - x0. That script loads the scheduler with shift=3.0, which changes nothing
for Qwen-Image's config: with use_dynamic_shifting the training sigmas are unshifted, the shift being for sampling.
The pipeline samples with true classifier-free guidance (true_cfg_scale against a negative prompt), the combined
prediction rescaled to the norm of the conditional one.

Prompts are embedded at one fixed length (--max_sequence_length, 512 by default as in diffusers' script and the
pipeline), zeros after each prompt's end and a mask that says so: what the pipeline computes, padded, so that every
cached embedding has one shape. LoRA on the text encoder (a 7 B LLM) is not offered.

The packing and the image shapes take extra reference latents after the image's (what Qwen-Image-Edit's pipelines
give the transformer): `pack_tokens`, `image_shapes` and `denoise(..., references=...)`. Edit LoRAs themselves are
refused (NO_REFERENCES), and so are Qwen-Image-Edit bases (the registry's REFUSED).
"""
from functools import lru_cache

from ..cli import UserError
from ..diffusion import FLOW_SCHEDULER_CLASSES
from ..ui_lora import DIFFUSERS_IMPLEMENTATION, prefixed_lora
from ..vae import vae_factor
from . import every_target, no_empty_prompt_zeros, vae_latents

KEY = "qwen_image"
NAME = "Qwen-Image"
PIPELINE = "QwenImagePipeline"
DENOISER = "transformer"
REFERENCES = 0  # reference images (edit LoRAs): refused, for NO_REFERENCES
EDIT_PIPELINE = None
NO_REFERENCES = ("Qwen-Image-Edit's pipelines also show the reference images to the Qwen2.5-VL text encoder with the "
                 "instruction, through Qwen2VLProcessor (which needs torchvision), and the recipes embed each caption "
                 "once, not once per instruction and reference: Qwen-Image-Edit edit LoRAs are not supported yet "
                 "(docs/train_lora.md); train them on a FLUX.1 Kontext or FLUX.2 base")
SWAP_BLOCKS = ("transformer_blocks",)  # the denoiser's blocks, in the order its forward runs them
# What its LoRA files say of their base (musubi-tuner's ss_base_model_version and ModelSpec architecture, by prefix),
# and tensor names only its LoRAs have: its text and image input layers, the blocks under kohya's and ComfyUI's names
# (musubi-tuner's files; ComfyUI's, as the UI file here).
LORA_METADATA = {"ss_base_model_version": ("qwen_image",), "modelspec.architecture": ("Qwen-Image",)}
LORA_KEY_PREFIXES = ("transformer.img_in.", "transformer.txt_in.", "lora_unet_transformer_blocks_",
                     "diffusion_model.transformer_blocks.")
OBJECTIVE = "flow"
FLOW_DEFAULTS = {"weighting_scheme": "none", "precondition_outputs": 0}  # diffusers' Qwen-Image script's
COMPONENTS = {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
              "tokenizer": ("transformers", "Qwen2Tokenizer"),
              "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
              "vae": ("diffusers", "AutoencoderKLQwenImage"),
              "transformer": ("diffusers", "QwenImageTransformer2DModel")}
TEXT_ENCODERS = ("text_encoder",)
LORA_TEXT_ENCODERS = ()  # Qwen2.5-VL 7B: no LoRA on it here (nor in diffusers' script)
LORA_TARGETS = "to_k,to_q,to_v,to_out.0"  # diffusers' script's default
TEXT_LORA_TARGETS = ()
TIME_IDS = False
MAX_SEQUENCE_LENGTH = 512  # diffusers' script's default, and the pipeline's
MAX_PIPELINE_LENGTH = 1024  # the most QwenImagePipeline takes
TRAINING_GUIDANCE = None  # no guidance embedding (guidance_embeds False)
OPTIONAL_COMPONENTS = None
SAMPLERS = FLOW_SCHEDULER_CLASSES
SAMPLER, SAMPLE_STEPS, SAMPLE_GUIDANCE = "euler", 50, 4.0  # QwenImagePipeline's defaults (true_cfg_scale 4.0)
SAMPLE_FLAGS = ("negative_prompt", "max_sequence_length")
LORA_SCALE_ARGUMENT = "attention_kwargs"  # the pipeline call's argument that scales the LoRAs
PIPELINE_EXTRAS = {}
SINGLE_FILE = False  # no single-file checkpoint layout here (train_text_to_image.py --save_model_as)
NATIVE_SIZE_FROM = "pipeline"  # QwenImagePipeline's default size: 128 latents x the VAE's factor
RESOLUTION_FACTOR = "the VAE's downsampling factor times 2 (Qwen-Image packs 2 x 2 latents)"
DEFAULT_LATENTS = 128  # QwenImagePipeline.default_sample_size


@lru_cache(maxsize=None)
def prompt_template(pipeline=PIPELINE):
    """The pipeline's prompt template ("...{}...") and how many of its leading tokens the pipeline drops, read from an
    empty instance of the pipeline class (the values are set in its __init__)."""
    import diffusers

    pipe = getattr(diffusers, pipeline)(**{name: None for name in COMPONENTS})
    return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx


def text_length(components, requested=None, training=False):
    """The prompt's length in tokens after the template's: as requested, else 512 (diffusers' script's and the
    pipeline's); the pipeline takes at most 1024."""
    length = requested or MAX_SEQUENCE_LENGTH
    if length > MAX_PIPELINE_LENGTH:
        raise UserError(f"--max_sequence_length {length}: {PIPELINE} takes prompts of at most {MAX_PIPELINE_LENGTH} "
                        "tokens; give less")
    return length


def native_resolution(configs):
    """What QwenImagePipeline draws by default: 128 latents x the VAE's factor (1024 px for Qwen-Image)."""
    return DEFAULT_LATENTS * vae_factor(configs["vae"])


def resolution_factor(configs):
    return vae_factor(configs["vae"]) * 2


def size_factor(configs):
    return resolution_factor(configs)


def fit_problems(denoiser_config, configs):
    """A fresh transformer against the base's other parts: packed latents in, the VAE's channels out, the text
    model's width."""
    z_dim = configs["vae"].get("z_dim", 16)
    text = configs.get("text_encoder", {})
    checks = (("in_channels", z_dim * 4, "4 x the VAE's z_dim"), ("out_channels", z_dim, "the VAE's z_dim"),
              ("joint_attention_dim", text.get("text_config", text).get("hidden_size"), "the text model's hidden size"))
    return [(key, denoiser_config.get(key), want, what) for key, want, what in checks
            if want is not None and denoiser_config.get(key) != want]


def tokenize(parts, prompts, max_sequence_length=None):
    """Each prompt in the pipeline's template, padded (and cut) to the template's dropped tokens plus
    max_sequence_length: [token ids, attention mask]."""
    template, dropped = prompt_template()
    tokens = parts["tokenizer"]([template.format(p) for p in prompts], max_length=dropped + max_sequence_length,
                                padding="max_length", truncation=True, return_tensors="pt")
    return [tokens.input_ids, tokens.attention_mask]


def encode_prompts(parts, ids):
    """As QwenImagePipeline.encode_prompt, at a fixed length: the text model's last hidden states (its decoder alone:
    the pipeline's hidden_states[-1], without the language-model head) with the template's tokens dropped, zeros after
    each prompt's end, and the mask of its tokens (prompt_embeds_mask)."""
    _, dropped = prompt_template()
    input_ids, mask = ids
    encoder = parts["text_encoder"]
    states = getattr(encoder, "model", encoder)(input_ids=input_ids, attention_mask=mask).last_hidden_state
    mask = mask[:, dropped:]
    return {"prompt_embeds": states[:, dropped:] * mask[..., None].to(states.dtype), "prompt_embeds_mask": mask}


empty_prompt_zeros = no_empty_prompt_zeros


def pack(latents):
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: each 2 x 2 patch one token (QwenImagePipeline._pack_latents' layout)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens, h, w):
    """pack's inverse, for latents of h x w."""
    b, _, channels = tokens.shape
    return tokens.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, channels // 4, h, w)


def packed_shape(shape):
    """[B, C, H, W] latents' shape as the transformer sees them."""
    b, c, h, w = shape
    return [b, (h // 2) * (w // 2), c * 4]


def pack_tokens(latents, references=()):
    """The transformer's image tokens: the latents' packed, then each reference latent's (Qwen-Image-Edit) after
    them."""
    import torch

    return torch.cat([pack(x) for x in (latents, *references)], dim=1) if references else pack(latents)


def image_shapes(latents, references=()):
    """img_shapes as the pipelines give it: per sample, (frames, rows, columns) of packed tokens for the image and then
    each reference latent."""
    grids = [(1, x.shape[-2] // 2, x.shape[-1] // 2) for x in (latents, *references)]
    return [grids] * latents.shape[0]


def batch_text(cond):
    """The batch's prompt embeddings and mask cut after its longest prompt, the mask None when nothing is left to mask
    out: what the pipeline and diffusers' script give the transformer (the same output as the padded ones, with fewer
    tokens, and with no mask an attention kernel that takes none)."""
    mask = cond["prompt_embeds_mask"]
    length = int(mask.sum(dim=1).max())
    mask = mask[:, :length]
    return cond["prompt_embeds"][:, :length], None if bool(mask.all()) else mask


def denoise(transformer, noisy, timesteps, cond, guidance=None, references=()):
    """The transformer's prediction (noise - x0) for noisy latents [B, C, H, W], packed in and unpacked out; the
    timestep divided by 1000 and the text (batch_text), as the pipeline gives them. `references`: latents the
    transformer sees after the image's tokens and predicts nothing for (Qwen-Image-Edit)."""
    _, _, h, w = noisy.shape
    text, mask = batch_text(cond)
    out = transformer(hidden_states=pack_tokens(noisy, references), timestep=timesteps / 1000,
                      encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                      img_shapes=image_shapes(noisy, references), return_dict=False)[0]
    return unpack(out[:, :(h // 2) * (w // 2)], h, w)


def guidance_kwargs(denoiser_config, scale, batch):
    """True classifier-free guidance (QwenImagePipeline's true_cfg_scale, against the empty prompt that caption
    dropout trains; the pipeline rescales the result to the conditional prediction's norm) when `scale` is above 1.
    -> (the call's arguments, whether it needs the unconditional embeddings)."""
    if scale <= 1:
        return {"true_cfg_scale": scale}, False
    return {"true_cfg_scale": scale, "negative_prompt": [""] * batch}, True


def pipeline_prompt_kwargs(cond, uncond):
    """A pipeline call's arguments for embeddings computed beforehand, with their masks and their length (the
    pipeline would cut longer ones to its default 512)."""
    kwargs = {"prompt_embeds": cond["prompt_embeds"], "prompt_embeds_mask": cond["prompt_embeds_mask"],
              "max_sequence_length": cond["prompt_embeds"].shape[1]}
    if uncond is not None:
        kwargs.update(negative_prompt_embeds=uncond["prompt_embeds"],
                      negative_prompt_embeds_mask=uncond["prompt_embeds_mask"])
    return kwargs


def sample_size(pipe):
    """(height, width) QwenImagePipeline draws by default: 128 latents x the VAE's factor."""
    size = pipe.default_sample_size * pipe.vae_scale_factor
    return size, size


def unpack_latents(pipe, latents, height, width):
    """The pipeline's output_type="latent" result (packed tokens, normalised) -> [B, C, h, w]."""
    return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)[:, :, 0]


text_encoder_targets = every_target


def base_metadata(denoiser_config, prediction_type):
    """musubi-tuner's names: ss_base_model_version qwen_image, ModelSpec architecture Qwen-Image."""
    return {"ss_base_model_version": "qwen_image", "modelspec.architecture": "Qwen-Image/lora"}


UI_IMPLEMENTATION = DIFFUSERS_IMPLEMENTATION


def ui_lora(states, alpha, denoiser_config):
    """The UI file under ComfyUI's own names for its QwenImage model, `diffusion_model.<module>` (its modules are
    diffusers', and its final norm keeps diffusers' scale/shift order), with alphas and DoRA magnitudes
    (common/ui_lora.py). diffusers' Qwen-Image loader reads these names too, alphas included (it refuses them under
    `transformer.`)."""
    return prefixed_lora(states["transformer"], alpha, "diffusion_model")


latent_config = vae_latents
