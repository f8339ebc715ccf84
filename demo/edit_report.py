"""`python -m demo.edit_report --lora outputs/edit-lora`: what the edit LoRA of `make train-edit-lora` learned.

The LoRA's base (from lora_info.json) as its family's edit pipeline (Flux.1: FluxKontextPipeline, as sample.py --image
draws), given a held-out digit (data/digits/test: white on black, never trained on) as the reference and the
instruction "make it red ink on paper", which names no digit: `--per_digit` references of each digit, sample i from
seed i, at LoRA scale 0 (the base alone, the same reference) and 1, with sample.py's default sampler, steps and
guidance. Measured by demo/digit_eval.py: the share of outputs whose digit, as the digit classifier reads it, is the
reference's (the edit kept what the instruction does not touch), and the share in the red-ink style (light paper, red
strokes). Writes side_by_side.png (rows: reference, base, LoRA; a column per digit) and the numbers into the LoRA's
all_results.json, and prints them.
"""
import argparse
import json
import os
import time

INSTRUCTION = "make it red ink on paper"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lora", default="outputs/edit-lora", help="A train_lora.py output folder (an edit LoRA).")
    parser.add_argument("--references", default="data/digits/test",
                        help="An imagefolder split of held-out digits (metadata.jsonl with file_name and label).")
    parser.add_argument("--per_digit", type=int, default=10, help="References per digit.")
    parser.add_argument("--prompt", default=INSTRUCTION)
    parser.add_argument("--judge", default="assets/digit-classifier", help="The digit classifier.")
    parser.add_argument("--batch_size", type=int, default=50)
    return parser.parse_args(argv)


def held_out_references(folder, per_digit):
    """The first `per_digit` images of each digit (by file name) -> (PIL images, labels tensor)."""
    import torch
    from PIL import Image

    with open(os.path.join(folder, "metadata.jsonl")) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda row: row["file_name"])
    chosen = [row for digit in range(10) for row in [r for r in rows if r["label"] == digit][:per_digit]]
    images = [Image.open(os.path.join(folder, row["file_name"])).convert("RGB") for row in chosen]
    return images, torch.tensor([row["label"] for row in chosen])


def edit(pipe, family, references, prompt, lora_scale, batch_size):
    """Sample i from references[i] and seed i, as sample.py --image draws (the family's reference_kwargs, its default
    steps, guidance and size) -> images [N, 3, H, W] in [0, 1]."""
    import torch

    height, width = family.sample_size(pipe)
    length = family.text_length(pipe.components)
    out = []
    for start in range(0, len(references), batch_size):
        chunk = references[start:start + batch_size]
        kwargs = {family.LORA_SCALE_ARGUMENT: {"scale": lora_scale}, **family.reference_kwargs([chunk], height, width),
                  **family.guidance_kwargs(getattr(pipe, family.DENOISER).config, family.SAMPLE_GUIDANCE,
                                           len(chunk))[0]}
        if length:
            kwargs["max_sequence_length"] = length
        generators = [torch.Generator().manual_seed(start + i) for i in range(len(chunk))]
        with torch.no_grad():
            out.append(pipe(prompt=[prompt] * len(chunk), num_inference_steps=family.SAMPLE_STEPS, height=height,
                            width=width, generator=generators, output_type="pt", **kwargs).images.float().cpu())
    return torch.cat(out)


def main(args):
    import numpy as np
    import torch

    from common.diffusion import image_grid, to_pil
    from demo.digit_eval import Judge, add_results, in_style, lora_pipeline

    pipe, family = lora_pipeline(args.lora, uses="the edit report draws from", edit=True)
    judge = Judge(args.judge)
    references, labels = held_out_references(args.references, args.per_digit)
    pixels = torch.from_numpy(np.stack([np.asarray(r) for r in references])).permute(0, 3, 1, 2).float() / 255
    start, rows, sweep = time.time(), [pixels[::args.per_digit]], []
    for scale in (0.0, 1.0):
        images = edit(pipe, family, references, args.prompt, scale, args.batch_size)
        same = judge.predict(images) == labels
        sweep.append({"lora_scale": scale, "same_digit": round(same.float().mean().item(), 4),
                      "red_ink": round(in_style(images).float().mean().item(), 4),
                      "same_digit_per_digit": [round(same[labels == d].float().mean().item(), 2) for d in range(10)]})
        rows.append(images[::args.per_digit])
    picture = os.path.join(args.lora, "side_by_side.png")
    image_grid(to_pil(torch.cat(rows)), ncol=10).resize((10 * 64, 3 * 64), 0).save(picture)
    base, lora = sweep
    results = {"edit_same_digit": lora["same_digit"], "edit_red_ink": lora["red_ink"],
               "edit_same_digit_base": base["same_digit"], "edit_red_ink_base": base["red_ink"],
               "edit_eval": {"prompt": args.prompt, "references": args.references, "samples": len(references),
                             "judge_on_references": round((judge.predict(pixels) == labels).float().mean().item(), 4),
                             "sampler": family.SAMPLER, "num_inference_steps": family.SAMPLE_STEPS,
                             "guidance_scale": family.SAMPLE_GUIDANCE, "lora_scale_sweep": sweep,
                             "time_s": round(time.time() - start, 1)}}
    add_results(args.lora, results)
    print(f"edit LoRA ({len(references)} held-out references, \"{args.prompt}\"):")
    for row in sweep:
        print(f"  LoRA scale {row['lora_scale']:<4g} same digit as the reference {row['same_digit']:6.1%}   red ink on "
              f"paper {row['red_ink']:6.1%}")
    print(f"side by side (rows: reference, base, LoRA; same seeds): {picture}")
    return results


if __name__ == "__main__":
    import torch

    from common.cli import quiet_libraries, quiet_loading_bars, run

    quiet_libraries()
    quiet_loading_bars()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    run(main, parse_args)
