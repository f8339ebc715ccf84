"""How a text-to-image model is drawn when no flag says otherwise, and the model cards' snippet that says it.

sample.py, the trainers' validation images and DreamBooth's class images draw with these defaults, and every model
card the recipes write (a LoRA's README.md, train_text_to_image.py's, the shipped bases' in assets/) prints them as one
diffusers pipeline call, so that what a card shows and what sample.py draws are the same images. Where each default
comes from, the first that says it:
- a train_lora.py LoRA's lora_info.json: its training size, its T5 length, whether it trained without T5;
- the base's own model card: the keyword arguments of the pipeline call (`pipe(...)`) in the python block of a local
  folder's README.md (size, steps, guidance or true CFG, T5 length), as the cards written here hold them;
- the family (common/families/: SAMPLE_STEPS, SAMPLE_GUIDANCE, text_length, sample_size), where that is what its
  pipeline draws; FluxPipeline draws a base without a guidance embedding (FLUX.1-schnell's kind) without true
  classifier-free guidance unless its card asks for it, or the run trained the unconditional branch (caption dropout
  on the whole denoiser, train_text_to_image.py).
"""
import ast
import json
import os
import re

CARD = "README.md"
CARD_KEYS = ("height", "width", "num_inference_steps", "guidance_scale", "true_cfg_scale", "max_sequence_length",
             "num_frames")


def card_call(folder):
    """{key: value} of CARD_KEYS given as literals to the first `pipe(...)` call in the python blocks of the folder's
    README.md; {} for a hub id, a folder without a card, or a card without such a call."""
    path = os.path.join(folder, CARD)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "pipe":
                call = {}
                for keyword in node.keywords:
                    try:
                        value = ast.literal_eval(keyword.value) if keyword.arg in CARD_KEYS else None
                    except ValueError:
                        continue
                    if isinstance(value, int | float) and not isinstance(value, bool):
                        call[keyword.arg] = value
                return call
    return {}


def guided_by_true_cfg(family, denoiser_config):
    """True when the family's pipeline guides this denoiser by true classifier-free guidance (FluxPipeline's
    true_cfg_scale, a second pass against a negative prompt): a base without a guidance embedding."""
    return "true_cfg_scale" in family.guidance_kwargs(denoiser_config, family.SAMPLE_GUIDANCE, 1)[0]


def default_guidance(family, denoiser_config, card, unconditional=False):
    """The guidance scale drawn with by default (family.guidance_kwargs turns it into the call's arguments): the
    card's (true_cfg_scale where the pipeline guides by true CFG, else guidance_scale); else the family's
    SAMPLE_GUIDANCE, except under true CFG, which the pipeline draws without (1: none) unless `unconditional` (the
    denoiser learned the empty prompt: caption dropout over all its weights)."""
    true_cfg = guided_by_true_cfg(family, denoiser_config)
    key = "true_cfg_scale" if true_cfg else "guidance_scale"
    if key in card:
        return card[key]
    return 1.0 if true_cfg and not unconditional else family.SAMPLE_GUIDANCE


def sampling_defaults(family, base, denoiser_config, info=None, unconditional=False):
    """-> {"height", "width", "num_inference_steps", "guidance_scale", "max_sequence_length", "drop_t5"}: what a
    model is drawn with by default (see the module's doc). base: the base pipeline (hub id or folder, whose card is
    read); info: a LoRA's lora_info.json, or None. height/width None: the family's sample_size of the loaded pipeline;
    max_sequence_length None: family.text_length's default."""
    card = card_call(base) if os.path.isdir(base) else {}
    info = info or {}
    return {"height": info.get("resolution") or card.get("height"),
            "width": info.get("resolution") or card.get("width"),
            "num_inference_steps": card.get("num_inference_steps") or family.SAMPLE_STEPS,
            "guidance_scale": default_guidance(family, denoiser_config, card, unconditional),
            "max_sequence_length": info.get("max_sequence_length") or card.get("max_sequence_length"),
            "num_frames": info.get("num_frames") or card.get("num_frames"),  # (a video family's clips)
            "drop_t5": bool(info.get("drop_t5"))}


def call_kwargs(family, denoiser_config, height, width, steps, guidance, max_sequence_length=None):
    """The pipeline call's keyword arguments for one prompt, as sample.py gives them (common/drawing.py)."""
    kwargs = {"height": height, "width": width, "num_inference_steps": steps}
    for key, value in family.guidance_kwargs(denoiser_config, guidance, 1)[0].items():
        kwargs[key] = value[0] if isinstance(value, list) else value
    if max_sequence_length:
        kwargs["max_sequence_length"] = max_sequence_length
    return kwargs


def base_scheduler(base, revision=None, cache_dir=None):
    """The base's scheduler as its pipeline loads it (the class model_index.json names)."""
    import diffusers

    from .families import read_model_index

    name = read_model_index(base, "the base model", revision, cache_dir)["scheduler"][1]
    return getattr(diffusers, name).from_pretrained(base, subfolder="scheduler", revision=revision,
                                                    cache_dir=cache_dir)


def scheduler_swap(family, scheduler, prediction_type=None):
    """What the snippet does to draw with the family's sampler as sample.py does (common/diffusion.py
    sampling_scheduler): None when the pipeline's own scheduler is that sampler, else (the sampler's class name, the
    settings `from_config` must be given beside pipe.scheduler.config). scheduler: the base's, as its pipeline loads
    it; prediction_type: a LoRA's own target (lora_info.json), set on it first as sample.py does."""
    import diffusers

    from .diffusion import sampler_settings

    name = family.SAMPLERS[family.SAMPLER]
    cls = getattr(diffusers, name)
    training = dict(scheduler.config, **({"prediction_type": prediction_type} if prediction_type else {}))
    plain = cls.from_config(scheduler.config).config  # what from_config alone gives
    changed = {key: value for key, value in sampler_settings(cls, training).items() if plain.get(key) != value}
    if type(scheduler).__name__ == name and not changed:
        return None
    return name, changed


class ReferenceCode(str):
    """A reference image in a snippet: the code that gives it, resized as the family's reference_kwargs asks."""

    def resize(self, size):
        return ReferenceCode(f"{self}.resize({tuple(size)!r})")


def literal(value):
    """A value as Python source (strings in double quotes, as the cards write them; a reference image as its code)."""
    if isinstance(value, ReferenceCode):
        return str(value)
    if isinstance(value, list) and value and isinstance(value[0], ReferenceCode):
        return f"[{', '.join(value)}]"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def prompt_argument(pipeline, prompt):
    """The prompt as the call's first argument, by keyword where the pipeline's first parameter is another (FLUX.2's
    and Kontext's take the image first)."""
    import inspect

    import diffusers

    first = list(inspect.signature(getattr(diffusers, pipeline).__call__).parameters)[1]
    return literal(prompt) if first == "prompt" else f"prompt={literal(prompt)}"


def pipeline_snippet(family, base, prompt, call, lora=None, swap=None, load=None, seed=0, references=(),
                     expert=None):
    """The model card's code: the family's pipeline from `base` (`load`: from_pretrained's other arguments, e.g.
    text_encoder_3=None), the sampler swap (scheduler_swap's), the LoRA folder, one call with `call` (call_kwargs')
    and a seeded generator, the image saved. What it draws is what `python sample.py --model <the model> --prompt
    <prompt> --seed <seed>` draws; with `references` (an edit LoRA's reference image files, which `call` names as
    ReferenceCode), its edit pipeline, as sample.py --image draws; `expert`: a Wan 2.2 A14B LoRA's (low: loaded into
    transformer_2; both: the low one's from its folder's low/ too)."""
    pipeline = family.EDIT_PIPELINE if references else family.PIPELINE
    imports = sorted({pipeline, *([swap[0]] if swap else [])})
    options = "".join(f", {key}={literal(value)}" for key, value in (load or {}).items())
    clip = call.get("num_frames", 1) > 1  # a video family's clip: its frames as an animated GIF
    lines = ["import torch", f"from diffusers import {', '.join(imports)}",
             *(["from diffusers.utils import load_image"] if references else []),
             *(["from diffusers.utils import export_to_gif"] if clip else []), "",
             f"pipe = {pipeline}.from_pretrained({literal(base)}{options})"]
    if swap:
        settings = "".join(f", {key}={literal(value)}" for key, value in swap[1].items())
        lines.append(f"pipe.scheduler = {swap[0]}.from_config(pipe.scheduler.config{settings})")
    if lora:
        lines.append(f"pipe.load_lora_weights({literal(lora)}{', load_into_transformer_2=True' * (expert == 'low')})")
        if expert == "both":
            lines.append(f"pipe.load_lora_weights({literal(os.path.join(lora, 'low'))}, load_into_transformer_2=True)")
    lines += [f"{reference_name(i, references)} = load_image({literal(path)})" for i, path in enumerate(references)]
    video = getattr(family, "VIDEO", False)  # (WanPipeline's output: frames, PIL images with output_type="pil")
    head = "video = pipe(" if clip else "image = pipe("
    parts = [prompt_argument(pipeline, prompt), *(f"{key}={literal(value)}" for key, value in call.items()),
             f"generator=torch.Generator().manual_seed({seed})", *(['output_type="pil"'] if video else [])]
    end = ").frames[0]" if clip else ").frames[0][0]" if video else ").images[0]"
    line = head
    for i, part in enumerate(parts):
        part += end if i == len(parts) - 1 else ","
        if len(line) + len(part) + 1 > 116 and line.strip() != head.strip():
            lines.append(line.rstrip())
            line = " " * len(head)
        line += part if line.endswith(("(", " ")) else " " + part
    lines += [line, 'export_to_gif(video, "sample.gif", fps=16)' if clip else 'image.save("sample.png")']
    return "\n".join(lines)


def loading_options(family, revision=None, variant=None, drop_t5=False):
    """from_pretrained's other arguments in a snippet, as sample.py loads the base: its revision and weights variant,
    and no T5 for a model trained without it."""
    options = {key: value for key, value in (("revision", revision), ("variant", variant)) if value}
    return {**options, **{name: None for name in (family.OPTIONAL_COMPONENTS or ()) if drop_t5}}


def reference_size(image, height, width, factor):
    """The size drawn from a reference image when none is asked for: the reference's aspect ratio at the area of
    height x width (the base's default), each side a multiple of `factor`."""
    aspect = image.size[0] / image.size[1]
    w = max(factor, round((height * width * aspect) ** 0.5 / factor) * factor)
    h = max(factor, round((height * width / aspect) ** 0.5 / factor) * factor)
    return h, w


def reference_name(i, references):
    return f"reference_{i + 1}" if len(references) > 1 else "reference"


def model_snippet(family, path, prompt, info, base=None, lora=None, unconditional=False, cache_dir=None,
                  references=()):
    """The card's snippet (pipeline_snippet): the pipeline at `path` (with the LoRA folder `lora`) drawing `prompt` at
    the defaults sample.py takes for the model: sampling_defaults of the base `base` (default `path`) with `info`, a
    LoRA's lora_info.json or what a run records alike (its resolution, T5 length, revision); an edit LoRA's from its
    `references` (image files), at the first one's aspect ratio. Reads configs, no weights."""
    from .base_models import component_configs

    revision = info.get("revision")
    configs = component_configs(path, ("vae", family.DENOISER), revision, cache_dir)
    config = configs[family.DENOISER]
    defaults = sampling_defaults(family, base or path, config, info, unconditional)
    height, width = defaults["height"], defaults["width"]
    if references:  # (sample.py --image: at the reference's aspect ratio)
        from PIL import Image

        if height and width and os.path.isfile(references[0]):
            with Image.open(references[0]) as image:
                height, width = reference_size(image, height, width, family.resolution_factor(configs))
    call = call_kwargs(family, config, height, width, defaults["num_inference_steps"], defaults["guidance_scale"],
                       defaults["max_sequence_length"])
    if references:
        codes = [ReferenceCode(reference_name(i, references)) for i in range(len(references))]
        call = {**family.reference_kwargs(codes, height, width), **call}
    if getattr(family, "VIDEO", False):  # (as sample.py: the LoRA's clips, the card's, the pipeline's)
        call["num_frames"] = defaults["num_frames"] or family.SAMPLE_FRAMES
    swap = scheduler_swap(family, base_scheduler(path, revision, cache_dir), info.get("prediction_type"))
    load = loading_options(family, revision, info.get("variant"), defaults["drop_t5"])
    return pipeline_snippet(family, path, prompt, call, lora=lora, swap=swap, load=load, references=references,
                            expert=info.get("wan_expert"))
