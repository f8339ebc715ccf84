"""`make bench`'s FLUX.2 klein row: train_lora.py against diffusers' own train_dreambooth_lora_flux2_klein.py on the
tiny random-init FLUX.2 klein (models/tiny-flux2-klein, `make tiny-flux2-klein`), as tests/benchmarks/flux_peer.py
does for Flux.1: the same settings (rank, targets: both scripts' defaults, steps, batch, learning rate, resolution,
seed, prompt length, cached latents), each a whole `accelerate launch` on the CPU, timed from start to exit,
interleaved; then both LoRAs' held-out loss on the red-ink digits' test split at the same fixed noise and sigmas.

The peer runs unchanged (check_min_version passes at the pinned diffusers) through tests/benchmarks/peer_run.py (PIL
transforms for torchvision), with one flag beyond the shared ones: `--text_encoder_out_layers 9 18 27`, the layers
Flux2KleinPipeline embeds prompts with (and train_lora.py too). The script's default, FLUX.2 dev's 10, 20, 30,
would train on other embeddings than the pipeline samples with, and on the tiny Qwen3 (28 layers) it stops at once
(hidden_states[30] out of range).

    python tests/benchmarks/flux2_klein_peer.py fetch --diffusers_repo PATH
    python tests/benchmarks/flux2_klein_peer.py run [--repeats 3]   # -> outputs/bench/flux2_klein_peer.json, a table
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
PEERS = os.path.join(ROOT, ".gpu-pack", "peers")
PEER = "train_dreambooth_lora_flux2_klein.py"
BASE, DATA = "models/tiny-flux2-klein", "data/digits-red-ink"
SAME = {"--resolution": "32", "--train_batch_size": "8", "--max_train_steps": "300", "--learning_rate": "1e-3",
        "--rank": "4", "--seed": "0", "--max_sequence_length": "64", "--lr_scheduler": "constant",
        "--lr_warmup_steps": "0", "--checkpointing_steps": "100000", "--adam_weight_decay": "1e-4",
        "--mixed_precision": "no"}
LAYERS = ["--text_encoder_out_layers", "9", "18", "27"]  # the pipeline's (the peer's default is dev's)
TARGET = 1.3  # train_lora.py's speed over the peer's, whole process


def commands(out):
    same = [x for pair in SAME.items() for x in pair]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              os.path.join(ROOT, "accelerate_configs", "cpu.yaml"), "--num_cpu_threads_per_process", "1"]
    ours = [*launch, os.path.join(ROOT, "train_lora.py"), "--pretrained_model_name_or_path", BASE, "--train_data_dir",
            DATA, *same, "--cache_latents", "--report_to", "tensorboard", "--output_dir", os.path.join(out, "ours")]
    peer = [*launch, os.path.join(HERE, "peer_run.py"), os.path.join(PEERS, PEER), "--pretrained_model_name_or_path",
            BASE, "--dataset_name", DATA, "--caption_column", "text", "--instance_prompt", "a handwritten digit",
            *same, *LAYERS, "--cache_latents", "--report_to", "tensorboard", "--output_dir",
            os.path.join(out, "peer")]
    return {"ours": ours, "peer": peer}


def held_out_losses(folders):
    """{name: held-out loss} of the base (None) and each LoRA folder, on the first 64 test images of the red-ink
    digits with their captions, at one set of fixed noise and sigmas."""
    import argparse as ap

    import torch
    from accelerate import Accelerator
    from diffusers import Flux2KleinPipeline

    from common.families import flux2_klein
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
        pipe = Flux2KleinPipeline.from_pretrained(BASE)
        if folder:
            pipe.load_lora_weights(folder)
        objective = FlowMatching(pipe.scheduler.__class__.from_config(pipe.scheduler.config))
        condition = Conditioning(flux2_klein, pipe.components, captions.prompts, int(SAME["--max_sequence_length"]),
                                 "cpu")
        loss = HeldOutLoss(held_out, lambda x, vae=pipe.vae: encode_params(vae, x), flux2_klein.latent_config(pipe.vae),
                           list(range(len(held_out))), objective, Accelerator(cpu=True), 0, 32)
        results[name] = loss(pipe.transformer,
                             lambda x, t, cond, m=pipe.transformer: flux2_klein.denoise(m, x, t, cond),
                             lambda ids: condition(captions.held_out_ids[ids]))
    return results


def run(args):
    from flux_peer import environment

    missing = [path for path in (os.path.join(PEERS, PEER), os.path.join(ROOT, BASE, "model_index.json"),
                                 os.path.join(ROOT, DATA, "train", "metadata.jsonl")) if not os.path.isfile(path)]
    if missing:
        sys.exit(f"flux2_klein_peer: missing {missing[0]}: `python tests/benchmarks/flux2_klein_peer.py fetch "
                 "--diffusers_repo ...` copies diffusers' script, `make tiny-flux2-klein data` the base and data")
    out = os.path.join(ROOT, "outputs", "bench", "flux2_klein_peer")
    times = {"ours": [], "peer": []}
    for repeat in range(args.repeats):
        for name, cmd in commands(out).items():  # interleaved, each a fresh process
            start = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"flux2_klein_peer: {name} failed:\n{proc.stderr[-3000:]}")
            times[name].append(round(time.perf_counter() - start, 2))
            print(f"repeat {repeat + 1}: {name} {times[name][-1]} s", flush=True)
    losses = held_out_losses({"base": None, "ours": os.path.join(out, "ours"), "peer": os.path.join(out, "peer")})
    median = {name: statistics.median(values) for name, values in times.items()}
    result = {"settings": SAME, "peer_flags": LAYERS, "steps": int(SAME["--max_train_steps"]), "seconds": times,
              "median_s": median, "speedup": round(median["peer"] / median["ours"], 3), "target_speedup": TARGET,
              "held_out_loss": losses, "commands": {k: " ".join(v) for k, v in commands(out).items()},
              "peer_source": json.load(open(os.path.join(PEERS, "SOURCE_flux2_klein.json")))
              if os.path.isfile(os.path.join(PEERS, "SOURCE_flux2_klein.json")) else None}
    with open(os.path.join(ROOT, "outputs", "bench", "flux2_klein_peer.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"| FLUX.2 klein LoRA, tiny, {SAME['--max_train_steps']} steps | train_lora.py {median['ours']} s | "
          f"diffusers {median['peer']} s | {result['speedup']}x (target {TARGET}x) | held-out loss: base "
          f"{losses['base']:.4f}, ours {losses['ours']:.4f}, diffusers' {losses['peer']:.4f} |")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    fetch = steps.add_parser("fetch", help="Copy diffusers' klein script at the pinned version into .gpu-pack/peers.")
    fetch.add_argument("--diffusers_repo", required=True)
    go = steps.add_parser("run", help="Time both and compare their held-out losses.")
    go.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    if args.step == "fetch":
        import re

        from gpu_evidence import git, peer_tag

        from common.cli import UserError
        version = re.search(r"^diffusers==(\S+)", open(os.path.join(ROOT, "requirements.txt")).read(), re.M).group(1)
        try:
            tag, note = peer_tag(args.diffusers_repo, version)
            os.makedirs(PEERS, exist_ok=True)
            with open(os.path.join(PEERS, PEER), "wb") as f:
                f.write(git(args.diffusers_repo, "show", f"{tag}:examples/dreambooth/{PEER}"))
            commit = git(args.diffusers_repo, "rev-parse", f"{tag}^{{commit}}").decode().strip()
        except UserError as err:
            sys.exit(f"error: {err}")
        with open(os.path.join(PEERS, "SOURCE_flux2_klein.json"), "w") as f:
            json.dump({"repository": os.path.abspath(args.diffusers_repo), "tag": tag, "commit": commit,
                       "pinned_diffusers": version, "note": note, "files": [f"examples/dreambooth/{PEER}"]}, f,
                      indent=2)
        print(f"diffusers' {PEER} at {tag} in {PEERS}" + (f" ({note})" if note else ""))
    else:
        run(args)


if __name__ == "__main__":
    main()
