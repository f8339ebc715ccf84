"""The DreamBooth demo of train_lora.py: one digit's red-ink style taught under a rare token, and how far it leaks.

`python -m demo.dreambooth data`: data/dreambooth/instance/, the first --instances red-ink sevens of the train split
(data/digits-red-ink, `make data`), for --instance_data_dir with --instance_prompt "a handwritten digit seven, sks".
`python -m demo.dreambooth report --lora outputs/dreambooth`: the LoRA's base with the LoRA (a LoHa or LoKr through
peft), --per_prompt seeds of each prompt: "a handwritten digit seven, sks" (the instance prompt: the style should show),
"a handwritten digit seven" (the class prompt: it should not), and "a handwritten digit <d>" for the nine other digits
(drift into the rest of the language), with sample.py's default sampler, steps and guidance. Measured by
demo/digit_eval.py (style rate, content); the numbers go into the LoRA's all_results.json under "dreambooth_eval" and
are printed.
"""
import argparse
import json
import os
import shutil

from demo.digits import NAMES

INSTANCE_PROMPT = "a handwritten digit seven, sks"
CLASS_PROMPT = "a handwritten digit seven"


def write_instances(source, output, digit, count):
    rows = [json.loads(line) for line in open(os.path.join(source, "metadata.jsonl"))]
    chosen = [row["file_name"] for row in rows if row["label"] == digit][:count]
    shutil.rmtree(output + ".tmp", ignore_errors=True)
    os.makedirs(output + ".tmp")
    for name in chosen:
        shutil.copy(os.path.join(source, name), os.path.join(output + ".tmp", name))
    shutil.rmtree(output, ignore_errors=True)
    os.replace(output + ".tmp", output)
    print(f"wrote {len(chosen)} red-ink {NAMES[digit]}s to {output}")


def report(lora, per_prompt, judge_path, seed):
    import torch

    from demo.digit_eval import Judge, add_results, generate, lora_pipeline, score

    pipe, family = lora_pipeline(lora, uses="the DreamBooth report draws from")  # (a LoHa or LoKr through peft)
    judge = Judge(judge_path)
    seven = NAMES.index("seven")
    others = [d for d in range(10) if d != seven]
    groups = {"with_token": ([INSTANCE_PROMPT], [seven]), "without_token": ([CLASS_PROMPT], [seven]),
              "other_digits": ([f"a handwritten digit {NAMES[d]}" for d in others], others)}
    results = {}
    for name, (prompts, digits) in groups.items():
        all_prompts = [p for p in prompts for _ in range(per_prompt)]
        labels = torch.tensor(digits).repeat_interleave(per_prompt)
        images = generate(pipe, family, all_prompts, family.SAMPLE_GUIDANCE, family.SAMPLE_STEPS, seed=seed)
        measured = score(images, labels, judge)
        results[name] = {"style_rate": measured["style_rate"], "content": measured["content"],
                         "samples": len(all_prompts)}
    results = {"dreambooth_eval": {**results, "instance_prompt": INSTANCE_PROMPT, "class_prompt": CLASS_PROMPT,
                                   "sampler": family.SAMPLER, "num_inference_steps": family.SAMPLE_STEPS,
                                   "guidance_scale": family.SAMPLE_GUIDANCE}}
    add_results(lora, results)
    print(f"DreamBooth LoRA {lora} ({per_prompt} samples per prompt):")
    for name, row in results["dreambooth_eval"].items():
        if isinstance(row, dict):
            print(f"  {name:<16} style rate {row['style_rate']:6.1%}   content {row['content']:6.1%}")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="Write the instance images.")
    data.add_argument("--source", default="data/digits-red-ink/train")
    data.add_argument("--output_dir", default="data/dreambooth/instance")
    data.add_argument("--instances", type=int, default=20)
    measure = sub.add_parser("report", help="Measure a DreamBooth LoRA.")
    measure.add_argument("--lora", default="outputs/dreambooth")
    measure.add_argument("--per_prompt", type=int, default=50)
    measure.add_argument("--judge", default="assets/digit-classifier")
    measure.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "data":
        write_instances(args.source, args.output_dir, NAMES.index("seven"), args.instances)
    else:
        import torch

        from common.cli import quiet_libraries, quiet_loading_bars, run

        quiet_libraries()
        quiet_loading_bars()
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
        run(lambda a: report(a.lora, a.per_prompt, a.judge, a.seed), lambda _: args)  # (a wrong --lora: one line)


if __name__ == "__main__":
    main()
