"""`python -m demo.style_report --lora outputs/lora`: what the red-ink style LoRA of `make train-lora` learned.

The LoRA's base (from lora_info.json) with the LoRA (`load_lora_weights`; a LoHa or LoKr through peft), prompted "a
handwritten digit <d>, red ink on paper" for each digit, `--per_digit` seeds each, at each LoRA scale of `--lora_scales`
(0 is the base alone: the style prompt without the LoRA), with sample.py's default sampler, steps and guidance. Measured
by demo/digit_eval.py: style rate (share of samples in the red-ink style) and content (share the digit classifier
recognises as the prompted digit once the style is undone), the background (paper) and stroke colours. Writes
side_by_side.png (a row per scale, a column per digit, same seeds) and the numbers into the LoRA's all_results.json, and
prints them.
"""
import argparse
import os
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lora", default="outputs/lora", help="A train_lora.py output folder.")
    parser.add_argument("--per_digit", type=int, default=10, help="Samples per digit and scale.")
    parser.add_argument("--lora_scales", default="0,0.5,1", help="Comma-separated; 0 = without the LoRA.")
    parser.add_argument("--judge", default="assets/digit-classifier", help="The digit classifier.")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(args):
    import torch

    from common.diffusion import image_grid, to_pil
    from demo.digit_eval import Judge, add_results, digit_prompts, generate, lora_pipeline, score

    pipe, family = lora_pipeline(args.lora, uses="the style report draws from")  # (a LoHa or LoKr through peft)
    judge = Judge(args.judge)
    prompts, labels = digit_prompts(args.per_digit, style=True)
    rows, sweep, start = [], [], time.time()
    for scale in [float(s) for s in args.lora_scales.split(",")]:
        images = generate(pipe, family, prompts, family.SAMPLE_GUIDANCE, family.SAMPLE_STEPS, seed=args.seed,
                          lora_scale=scale)
        sweep.append({"lora_scale": scale, **score(images, labels, judge)})
        rows.append(images[::args.per_digit])  # the first seed of each digit
    picture = os.path.join(args.lora, "side_by_side.png")
    image_grid(to_pil(torch.cat(rows)), ncol=10).resize((10 * 64, len(rows) * 64), 0).save(picture)
    without = next((r for r in sweep if r["lora_scale"] == 0), None)
    full = next((r for r in sweep if r["lora_scale"] == 1), sweep[-1])
    results = {"style_rate_without_lora": without["style_rate"] if without else None,
               "style_rate": full["style_rate"], "content": full["content"],
               "style_eval": {"prompt": "a handwritten digit <d>, red ink on paper", "samples_per_digit":
                              args.per_digit, "sampler": family.SAMPLER, "num_inference_steps": family.SAMPLE_STEPS,
                              "guidance_scale": family.SAMPLE_GUIDANCE, "lora_scale_sweep": sweep,
                              "time_s": round(time.time() - start, 1)}}
    existing = add_results(args.lora, results)
    print(f"style LoRA ({10 * args.per_digit} samples per scale, \"a handwritten digit <d>, red ink on paper\"):")
    for row in sweep:
        print(f"  LoRA scale {row['lora_scale']:<4g} style rate {row['style_rate']:6.1%}   content "
              f"{row['content']:6.1%}   ink blot {row['blot_rate']:6.1%}   background RGB "
              f"{tuple(row['background_rgb'])}   strokes RGB {tuple(row['stroke_rgb'])}")
    losses = existing.get("validation_losses")
    if losses:  # --validation_split: the held-out red-ink digits' denoising loss, before and after
        first, last = min(losses, key=int), max(losses, key=int)
        print(f"  held-out loss (val/loss) {losses[first]:.4f} at step {first} -> {losses[last]:.4f} at step {last}")
    print(f"side by side (a row per scale, same seeds): {picture}")
    return results


if __name__ == "__main__":
    import torch

    from common.cli import quiet_libraries, quiet_loading_bars, run

    quiet_libraries()
    quiet_loading_bars()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    run(main, parse_args)  # (a LoRA it cannot read: one line)
