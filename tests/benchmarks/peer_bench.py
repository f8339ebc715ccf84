"""What `make bench`'s rows against diffusers' own scripts share (sd_peer.py, flux_peer.py, qwen_image_peer.py,
flux2_klein_peer.py, z_image_peer.py, kontext_peer.py; each says only its peer script, base, flags and data): both
scripts on the same tiny random-init base and data with the same settings, each a whole `accelerate launch` on the
CPU, timed from start to exit, interleaved, several repeats; then both LoRAs' held-out loss on the first 64 test images
of the red-ink digits with their captions, at one set of fixed noise and timesteps (common/validation_loss.py), so
that speed is not bought with quality.

diffusers' wheel has no examples: `make bench-peers DIFFUSERS_REPO=<a clone of diffusers>` copies the scripts, at the
tag of the pinned diffusers (or the nearest below it), into .gpu-pack/peers (make gpu-evidence-pack does too). They
import torchvision for a few PIL transforms; torchvision does not import beside the CPU torch here, so a peer runs
through tests/benchmarks/peer_run.py, which gives it those transforms written on PIL (peer_torchvision).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PEERS = os.path.join(ROOT, ".gpu-pack", "peers")
DATA = "data/digits-red-ink"
TARGET = 1.3  # train_lora.py's speed over the peer's, whole process
# the flags the dreambooth scripts take for an imagefolder with captions
DREAMBOOTH_DATA = ["--dataset_name", DATA, "--caption_column", "text", "--instance_prompt", "a handwritten digit"]


@dataclass
class Row:
    """One comparison: `name` (the script's, and its outputs'), `title` (the table row's), `peer` (diffusers' script,
    in .gpu-pack/peers), `base` (a diffusers folder), `pipeline` (its diffusers class, for the held-out loss),
    `family` (common/families/), `same` (flags both take, with their values; None: a flag without one), then what
    only one side takes: its data flags, its other flags, its cache flag. `family_latents`: the held-out loss reads
    the latents' scale from the family's latent_config (FLUX.2, Qwen-Image), else from the VAE's config;
    `references`: its test images have reference images (edit LoRAs). `needs`: the data files the row reads;
    `prepare()` writes its data from them; `make`: what builds the base and data; `fetch`: "all" (the peers of make
    bench-peers, SOURCE.json) or "one" (only this peer, recorded in `source`) for a `fetch` step, else None."""
    name: str
    title: str
    peer: str
    base: str
    pipeline: str
    family: str
    same: dict
    make: str
    ours_data: list = field(default_factory=lambda: ["--train_data_dir", DATA])
    peer_data: list = field(default_factory=lambda: list(DREAMBOOTH_DATA))
    ours: list = field(default_factory=list)
    peer_flags: list = field(default_factory=list)
    cache: list = field(default_factory=lambda: ["--cache_latents"])
    peer_cache: list = field(default_factory=lambda: ["--cache_latents"])
    family_latents: bool = False
    references: bool = False
    held_out_data: str = DATA
    needs: list = field(default_factory=lambda: [f"{DATA}/train/metadata.jsonl"])
    prepare: object = None
    fetch: str = None
    source: str = "SOURCE.json"


def launch():
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            os.path.join(ROOT, "accelerate_configs", "cpu.yaml"), "--num_cpu_threads_per_process", "1"]


def settings(row, steps=None, seed=None):
    return {**row.same, **({"--max_train_steps": str(steps)} if steps else {}),
            **({"--seed": str(seed)} if seed is not None else {})}


def commands(row, out, steps=None, seed=None):
    same = [x for flag, value in settings(row, steps, seed).items()
            for x in ((flag,) if value is None else (flag, value))]
    ours = [*launch(), os.path.join(ROOT, "train_lora.py"), "--pretrained_model_name_or_path", row.base,
            *row.ours_data, *same, *row.ours, *row.cache, "--report_to", "tensorboard", "--output_dir",
            os.path.join(out, "ours")]
    peer = [*launch(), os.path.join(HERE, "peer_run.py"), os.path.join(PEERS, row.peer),
            "--pretrained_model_name_or_path", row.base, *row.peer_data, *same, *row.peer_flags, *row.peer_cache,
            "--report_to", "tensorboard", "--output_dir", os.path.join(out, "peer")]
    return {"ours": ours, "peer": peer}


def environment():
    # (TQDM_DISABLE quiets the libraries' own bars; both scripts' training bars pass `disable=` and stay, as users see
    # them: each script pays for its own)
    return dict(os.environ, ACCELERATE_USE_CPU="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1", PYTHONPATH=ROOT)


def held_out_losses(row, folders):
    """{name: held-out loss} of the base (None) and each LoRA folder (through load_lora_weights), on the first 64
    test images of `row.held_out_data` with their captions (with `row.references`, each target denoised with its
    reference images), at one set of fixed noise and timesteps."""
    import argparse as ap
    import importlib

    import diffusers
    import torch
    from accelerate import Accelerator

    from common.image_data import Captions, image_datasets, load_image_dataset
    from common.objectives import DDPM, FlowMatching
    from common.prompts import Conditioning
    from common.references import paired_references
    from common.vae import encode_params
    from common.validation_loss import HeldOutLoss

    family = importlib.import_module(f"common.families.{row.family}")
    torch.set_num_threads(2)
    args = ap.Namespace(dataset_name=None, dataset_config_name=None, train_data_dir=row.held_out_data, cache_dir=None,
                        image_column="image", caption_column="text", eval_split="test", max_train_samples=None,
                        resolution=int(row.same["--resolution"]), center_crop=True, random_flip=False, seed=0,
                        caption_prefix="", caption_dropout_prob=0.0, control_data_dir=[],
                        control_image_column=["control"] if row.references else [], allow_missing_control=False,
                        validation_image=[], pretrained_model_name_or_path=row.base, revision=None)
    _, test = load_image_dataset(args)
    test = test.select(range(64))
    refs = paired_references(args, family, test, test)[0] if row.references else None
    captions = Captions(args, test, test)
    _, held_out = image_datasets(args, test, test, **({"references": refs.rows} if refs else {}))
    guidance = float(row.same["--guidance_scale"]) if "--guidance_scale" in row.same else None
    results = {}
    for name, folder in folders.items():
        pipe = getattr(diffusers, row.pipeline).from_pretrained(row.base)
        if folder:
            pipe.load_lora_weights(folder)
        scheduler = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
        objective = DDPM(scheduler) if family.OBJECTIVE == "ddpm" else FlowMatching(scheduler)
        length = row.same.get("--max_sequence_length")
        condition = Conditioning(family, pipe.components, captions.prompts, length and int(length), "cpu")
        latent_config = family.latent_config(pipe.vae) if row.family_latents else pipe.vae.config
        denoiser = getattr(pipe, family.DENOISER)

        def encode(x, vae=pipe.vae):
            return encode_params(vae, x)

        def embed(ids, condition=condition, encode=encode, config=latent_config):
            cond = condition(captions.held_out_ids[ids])
            return {**cond, **refs.held_out(ids, held_out, encode, config)} if refs else cond

        loss = HeldOutLoss(held_out, encode, latent_config, list(range(len(held_out))), objective,
                           Accelerator(cpu=True), 0, 32)
        results[name] = loss(denoiser, lambda x, t, cond, m=denoiser: family.denoise(m, x, t, cond, guidance), embed)
        if refs:
            refs.held_out_cache.clear()  # (each base's VAE encodes its own)
    return results


def run(row, repeats=3, steps=None, seeds=None):
    """Both scripts `repeats` times for each seed of `seeds` (default: the row's own), interleaved, each a fresh
    process; then the held-out losses of each seed's two LoRAs. -> the result, also in outputs/bench/<row.name>.json,
    and a markdown row printed: the median time over every run, the mean held-out loss over the seeds."""
    missing = [path for path in (os.path.join(PEERS, row.peer), os.path.join(ROOT, row.base, "model_index.json"),
                                 *(os.path.join(ROOT, p) for p in row.needs)) if not os.path.isfile(path)]
    if missing:
        sys.exit(f"{row.name}: missing {missing[0]}: `make bench-peers DIFFUSERS_REPO=...` copies diffusers' script, "
                 f"`{row.make}` builds the base and the data")
    if row.prepare:
        row.prepare()
    seeds = seeds or [int(row.same["--seed"])]
    out = os.path.join(ROOT, "outputs", "bench", row.name)
    times, per_seed = {"ours": [], "peer": []}, {}
    for seed in seeds:
        folder = out if len(seeds) == 1 else os.path.join(out, f"seed{seed}")
        for repeat in range(repeats):
            for name, cmd in commands(row, folder, steps, seed).items():  # interleaved, each a fresh process
                start = time.perf_counter()
                proc = subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"{row.name}: {name} failed:\n{proc.stderr[-3000:]}")
                times[name].append(round(time.perf_counter() - start, 2))
                print(f"seed {seed}, repeat {repeat + 1}: {name} {times[name][-1]} s (load average "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
        per_seed[seed] = {name: os.path.join(folder, name) for name in ("ours", "peer")}
    folders = {"base": None, **{f"{name} seed {seed}": path for seed, paths in per_seed.items()
                                for name, path in paths.items()}}
    found = held_out_losses(row, folders)
    losses = {"base": found["base"], **{name: statistics.mean(found[f"{name} seed {seed}"] for seed in seeds)
                                        for name in ("ours", "peer")}}
    median = {name: statistics.median(values) for name, values in times.items()}
    steps = int(settings(row, steps)["--max_train_steps"])
    source = os.path.join(PEERS, row.source)
    result = {"settings": settings(row, steps), "ours_flags": row.ours, "peer_flags": row.peer_flags, "steps": steps,
              "seeds": seeds, "seconds": times, "median_s": median,
              "speedup": round(median["peer"] / median["ours"], 3), "target_speedup": TARGET,
              "held_out_loss": losses, "held_out_loss_per_seed": {
                  seed: {name: found[f"{name} seed {seed}"] for name in ("ours", "peer")} for seed in seeds},
              "commands": {k: " ".join(v) for k, v in commands(row, out, steps).items()},
              "peer_source": json.load(open(source)) if os.path.isfile(source) else None}
    with open(os.path.join(ROOT, "outputs", "bench", f"{row.name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    mean = f"mean of {len(seeds)} seeds, " if len(seeds) > 1 else ""
    print(f"| {row.title}, tiny, {steps} steps | train_lora.py {median['ours']} s | diffusers {median['peer']} s | "
          f"{result['speedup']}x (target {TARGET}x) | held-out loss ({mean}base {losses['base']:.4f}): ours "
          f"{losses['ours']:.4f}, diffusers' {losses['peer']:.4f} |")
    return result


def fetch(row, diffusers_repo):
    """Copy diffusers' scripts at the pinned version (or the nearest tag below it) into .gpu-pack/peers: all of make
    bench-peers' (row.fetch "all"), or this row's alone ("one", recorded in its own SOURCE file)."""
    import re

    sys.path.insert(0, HERE)
    from gpu_evidence import copy_peers, git, peer_tag

    from common.cli import UserError
    version = re.search(r"^diffusers==(\S+)", open(os.path.join(ROOT, "requirements.txt")).read(), re.M).group(1)
    try:
        if row.fetch == "all":
            source = copy_peers(diffusers_repo, PEERS, version)
            print(f"diffusers' scripts at {source['tag']} in {PEERS}" + (f" ({source['note']})" if source["note"]
                                                                          else ""))
            return
        tag, note = peer_tag(diffusers_repo, version)
    except UserError as err:
        sys.exit(f"error: {err}")
    os.makedirs(PEERS, exist_ok=True)
    with open(os.path.join(PEERS, row.peer), "wb") as f:
        f.write(git(diffusers_repo, "show", f"{tag}:examples/dreambooth/{row.peer}"))
    commit = git(diffusers_repo, "rev-parse", f"{tag}^{{commit}}").decode().strip()
    with open(os.path.join(PEERS, row.source), "w") as f:
        json.dump({"repository": os.path.abspath(diffusers_repo), "tag": tag, "commit": commit,
                   "pinned_diffusers": version, "note": note, "files": [f"examples/dreambooth/{row.peer}"]}, f,
                  indent=2)
    print(f"diffusers' {row.peer} at {tag} in {PEERS}" + (f" ({note})" if note else ""))


def main(row, doc, argv=None):
    """The command line of a row's script: `run [--repeats N] [--steps N] [--seeds S ...]`, and `fetch
    --diffusers_repo PATH` where the row fetches."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    if row.fetch:
        get = steps.add_parser("fetch", help="Copy diffusers' script(s) at the pinned version into .gpu-pack/peers.")
        get.add_argument("--diffusers_repo", required=True)
    go = steps.add_parser("run", help="Time both and compare their held-out losses.")
    go.add_argument("--repeats", type=int, default=3)
    go.add_argument("--steps", type=int, default=None, help=f"Default: {row.same['--max_train_steps']}.")
    go.add_argument("--seeds", type=int, nargs="+", default=None,
                    help=f"Train with each of these seeds (default: {row.same['--seed']}); the held-out loss is their "
                         "mean.")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    if args.step == "fetch":
        fetch(row, args.diffusers_repo)
    else:
        run(row, args.repeats, args.steps, args.seeds)
