"""`python -m demo.motion_eval --model assets/tiny-wan-digits` (or `--lora outputs/video-lora`): which digit a
text-to-video model draws, and which way it moves it, judged from the drawn frames alone.

- drift: the ink's centroid column in each frame (luminance-weighted; frames with almost no ink left out), and the
  least-squares slope of it over the frames, in px a frame. Rightward: a slope above MIN_DRIFT (the moving digits'
  clips move 2 px a frame), leftward: below -MIN_DRIFT.
- content: the digit classifier (assets/digit-classifier, trained on digits that fill their 32 px frame) on each frame's
  ink, cut out as a square of half the frame around the centre of its bounding box and scaled to the frame's size
  (the clips' digit is half the frame); the clip's digit is the frames' most frequent answer.
Samples: `per_digit` clips per digit prompt "a handwritten digit <d> moving <direction>", seeds 0, 1, ... (one
generator per clip), at sample.py's defaults for the model (its model card's steps, guidance, size and frames).
"""
import argparse
import os
import time

import torch

MIN_DRIFT = 0.5  # px a frame
INK = 0.25  # a pixel is ink above this share of its frame's brightest
MIN_INK = 2.0  # a frame with less ink (the sum of its brightness above the background) has none


def ink_columns(clips):
    """clips [N, F, 3, H, W] in [0, 1] -> (centroid column [N, F], whether the frame has ink [N, F])."""
    g = 0.299 * clips[:, :, 0] + 0.587 * clips[:, :, 1] + 0.114 * clips[:, :, 2]
    g = (g - g.flatten(2).median(2).values[..., None, None]).clamp(min=0)  # the background (the median) is no ink
    mass = g.sum((2, 3))
    columns = torch.arange(g.shape[-1], dtype=g.dtype)
    x = (g.sum(2) * columns).sum(-1) / mass.clamp(min=1e-6)
    return x, mass > MIN_INK


def drift(clips):
    """clips [N, F, 3, H, W] in [0, 1] -> the ink centroid's slope [N] in px a frame (+: rightward); 0 where fewer
    than two frames have ink."""
    x, inked = ink_columns(clips)
    t = torch.arange(x.shape[1], dtype=x.dtype).expand_as(x)
    w = inked.to(x.dtype)
    n = w.sum(1).clamp(min=1)
    tm, xm = (w * t).sum(1) / n, (w * x).sum(1) / n
    var = (w * (t - tm[:, None]).square()).sum(1)
    slope = (w * (t - tm[:, None]) * (x - xm[:, None])).sum(1) / var.clamp(min=1e-6)
    return torch.where(inked.sum(1) >= 2, slope, torch.zeros_like(slope))


def digit_crops(frames, side=None):
    """frames [M, 3, H, W] in [0, 1] -> [M, 3, H, W]: a square of `side` px (half the frame) around the centre of each
    frame's ink bounding box, scaled to the frame's size."""
    import torch.nn.functional as F

    m, _, h, w = frames.shape
    side = side or w // 2
    g = frames.mean(1)
    g = (g - g.flatten(1).median(1).values[:, None, None]).clamp(min=0)
    ink = g > INK * g.flatten(1).max(1).values.clamp(min=1e-6)[:, None, None]
    padded = F.pad(frames, (side, side, side, side))
    out = []
    for i in range(m):
        rows, cols = ink[i].any(1).nonzero(), ink[i].any(0).nonzero()
        cy = (rows.min() + rows.max() + 1).item() / 2 if len(rows) else h / 2
        cx = (cols.min() + cols.max() + 1).item() / 2 if len(cols) else w / 2
        top, left = round(cy - side / 2) + side, round(cx - side / 2) + side
        out.append(padded[i, :, top:top + side, left:left + side])
    return F.interpolate(torch.stack(out), size=(h, w), mode="bilinear", align_corners=False).clamp(0, 1)


def clip_digits(clips, judge):
    """clips [N, F, 3, H, W] -> the digit each shows [N] (the frames' most frequent answer of `judge`)."""
    n, f = clips.shape[:2]
    answers = judge.predict(digit_crops(clips.flatten(0, 1))).view(n, f)
    return answers.mode(1).values


def score_clips(clips, labels, judge, direction="right"):
    """-> {"content": share showing the prompted digit, "rightward" / "leftward": share drifting so, "hit": share
    drifting `direction` AND showing the prompted digit, "mean_drift_px": mean slope, "per_digit": content per
    digit}."""
    slope = drift(clips)
    correct = clip_digits(clips, judge) == labels
    moving = slope > MIN_DRIFT if direction == "right" else slope < -MIN_DRIFT
    return {"content": round(correct.float().mean().item(), 4),
            "rightward": round((slope > MIN_DRIFT).float().mean().item(), 4),
            "leftward": round((slope < -MIN_DRIFT).float().mean().item(), 4),
            "hit": round((moving & correct).float().mean().item(), 4),
            "mean_drift_px": round(slope.mean().item(), 3),
            "per_digit": [round(correct[labels == d].float().mean().item(), 2) for d in range(10)]}


def motion_prompts(per_digit, direction):
    prompts = [f"a handwritten digit {d} moving {direction}" for d in range(10) for _ in range(per_digit)]
    return prompts, torch.arange(10).repeat_interleave(per_digit)


@torch.no_grad()
def draw(pipe, prompts, settings, seed=0, batch_size=50):
    """-> clips [N, F, 3, H, W] in [0, 1]; clip i from torch.Generator().manual_seed(seed + i). settings: the call's
    height, width, num_frames, num_inference_steps, guidance_scale, max_sequence_length."""
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        generators = [torch.Generator().manual_seed(seed + start + i) for i in range(len(chunk))]
        out.append(pipe(chunk, generator=generators, output_type="pt", **settings).frames.float().cpu())
    return torch.cat(out)


def model_settings(base, info=None):
    """sample.py's defaults for the base (its model card's call) or a LoRA on it (info: its lora_info.json)."""
    import json

    from common.families import wan
    from common.sampling_defaults import sampling_defaults

    with open(os.path.join(base, "transformer", "config.json")) as f:
        config = json.load(f)
    d = sampling_defaults(wan, base, config, info)
    return {"height": d["height"], "width": d["width"], "num_frames": d["num_frames"],
            "num_inference_steps": d["num_inference_steps"], "guidance_scale": d["guidance_scale"],
            "max_sequence_length": d["max_sequence_length"]}


def load(model=None, lora=None):
    """-> (pipe, settings, base): the base alone (`model`) or with a train_lora.py LoRA (`lora`), as sample.py draws."""
    import diffusers

    from common.diffusion import sampling_scheduler
    from common.families import wan
    from common.lora_files import read_lora_info

    info = read_lora_info(lora) if lora else None
    base = info["base_model"] if lora else model
    pipe = diffusers.WanPipeline.from_pretrained(base, dtype=torch.float32)
    pipe.scheduler = sampling_scheduler(wan.SAMPLER, pipe.scheduler.config, wan.SAMPLERS)
    pipe.set_progress_bar_config(disable=True)
    if lora:
        pipe.load_lora_weights(lora)
    return pipe, model_settings(base, info), base


def evaluate(pipe, settings, direction, per_digit, judge, seed=0):
    """Draw per_digit clips of each digit moving `direction` and score them. -> (metrics, clips)."""
    prompts, labels = motion_prompts(per_digit, direction)
    start = time.time()
    clips = draw(pipe, prompts, settings, seed)
    metrics = {"prompt": f"a handwritten digit <d> moving {direction}", "samples": len(prompts),
               **score_clips(clips, labels, judge, "right"), "sample_time_s": round(time.time() - start, 1)}
    return metrics, clips


def save_preview(clips, path, scale=2):
    """clips [N, F, 3, H, W] -> an animated GIF of them side by side (loops), `scale` times larger."""
    from common.diffusion import image_grid, to_pil
    from common.video import save_clip

    n, f, _, h, w = clips.shape
    frames = [image_grid(to_pil(clips[:, t]), ncol=n).resize((n * w * scale, h * scale), 0) for t in range(f)]
    return save_clip(frames, path, fps=8)


def save_strip(clips, path, scale=2):
    """clips [N, F, 3, H, W] -> one PNG: a row per clip, its frames left to right."""
    from common.diffusion import image_grid, to_pil

    n, f, _, h, w = clips.shape
    image_grid(to_pil(clips.flatten(0, 1)), ncol=f).resize((f * w * scale, n * h * scale), 0).save(path)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="A Wan base folder (assets/tiny-wan-digits).")
    which.add_argument("--lora", help="A train_lora.py output folder on such a base; its all_results.json gets the "
                                      "numbers, and preview.gif and strip.png are written beside it.")
    parser.add_argument("--direction", choices=["left", "right"], default="right", help="The prompts' motion.")
    parser.add_argument("--per_digit", type=int, default=10, help="Clips per digit.")
    parser.add_argument("--judge", default="assets/digit-classifier", help="The digit classifier.")
    args = parser.parse_args(argv)
    from common.cli import quiet_libraries, quiet_loading_bars
    from demo.digit_eval import Judge, add_results

    quiet_libraries()
    quiet_loading_bars()
    pipe, settings, _ = load(args.model, args.lora)
    metrics, clips = evaluate(pipe, settings, args.direction, args.per_digit, Judge(args.judge))
    metrics["settings"] = settings
    if args.lora:
        first = clips[::args.per_digit]  # the first seed of each digit
        save_preview(first, os.path.join(args.lora, "preview.gif"))
        save_strip(first[:4], os.path.join(args.lora, "strip.png"))
        add_results(args.lora, {"motion_eval": metrics})
    print(f"{metrics['samples']} clips of \"{metrics['prompt']}\": the prompted digit {metrics['content']:.1%}, "
          f"drifting right {metrics['rightward']:.1%}, left {metrics['leftward']:.1%}; right AND the prompted digit "
          f"{metrics['hit']:.1%} (mean drift {metrics['mean_drift_px']:+.2f} px a frame)")


if __name__ == "__main__":
    main()
