"""`make bench`'s Kontext row: train_lora.py with reference images against diffusers' own
train_dreambooth_lora_flux_kontext.py on the tiny random-init Flux.1 (models/tiny-flux, `make tiny-flux`), which both
load as FluxKontextPipeline's parts, with the same pairs (each white-on-black digit the reference of its red-ink twin,
"make it red ink on paper"), settings (rank, both scripts' default targets, steps, batch, learning rate, resolution,
seed, T5 length, guidance input, cached latents), each a whole `accelerate launch` on the CPU, timed from start to exit
and interleaved; then both LoRAs' held-out loss on test pairs with their references, at the same fixed noise and
sigmas (common/validation_loss.py), so that speed is not bought with quality.

The pairs are one imagefolder both read (outputs/bench/kontext-pairs: the target's `file_name`, the reference's
`control_file_name`, the instruction in `text`): ours through --control_image_column control, the peer's through
--cond_image_column control. The peer's file comes as flux_peer.py's does (`make bench-peers`), and runs through
tests/benchmarks/peer_run.py (torchvision's PIL transforms written here).

    python tests/benchmarks/kontext_peer.py run [--repeats 3]      # -> outputs/bench/kontext_peer.json and a table
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from flux_peer import BASE, PEERS, environment  # noqa: E402

PEER = "train_dreambooth_lora_flux_kontext.py"
PAIRS = os.path.join("outputs", "bench", "kontext-pairs")
INSTRUCTION = "make it red ink on paper"
SAME = {"--resolution": "32", "--train_batch_size": "8", "--max_train_steps": "600", "--learning_rate": "1e-3",
        "--rank": "4", "--seed": "0", "--max_sequence_length": "64", "--guidance_scale": "3.5",
        "--lr_scheduler": "constant", "--lr_warmup_steps": "0", "--checkpointing_steps": "100000",
        "--adam_weight_decay": "1e-4", "--mixed_precision": "no", "--caption_column": "text"}
TARGET = 1.3  # train_lora.py's speed over the peer's, whole process
# What the peer does by default, asked of ours: train on the latent distributions' mode (its --vae_encode_mode), and
# encode the cache a training batch at a time.
OURS = ["--vae_encode_mode", "mode", "--vae_encode_batch_size", SAME["--train_batch_size"]]


def write_pairs(root=os.path.join(ROOT, PAIRS)):
    """data/digits-red-ink's images as targets, data/digits' as their references (controls/), one imagefolder."""
    if os.path.isfile(os.path.join(root, "test", "metadata.jsonl")):
        return root
    shutil.rmtree(root + ".tmp", ignore_errors=True)
    for split in ("train", "test"):
        folder = os.path.join(root + ".tmp", split)
        os.makedirs(os.path.join(folder, "controls"))
        with open(os.path.join(ROOT, "data", "digits-red-ink", split, "metadata.jsonl")) as f:
            names = [json.loads(line)["file_name"] for line in f]
        with open(os.path.join(folder, "metadata.jsonl"), "w") as f:
            for name in names:
                shutil.copy(os.path.join(ROOT, "data", "digits-red-ink", split, name), os.path.join(folder, name))
                shutil.copy(os.path.join(ROOT, "data", "digits", split, name), os.path.join(folder, "controls", name))
                f.write(json.dumps({"file_name": name, "control_file_name": f"controls/{name}",
                                    "text": INSTRUCTION}) + "\n")
    os.replace(root + ".tmp", root)
    return root


def commands(out):
    same = [x for pair in SAME.items() for x in pair]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              os.path.join(ROOT, "accelerate_configs", "cpu.yaml"), "--num_cpu_threads_per_process", "1"]
    ours = [*launch, os.path.join(ROOT, "train_lora.py"), "--pretrained_model_name_or_path", BASE, "--train_data_dir",
            PAIRS, "--control_image_column", "control", *same, *OURS, "--cache_latents", "--report_to", "tensorboard",
            "--output_dir", os.path.join(out, "ours")]
    peer = [*launch, os.path.join(HERE, "peer_run.py"), os.path.join(PEERS, PEER), "--pretrained_model_name_or_path",
            BASE, "--dataset_name", PAIRS, "--image_column", "image", "--cond_image_column", "control",
            "--instance_prompt", INSTRUCTION, *same, "--cache_latents", "--report_to", "tensorboard",
            "--output_dir", os.path.join(out, "peer")]
    return {"ours": ours, "peer": peer}


def held_out_losses(folders):
    """{name: held-out loss} of the base (None) and each LoRA folder, on the first 64 test pairs, each target denoised
    with its reference, at one set of fixed noise and sigmas."""
    import argparse as ap

    import torch
    from accelerate import Accelerator
    from diffusers import FluxKontextPipeline

    from common.families import flux
    from common.image_data import Captions, image_datasets, load_image_dataset
    from common.objectives import FlowMatching
    from common.prompts import Conditioning
    from common.references import paired_references
    from common.vae import encode_params
    from common.validation_loss import HeldOutLoss

    torch.set_num_threads(2)
    args = ap.Namespace(dataset_name=None, dataset_config_name=None, train_data_dir=PAIRS, cache_dir=None,
                        image_column="image", caption_column="text", eval_split="test", max_train_samples=None,
                        resolution=32, center_crop=True, random_flip=False, seed=0, caption_prefix="",
                        caption_dropout_prob=0.0, control_data_dir=[], control_image_column=["control"],
                        allow_missing_control=False, validation_image=[], pretrained_model_name_or_path=BASE,
                        revision=None)
    _, test = load_image_dataset(args)
    test = test.select(range(64))
    refs, _ = paired_references(args, flux, test, test)
    captions = Captions(args, test, test)
    _, held_out = image_datasets(args, test, test, references=refs.rows)
    results = {}
    for name, folder in folders.items():
        pipe = FluxKontextPipeline.from_pretrained(BASE)
        if folder:
            pipe.load_lora_weights(folder)
        objective = FlowMatching(pipe.scheduler.__class__.from_config(pipe.scheduler.config))
        condition = Conditioning(flux, pipe.components, captions.prompts, int(SAME["--max_sequence_length"]), "cpu")

        def encode(x, vae=pipe.vae):
            return encode_params(vae, x)

        loss = HeldOutLoss(held_out, encode, pipe.vae.config, list(range(len(held_out))), objective,
                           Accelerator(cpu=True), 0, 32)
        results[name] = loss(pipe.transformer, lambda x, t, cond, m=pipe.transformer: flux.denoise(m, x, t, cond, 3.5),
                             lambda ids, e=encode, c=pipe.vae.config, cond=condition: {
                                 **cond(captions.held_out_ids[ids]), **refs.held_out(ids, held_out, e, c)})
        refs.held_out_cache.clear()  # (each base's VAE encodes its own)
    return results


def run(args):
    missing = [path for path in (os.path.join(PEERS, PEER), os.path.join(ROOT, BASE, "model_index.json"),
                                 os.path.join(ROOT, "data", "digits", "train", "metadata.jsonl"))
               if not os.path.isfile(path)]
    if missing:
        sys.exit(f"kontext_peer: missing {missing[0]}: `make bench-peers DIFFUSERS_REPO=...` copies diffusers' script, "
                 "`make tiny-flux data` builds the base and the data")
    write_pairs()
    out = os.path.join(ROOT, "outputs", "bench", "kontext_peer")
    times = {"ours": [], "peer": []}
    for repeat in range(args.repeats):
        for name, cmd in commands(out).items():  # interleaved, each a fresh process
            start = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"kontext_peer: {name} failed:\n{proc.stderr[-3000:]}")
            times[name].append(round(time.perf_counter() - start, 2))
            print(f"repeat {repeat + 1}: {name} {times[name][-1]} s", flush=True)
    losses = held_out_losses({"base": None, "ours": os.path.join(out, "ours"), "peer": os.path.join(out, "peer")})
    median = {name: statistics.median(values) for name, values in times.items()}
    result = {"settings": SAME, "steps": int(SAME["--max_train_steps"]), "seconds": times, "median_s": median,
              "speedup": round(median["peer"] / median["ours"], 3), "target_speedup": TARGET,
              "held_out_loss": losses, "commands": {k: " ".join(v) for k, v in commands(out).items()},
              "peer_source": json.load(open(os.path.join(PEERS, "SOURCE.json")))
              if os.path.isfile(os.path.join(PEERS, "SOURCE.json")) else None}
    with open(os.path.join(ROOT, "outputs", "bench", "kontext_peer.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"| FLUX.1 Kontext edit LoRA, tiny, {SAME['--max_train_steps']} steps | train_lora.py {median['ours']} s | "
          f"diffusers {median['peer']} s | {result['speedup']}x (target {TARGET}x) | held-out loss: base "
          f"{losses['base']:.4f}, ours {losses['ours']:.4f}, diffusers' {losses['peer']:.4f} |")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    go = steps.add_parser("run", help="Time both and compare their held-out losses.")
    go.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    run(args)


if __name__ == "__main__":
    main()
