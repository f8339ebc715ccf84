"""How well a text-to-image model draws the digits, and how much of the red-ink style it shows.

- content: the share of samples that the digit classifier (train_classifier.py's output; the repository ships one in
  assets/digit-classifier) recognises as the prompted digit, after `to_judge` turns any image into white strokes on
  black (luminance, inverted when the background is light, contrast stretched), so that it also reads styled ones.
- style rate: the share of samples in the red-ink style: a light background (median luminance > 0.6) and reddish
  dark strokes (mean R - mean(G, B) > 0.25 over the darkest 15 % of the pixels). The red-ink digits themselves all
  pass (median luminance 0.83, redness 0.46), the white-on-black ones none (0.14, 0.0).
- blot rate: the share of samples with the masked-loss demo's ink blot in the top-right corner (has_blot).
- colours: the background (paper) colour, the median RGB of each sample's outer frame (1/16 of its width: the digits
  are centred), and the stroke colour, the mean RGB of the 15 % of its pixels farthest from that background, averaged
  over the samples (0-255). The red-ink data: paper (240, 235, 220), ink up to (170, 20, 20); the base's digits:
  white strokes on black.
Samples: `per_digit` images per digit prompt, seeds 0, 1, ... (one generator per image, so an image does not depend
on the batch it is drawn in), the pipeline's scheduler as given.
"""
import torch

from demo.digits import NAMES, STYLE

JUDGE = "assets/digit-classifier"


def digit_prompts(per_digit, style=False):
    prompts = [f"a handwritten digit {name}{STYLE if style else ''}" for name in NAMES for _ in range(per_digit)]
    return prompts, torch.arange(10).repeat_interleave(per_digit)


@torch.no_grad()
def generate(pipe, family, prompts, guidance_scale, num_inference_steps, seed=0, batch_size=100, lora_scale=None):
    """-> images [N, 3, H, W] in [0, 1] at the family's sample size, guidance and T5 length (common/families/), as
    sample.py draws; image i from torch.Generator().manual_seed(seed + i)."""
    out = []
    kwargs = {family.LORA_SCALE_ARGUMENT: {"scale": lora_scale}} if lora_scale is not None else {}
    length = family.text_length(pipe.components)
    if length:
        kwargs["max_sequence_length"] = length
    height, width = family.sample_size(pipe)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        generators = [torch.Generator().manual_seed(seed + start + i) for i in range(len(chunk))]
        guidance = family.guidance_kwargs(getattr(pipe, family.DENOISER).config, guidance_scale, len(chunk))[0]
        out.append(pipe(chunk, num_inference_steps=num_inference_steps, generator=generators, output_type="pt",
                        height=height, width=width, **guidance, **kwargs).images.float().cpu())
    return torch.cat(out)


def lora_pipeline(lora, uses, edit=False):
    """A train_lora.py output on its base (from lora_info.json), as sample.py loads it: the base with sample.py's
    default sampler (`edit`: the family's edit pipeline, as sample.py --image), the LoRA with diffusers'
    load_lora_weights, a LoHa or LoKr (peft_adapter_weights.safetensors) through peft; either scales with the
    pipeline's LoRA scale. -> (pipe, family)."""
    import torch

    from common.diffusion import sampling_scheduler
    from common.drawing import load_pipeline
    from common.families import load_family
    from common.lora_files import load_peft_adapters, peft_adapter_configs, read_lora_info

    base = read_lora_info(lora)["base_model"]
    family = load_family(base, "the LoRA's base", uses=uses)
    pipe = load_pipeline(family, base, "the LoRA's base", torch.float32, edit=edit)
    pipe.scheduler = sampling_scheduler(family.SAMPLER, pipe.scheduler.config, family.SAMPLERS)
    pipe.set_progress_bar_config(disable=True)
    if peft_adapter_configs(lora) is not None:
        load_peft_adapters(pipe, lora, "default_0")
    else:
        pipe.load_lora_weights(lora)
    return pipe, family


def add_results(lora, results):
    """Merge `results` into the LoRA's all_results.json. -> what the file held before."""
    import json
    import os

    path = os.path.join(lora, "all_results.json")
    existing = {}
    if os.path.isfile(path):
        with open(path) as f:
            existing = json.load(f)
    with open(path, "w") as f:
        json.dump({**existing, **results}, f, indent=2)
    return existing


def luminance(x):
    return 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]


def style_stats(x, dark_fraction=0.15):
    """-> (median luminance [N], redness of the darkest pixels [N])."""
    lum = luminance(x).flatten(1)
    k = max(1, int(dark_fraction * lum.shape[1]))
    dark_index = lum.topk(k, dim=1, largest=False).indices
    dark = torch.gather(x.flatten(2), 2, dark_index[:, None].expand(-1, 3, -1)).mean(2)
    return lum.median(1).values, dark[:, 0] - dark[:, 1:].mean(1)


def colour_stats(x, frame=1 / 16, stroke_fraction=0.15):
    """-> (background RGB [N, 3], stroke RGB [N, 3]) in [0, 1] of images x [N, 3, H, W] (see the module's doc)."""
    n, _, h, w = x.shape
    k = max(1, round(frame * w))
    ring = torch.ones(h, w, dtype=torch.bool)
    ring[k:h - k, k:w - k] = False
    background = x[:, :, ring].median(2).values
    distance = (x - background[:, :, None, None]).norm(dim=1).flatten(1)
    far = distance.topk(max(1, int(stroke_fraction * h * w)), dim=1).indices
    strokes = torch.gather(x.flatten(2), 2, far[:, None].expand(-1, 3, -1)).mean(2)
    return background, strokes


def in_style(x):
    median, redness = style_stats(x)
    return (median > 0.6) & (redness > 0.25)


def to_judge(x):
    """Any image -> white strokes on black, 3 channels (plain digits stay as they are, up to contrast)."""
    g = luminance(x)
    light = g.flatten(1).median(1).values > 0.5
    g = torch.where(light[:, None, None], 1 - g, g)
    low, high = g.flatten(1).min(1).values[:, None, None], g.flatten(1).max(1).values[:, None, None]
    g = (g - low) / (high - low).clamp(min=1e-3)
    return g[:, None].expand(-1, 3, -1, -1).contiguous()


class Judge:
    """The digit classifier: images [N, 3, H, W] in [0, 1] -> predicted digits [N]."""

    def __init__(self, path=JUDGE, device="cpu"):
        from common.classifier_metrics import ClassifierScorer

        self.scorer = ClassifierScorer(path, device)
        ids = self.scorer.class_ids([str(i) for i in range(10)])
        self.digit_of = torch.full((int(ids.max()) + 1,), -1, dtype=torch.long)
        self.digit_of[ids] = torch.arange(10)

    def predict(self, images):
        _, predicted = self.scorer(to_judge(images))
        return self.digit_of[predicted.cpu()]


def has_blot(x):
    """Samples that show the masked-loss demo's ink blot: where demo.digits puts it, reddish (mean R - mean(G, B) >
    0.25; the blotted data: 0.59, the base's black corner and the red-ink paper: under 0.1)."""
    from demo.digits import blot_box

    top, bottom, left, right = blot_box(x.shape[-1])
    corner = x[:, :, top:bottom, left:right].mean((2, 3))
    return corner[:, 0] - corner[:, 1:].mean(1) > 0.25


def score(images, labels, judge):
    """-> {"content": share recognised, "style_rate": share in style, "blot_rate": share with the ink blot,
    "background_rgb" and "stroke_rgb" (0-255, the samples' mean), "per_digit": content per digit}."""
    correct = judge.predict(images) == labels
    background, strokes = colour_stats(images)
    return {"content": round(correct.float().mean().item(), 4),
            "style_rate": round(in_style(images).float().mean().item(), 4),
            "blot_rate": round(has_blot(images).float().mean().item(), 4),
            "background_rgb": [round(v) for v in (background.mean(0) * 255).tolist()],
            "stroke_rgb": [round(v) for v in (strokes.mean(0) * 255).tolist()],
            "per_digit": [round(correct[labels == d].float().mean().item(), 2) for d in range(10)]}
