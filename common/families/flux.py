"""Flux.1 (FluxPipeline): a transformer trained by flow matching on 2 x 2 packed latents, conditioned on T5's hidden
states (with text ids) and CLIP's pooled embedding, with a guidance input when the base is guidance-distilled
(Flux.1-dev: config guidance_embeds). As diffusers' train_dreambooth_lora_flux.py trains it: the transformer takes
the timestep divided by 1000, the training sigmas are unshifted (the config's dynamic shifting is for sampling), no
loss weighting, target noise - x0. Edits (FLUX.1 Kontext, FluxKontextPipeline; any Flux.1 base given reference
images, common/references.py): the reference's packed latents appended to the image tokens with their own ids (first
coordinate 1), the prediction read from the image tokens only, as train_dreambooth_lora_flux_kontext.py does.
"""
from ..diffusion import FLOW_SCHEDULER_CLASSES
from ..prompts import clip_ids, t5_ids
from ..ui_lora import DIFFUSERS_IMPLEMENTATION, prefixed_lora
from ..vae import vae_factor, vae_sample_size
from . import embedding_kwargs, every_target, no_empty_prompt_zeros, t5_text_length, vae_latents, vae_native_resolution

KEY = "flux"
NAME = "Flux.1"
PIPELINE = "FluxPipeline"
EDIT_PIPELINE = "FluxKontextPipeline"  # draws from reference images (FLUX.1 Kontext)
PIPELINES = (EDIT_PIPELINE,)  # FLUX.1 Kontext bases' model_index.json names it
REFERENCES = 1  # reference images FluxKontextPipeline takes
DENOISER = "transformer"
# What its LoRA files say of their base (kohya's ss_base_model_version, ModelSpec's modelspec.architecture, by prefix),
# and tensor names only its LoRAs have: the single-stream blocks, kohya's double_blocks/single_blocks, the guidance
# embedder.
LORA_METADATA = {"ss_base_model_version": ("flux1",), "modelspec.architecture": ("flux-1",)}
LORA_KEY_PREFIXES = ("transformer.single_transformer_blocks.", "lora_unet_double_blocks_", "lora_unet_single_blocks_",
                     "transformer.x_embedder.", "transformer.time_text_embed.guidance_embedder.")
OBJECTIVE = "flow"
FLOW_DEFAULTS = {"weighting_scheme": "none", "precondition_outputs": 0}  # diffusers' Flux script's
COMPONENTS = {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
              "tokenizer": ("transformers", "CLIPTokenizer"), "tokenizer_2": ("transformers", "T5TokenizerFast"),
              "text_encoder": ("transformers", "CLIPTextModel"), "text_encoder_2": ("transformers", "T5EncoderModel"),
              "vae": ("diffusers", "AutoencoderKL"), "transformer": ("diffusers", "FluxTransformer2DModel")}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")  # CLIP (pooled), T5 (states)
LORA_TEXT_ENCODERS = ("text_encoder",)  # never T5, as diffusers' script
LORA_TARGETS = ("attn.to_k,attn.to_q,attn.to_v,attn.to_out.0,attn.add_k_proj,attn.add_q_proj,attn.add_v_proj,"
                "attn.to_add_out,ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2")  # diffusers' default
TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
TIME_IDS = False
MAX_SEQUENCE_LENGTH = 512  # diffusers' Flux script's default
TRAINING_GUIDANCE = 3.5  # the guidance input while training (diffusers' Flux script's --guidance_scale)
OPTIONAL_COMPONENTS = None
SAMPLERS = FLOW_SCHEDULER_CLASSES
SAMPLER, SAMPLE_STEPS, SAMPLE_GUIDANCE = "euler", 28, 3.5  # FluxPipeline's defaults (3.5: the guidance input; a base
# without a guidance embedding draws without true CFG unless its card says so: common/sampling_defaults.py)
SAMPLE_FLAGS = ("max_sequence_length",)
LORA_SCALE_ARGUMENT = "joint_attention_kwargs"  # the pipeline call's argument that scales the LoRAs
PIPELINE_EXTRAS = {}
SINGLE_FILE = False  # no single-file checkpoint layout here (train_text_to_image.py --save_model_as)
SWAP_BLOCKS = ("transformer_blocks", "single_transformer_blocks")  # the blocks, in the order they run
NATIVE_SIZE_FROM = "VAE"  # whose config's sample_size is the native training size
RESOLUTION_FACTOR = "the VAE's downsampling factor times 2 (Flux packs 2 x 2 latents)"


def text_length(components, requested=None, training=False):
    """T5's prompt length: as requested, else 512 (diffusers' Flux script's and the pipeline's), capped by the T5
    tokenizer's model_max_length."""
    return t5_text_length(components.get("tokenizer_2"), requested, MAX_SEQUENCE_LENGTH if training else 512)


native_resolution = vae_native_resolution  # (FluxPipeline itself defaults to 128 latents)


def resolution_factor(configs):
    return vae_factor(configs["vae"]) * 2


def size_factor(configs):
    return resolution_factor(configs)


def fit_problems(denoiser_config, configs):
    """A fresh transformer against the base's other parts: packed latents in, T5's width, CLIP's pooled width."""
    checks = (("in_channels", configs["vae"].get("latent_channels", 16) * 4, "4 x the VAE's latent channels"),
              ("joint_attention_dim", configs.get("text_encoder_2", {}).get("d_model"), "T5's d_model"),
              ("pooled_projection_dim", configs.get("text_encoder", {}).get("hidden_size"), "CLIP's hidden size"))
    return [(key, denoiser_config.get(key), want, what) for key, want, what in checks
            if want is not None and denoiser_config.get(key) != want]


def tokenize(parts, prompts, max_sequence_length=None):
    """CLIP's 77 ids (for the pooled embedding) and T5's max_sequence_length ids."""
    return [clip_ids(parts["tokenizer"], prompts), t5_ids(parts["tokenizer_2"], prompts, max_sequence_length)]


def encode_prompts(parts, ids):
    """As FluxPipeline.encode_prompt: CLIP's pooled output, T5's last hidden states."""
    pooled = parts["text_encoder"](ids[0], output_hidden_states=False).pooler_output
    return {"prompt_embeds": parts["text_encoder_2"](ids[1], output_hidden_states=False)[0],
            "pooled_prompt_embeds": pooled}


empty_prompt_zeros = no_empty_prompt_zeros


def pack(latents):
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: each 2 x 2 patch one token (FluxPipeline._pack_latents' layout)."""
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


def image_ids(h, w, device):
    """Each packed token's (0, row, column): FluxPipeline._prepare_latent_image_ids for h/2 x w/2 tokens."""
    import torch

    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] += torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] += torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3)


def reference_tokens(latents, device):
    """Reference latents (a list of [B, C, h, w]) -> (their tokens [B, n, 4C], their ids [n, 3]): packed as the image
    tokens, each token's ids (1, row, column), as FluxKontextPipeline.prepare_latents makes them."""
    import torch

    ids = [image_ids(x.shape[-2], x.shape[-1], device) for x in latents]
    for i in ids:
        i[:, 0] = 1
    return torch.cat([pack(x) for x in latents], dim=1), torch.cat(ids)


def denoise(transformer, noisy, timesteps, cond, guidance=None):
    """The transformer's prediction (noise - x0) for noisy latents [B, C, H, W], packed in and unpacked out; the
    timestep divided by 1000, as the pipeline gives it; `guidance` for a guidance-distilled base. With
    cond["reference_latents"] (edits) their tokens follow the image tokens, and the prediction is the image tokens'."""
    import torch

    b, _, h, w = noisy.shape
    text = cond["prompt_embeds"]
    tokens, ids = pack(noisy), image_ids(h, w, noisy.device)
    if cond.get("reference_latents"):
        more, more_ids = reference_tokens(cond["reference_latents"], noisy.device)
        tokens, ids = torch.cat([tokens, more.to(tokens.dtype)], dim=1), torch.cat([ids, more_ids])
    out = transformer(hidden_states=tokens, timestep=timesteps / 1000,
                      guidance=None if guidance is None else torch.full((b,), float(guidance), device=noisy.device),
                      pooled_projections=cond["pooled_prompt_embeds"], encoder_hidden_states=text,
                      txt_ids=torch.zeros(text.shape[1], 3, device=noisy.device), img_ids=ids, return_dict=False)[0]
    return unpack(out[:, :(h // 2) * (w // 2)], h, w)


def reference_kwargs(references, height, width):
    """FluxKontextPipeline's arguments to draw height x width from `references` (one PIL image, or a list of one per
    prompt): the reference resized to the drawing's size, as training pairs it with its target (the pipeline's
    resize to its preferred resolutions off), and max_area kept at height x width (the pipeline's default of
    1024 x 1024 would change the size)."""
    def resized(image):
        return [resized(i) for i in image] if isinstance(image, list) else image.resize((width, height))

    return {"image": resized(references[0]), "max_area": height * width, "_auto_resize": False}


def guidance_kwargs(denoiser_config, scale, batch):
    """A guidance-distilled base (Flux.1-dev) is given the guidance as an input, with no unconditional branch; one
    without a guidance embedding (Flux.1-schnell, a base trained here from scratch with caption dropout) gets true
    classifier-free guidance (FluxPipeline's true_cfg_scale, against the empty prompt) when `scale` is above 1, and
    no guidance argument at all at 1 or below. -> (the call's arguments, whether it needs the unconditional
    embeddings)."""
    if denoiser_config.get("guidance_embeds"):
        return {"guidance_scale": scale}, False
    if scale <= 1:
        return {}, False
    return {"true_cfg_scale": scale, "negative_prompt": [""] * batch}, True


pipeline_prompt_kwargs = embedding_kwargs


def sample_size(pipe):
    """(height, width) drawn by default: the VAE's sample_size (FluxPipeline's own default is 128 latents)."""
    size = vae_sample_size(pipe.vae.config) or pipe.default_sample_size * pipe.vae_scale_factor
    return size, size


def unpack_latents(pipe, latents, height, width):
    return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)


text_encoder_targets = every_target


def base_metadata(denoiser_config, prediction_type):
    """kohya's and ModelSpec's names: flux1, flux-1-dev (guidance-distilled) or flux-1-schnell."""
    variant = "dev" if denoiser_config.get("guidance_embeds") else "schnell"
    return {"ss_base_model_version": "flux1", "modelspec.architecture": f"flux-1-{variant}/lora"}


UI_IMPLEMENTATION = DIFFUSERS_IMPLEMENTATION


def ui_lora(states, alpha, denoiser_config):
    """ComfyUI and Forge read Flux.1 LoRAs under diffusers' module paths (`transformer.<module>`; its CLIP's under
    `text_encoder.text_model.`), with alphas and DoRA magnitudes; the final norm's halves are swapped in ComfyUI's
    weight (common/ui_lora.py)."""
    weights = prefixed_lora(states["transformer"], alpha, "transformer", swapped_halves=("norm_out.linear",))
    if "text_encoder" in states:
        weights.update(prefixed_lora(states["text_encoder"], alpha, "text_encoder", "text_model."))
    return weights


latent_config = vae_latents
