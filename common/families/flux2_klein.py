"""FLUX.2 klein (Flux2KleinPipeline): a transformer trained by flow matching on the VAE's latents cut into 2 x 2
patches (32 channels -> 128) and normalized by the VAE's batch-norm running statistics, one token per patch with 4-axis
position ids (t, h, w, l); conditioned on the hidden states of Qwen3 layers 9, 18 and 27 side by side (the prompt in
Qwen3's chat template with an empty thinking block, padded to max_sequence_length); no guidance input, true
classifier-free guidance against "" when sampling. As diffusers' train_dreambooth_lora_flux2_klein.py trains it: the
posterior's mode (not a draw), the timestep divided by 1000, unshifted training sigmas, no loss weighting, target
noise - x0; as the pipeline embeds prompts (the script's --text_encoder_out_layers defaults to dev's 10, 20, 30).
Edits (reference images, common/references.py): the pipeline itself takes them (image=); their patchified, normalized
latents are appended to the image tokens, reference j's ids (10 + 10 j, row, column, 0), and the prediction is read
from the image tokens only, as Flux2KleinPipeline draws and train_dreambooth_lora_flux2_klein_img2img.py trains (its
dev twin, train_dreambooth_lora_flux2_img2img.py, numbers a batch's references by sample: 10, 20, ... for one each).

The UI file holds FLUX.2's own module names (double_blocks, single_blocks, kohya's lora_unet_ prefix): what ComfyUI's
key map gives every model it loads, where diffusers' names of FLUX.2's fused layers are not read by ComfyUI before
its FLUX.2 map (Comfy-Org/ComfyUI#11926). The double blocks' separate q, k and v LoRAs (and LoHas) go into the fused
qkv weight as one of their ranks together (down weights stacked, up weights block-diagonal), exactly; a LoKr's, which
cannot be fused, under ComfyUI's lycoris_ names, which its map slices out of the fused weight.

This module is complete on its own (a copy of train_lora.py for klein needs nothing else); FLUX.2 dev (flux2.py)
takes what the two share from here.
"""
import re

from ..diffusion import FLOW_SCHEDULER_CLASSES
from ..ui_lora import KOHYA_SUFFIXES
from ..ui_lora import ui_lora as lora_tensors
from ..vae import vae_factor, vae_sample_size
from . import classifier_free_guidance, embedding_kwargs, every_target, no_empty_prompt_zeros, vae_native_resolution

KEY = "flux2_klein"
NAME = "FLUX.2 klein"
PIPELINE = "Flux2KleinPipeline"
DENOISER = "transformer"
EDIT_PIPELINE = PIPELINE  # it takes reference images itself (image=)
REFERENCES = 4  # BFL's most for klein (docs.bfl.ai, "Reference Images per Model"; the pipeline sets none)
REFERENCE_MIN_SIDE = 64  # Flux2ImageProcessor.check_image_input's min_side_length: smaller ones are refused
REFERENCE_TIME = 10  # reference j's first id: 10 + 10 j (the pipelines' _prepare_image_ids)
SWAP_BLOCKS = ("transformer_blocks", "single_transformer_blocks")  # the blocks, in the order they run
# What its LoRA files say of their base (ModelSpec's modelspec.architecture, ours and musubi-tuner's spelling, by
# prefix; kohya's ss_base_model_version "flux2" is FLUX.2 dev's and klein's alike), and tensor names only FLUX.2's
# LoRAs have (its fused single-block projection, its SwiGLU feed-forwards, its shared modulations; `*`: any block).
LORA_METADATA = {"modelspec.architecture": ("flux-2-klein", "Flux.2-klein")}
LORA_KEY_PREFIXES = ("transformer.single_transformer_blocks.*.attn.to_qkv_mlp_proj.",
                     "transformer.transformer_blocks.*.ff.linear_",
                     "transformer.transformer_blocks.*.ff_context.linear_",
                     "transformer.double_stream_modulation_", "transformer.single_stream_modulation.",
                     "transformer.time_guidance_embed.", "lora_unet_double_stream_modulation_",
                     "lora_unet_single_stream_modulation_")
OBJECTIVE = "flow"
FLOW_DEFAULTS = {"weighting_scheme": "none", "precondition_outputs": 0}  # diffusers' FLUX.2 scripts'
COMPONENTS = {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
              "tokenizer": ("transformers", "AutoTokenizer"), "text_encoder": ("transformers", "Qwen3ForCausalLM"),
              "vae": ("diffusers", "AutoencoderKLFlux2"), "transformer": ("diffusers", "Flux2Transformer2DModel")}
TEXT_ENCODERS = ("text_encoder",)
TEXT_LAYERS = (9, 18, 27)  # the hidden states the pipeline stacks (its text_encoder_out_layers)
LORA_TEXT_ENCODERS = ()  # Qwen3 (4 B or 8 B parameters): no LoRA on it, as diffusers' script
# diffusers' script's default: the double blocks' image attention, the single blocks' fused projection and output
LORA_TARGETS = "to_k,to_q,to_v,to_out.0,to_qkv_mlp_proj,single_transformer_blocks.*.attn.to_out"
TEXT_LORA_TARGETS = ()
TIME_IDS = False
MAX_SEQUENCE_LENGTH = 512  # the pipeline's and diffusers' script's prompt length
TRAINING_GUIDANCE = None  # no guidance embedding
OPTIONAL_COMPONENTS = None
SAMPLERS = FLOW_SCHEDULER_CLASSES
SAMPLER, SAMPLE_STEPS, SAMPLE_GUIDANCE = "euler", 50, 4.0  # Flux2KleinPipeline's defaults
SAMPLE_FLAGS = ("max_sequence_length",)
LORA_SCALE_ARGUMENT = "attention_kwargs"
PIPELINE_EXTRAS = {}
SINGLE_FILE = False
NATIVE_SIZE_FROM = "VAE"
RESOLUTION_FACTOR = "the VAE's downsampling factor times 2 (FLUX.2 cuts latents into 2 x 2 patches)"
SIZES = {3072: "4b", 4096: "9b"}  # the transformer's width -> klein's size, for ModelSpec's architecture


def text_length(components, requested=None, training=False):
    """The prompt length in tokens: as requested, else the pipeline's 512, capped by the tokenizer's
    model_max_length."""
    tokenizer = components.get("tokenizer")
    return requested or min(MAX_SEQUENCE_LENGTH, getattr(tokenizer, "model_max_length", None) or MAX_SEQUENCE_LENGTH)


native_resolution = vae_native_resolution  # (the pipelines themselves default to 128 latents: 1024 px)


def resolution_factor(configs):
    return vae_factor(configs["vae"]) * 2


def size_factor(configs):
    return resolution_factor(configs)


def text_width(text_config):
    """A text encoder config's hidden size (Mistral3's under text_config), or None."""
    return (text_config.get("text_config") or text_config).get("hidden_size")


def fit_problems(denoiser_config, configs):
    """A fresh transformer against the base's other parts: 2 x 2 patches of the VAE's channels in, the text encoder's
    three stacked layers as its text width."""
    width = text_width(configs.get("text_encoder", {}))
    checks = (("in_channels", configs["vae"].get("latent_channels", 32) * 4, "4 x the VAE's latent channels"),
              ("joint_attention_dim", width and width * len(TEXT_LAYERS),
               f"{len(TEXT_LAYERS)} x the text encoder's hidden size"))
    return [(key, denoiser_config.get(key), want, what) for key, want, what in checks
            if want is not None and denoiser_config.get(key) != want]


def chat_ids(tokenizer, texts, max_sequence_length):
    """Each chat text tokenized as the pipeline does: padded and truncated to max_sequence_length. -> [input ids,
    attention mask], each [N, max_sequence_length]."""
    import torch

    encoded = [tokenizer(text, return_tensors="pt", padding="max_length", truncation=True,
                         max_length=max_sequence_length) for text in texts]
    return [torch.cat([e["input_ids"] for e in encoded]), torch.cat([e["attention_mask"] for e in encoded])]


def tokenize(parts, prompts, max_sequence_length=None):
    """As Flux2KleinPipeline._get_qwen3_prompt_embeds: each prompt as a user turn of Qwen3's chat template with the
    assistant's turn opened and thinking off, padded to max_sequence_length. -> [ids, attention mask]."""
    tokenizer = parts["tokenizer"]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False) for prompt in prompts]
    return chat_ids(tokenizer, texts, max_sequence_length or MAX_SEQUENCE_LENGTH)


def stacked_states(encoder, ids, layers):
    """The text encoder's hidden states of `layers` side by side per token: [B, L, len(layers) x width], as the
    FLUX.2 pipelines compute their prompt embeddings."""
    import torch

    output = encoder(input_ids=ids[0], attention_mask=ids[1], output_hidden_states=True, use_cache=False)
    states = torch.stack([output.hidden_states[k] for k in layers], dim=1)
    b, n, length, width = states.shape
    return states.permute(0, 2, 1, 3).reshape(b, length, n * width)


def encode_prompts(parts, ids):
    """Qwen3's hidden states of layers 9, 18, 27 (the pipeline's default), stacked per token. The pipeline gives the
    transformer no attention mask: the padding's states are part of the embedding."""
    return {"prompt_embeds": stacked_states(parts["text_encoder"], ids, TEXT_LAYERS)}


empty_prompt_zeros = no_empty_prompt_zeros


def pack(latents):
    """[B, C, h, w] -> [B, h w, C]: one token per (already patchified) latent position, rows first (Flux2 pipelines'
    _pack_latents)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def unpack(tokens, h, w):
    """pack's inverse."""
    b, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(b, c, h, w)


def packed_shape(shape):
    """The VAE's latents' shape [B, C, H, W] as the transformer sees them: 2 x 2 patches, one token each."""
    b, c, h, w = shape
    return [b, (h // 2) * (w // 2), c * 4]


def image_ids(h, w, device):
    """Each token's (t, h, w, l) = (0, row, column, 0): Flux2 pipelines' _prepare_latent_ids."""
    import torch

    return torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1)).to(device)


def text_ids(length, device):
    """Each text token's (0, 0, 0, position): Flux2 pipelines' _prepare_text_ids."""
    import torch

    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length)).to(device)


def reference_tokens(latents, device):
    """Reference latents (a list of [B, C, h, w], patchified and normalized) -> (their tokens [B, n, C], their ids
    [n, 4]): reference j's ids (10 + 10 j, row, column, 0), as Flux2KleinPipeline.prepare_image_latents makes them."""
    import torch

    ids = []
    for j, x in enumerate(latents):
        time = torch.tensor([REFERENCE_TIME * (j + 1)])
        ids.append(torch.cartesian_prod(time, torch.arange(x.shape[-2]), torch.arange(x.shape[-1]), torch.arange(1)))
    return torch.cat([pack(x) for x in latents], dim=1), torch.cat(ids).to(device)


def denoise(transformer, noisy, timesteps, cond, guidance=None):
    """The transformer's prediction (noise - x0) for noisy patchified latents [B, C, h, w], packed in and unpacked
    out; the timestep divided by 1000, as the pipeline gives it; `guidance` for a base with a guidance embedding
    (FLUX.2 dev). With cond["reference_latents"] (edits) their tokens follow the image tokens, and the prediction is
    the image tokens'."""
    import torch

    b, _, h, w = noisy.shape
    text = cond["prompt_embeds"]
    tokens, ids = pack(noisy), image_ids(h, w, noisy.device)
    if cond.get("reference_latents"):
        more, more_ids = reference_tokens(cond["reference_latents"], noisy.device)
        tokens, ids = torch.cat([tokens, more.to(tokens.dtype)], dim=1), torch.cat([ids, more_ids])
    out = transformer(hidden_states=tokens, timestep=timesteps / 1000,
                      guidance=None if guidance is None else torch.full((b,), float(guidance), device=noisy.device),
                      encoder_hidden_states=text, txt_ids=text_ids(text.shape[1], noisy.device),
                      img_ids=ids, return_dict=False)[0]
    return unpack(out[:, :h * w], h, w)


def reference_kwargs(references, height, width):
    """The pipeline's arguments to draw height x width from `references` (PIL images, one per reference, for every
    prompt of the call): each resized to the drawing's size, as training pairs it with its target (the pipeline then
    keeps it as it is: a multiple of its factor, under 1024 x 1024)."""
    return {"image": [image.resize((width, height)) for image in references]}


guidance_kwargs = classifier_free_guidance  # true CFG against "" (ignored by a step-distilled klein)


pipeline_prompt_kwargs = embedding_kwargs


def sample_size(pipe):
    """(height, width) drawn by default: the VAE's sample_size (the pipeline's own default is 128 latents)."""
    size = vae_sample_size(pipe.vae.config) or pipe.default_sample_size * pipe.vae_scale_factor
    return size, size


def latent_config(vae):
    """The VAE's latents -> the denoiser's (common/vae.py): 2 x 2 patches, minus the batch norm's running mean,
    divided by sqrt(running variance + eps), as the pipeline and diffusers' script compute them; training uses the
    posterior's mode, as the script does."""
    import torch

    std = torch.sqrt(vae.bn.running_var.float() + vae.config.batch_norm_eps)
    return {"latent_patch": 2, "latents_mean": vae.bn.running_mean.float().tolist(), "latents_std": std.tolist(),
            "scaling_factor": 1.0, "latent_mode": True}


def unpack_latents(pipe, latents, height, width):
    """The pipeline's latents -> the denoiser's [B, C, h, w]: its output_type="latent" result is the VAE's own
    latents (denormalized, unpatchified), normalized back here; the scheduler's (x0 along the way) are the packed
    tokens, unpacked."""
    from ..vae import normalize

    if latents.ndim == 3:
        factor = pipe.vae_scale_factor * 2
        return unpack(latents, height // factor, width // factor)
    return normalize(latent_config(pipe.vae), latents.float())


text_encoder_targets = every_target


def base_metadata(denoiser_config, prediction_type):
    """kohya's and ModelSpec's names: flux2, flux-2-klein(-4b, -9b by the transformer's width)."""
    size = SIZES.get(denoiser_config.get("num_attention_heads", 0) * denoiser_config.get("attention_head_dim", 0))
    return {"ss_base_model_version": "flux2",
            "modelspec.architecture": f"flux-2-klein{'-' + size if size else ''}/lora"}


UI_IMPLEMENTATION = "https://github.com/black-forest-labs/flux2"  # FLUX.2's own module names, as musubi-tuner's

# diffusers' module -> FLUX.2's own (what ComfyUI loads), block index N kept; q, k and v go into one fused weight.
NATIVE_NAMES = (
    (r"transformer_blocks\.(\d+)\.attn\.to_([qkv])", r"double_blocks.\1.img_attn.qkv"),
    (r"transformer_blocks\.(\d+)\.attn\.add_([qkv])_proj", r"double_blocks.\1.txt_attn.qkv"),
    (r"transformer_blocks\.(\d+)\.attn\.to_out\.0", r"double_blocks.\1.img_attn.proj"),
    (r"transformer_blocks\.(\d+)\.attn\.to_add_out", r"double_blocks.\1.txt_attn.proj"),
    (r"transformer_blocks\.(\d+)\.ff\.linear_in", r"double_blocks.\1.img_mlp.0"),
    (r"transformer_blocks\.(\d+)\.ff\.linear_out", r"double_blocks.\1.img_mlp.2"),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_in", r"double_blocks.\1.txt_mlp.0"),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_out", r"double_blocks.\1.txt_mlp.2"),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj", r"single_blocks.\1.linear1"),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_out", r"single_blocks.\1.linear2"),
    (r"x_embedder", "img_in"), (r"context_embedder", "txt_in"),
    (r"time_guidance_embed\.timestep_embedder\.linear_([12])", r"time_in.\1"),
    (r"time_guidance_embed\.guidance_embedder\.linear_([12])", r"guidance_in.\1"),
    (r"(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.linear", r"\1.lin"),
    (r"proj_out", "final_layer.linear"), (r"norm_out\.linear", "final_layer.adaLN_modulation.1"),
)
EMBEDDER_LAYERS = {"1": "in_layer", "2": "out_layer"}
SWAPPED = ("final_layer.adaLN_modulation.1",)  # scale and shift in the other order than diffusers' norm_out
FUSED = {"q": 0, "k": 1, "v": 2}


def native_name(module):
    """diffusers' module path -> (FLUX.2's own module path, the slot of a fused q/k/v weight or None); KeyError for a
    module FLUX.2's own model has not."""
    for pattern, native in NATIVE_NAMES:
        match = re.fullmatch(pattern, module)
        if match:
            name = match.expand(native)
            if name.startswith(("time_in.", "guidance_in.")):
                name = name[:-1] + EMBEDDER_LAYERS[name[-1]]
            slot = FUSED[match.group(2)] if native.endswith(".qkv") else None
            return name, slot
    raise KeyError(module)


def fuse(parts, weights, blockwise):
    """The slots' tensors of one fused weight: `weights` stacked (a LoRA's down, a LoHa's b factors), `blockwise`
    placed block-diagonally (up weights: each slot's rows, its own rank's columns; a missing slot's rows are zero)."""
    import torch

    slots = sorted(parts)
    fused = {name: torch.cat([parts[s][name] for s in slots]) for name in weights}
    for name in blockwise:
        rows = parts[slots[0]][name].shape[0]
        blocks = [parts[s][name] for s in slots]
        out = torch.zeros(rows * len(FUSED), sum(b.shape[1] for b in blocks), dtype=blocks[0].dtype)
        column = 0
        for slot, block in zip(slots, blocks):
            out[slot * rows:(slot + 1) * rows, column:column + block.shape[1]] = block
            column += block.shape[1]
        fused[name] = out
    return fused


def ui_lora(states, alpha, denoiser_config):
    """The UI file's tensors: kohya's names of FLUX.2's own modules (`lora_unet_double_blocks_0_img_attn_qkv`,
    `.lora_down.weight`, `.lora_up.weight`, `.alpha`), what ComfyUI's key map reads for FLUX.2 (and diffusers' FLUX.2
    loader reads back). A double block's q, k and v LoRAs become one LoRA of the fused qkv weight (its alpha times the
    number of parts, so that alpha / rank stays); a LoHa's likewise; a LoKr's cannot be fused (a stack of Kronecker
    products is none): each goes under ComfyUI's `lycoris_<diffusers module>` name, which its Flux map slices out of
    the fused weight. The final norm's halves swapped (FLUX.2 holds shift before scale); a LoKr's there under its
    `lycoris_` name too, which ComfyUI's map swaps."""
    from ..cli import UserError

    modules, fused, sliced = {}, {}, {}
    for key, value in states["transformer"].items():
        module, _, weight = key.partition(".lora_") if ".lora_" in key else key.rpartition(".")
        weight = ("lora_" + weight) if ".lora_" in key else weight
        try:
            name, slot = native_name(module)
        except KeyError:
            raise UserError(f"the UI LoRA file has no name for the module '{module}' (FLUX.2's own model has none); "
                            "leave it out of the LoRA's target modules") from None
        if slot is None and not (weight.startswith("lokr_") and name in SWAPPED):
            modules.setdefault(name, {})[weight] = value
        elif weight.startswith("lokr_"):  # (the final norm's too: ComfyUI swaps a LoKr's halves under this name)
            sliced[f"lycoris_{module.replace('.', '_')}.{weight}"] = value
        else:
            fused.setdefault(name, {}).setdefault(slot, {})[weight] = value
    groups = {1: {f"lora_unet_{name.replace('.', '_')}.{weight}": value for name, parts in modules.items()
                  for weight, value in parts.items()}}
    for name, slots in fused.items():
        names = set(next(iter(slots.values())))
        if "lora_magnitude_vector" in names and len(slots) < len(FUSED):
            raise UserError(f"the UI LoRA file: a DoRA on some of a double block's q, k and v but not all cannot be "
                            f"written as FLUX.2's fused {name} weight; target all three, or train a LoRA")
        parts = fuse(slots, [n for n in names if n in ("lora_A.weight", "hada_w1_b", "hada_w2_b",
                                                       "lora_magnitude_vector")],
                     [n for n in names if n in ("lora_B.weight", "hada_w1_a", "hada_w2_a")])
        groups.setdefault(len(slots), {}).update({f"lora_unet_{name.replace('.', '_')}.{weight}": value
                                                  for weight, value in parts.items()})
    groups[1].update(sliced)
    weights = {}
    for count, state in groups.items():
        weights.update(lora_tensors(state, alpha * count, lambda module: module, KOHYA_SUFFIXES,
                                    swapped_halves=[f"lora_unet_{m.replace('.', '_')}" for m in SWAPPED]))
    for module in SWAPPED:  # the update's rows too: ComfyUI applies the file's weights as they are
        for weight in ("lora_up.weight", "hada_w1_a", "hada_w2_a"):
            key = f"lora_unet_{module.replace('.', '_')}.{weight}"
            if key in weights:
                weights[key] = swap_halves(weights[key])
    return weights


def swap_halves(weight):
    import torch

    return torch.cat(weight.chunk(2)[::-1]).contiguous()
