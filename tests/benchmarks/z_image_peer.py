"""`make bench`'s Z-Image row: train_lora.py against diffusers' own train_dreambooth_lora_z_image.py on the tiny
random-init Z-Image (models/tiny-z-image, `make tiny-z-image`), with the same settings (rank, targets: both scripts'
defaults, steps, batch, learning rate, resolution, seed, Qwen3 prompt length, cached latents), each a whole
`accelerate launch` on the CPU, timed from start to exit, interleaved; then both LoRAs' held-out loss on the red-ink
digits' test split, at the same fixed noise and sigmas (common/validation_loss.py), so that speed is not bought with
quality. The peer script is fetched and run as for the Flux row (tests/benchmarks/flux_peer.py: `make bench-peers`
copies it, at the pinned diffusers' tag or the nearest below, into .gpu-pack/peers; peer_run.py stands in for
torchvision).

    python tests/benchmarks/z_image_peer.py run [--repeats 3]    # -> outputs/bench/z_image_peer.json and a table
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from flux_peer import DATA, PEERS, TARGET, environment  # noqa: E402

PEER = "train_dreambooth_lora_z_image.py"
BASE = "models/tiny-z-image"
SAME = {"--resolution": "32", "--train_batch_size": "8", "--max_train_steps": "600", "--learning_rate": "1e-3",
        "--rank": "4", "--seed": "0", "--max_sequence_length": "64", "--lr_scheduler": "constant",
        "--lr_warmup_steps": "0", "--checkpointing_steps": "100000", "--adam_weight_decay": "1e-4",
        "--mixed_precision": "no"}


def commands(out, steps=None):
    same = {**SAME, **({"--max_train_steps": str(steps)} if steps else {})}
    same = [x for pair in same.items() for x in pair]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              os.path.join(ROOT, "accelerate_configs", "cpu.yaml"), "--num_cpu_threads_per_process", "1"]
    ours = [*launch, os.path.join(ROOT, "train_lora.py"), "--pretrained_model_name_or_path", BASE, "--train_data_dir",
            DATA, *same, "--cache_latents", "--report_to", "tensorboard", "--output_dir", os.path.join(out, "ours")]
    peer = [*launch, os.path.join(HERE, "peer_run.py"), os.path.join(PEERS, PEER), "--pretrained_model_name_or_path",
            BASE, "--dataset_name", DATA, "--caption_column", "text", "--instance_prompt", "a handwritten digit",
            *same, "--cache_latents", "--report_to", "tensorboard", "--output_dir", os.path.join(out, "peer")]
    return {"ours": ours, "peer": peer}


def held_out_losses(folders):
    """{name: held-out loss} of the base (None) and each LoRA folder, on the first 64 test images of the red-ink
    digits with their captions, at one set of fixed noise and sigmas."""
    import argparse as ap

    import torch
    from accelerate import Accelerator
    from diffusers import ZImagePipeline

    from common.families import z_image
    from common.image_data import Captions, image_datasets, load_image_dataset
    from common.objectives import FlowMatching
    from common.prompts import Conditioning
    from common.vae import encode_params
    from common.validation_loss import HeldOutLoss

    torch.set_num_threads(2)
    args = ap.Namespace(dataset_name=None, dataset_config_name=None, train_data_dir=DATA, cache_dir=None,
                        image_column="image", caption_column="text", eval_split="test", max_train_samples=None,
                        resolution=32, center_crop=True, random_flip=False, seed=0, caption_prefix="",
                        caption_dropout_prob=0.0)
    _, test = load_image_dataset(args)
    test = test.select(range(64))
    captions = Captions(args, test, test)
    _, held_out = image_datasets(args, test, test)
    results = {}
    for name, folder in folders.items():
        pipe = ZImagePipeline.from_pretrained(BASE)
        if folder:
            pipe.load_lora_weights(folder)
        objective = FlowMatching(pipe.scheduler.__class__.from_config(pipe.scheduler.config))
        condition = Conditioning(z_image, pipe.components, captions.prompts, int(SAME["--max_sequence_length"]),
                                 "cpu")
        loss = HeldOutLoss(held_out, lambda x, vae=pipe.vae: encode_params(vae, x), pipe.vae.config,
                           list(range(len(held_out))), objective, Accelerator(cpu=True), 0, 32)
        results[name] = loss(pipe.transformer, lambda x, t, cond, m=pipe.transformer: z_image.denoise(m, x, t, cond),
                             lambda ids: condition(captions.held_out_ids[ids]))
    return results


def run(args):
    missing = [path for path in (os.path.join(PEERS, PEER), os.path.join(ROOT, BASE, "model_index.json"),
                                 os.path.join(ROOT, DATA, "train", "metadata.jsonl")) if not os.path.isfile(path)]
    if missing:
        sys.exit(f"z_image_peer: missing {missing[0]}: `make bench-peers DIFFUSERS_REPO=...` copies diffusers' "
                 "script, `make tiny-z-image data` builds the base and the data")
    out = os.path.join(ROOT, "outputs", "bench", "z_image_peer")
    times = {"ours": [], "peer": []}
    for repeat in range(args.repeats):
        for name, cmd in commands(out, args.steps).items():  # interleaved, each a fresh process
            start = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"z_image_peer: {name} failed:\n{proc.stderr[-3000:]}")
            times[name].append(round(time.perf_counter() - start, 2))
            print(f"repeat {repeat + 1}: {name} {times[name][-1]} s", flush=True)
    losses = held_out_losses({"base": None, "ours": os.path.join(out, "ours"), "peer": os.path.join(out, "peer")})
    median = {name: statistics.median(values) for name, values in times.items()}
    steps = args.steps or int(SAME["--max_train_steps"])
    result = {"settings": {**SAME, "--max_train_steps": str(steps)}, "steps": steps, "seconds": times,
              "median_s": median, "speedup": round(median["peer"] / median["ours"], 3), "target_speedup": TARGET,
              "held_out_loss": losses, "commands": {k: " ".join(v) for k, v in commands(out, args.steps).items()},
              "peer_source": json.load(open(os.path.join(PEERS, "SOURCE.json")))
              if os.path.isfile(os.path.join(PEERS, "SOURCE.json")) else None}
    with open(os.path.join(ROOT, "outputs", "bench", "z_image_peer.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"| Z-Image LoRA, tiny, {steps} steps | train_lora.py {median['ours']} s | diffusers {median['peer']} s | "
          f"{result['speedup']}x (target {TARGET}x) | held-out loss: base {losses['base']:.4f}, ours "
          f"{losses['ours']:.4f}, diffusers' {losses['peer']:.4f} |")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    go = steps.add_parser("run", help="Time both and compare their held-out losses.")
    go.add_argument("--repeats", type=int, default=3)
    go.add_argument("--steps", type=int, default=None, help=f"Default: {SAME['--max_train_steps']}.")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    run(args)


if __name__ == "__main__":
    main()
