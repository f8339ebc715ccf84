"""Wan 2.1 and 2.2 text-to-video (WanPipeline) and image-to-video (WanImageToVideoPipeline): a 3-D transformer trained
by flow matching on the latents of a 3-D causal VAE (AutoencoderKLWan: 4x fewer frames, 8x fewer pixels a side, 16
channels normalised by its config's per-channel latents_mean and latents_std, no scaling factor), which it cuts into 1 x
2 x 2 patches itself, conditioned on the last hidden states of UMT5 over the cleaned prompt (the pipeline's
prompt_clean), zeros after each prompt's end, no mask given to the transformer. The transformer takes the timestep in
the scheduler's units (sigma x 1000) and predicts the velocity noise - x0; the training sigmas are the scheduler's,
shifted by its config's shift (what the pipeline samples with), no loss weighting, on the latent distribution's mode.
The pipeline guides by classifier-free guidance against the negative (default empty) prompt.

Latents are [B, C, F, h, w] for clips and [B, C, h, w] for images, which train as clips of one frame (the VAE adds and
drops that frame axis, common/vae.py; `denoise` here does the same for the transformer). LoRA on UMT5 is not offered.
TI2V-5B's VAE cuts 2 x 2 patches first (48 channels, scale_factor_spatial 16) and its pipeline gives the transformer
one timestep per token (expand_timesteps), all equal without a first frame: the same as one per clip. Wan 2.2 A14B
has two experts switched at a boundary timestep (`transformer` at t >= boundary_ratio x 1000, `transformer_2` below):
train_lora.py --wan_expert trains a LoRA of one of them on its side of the boundary, or of both, each sample through
its timestep's expert (expert_family, experts_model).

Image-to-video (WanImageToVideoPipeline bases; sample.py --image gives the first frame, a training clip its own frame
0): TI2V-5B (expand_timesteps) takes the first frame's clean latents in the first latent frame's place, at timestep 0,
and learns the frames after it (first_frame_view); Wan 2.2 I2V A14B and Wan 2.1 I2V take a mask and the latents of
the first frame followed by black frames as 20 more input channels, Wan 2.1 also the frame's CLIP image embeddings,
and learn every frame (condition_view, image_condition, from each batch's pixels).
"""
from ..cli import UserError
from ..diffusion import FLOW_SCHEDULER_CLASSES
from ..ui_lora import DIFFUSERS_IMPLEMENTATION, DIFFUSERS_SUFFIXES
from ..ui_lora import ui_lora as named_lora
from ..vae import vae_factor
from . import embedding_kwargs, every_target, no_empty_prompt_zeros, t5_text_length, vae_latents

KEY = "wan"
NAME = "Wan"
PIPELINE = "WanPipeline"
DENOISER = "transformer"
# Wan 2.2 TI2V-5B's image-to-video: the pipeline that draws from a first frame (sample.py --image), and its bases
I2V_PIPELINE = "WanImageToVideoPipeline"
PIPELINES = (I2V_PIPELINE,)  # the image-to-video bases' model_index.json names it
REFERENCES = 1  # the first frame (TI2V-5B bases only: check_first_frame)
EDIT_PIPELINE = I2V_PIPELINE
SWAP_BLOCKS = ("blocks",)  # the denoiser's blocks, in the order its forward runs them
# What its LoRA files say of their base (musubi-tuner's ss_base_model_version "wan2.1_...", ModelSpec's architecture),
# and tensor names only its LoRAs have: its `blocks` under diffusers', ComfyUI's and kohya's prefixes.
LORA_METADATA = {"ss_base_model_version": ("wan",), "modelspec.architecture": ("wan", "Wan")}
LORA_KEY_PREFIXES = ("transformer.blocks.", "diffusion_model.blocks.", "lora_unet_blocks_")
OBJECTIVE = "flow"
FLOW_DEFAULTS = {"weighting_scheme": "none", "precondition_outputs": 0}
COMPONENTS = {"scheduler": ("common.families.wan", "TrainingScheduler"),  # (FlowMatchEulerDiscreteScheduler)
              "tokenizer": ("transformers", "AutoTokenizer"), "text_encoder": ("transformers", "UMT5EncoderModel"),
              "vae": ("diffusers", "AutoencoderKLWan"), "transformer": ("diffusers", "WanTransformer3DModel")}
TEXT_ENCODERS = ("text_encoder",)  # UMT5-XXL (5.7 B parameters in Wan 2.1)
LORA_TEXT_ENCODERS = ()  # no LoRA on UMT5
LORA_TARGETS = "to_k,to_q,to_v,to_out.0"  # every block's self- and cross-attention
TEXT_LORA_TARGETS = ()
TIME_IDS = False
MAX_SEQUENCE_LENGTH = 512  # WanPipeline's default prompt length
TRAINING_GUIDANCE = None
OPTIONAL_COMPONENTS = None
SAMPLERS = FLOW_SCHEDULER_CLASSES
SAMPLER, SAMPLE_STEPS, SAMPLE_GUIDANCE = "euler", 50, 5.0  # WanPipeline's defaults
SAMPLE_FLAGS = ("negative_prompt", "max_sequence_length", "num_frames")
SAMPLE_FRAMES = 81  # WanPipeline's default clip length
LORA_SCALE_ARGUMENT = "attention_kwargs"  # the pipeline call's argument that scales the LoRAs
PIPELINE_EXTRAS = {}
SINGLE_FILE = False  # no single-file checkpoint layout here (train_text_to_image.py --save_model_as)
NATIVE_SIZE_FROM = "pipeline"  # WanPipeline's default: 480 x 832
RESOLUTION_FACTOR = "the VAE's downsampling factor times the transformer's patch (16 for Wan 2.1)"
DEFAULT_SIZE = (480, 832)  # WanPipeline's default height and width
VIDEO = True  # latents may carry a frame axis: [B, C, F, h, w]
# diffusers' module names -> ComfyUI's native Wan names (comfy/ldm/wan/model.py), which its LoRA map reads as they are
UI_NAMES = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
            "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
            "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "attn2.add_k_proj": "cross_attn.k_img",
            "attn2.add_v_proj": "cross_attn.v_img", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}


class TrainingScheduler:
    """Loads a Wan base's scheduler as the FlowMatchEulerDiscreteScheduler the recipes train and draw with: the hub's
    Wan bases ship UniPCMultistepScheduler in its flow-matching mode, whose shift is `flow_shift`
    (common/diffusion.py's sampler_settings carries it over)."""

    @staticmethod
    def from_pretrained(path, subfolder=None, **kwargs):
        from diffusers import FlowMatchEulerDiscreteScheduler

        from ..diffusion import sampler_settings

        config = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder=subfolder, **kwargs)
        return FlowMatchEulerDiscreteScheduler.from_config(config, **sampler_settings(FlowMatchEulerDiscreteScheduler,
                                                                                      config))


def text_length(components, requested=None, training=False):
    """UMT5's prompt length: as requested, else 512 (the pipeline's), capped by the tokenizer's model_max_length."""
    return t5_text_length(components.get("tokenizer"), requested, MAX_SEQUENCE_LENGTH)


def native_resolution(configs):
    """WanPipeline's default height (480; its width is 832)."""
    return DEFAULT_SIZE[0]


def patch_size(configs):
    return tuple((configs.get("transformer") or {}).get("patch_size") or (1, 2, 2))


def resolution_factor(configs):
    return vae_factor(configs["vae"]) * patch_size(configs)[1]


def size_factor(configs):
    return resolution_factor(configs)


def check_size(configs, height, width, flags="--height/--width", fix=None):
    """One line for a size whose patch grid the transformer's rotary embedding cannot place: it holds
    rope_max_seq_len positions an axis (1024 in the real bases, far above any size they draw; a tiny base's is small).
    flags: what set the size; fix: what to do (default: a size that fits)."""
    denoiser = next((config for name, config in configs.items() if name.startswith("transformer")), {})
    most = denoiser.get("rope_max_seq_len", 1024)
    factor = resolution_factor(configs)
    if max(height, width) // factor > most:
        fix = fix or f"give --height and --width of at most {most * factor}"
        raise UserError(f"{flags} {height} x {width} px: this base's transformer places at most {most} patches of "
                        f"{factor} px an axis (rope_max_seq_len {most} in its config), {most * factor} px a side; "
                        f"{fix}")


def temporal_factor(vae_config):
    """How many frames make one latent frame (4 for Wan 2.1's VAE): a clip takes 4k + 1 frames."""
    return vae_config.get("scale_factor_temporal") or 2 ** sum(vae_config.get("temperal_downsample", ()))


def check_frames(num_frames, vae_config, flag="--num_frames"):
    """One line for a frame count the VAE's temporal compression cannot take."""
    factor = temporal_factor(vae_config)
    if (num_frames - 1) % factor:
        lower = (num_frames - 1) // factor * factor + 1
        raise UserError(f"{flag} {num_frames}: Wan's VAE takes {factor}k + 1 frames (its temporal compression "
                        f"is {factor}); give {lower} or {lower + factor}")


EXPERTS = {"high": "transformer", "low": "transformer_2"}  # --wan_expert -> the A14B expert it trains
LOW_FOLDER = "low"  # --wan_expert both: the low expert's LoRA folder inside the output folder
DEFAULT_EXPERT = "high"  # the expert diffusers' load_lora_weights loads into without load_into_transformer_2


def boundary_ratio(path, revision=None, cache_dir=None):
    """A Wan 2.2 A14B base's boundary_ratio (its model_index.json; two experts: `transformer` at timesteps >= ratio x
    num_train_timesteps, `transformer_2` below), None for a base with one expert."""
    from . import read_model_index

    index = read_model_index(path, "--pretrained_model_name_or_path", revision, cache_dir)
    if (index.get("transformer_2") or [None])[0] is None and index.get("boundary_ratio") is None:
        return None
    return index.get("boundary_ratio")


def check_base(path, revision=None, cache_dir=None, expert=False):
    """-> the expert to train (None for a base with one expert): `expert` is --wan_expert's value (None: not given,
    then DEFAULT_EXPERT for A14B), False where the script trains no expert (train_text_to_image.py). One line for
    --wan_expert on a base with one expert, or an A14B base where experts do not train; for the image-to-video bases
    not trained here (image_to_video), and TI2V-5B's image-to-video where no expert trains."""
    if image_to_video(path, revision, cache_dir) and expert is False:
        raise UserError(f"--pretrained_model_name_or_path '{path}' is Wan 2.2 TI2V-5B's image-to-video "
                        f"({I2V_PIPELINE}), which train_lora.py trains; this script trains its text-to-video mode: "
                        "give the base saved as WanPipeline")
    ratio = boundary_ratio(path, revision, cache_dir)
    if ratio is None:
        if expert:
            raise UserError(f"--wan_expert {expert}: '{path}' has one transformer (Wan 2.1, Wan 2.2 TI2V-5B), no "
                            "experts to choose from (Wan 2.2 A14B has two); leave --wan_expert out")
        return None
    if expert is False:
        raise UserError(f"--pretrained_model_name_or_path '{path}' is Wan 2.2 A14B (two experts: transformer above "
                        f"the boundary timestep, transformer_2 below it, boundary_ratio {ratio}), whose experts are "
                        "trained by train_lora.py --wan_expert only; give Wan 2.1 or Wan 2.2 TI2V-5B")
    return expert or DEFAULT_EXPERT


def image_to_video(path, revision=None, cache_dir=None):
    """How a base draws from a first frame: "first_frame" for one saved as WanImageToVideoPipeline with per-token
    timesteps (Wan 2.2 TI2V-5B's image-to-video: the frame's clean latents in the first latent frame's place),
    "condition" for one without them (Wan 2.2 I2V A14B, Wan 2.1 I2V: the frame's latents and a mask concatenated to
    the noise; Wan 2.1's its CLIP image embeddings too), False for a WanPipeline."""
    from . import read_model_index

    index = read_model_index(path, "--pretrained_model_name_or_path", revision, cache_dir)
    if index.get("_class_name") != I2V_PIPELINE:
        return False
    return "first_frame" if index.get("expand_timesteps") else "condition"


def check_first_frame(path, flag, given, revision=None, cache_dir=None):
    """sample.py: one line for an image-to-video base (or a LoRA of one) without a first frame (--image), and for a
    first frame on a text-to-video base that does not take one (Wan 2.1 T2V, A14B: only TI2V-5B's does)."""
    from . import read_model_index

    if image_to_video(path, revision, cache_dir):
        if not given:
            raise UserError(f"{flag} '{path}' is an image-to-video base ({I2V_PIPELINE}): it draws from a first "
                            "frame; give --image FIRST_FRAME.png")
    elif given and not read_model_index(path, flag, revision, cache_dir).get("expand_timesteps"):
        raise UserError(f"--image: {flag} '{path}' is a Wan text-to-video base; only Wan 2.2 TI2V-5B draws from a "
                        f"first frame ({I2V_PIPELINE}, expand_timesteps): leave --image out")


def first_frame_view(module):
    """The family as it trains an image-to-video LoRA of Wan 2.2 TI2V-5B, as its pipeline draws: the clean latents of
    each clip's own first frame in place of that latent frame's noise, given timestep 0 (the other tokens the clip's
    timestep), and the loss on the frames after it (training_objective); a one-frame clip (an image) trains as
    text-to-image, as the base draws one without a first frame."""
    import types

    view = types.SimpleNamespace(**{k: v for k, v in vars(module).items() if not k.startswith("__")})
    view.PIPELINE = I2V_PIPELINE
    view.PIPELINE_EXTRAS = {"expand_timesteps": True}  # (validation's pipeline, built from the parts)
    view.FIRST_FRAME = True
    view.denoise = first_frame_denoise
    view.training_objective = FirstFrame
    return view


def condition_view(view, path):
    """The family as it trains an image-to-video LoRA of Wan 2.2 I2V A14B (`view`: an expert's), as
    WanImageToVideoPipeline draws without expand_timesteps: beside the noisy latents, a mask (1 on the first latent
    frame) and the latents of the clip's first frame followed by black frames (image_condition), concatenated as
    channels (the transformer's in_channels: twice the VAE's z_dim and 4); the loss on every frame, as musubi-tuner
    trains it. The condition is encoded from each batch's pixels (References), or cached with the latents
    (--cache_latents: CachedLatents' condition). A base with an
    image encoder (Wan 2.1 I2V) gets the first frame's CLIP image embeddings too (image_embeds), from its image
    encoder, loaded here (for validation's pipeline too: PIPELINE_EXTRAS)."""
    import types

    from ..base_models import component_configs
    from . import read_model_index

    configs = component_configs(path, ("vae", "transformer"))
    clip = (read_model_index(path, "--pretrained_model_name_or_path").get("image_encoder") or [None])[0] is not None
    if clip and not configs["transformer"].get("image_dim"):
        raise UserError(f"'{path}' is a {I2V_PIPELINE} base with an image encoder whose transformer takes no image "
                        "embeddings (its config's image_dim): give a Wan 2.1 I2V base")
    want = 2 * configs["vae"].get("z_dim", 16) + 4
    if configs["transformer"].get("in_channels") != want:
        raise UserError(f"'{path}' is a {I2V_PIPELINE} base whose transformer takes in_channels "
                        f"{configs['transformer'].get('in_channels')}, not the {want} of the noise, the mask and the "
                        "first frame's latents: give a Wan 2.2 I2V A14B or Wan 2.1 I2V base")
    if not isinstance(view, types.SimpleNamespace):  # (the module itself: a base with one transformer)
        view = types.SimpleNamespace(**{k: v for k, v in vars(view).items() if not k.startswith("__")})
    view.PIPELINE = I2V_PIPELINE
    view.FIRST_FRAME = True
    view.IMAGE_CONDITION = True
    view.denoise = condition_denoise
    view.image_condition = image_condition
    expert = getattr(view, "EXPERT", None)
    view.base_metadata = lambda config, prediction_type: {  # musubi-tuner's name for it, the expert in ModelSpec's
        "ss_base_model_version": "wan2.2_i2v_a14b", "modelspec.architecture": f"wan2.2-i2v-a14b/lora-{expert}"}
    if clip:
        import transformers  # (the image encoder's and processor's classes, as model_index.json names them)

        index = read_model_index(path, "--pretrained_model_name_or_path")
        encoder = getattr(transformers, index["image_encoder"][1]).from_pretrained(path, subfolder="image_encoder")
        processor = getattr(transformers, index["image_processor"][1]).from_pretrained(path,
                                                                                        subfolder="image_processor")
        encoder.requires_grad_(False).eval()
        view.PIPELINE_EXTRAS = {**view.PIPELINE_EXTRAS, "image_encoder": encoder, "image_processor": processor}
        view.image_condition = lambda encode, pixels, latent_config: {
            **image_condition(encode, pixels, latent_config), "image_embeds": image_embeds(encoder, processor, pixels)}
        view.base_metadata = lambda config, prediction_type: {"ss_base_model_version": "wan2.1_i2v",
                                                              "modelspec.architecture": "wan2.1-i2v/lora"}
    return view


def image_embeds(encoder, processor, pixels):
    """WanImageToVideoPipeline's encode_image of each clip's first frame (pixels [B, F, 3, H, W] in [-1, 1]; an
    image [B, 3, H, W]) as the 8-bit picture the pipeline is given: the penultimate hidden states of the CLIP vision
    model over the image processor's input."""
    import torch

    first = pixels[:, 0] if pixels.ndim == 5 else pixels
    frames = ((first.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    inputs = processor(images=list(frames), return_tensors="pt").pixel_values
    encoder.to(pixels.device)
    with torch.no_grad():
        states = encoder(pixel_values=inputs.to(pixels.device, encoder.dtype), output_hidden_states=True)
    return states.hidden_states[-2]


def image_condition(encode, pixels, latent_config):
    """WanImageToVideoPipeline's condition (prepare_latents, no last frame) for clips [B, F, 3, H, W] (an image [B,
    3, H, W]: a clip of one frame): a mask [B, 4, f, h, w], 1 on the first latent frame (its 4 frames' worth), then
    the normalized mode of the latents of the first frame followed by black frames, as {"image_condition": ...}.
    encode(pixels) -> the VAE's latent-distribution parameters (train_lora.py's)."""
    import torch

    from ..vae import normalize

    clip = pixels if pixels.ndim == 5 else pixels[:, None]
    video = torch.zeros_like(clip)
    video[:, 0] = clip[:, 0]
    params = encode(video)
    means = params.chunk(2, dim=1)[0].float()
    means = normalize(latent_config, means if means.ndim == 5 else means[:, :, None])
    mask = torch.zeros(means.shape[0], 4, *means.shape[2:], dtype=means.dtype, device=means.device)
    mask[:, :, 0] = 1
    return {"image_condition": torch.cat([mask, means], dim=1)}


def condition_denoise(transformer, noisy, timesteps, cond, guidance=None):
    """denoise with WanImageToVideoPipeline's condition (cond["image_condition"]) concatenated to the noisy latents as
    channels (an image's [B, C, h, w]: one frame)."""
    import torch

    image = noisy.ndim == 4
    x = noisy[:, :, None] if image else noisy
    out = denoise(transformer, torch.cat([x, cond["image_condition"].to(x.dtype)], dim=1), timesteps, cond)
    return out[:, :, 0] if image else out


def first_frame_denoise(transformer, noisy, timesteps, cond, guidance=None):
    """denoise with the first latent frame given as clean (timestep 0 on its tokens), as WanImageToVideoPipeline
    calls the transformer with expand_timesteps; a one-frame clip as denoise."""
    import torch

    if noisy.ndim == 5 and noisy.shape[2] > 1:
        config = transformer.config if hasattr(transformer, "config") else transformer.module.config  # (DDP's)
        _, p, q = patch_size({"transformer": config})
        f, h, w = noisy.shape[2:]
        later = torch.ones(f, h // p, w // q, device=noisy.device, dtype=timesteps.dtype)
        later[0] = 0
        timesteps = timesteps[:, None] * later.flatten()[None]  # [B, tokens], in the patches' order
    return denoise(transformer, noisy, timesteps, cond, guidance)


class FirstFrame:
    """An objective (common/objectives.py) whose clips keep their first latent frame clean (the condition) and whose
    loss leaves it out; everything else is the wrapped objective's."""

    def __init__(self, objective):
        self.objective = objective

    def __getattr__(self, name):
        return getattr(self.__dict__["objective"], name)

    def __call__(self, latents):
        noised = self.objective(latents)
        return self.conditioned(latents, noised)

    def at(self, latents, noise, indices, weighted=True):
        return self.conditioned(latents, self.objective.at(latents, noise, indices, weighted))

    @staticmethod
    def conditioned(latents, noised):
        if latents.ndim != 5 or latents.shape[2] == 1:
            return noised
        noisy = noised.noisy.clone()
        noisy[:, :, :1] = latents[:, :, :1].to(noisy.dtype)
        return noised._replace(noisy=noisy)

    def losses(self, prediction, noised, mask=None):
        if prediction.ndim == 5 and prediction.shape[2] > 1:  # the frames after the first
            later = slice(1, None)
            noised = noised._replace(noisy=noised.noisy[:, :, later], target=noised.target[:, :, later])
            prediction = prediction[:, :, later]
            if mask is not None and mask.ndim == 5 and mask.shape[2] > 1:
                mask = mask[:, :, later]
        return self.objective.losses(prediction, noised, mask)

    def describe(self):
        return f"{self.objective.describe()}, each clip's first frame given clean (image-to-video)"


def reference_kwargs(references, height, width):
    """WanImageToVideoPipeline's first frame (sample.py --image), which it resizes to height x width itself."""
    i2v_without_ftfy()
    return {"image": references[0]}


def i2v_without_ftfy():
    """WanImageToVideoPipeline cleans prompts with ftfy without checking that it is installed, where WanPipeline
    checks (diffusers 0.42; huggingface/diffusers#12314): without ftfy, it cleans them as WanPipeline does then,
    whitespace only, which is what training encodes."""
    import types

    from diffusers.pipelines.wan import pipeline_wan_i2v
    from diffusers.utils import is_ftfy_available

    if not is_ftfy_available() and not hasattr(pipeline_wan_i2v, "ftfy"):
        pipeline_wan_i2v.ftfy = types.SimpleNamespace(fix_text=lambda text: text)


def expert_family(path, expert, revision=None, cache_dir=None):
    """This module for a base with one transformer (`expert` None); else the family as it trains `expert` (None:
    DEFAULT_EXPERT) of a Wan 2.2 A14B base: its pipeline holds both experts and the boundary_ratio; the denoiser is
    the chosen expert (the other stays frozen, off the device between validations), its training timesteps on its side
    of the boundary (TIMESTEP_RANGE: t >= boundary for `high`, below it for `low`); the LoRA file keeps diffusers'
    `transformer.` names, which `load_lora_weights(..., load_into_transformer_2=True)` loads into the low expert.
    `both`: one denoiser of the two (experts_model), saved as two LoRA folders (split_experts)."""
    import sys
    import types

    module = sys.modules[__name__]
    expert = check_base(path, revision, cache_dir, expert)
    kind = image_to_video(path, revision, cache_dir)
    if expert is None:
        return {"first_frame": first_frame_view, "condition": lambda m: condition_view(m, path)}.get(
            kind, lambda m: m)(module)
    ratio = boundary_ratio(path, revision, cache_dir)
    view = types.SimpleNamespace(**{k: v for k, v in vars(module).items() if not k.startswith("__")})
    view.COMPONENTS = {**COMPONENTS, "transformer_2": COMPONENTS["transformer"]}
    view.EXPERT = expert
    view.PIPELINE_EXTRAS = {"boundary_ratio": ratio}
    view.base_metadata = lambda config, prediction_type: {  # musubi-tuner's name for A14B, the expert in ModelSpec's
        "ss_base_model_version": "wan2.2_t2v_a14b", "modelspec.architecture": f"wan2.2-t2v-a14b/lora-{expert}"}
    if expert == "both":  # one denoiser of both experts (Experts), each with its LoRA, saved as two LoRA folders
        view.combine_experts = lambda parts: {**parts, "transformer": experts_model(
            parts["transformer"], parts.pop("transformer_2"), ratio * parts["scheduler"].config.num_train_timesteps)}
        view.expert_parts = lambda parts: {"transformer": parts["transformer"].transformer,
                                           "transformer_2": parts["transformer"].transformer_2}
        view.split_experts = lambda models: [
            ("", expert_family(path, "high", revision, cache_dir), {"transformer": models["transformer"].transformer}),
            (LOW_FOLDER, expert_family(path, "low", revision, cache_dir),
             {"transformer_2": models["transformer"].transformer_2})]
        return condition_view(view, path) if kind == "condition" else view
    view.DENOISER = EXPERTS[expert]
    view.FROZEN_EXPERTS = tuple(name for name in EXPERTS.values() if name != view.DENOISER)
    # the training timesteps, in units of num_train_timesteps: [low, high)
    view.TIMESTEP_RANGE = (ratio, float("inf")) if expert == "high" else (float("-inf"), ratio)
    view.LORA_FILE_DENOISER = "transformer"  # WanPipeline.save_lora_weights' only name; the loader picks the expert
    view.ui_lora = lambda states, alpha, config: named_lora(states[view.DENOISER], alpha, ui_name, DIFFUSERS_SUFFIXES)
    return condition_view(view, path) if kind == "condition" else view


def lora_expert(path, metadata):
    """The A14B expert a LoRA (a folder or a .safetensors file; metadata: the file's header) loads into: "low"
    (`transformer_2`: load_into_transformer_2=True), "high", "both" (a folder of a --wan_expert both run: the high
    one's here, the low one's in low/), or None (no word of it: diffusers' default, the high expert `transformer`;
    a Wan LoRA file names its denoiser `transformer` whichever expert it is for). From the lora_info.json of the
    folder, or beside the file (a both run's file there is the high one's), else the file's ModelSpec
    architecture (".../lora-low"), which travels with the file."""
    import os

    from ..lora_files import read_lora_info

    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    expert = (read_lora_info(folder) or {}).get("wan_expert") if os.path.exists(path) else None
    if expert == "both" and not os.path.isdir(path):
        return "high"
    if expert is None:
        architecture = (metadata or {}).get("modelspec.architecture", "")
        expert = next((name for name in EXPERTS if architecture.endswith(f"/lora-{name}")), None)
    return expert


def experts_model(transformer, transformer_2, boundary):
    """Wan 2.2 A14B's two experts as one denoiser (--wan_expert both): each sample of a batch goes to the expert
    WanPipeline would use at its timestep (`transformer` at t >= boundary, `transformer_2` below); a LoRA on each
    (add_adapter: the same config on both), the pair's adapters in one checkpoint (peft_config: the first's)."""
    import torch

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer, self.transformer_2, self.boundary = transformer, transformer_2, boundary

        config = property(lambda self: self.transformer.config)
        peft_config = property(lambda self: self.transformer.peft_config)
        dtype = property(lambda self: self.transformer.dtype)

        def add_adapter(self, config):
            import copy

            self.transformer.add_adapter(config)
            self.transformer_2.add_adapter(copy.deepcopy(config))

        def enable_gradient_checkpointing(self):
            self.transformer.enable_gradient_checkpointing()
            self.transformer_2.enable_gradient_checkpointing()

        def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False, **kwargs):
            high = timestep >= self.boundary
            out = None  # (I2V: fewer channels out than in)
            for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
                if rows.any():  # (the other expert's LoRA gets no gradient this step: DDP finds it unused)
                    pred = expert(hidden_states=hidden_states[rows], timestep=timestep[rows],
                                  encoder_hidden_states=encoder_hidden_states[rows], return_dict=False, **kwargs)[0]
                    if out is None:
                        out = hidden_states.new_empty((hidden_states.shape[0], *pred.shape[1:]))
                    out[rows] = pred.to(out.dtype)
            return (out,)

    return Experts()


def latent_frames(num_frames, vae_config):
    """How many latent frames a clip of num_frames makes: the first frame alone, then one per `temporal_factor`."""
    return (num_frames - 1) // temporal_factor(vae_config) + 1


def packed_shape(shape):
    """[B, C, f, h, w] latents as the transformer's patch embedding sees them: f x h/2 x w/2 patches of C x 2 x 2."""
    b, c, f, h, w = shape
    return [b, f * (h // 2) * (w // 2), c * 4]


def fit_problems(denoiser_config, configs):
    """A fresh transformer against the base's other parts: the VAE's channels in and out, UMT5's width."""
    z_dim = configs["vae"].get("z_dim", 16)
    checks = (("in_channels", z_dim, "the VAE's z_dim"), ("out_channels", z_dim, "the VAE's z_dim"),
              ("text_dim", configs.get("text_encoder", {}).get("d_model"), "UMT5's d_model"))
    return [(key, denoiser_config.get(key), want, what) for key, want, what in checks
            if want is not None and denoiser_config.get(key) != want]


def tokenize(parts, prompts, max_sequence_length=None):
    """As WanPipeline._get_t5_prompt_embeds: each prompt cleaned (prompt_clean), padded (and cut) to
    max_sequence_length: [token ids, attention mask]."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    tokens = parts["tokenizer"]([prompt_clean(p) for p in prompts], padding="max_length",
                                max_length=max_sequence_length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
    return [tokens.input_ids, tokens.attention_mask]


def encode_prompts(parts, ids):
    """UMT5's last hidden states, zeros after each prompt's end, as the pipeline computes them (one shape for every
    prompt: the pipeline pads them so too)."""
    input_ids, mask = ids
    states = parts["text_encoder"](input_ids, mask).last_hidden_state
    return {"prompt_embeds": states * mask[..., None].to(states.dtype)}


empty_prompt_zeros = no_empty_prompt_zeros


def denoise(transformer, noisy, timesteps, cond, guidance=None):
    """The velocity noise - x0 for noisy latents [B, C, F, h, w] (an image's [B, C, h, w]: one frame), as the pipeline
    calls the transformer: the timestep in the scheduler's units, the padded prompt embeddings (Wan 2.1 I2V: and the
    first frame's CLIP image embeddings, cond["image_embeds"])."""
    image = noisy.ndim == 4
    out = transformer(hidden_states=noisy[:, :, None] if image else noisy, timestep=timesteps,
                      encoder_hidden_states=cond["prompt_embeds"], return_dict=False,
                      **({"encoder_hidden_states_image": cond["image_embeds"]} if "image_embeds" in cond else {}))[0]
    return out[:, :, 0] if image else out


def guidance_kwargs(denoiser_config, scale, batch):
    """WanPipeline's classifier-free guidance, on above 1. -> (the call's arguments, whether it needs the
    unconditional embeddings)."""
    return {"guidance_scale": scale}, scale > 1


pipeline_prompt_kwargs = embedding_kwargs


def sample_size(pipe):
    """(height, width) WanPipeline draws by default."""
    return DEFAULT_SIZE


def unpack_latents(pipe, latents, height, width):
    """The pipeline's output_type="latent" result [B, C, F, h, w] (normalised) -> the denoiser's latents: one frame
    as [B, C, h, w]."""
    return latents[:, :, 0] if latents.shape[2] == 1 else latents


text_encoder_targets = every_target


def base_metadata(denoiser_config, prediction_type):
    """musubi-tuner's names for Wan's text-to-video models (TI2V-5B: its transformer takes the 48-channel latents of
    Wan 2.2's VAE)."""
    if denoiser_config.get("in_channels") == 48:
        return {"ss_base_model_version": "wan2.2_ti2v", "modelspec.architecture": "wan2.2-ti2v-5b/lora"}
    return {"ss_base_model_version": "wan2.1_t2v", "modelspec.architecture": "wan2.1-t2v/lora"}


UI_IMPLEMENTATION = DIFFUSERS_IMPLEMENTATION


def ui_name(module):
    """A transformer module's name in ComfyUI's Wan model, under `diffusion_model.` (KeyError: it has none)."""
    if module.startswith("blocks."):
        number, _, rest = module.removeprefix("blocks.").partition(".")
        return f"diffusion_model.blocks.{number}.{UI_NAMES[rest]}"
    raise KeyError(module)


def ui_lora(states, alpha, denoiser_config):
    """The UI file under ComfyUI's native Wan names (`diffusion_model.blocks.N.self_attn.q`...: its LoRA map has no
    branch for diffusers' Wan names), with alphas and DoRA magnitudes (common/ui_lora.py); diffusers' Wan loader reads
    these names too."""
    return named_lora(states["transformer"], alpha, ui_name, DIFFUSERS_SUFFIXES)


def latent_config(vae):
    """The VAE's per-channel latents_mean and latents_std; trained on the latent distribution's mode, as Wan's trainers
    cache it (musubi-tuner, diffusion-pipe) and its image-to-video pipelines encode the first frame (argmax)."""
    return {**vae_latents(vae), "latent_mode": True}
