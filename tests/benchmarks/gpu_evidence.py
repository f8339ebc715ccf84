"""`make gpu-evidence`: the docs' GPU claims measured on one GPU by one device command of at most 9 minutes, which takes
the pieces in their value order (workloads.toml's `order`) while its budget allows. Each piece writes its result
(tests/benchmarks/results/gpu-evidence/<piece>.json: the runs' exact commands, the versions, the device, the date, the
call), and each finished run's result goes to the call's --export_dir as it ends, so a call cut short keeps what
finished. A piece is skipped while its result is there; one cut short or failed runs again, whole, in a later call: a
run is compared only with runs of the same call on the same GPU.

    python tests/benchmarks/gpu_evidence.py run [--pieces a-eager,c-engines] [--budget_s 510] [--export_dir DIR]
    python tests/benchmarks/gpu_evidence.py preflight  # the pack against this machine's packages, in seconds
    python tests/benchmarks/gpu_evidence.py take DIR  # the results a device call brought back, into the results
    python tests/benchmarks/gpu_evidence.py list      # each piece: its result (date, device) or none yet
    python tests/benchmarks/gpu_evidence.py report    # the markdown of docs/performance.md's GPU evidence
    python tests/benchmarks/gpu_evidence.py pack --diffusers_repo PATH   # `make gpu-evidence-pack`

The pieces and their settings are workloads.toml's [gpu_evidence] tables: a. SD 1.5 against diffusers'
train_text_to_image_lora.py, eager, then compiled; b. FLUX.1-dev's architecture at 1024 px in bf16, bf16 + block swap,
nf4 + block swap, fp8 + block swap against diffusers' QLoRA script; c. SDXL, the optimizers, DeepSpeed and FSDP on one
GPU; e. SD3; f. Wan 2.1 1.3B and Wan 2.2 A14B (one expert) on moving-digit clips at 480x832, 33 (and 81) frames,
in bf16, bf16 + block swap, fp8 + block swap (the clips written when missing, folders of frames). The models are the
real architectures with random weights, built on the GPU in bf16 with every weight
drawn at once (`python -m demo.tiny_sd --fast`: seconds) into RAM (/dev/shm), never written to disk. Each training run
is launched as users launch it (`accelerate launch --config_file ...`) through peak_memory.py, which measures our
scripts and diffusers' the same way; steady-state steps/s comes from the run's progress bar (make bench's timing), the
whole run from launch to exit. A run that needs something this machine lacks (no CUDA device, a package, a peer script,
a flag train_lora.py does not have yet) is one line, and the others run. A piece that outlasts its time is stopped and
recorded as such; with --budget_s, a piece that would not end within the budget is left for the next call. Before any
of it, when a pack is there (`make gpu-evidence-pack`: .gpu-pack/manifest.json), the preflight checks it against the
machine's packages and stops in one line when they do not fit.

`pack` (on a machine with the network): the wheels a GPU machine without one lacks, for its Python, and diffusers'
peer scripts at the pinned version, into .gpu-pack/ (ignored by git), then what a device call would carry in all.
"""
import datetime
import glob
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import gpu_lora  # noqa: E402  (the reference LoRA step whose FLOPs give the MFU, the GPU's peak)
import run_bench  # noqa: E402  (the timed launch and the progress-bar timing of `make bench`)

from common.cli import RecipeArgumentParser, UserError  # noqa: E402
from common.cli import run as run_cli  # noqa: E402

CONFIG = os.path.join(HERE, "workloads.toml")
PEAK_WRAPPER = os.path.join(HERE, "peak_memory.py")
PACK_DIR = ".gpu-pack"
DEVICE_LIMIT_MIB = 64  # what one call of the device tool carries: the working tree and the carried folders
WRAPPERS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module", "_forward_module")  # and "module."
VERSIONS = ("torch", "accelerate", "diffusers", "transformers", "peft", "datasets", "huggingface_hub", "safetensors",
            "bitsandbytes", "deepspeed", "prodigyopt")
HOW_TO_PACK = ("on a machine with the network run `make gpu-evidence-pack`, carry .gpu-pack and install its wheels "
               "(docs/performance.md, GPU evidence)")


def load_config(path=CONFIG):
    with open(path, "rb") as f:
        cfg = tomllib.load(f)["gpu_evidence"]
    for pid, piece in cfg["pieces"].items():
        if piece.get("limit_s", cfg["max_piece_s"]) > cfg["max_piece_s"]:
            raise UserError(f"{path}: piece {pid}'s limit_s is over max_piece_s ({cfg['max_piece_s']} s)")
        needs_checkpoint = [r["id"] for r in piece["runs"] if r.get("resume") or r.get("engine_state")]
        if needs_checkpoint and "checkpoint_at" not in piece:
            raise UserError(f"{path}: piece {pid}: {', '.join(needs_checkpoint)} resume or check a checkpoint: give "
                            "the piece checkpoint_at")
    order = cfg.get("order") or list(cfg["pieces"])
    cfg["order"] = order + [pid for pid in cfg["pieces"] if pid not in order]
    return cfg


def at_root(path):
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


def shown(cmd):
    """A command as a user would type it: paths relative to the repository, the launcher as `accelerate`."""
    launcher = run_bench.accelerate_cli()
    if cmd[:len(launcher)] == launcher:
        cmd = ["accelerate", *cmd[len(launcher):]]
    return shlex.join(rel(c) if os.path.isabs(c) else c for c in cmd)


def rel(path):
    """A path inside the repository relative to it; any other as it is."""
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def driver_command(argv):
    return shlex.join(["python", os.path.relpath(os.path.abspath(__file__), ROOT), *argv])


# ---- results -------------------------------------------------------------------------------------------------


def result_file(cfg, pid):
    return os.path.join(at_root(cfg["results"]), f"{pid}.json")


def stored_result(cfg, pid):
    """The piece's result: in the results folder, or (a second call on the same machine, whose results folder is laid
    anew from the working tree) the copy kept in the work folder."""
    for path in (result_file(cfg, pid), os.path.join(at_root(cfg["work"]), "results", f"{pid}.json")):
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    return None


def write_json(path, data):
    """Whole or not at all: written beside, then renamed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)


BUNDLE = "gpu-evidence-results.json"


def save_result(cfg, pid, result, export_dir):
    """In the results folder and the work folder; with export_dir, every result this machine has written so far in
    one file there (a device call returns a few files only, and a later call on the same machine skips the pieces
    an earlier one ran: so the last call's bundle holds them all)."""
    kept = os.path.join(at_root(cfg["work"]), "results")
    for path in (result_file(cfg, pid), os.path.join(kept, f"{pid}.json")):
        write_json(path, result)
    if export_dir:
        bundle = {}
        for path in sorted(glob.glob(os.path.join(kept, "*.json"))):
            with open(path) as f:
                bundle[os.path.basename(path)[:-len(".json")]] = json.load(f)
        write_json(os.path.join(export_dir, BUNDLE), bundle)
    return result_file(cfg, pid)


def take(args):
    """The results a device call brought back (its files folder, or the bundle itself) into the results folder."""
    cfg = load_config(args.config)
    path = os.path.join(args.source, BUNDLE) if os.path.isdir(args.source) else args.source
    if not os.path.isfile(path):
        raise UserError(f"{args.source}: no {BUNDLE} there (a device call's files folder, or the file itself)")
    with open(path) as f:
        bundle = json.load(f)
    for pid, result in bundle.items():
        if pid not in cfg["pieces"] or result.get("piece") != pid:
            raise UserError(f"{path}: {pid!r} is not a piece of {rel(args.config)}")
        there = result_file(cfg, pid)
        if os.path.isfile(there):
            with open(there) as f:
                if json.load(f) == result:
                    continue
        write_json(there, result)
        print(f"{pid}: {result['status']}, {result['machine']['date']}, {result['machine']['device']}: {rel(there)}")
    return 0


# ---- what a piece needs --------------------------------------------------------------------------------------


def machine_facts(device):
    import torch

    facts = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             "platform": platform.platform(), "python": platform.python_version(),
             "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cuda": torch.version.cuda,
             "versions": {pkg: installed_version(pkg) for pkg in VERSIONS}}
    if device.type == "cuda":
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True) if shutil.which("nvidia-smi") else None
        facts.update(driver=smi.stdout.strip() if smi and smi.returncode == 0 else None,
                     peak_tflops_datasheet=gpu_lora.peak_tflops(facts["device"]),
                     matmul_bf16_tflops_measured=round(gpu_lora.matmul_tflops(device), 1))
    return facts


def installed_version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


_imports = {}


def import_problem(package):
    """None when `package` imports, else why not (one line)."""
    if package not in _imports:
        try:
            importlib.import_module(package)
            _imports[package] = None
        except Exception as err:  # a missing package, or one that refuses the versions beside it
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            _imports[package] = f"{package} is not installed" if isinstance(err, ModuleNotFoundError) and \
                err.name == package else f"{package} does not import ({first[:200]})"
    return _imports[package]


_help = {}


def recipe_help():
    if "text" not in _help:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_lora.py"), "--help"], cwd=ROOT,
                              capture_output=True, text=True)
        _help["text"] = proc.stdout
    return _help["text"]


def piece_problem(cfg, pid):
    """Why piece `pid` cannot run here, in one line ("not available yet: ..." for what the project lacks), or None."""
    piece = cfg["pieces"][pid]
    if "help_shows" in piece and not re.search(piece["help_shows"], recipe_help()):
        return f"not available yet: train_lora.py has no {piece.get('family', pid)} family"
    if not piece["runs"]:
        return f"not available yet: its runs are not filled in (workloads.toml, [gpu_evidence.pieces.{pid}])"
    if "architecture" not in cfg["models"][piece["model"]] and not built(cfg, piece["model"]):
        return f"not available yet: no model {piece['model']} (workloads.toml, [gpu_evidence.models])"
    packages = list(dict.fromkeys([*cfg["packages"], *(p for r in piece["runs"] if not run_problem(r)
                                                        for p in r.get("packages", ()))]))
    missing = [problem for problem in map(import_problem, packages) if problem]
    peers = sorted({r["peer"] for r in piece["runs"] if "peer" in r})
    missing += [f"diffusers' {peer} is not in {cfg['peers']}" for peer in peers
                if not os.path.isfile(os.path.join(at_root(cfg["peers"]), peer))]
    if missing:
        return f"missing: {'; '.join(missing)}: {HOW_TO_PACK}"
    return None


def model_path(cfg, name):
    """Where model `name` is: its `path`, or (an `architecture` to build) in `models_dir`, RAM, when that has room for
    it, else in the work folder (on disk)."""
    model = cfg["models"][name]
    if "path" in model:
        return at_root(model["path"])
    ram = at_root(cfg["models_dir"])
    there = os.path.join(ram, name)
    if built_at(there):
        return there
    os.makedirs(ram, exist_ok=True)
    need = model.get("memory_gb", 0) * 1e9
    held = sum(folder_bytes(os.path.join(ram, m)) for m in os.listdir(ram))
    return there if shutil.disk_usage(ram).free + held >= need else os.path.join(at_root(cfg["work"]), "models", name)


def built_at(path):
    return os.path.isfile(os.path.join(path, "model_index.json"))


def built(cfg, name):
    return built_at(model_path(cfg, name))


def run_problem(run):
    """Why a run of a piece cannot run with this train_lora.py (a flag it does not have yet), or None."""
    if "help_shows" in run and "peer" not in run and not re.search(run["help_shows"], recipe_help()):
        return f"not available yet: train_lora.py --help shows no {run['help_shows']!r}"
    return None


def ensure_data(cfg):
    path = at_root(cfg["data"])
    if os.path.isfile(os.path.join(path, "train", "metadata.jsonl")):
        return path
    if os.path.abspath(path) != os.path.join(ROOT, "data", "digits"):
        raise UserError(f"the data folder {cfg['data']} is missing (workloads.toml [gpu_evidence] data)")
    from demo.digits import write_digits

    write_digits(path)
    print(f"wrote the digits to {cfg['data']}", flush=True)
    return path


def host_available():
    """The host memory free for a run (/proc/meminfo's MemAvailable: files in RAM, /dev/shm's, count as used), in
    bytes; None where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def free_room_for(cfg, name, keep, there=False):
    """Room for model `name` beside it (`there`: it is built), and (`host_gb`: what its runs take in host memory
    besides its files in RAM) room in the host memory: the other built models that no pending piece needs go first."""
    path = model_path(cfg, name)
    need = 0 if there else cfg["models"][name].get("memory_gb", 0) * 1e9
    host = cfg["models"][name].get("host_gb", 0) * 1e9
    in_ram = path.startswith(at_root(cfg["models_dir"]))

    def short():
        available = host_available() if host else None
        return shutil.disk_usage(os.path.dirname(path)).free < need or \
            available is not None and available < host + need * in_ram

    for other, model in cfg["models"].items():
        if not short():
            break
        if other != name and other not in keep and "architecture" in model and built(cfg, other):
            shutil.rmtree(model_path(cfg, other))
            print(f"removed the model {other} for room: no pending piece needs it", flush=True)
    available = host_available() if host else None
    if available is not None and available < host + need * in_ram:  # (the runs may still fit: said, not refused)
        print(f"the model {name}'s runs take about {(host + need * in_ram) / 1e9:.0f} GB of host memory with its "
              f"files, {available / 1e9:.0f} GB is available", flush=True)
    free = shutil.disk_usage(os.path.dirname(path)).free
    return None if free >= need else \
        f"the model {name} needs about {need / 1e9:.0f} GB in {os.path.dirname(path)}, {free / 1e9:.0f} free"


def ensure_model(cfg, name, device, keep, timeout):
    """-> (None, build seconds or None when it was there) when the model is there (built now if need be), else (why
    not, in one line, None). A build draws every weight at once on the device, in bf16 (demo/tiny_sd.py --fast)."""
    model = cfg["models"][name]
    if built(cfg, name):
        if model.get("host_gb"):
            free_room_for(cfg, name, keep, there=True)
        return None, None
    if "architecture" not in model:
        return f"the model {name} is not at {model_path(cfg, name)} (workloads.toml [gpu_evidence.models])", None
    os.makedirs(os.path.dirname(model_path(cfg, name)), exist_ok=True)
    short = free_room_for(cfg, name, keep)
    if short:
        return short, None
    path = model_path(cfg, name)
    if not path.startswith(at_root(cfg["models_dir"])):
        print(f"the model {name} goes to the disk ({path}): {cfg['models_dir']} lacks room for it", flush=True)
    cmd = [sys.executable, "-m", "demo.tiny_sd", "--architecture", model["architecture"], "--device", device.type,
           "--fast", "--output_dir", path]
    log = os.path.join(at_root(cfg["work"]), "logs", f"model-{name}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    print(f"building the model {name}: {shown(cmd)}", flush=True)
    rc, wall, _ = run_bench.stream_timed(cmd, os.environ.copy(), log, timeout=timeout)
    if rc != 0 or not built_at(path):
        why = "it outlasted the time left" if rc is None else f"exit code {rc}: {last_line(log)}"
        return f"building the model {name} failed ({why}; log: {rel(log)})", None
    print(f"built the model {name} in {wall:.0f} s: {path}", flush=True)
    return None, round(wall, 1)


def log_tail(log, lines=40):
    with open(log, errors="replace") as f:
        text = [line.rstrip() for line in f.read().replace("\r", "\n").splitlines() if line.strip()]
    return "\n".join(text[-lines:])[-6000:]


LAUNCHER_ERRORS = ("subprocess.CalledProcessError", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError")


def last_line(log):
    """What a failed run's log says went wrong, in one line: its `error:` line, else its last exception (not the
    launcher's report that the process failed), else its last line."""
    with open(log, errors="replace") as f:
        lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip())
                 for line in f.read().replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"(\S+: )?error: ", line)]  # ours, argparse's
    raised = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", line)
              and not line.startswith(LAUNCHER_ERRORS)]
    return ((errors or raised or lines or ["(no output)"])[-1])[:500]


# ---- one training run ----------------------------------------------------------------------------------------


def clips_folder(cfg, piece):
    """Where a video piece's clips are (`clips`: {count, frames, width, height})."""
    c = piece["clips"]
    return os.path.join(at_root(cfg["work"]), f"clips-{c['count']}x{c['frames']}f-{c['width']}x{c['height']}")


def ensure_clips(cfg, piece):
    """A video piece's clips, written when missing: `count` moving digits (demo/moving_digits.py's digit_clip, a
    digit of half the frame's height drifting left a pixel a frame), `frames` frames of `width` x `height` px (the
    square clip in the middle of a black frame), each a folder of PNG frames with its same-name .txt caption ("a
    handwritten digit 3 moving left"): Pillow reads them, where video files would need PyAV on the GPU machine. The
    scripts resize them to the piece's size. -> the folder."""
    folder = clips_folder(cfg, piece)
    if os.path.isdir(folder):
        return folder
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    from demo.moving_digits import digit_clip

    c = piece["clips"]
    digits = load_digits()
    rng = np.random.default_rng(0)
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for i, index in enumerate(rng.choice(len(digits.images), c["count"], replace=False)):
        name = os.path.join(tmp, f"{i:04d}")
        os.makedirs(name)
        square = digit_clip(digits.images[index], c["frames"], c["height"], "left",
                            top=int(rng.integers(2, c["height"] // 2 - 1)))
        for t, frame in enumerate(square):
            canvas = Image.new("RGB", (c["width"], c["height"]))
            canvas.paste(frame, ((c["width"] - c["height"]) // 2, 0))
            canvas.save(os.path.join(name, f"{t:03d}.png"))
        with open(f"{name}.txt", "w") as f:
            f.write(f"a handwritten digit {digits.target[index]} moving left\n")
    os.replace(tmp, folder)
    print(f"wrote {c['count']} clips of {c['frames']} frames, {c['width']}x{c['height']}, to {rel(folder)}", flush=True)
    return folder


def piece_data(cfg, piece):
    """The piece's image folder: the data, (`data_images`) a folder of its first N training images, or (`clips`) its
    clips' folder (ensure_clips)."""
    if "clips" in piece:
        return clips_folder(cfg, piece)
    data = at_root(cfg["data"])
    n = piece.get("data_images")
    if not n:
        return data
    subset = os.path.join(at_root(cfg["work"]), f"data-{n}")
    if not os.path.isfile(os.path.join(subset, "train", "metadata.jsonl")):
        with open(os.path.join(data, "train", "metadata.jsonl")) as f:
            rows = [json.loads(line) for line in f][:n]
        shutil.rmtree(subset, ignore_errors=True)
        os.makedirs(os.path.join(subset, "train"))
        for row in rows:
            shutil.copy(os.path.join(data, "train", row["file_name"]), os.path.join(subset, "train", row["file_name"]))
        with open(os.path.join(subset, "train", "metadata.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return subset


def run_command(cfg, piece, run, out, extra=()):
    """The launch, the script, the model, the data flags (`data_args`; default --train_data_dir), `common` (the
    piece's own, if it has one), the piece's and the run's args, the sizes and steps; {data} is the data folder."""
    script = os.path.join(at_root(cfg["peers"]), run["peer"]) if "peer" in run else os.path.join(ROOT, "train_lora.py")
    checkpoints = ["--checkpointing_steps", str(piece["checkpoint_at"])] if "checkpoint_at" in piece else []
    data_args = run.get("data_args") or piece.get("data_args") or ["--train_data_dir", "{data}"]
    args = [*data_args, *piece.get("common", cfg["common"]), *piece.get("args", ()), *run.get("args", ())]
    return [*run_bench.accelerate_cli(), *(run.get("launch") or cfg["launch"]), *run.get("launch_args", ()),
            PEAK_WRAPPER, script, "--pretrained_model_name_or_path", model_path(cfg, piece["model"]),
            *(a.replace("{data}", piece_data(cfg, piece)).replace("{embeddings}", embeddings_file(cfg, piece))
              for a in args),
            "--resolution", str(piece["resolution"]), "--train_batch_size", str(piece["batch_size"]),
            "--max_train_steps", str(piece["steps"]), *checkpoints, "--output_dir", out, *extra]


def launch_run(cfg, pid, piece, run, out, timeout, extra=(), tag=""):
    """One launch, killed past `timeout` s. -> its record: command, return code (None: killed), wall, steps/s..."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    peak_file = out.rstrip("/") + ".peak.json"
    if os.path.exists(peak_file):
        os.remove(peak_file)
    cmd = run_command(cfg, piece, run, out, extra)
    env = dict(os.environ, **cfg.get("env", {}), PEAK_MEMORY_FILE=peak_file)
    env.pop("TQDM_DISABLE", None)  # the progress bar is what the run is timed by
    if "dataset_alias" in run:  # a peer script that names a hub dataset: the piece's images instead (peak_memory.py)
        env["DATASET_ALIASES"] = json.dumps({run["dataset_alias"]: piece_data(cfg, piece)})
    log = os.path.join(at_root(cfg["work"]), "logs", f"{pid}-{run['id']}{tag}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    print(f"{pid}: {run['id']}{tag}: {shown(cmd)}", flush=True)
    rc, wall, seen = run_bench.stream_timed(cmd, env, log, timeout=max(timeout, 1))
    record = {"command": shown(cmd), "log": rel(log), "returncode": rc, "wall_s": round(wall, 1)}
    if rc != 0:
        record["error"] = "stopped: out of time" if rc is None else last_line(log)
        record["log_tail"] = log_tail(log)  # the logs stay on the GPU machine: what it said comes back here
        return record
    timed = run_bench.steady_rate(seen, piece["warmup"], piece["steps"], piece.get("checkpoint_at"))
    if timed:
        record.update(steps_per_second=timed["steps_per_second"], first_step_s=round(timed["first_step_s"], 1),
                      samples_per_second=timed["steps_per_second"] * piece["batch_size"],
                      timed_steps=timed["timed_steps"])
    if os.path.isfile(peak_file):
        with open(peak_file) as f:
            peaks = json.load(f)
        record["peak_memory_mb"] = peaks["peak_memory_mb"]
        if peaks.get("training_peak_memory_mb") is not None:
            record["training_peak_memory_mb"] = peaks["training_peak_memory_mb"]
    return record


def embeddings_file(cfg, piece):
    return os.path.join(at_root(cfg["work"]), f"embeddings-{piece['model']}-{piece.get('data_images', 'all')}.parquet")


def prepare(cfg, pid, piece, run, timeout):
    """What a run needs made first, once a piece: `flux_embeddings`, the prompt embeddings file diffusers' QLoRA
    script reads (its compute_embeddings.py fetches FLUX.1-dev and a dataset from the hub: the same computation here,
    on the local model and the piece's images). -> None, or why it failed (one line)."""
    if run.get("prepare") != "flux_embeddings" or os.path.isfile(embeddings_file(cfg, piece)):
        return None
    cmd = [sys.executable, os.path.abspath(__file__), "embeddings", "--model", model_path(cfg, piece["model"]),
           "--data", piece_data(cfg, piece), "--output", embeddings_file(cfg, piece)]
    log = os.path.join(at_root(cfg["work"]), "logs", f"{pid}-{run['id']}-embeddings.log")
    print(f"{pid}: {run['id']}: the prompt embeddings: {shown(cmd)}", flush=True)
    rc, wall, _ = run_bench.stream_timed(cmd, dict(os.environ, **cfg.get("env", {})), log, timeout=max(timeout, 1))
    if rc != 0:
        return "stopped: out of time" if rc is None else f"the prompt embeddings failed: {last_line(log)}"
    print(f"{pid}: {run['id']}: the prompt embeddings in {wall:.0f} s", flush=True)
    return None


def flux_embeddings(args):
    """The parquet file of diffusers' research_projects/flux_lora_quantization/compute_embeddings.py, from the local
    model and images: per image (by the sha256 of its pixels, as the training script looks it up), FluxPipeline's
    encode_prompt of its caption at 77 tokens, flattened."""
    import pandas as pd
    import torch
    from datasets import load_dataset
    from diffusers import FluxPipeline
    from huggingface_hub.utils import insecure_hashlib

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = FluxPipeline.from_pretrained(args.model, transformer=None, vae=None, torch_dtype=torch.bfloat16).to(device)
    rows = []
    with torch.no_grad():
        for sample in load_dataset("imagefolder", data_dir=args.data, split="train"):
            embeds, pooled, text_ids = pipe.encode_prompt(prompt=sample["text"], prompt_2=None, max_sequence_length=77)
            rows.append((insecure_hashlib.sha256(sample["image"].tobytes()).hexdigest(),
                         *(x.float().cpu().numpy().flatten().tolist() for x in (embeds, pooled, text_ids))))
    frame = pd.DataFrame(rows, columns=["image_hash", "prompt_embeds", "pooled_prompt_embeds", "text_ids"])
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    frame.to_parquet(args.output + ".tmp.parquet")
    os.replace(args.output + ".tmp.parquet", args.output)
    print(f"{len(rows)} images' prompt embeddings: {args.output}")
    return 0


def lora_file(out):
    return os.path.join(out, "pytorch_lora_weights.safetensors")


def compare_loras(a, b):
    """The two LoRA files' largest absolute difference (inf when their keys differ)."""
    from safetensors.torch import load_file

    x, y = load_file(lora_file(a)), load_file(lora_file(b))
    if x.keys() != y.keys():
        return float("inf")
    return max((float((x[k].float() - y[k].float()).abs().max()) for k in x), default=0.0)


def wrapper_keys(out):
    """Keys with a wrapper's name in them (DDP, FSDP, torch.compile, activation checkpointing), in any file saved."""
    from safetensors.torch import load_file

    bad = []
    for path in sorted(glob.glob(os.path.join(out, "**", "*.safetensors"), recursive=True)):
        bad += [f"{os.path.relpath(path, out)}: {k}" for k in load_file(path)
                if k.startswith("module.") or any(w in k for w in WRAPPERS)]
    return bad


def plain(key):
    for wrapper in WRAPPERS:
        key = key.replace(wrapper + ".", "")
    return key[len("module."):] if key.startswith("module.") else key


def optimizer_state_mb(checkpoint):
    """Bytes of the tensors of the optimizer state in accelerate's optimizer.bin, MiB; None when there is none."""
    import torch

    path = os.path.join(checkpoint, "optimizer.bin")
    if not os.path.isfile(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)["state"]

    def size(x):
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, dict):
            return sum(map(size, x.values()))
        return sum(map(size, x)) if isinstance(x, (list, tuple)) else 0

    return round(size(state) / 2**20, 3)


def engine_weights(checkpoint, engine):
    """The trained model's weights as the engine itself checkpointed them: DeepSpeed's fp32 master weights
    (zero_to_fp32), FSDP's sharded state dict gathered (torch's converter)."""
    import torch

    if engine == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    full = checkpoint.rstrip("/") + "-fsdp.pt"
    dcp_to_torch_save(os.path.join(checkpoint, "pytorch_model_fsdp_0"), full)
    return torch.load(full, weights_only=True)["model"]


def engine_check(out, checkpoint, engine):
    """The final LoRA file against the engine's own checkpoint of the same step."""
    from safetensors.torch import load_file

    saved = load_file(lora_file(out))
    own = {plain(k): v.detach() for k, v in engine_weights(checkpoint, engine).items()}
    pairs = {k: own.get(k.removeprefix("unet.").replace(".weight", ".default.weight")) for k in saved}
    missing = [k for k, v in pairs.items() if v is None]
    found = {k: v for k, v in pairs.items() if v is not None}
    diff = max((float((saved[k].float() - v.float()).abs().max()) for k, v in found.items()), default=None)
    same_in_saved_dtype = all(saved[k].shape == v.shape and bool((saved[k] == v.to(saved[k].dtype)).all())
                              for k, v in found.items())
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in saved.values()})
    return {"keys": len(saved), "missing_in_engine_state": missing[:5], "max_abs_diff_to_engine": diff,
            "equal_in_saved_dtype": bool(found) and not missing and same_in_saved_dtype, "saved_dtypes": dtypes,
            "engine_dtypes": sorted({str(v.dtype).removeprefix("torch.") for v in found.values()})}


def load_check(base, out):
    """diffusers' own loader on the base: every key of the file lands on the UNet, with the file's values."""
    import torch
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from common.cli import quiet_loading_bars

    quiet_loading_bars()
    pipe = DiffusionPipeline.from_pretrained(base, dtype=torch.float32)
    pipe.load_lora_weights(out)
    adapters = pipe.get_list_adapters()
    name = adapters.get("unet", [None])[0]
    state = pipe.unet.state_dict()
    saved = load_file(lora_file(out))
    loaded = {k: state.get(k.removeprefix("unet.").replace(".weight", f".{name}.weight")) for k in saved}
    diff = max((float((saved[k].float() - v.float()).abs().max()) for k, v in loaded.items() if v is not None),
               default=None)
    return {"adapters": adapters, "keys_not_loaded": [k for k, v in loaded.items() if v is None][:5],
            "max_abs_diff": diff}


# ---- a piece -------------------------------------------------------------------------------------------------

_flops = {}


def step_flops(cfg, piece, device):
    """Model FLOPs of one optimizer step of the reference LoRA step at the piece's batch (gpu_lora.py), counted by
    torch's FlopCounterMode, without gradient checkpointing's recomputation. Cached by model and batch."""
    import torch

    key = (piece["model"], piece["batch_size"], piece["resolution"])
    if key not in _flops:
        from diffusers import DDPMScheduler
        from torch.utils.flop_counter import FlopCounterMode

        base = model_path(cfg, piece["model"])
        unet = gpu_lora.load_lora_unet(base, "bf16", device, rank=8, targets=cfg["lora_targets"])
        step = gpu_lora.reference_step(unet, DDPMScheduler.from_pretrained(base, subfolder="scheduler"),
                                       piece["batch_size"], "bf16", device)
        counter = FlopCounterMode(display=False)
        with counter:
            step()
        _flops[key] = counter.get_total_flops()
        del unet, step
        torch.cuda.empty_cache()
    return _flops[key]


CALL = datetime.datetime.now().astimezone().isoformat(timespec="seconds")  # this call: no baseline from another


def baseline_of(cfg, pid, records, ref):
    """The steps/s of run `ref`: this piece's, or "piece/run" from that piece's result if this same call wrote it (a
    baseline never comes from another call, which may be another GPU)."""
    other, _, rid = ref.rpartition("/")
    if other and other != pid:
        result = stored_result(cfg, other)
        records = {r["id"]: r for r in result["runs"]} if result and result.get("call") == CALL else {}
    return (records.get(rid) or {}).get("steps_per_second")


def check(record, key, fn, *args):
    """record[key] = fn(*args), or {"error": ...} when it raises: what a run wrote is the evidence, a check that
    cannot read it says so and the piece runs on. -> whether it worked."""
    try:
        record[key] = fn(*args)
        return True
    except Exception as err:
        record[key] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        return False


def run_piece(cfg, pid, device, piece_deadline, budget_deadline, flops, progress=None):
    """Every run of the piece while time is left; `progress(records)` after each (the runs that finished, for a call
    that may be cut). -> the result (status done, failed or timed_out), or None when the call's budget (not the
    piece's own limit) stopped it: then a later call runs it again."""
    piece = cfg["pieces"][pid]
    deadline, by_budget = min(piece_deadline, budget_deadline), budget_deadline < piece_deadline
    work = os.path.join(at_root(cfg["work"]), pid)
    records, status = {}, "done"
    for run in piece["runs"]:
        if progress and records:
            progress(records)
        record = records[run["id"]] = {"id": run["id"]}
        problem = run_problem(run)
        if problem:
            record["error"] = problem
            print(f"{pid}: {run['id']}: not run: {problem}", flush=True)
            continue
        if time.time() >= deadline:
            record["error"] = "not run: the piece was out of time"
            continue
        problem = prepare(cfg, pid, piece, run, deadline - time.time())
        if problem:
            record.update(error=problem, returncode=None if problem.startswith("stopped") else 1)
            status = "timed_out" if record["returncode"] is None else "failed"
            continue
        out = os.path.join(work, run["id"])
        record.update(launch_run(cfg, pid, piece, run, out, deadline - time.time()))
        if record["returncode"] is None:
            if by_budget:
                return cut(cfg, pid, device, records, flops)
            status = "timed_out"
            continue
        if record["returncode"] != 0:
            status = "failed"
            continue
        checkpoint = os.path.join(out, f"checkpoint-{piece.get('checkpoint_at')}")
        ok = True
        if os.path.isdir(checkpoint):
            ok &= check(record, "optimizer_state_mb", optimizer_state_mb, checkpoint)
        if os.path.isfile(lora_file(out)):
            ok &= check(record, "wrapper_keys", lambda: wrapper_keys(out)[:5])
        if run.get("resume"):
            if not os.path.isdir(checkpoint):
                record["resume"] = {"error": f"no {os.path.basename(checkpoint)} to resume from"}
                status = "failed"
                continue
            resumed = out + "-resumed"
            shutil.rmtree(resumed, ignore_errors=True)
            shutil.copytree(checkpoint, os.path.join(resumed, os.path.basename(checkpoint)))
            again = launch_run(cfg, pid, piece, run, resumed, deadline - time.time(),
                               extra=["--resume_from_checkpoint", "latest"], tag="-resumed")
            record["resume"] = {k: again.get(k) for k in ("command", "returncode", "wall_s", "error", "log_tail")}
            if again["returncode"] is None and by_budget:
                return cut(cfg, pid, device, records, flops)
            if again["returncode"] == 0:
                diff = {}
                ok &= check(diff, "max_abs_diff", compare_loras, out, resumed)
                record["resume"].update(diff, exact=diff.get("max_abs_diff") == 0.0)
            else:
                status = "timed_out" if again["returncode"] is None else "failed"
        if run.get("engine_state"):
            last = os.path.join(out, f"checkpoint-{piece['steps']}")
            ok &= check(record, "engine", engine_check, out, last, run["engine_state"])
        if run.get("load_check"):
            ok &= check(record, "load", load_check, model_path(cfg, piece["model"]), out)
        if not ok and status == "done":
            status = "failed"
    ratios(cfg, pid, device, records, flops)
    return {"status": status, "runs": list(records.values())}


def cut(cfg, pid, device, records, flops):
    """The piece stopped by the call's budget: what finished, as a result of status cut (run again next call)."""
    for record in records.values():
        if record.get("returncode", 0) is None:
            record["error"] = "stopped: the call's --budget_s ended"
    ratios(cfg, pid, device, records, flops)
    return {"status": "cut", "runs": list(records.values())}


def ratios(cfg, pid, device, records, flops):
    """Each run's MFU and its speed against its baseline (of this piece, or of a piece run in this same call)."""
    peak = device.type == "cuda" and gpu_lora.peak_tflops(torch_device_name(device))
    for run in cfg["pieces"][pid]["runs"]:
        record = records.get(run["id"])
        if record is None:
            continue
        if flops and record.get("steps_per_second") and peak:
            record["mfu"] = flops * record["steps_per_second"] / (peak * 1e12)
        base = run.get("baseline") and baseline_of(cfg, pid, records, run["baseline"])
        if base and record.get("steps_per_second"):
            record["ratio_to_baseline"] = record["steps_per_second"] / base


def torch_device_name(device):
    import torch

    return torch.cuda.get_device_name(device)


def checks_text(r):
    """The checks of one run, in a table cell."""
    def failed(x):
        return isinstance(x, dict) and "error" in x

    notes = [r["error"][:160]] if r.get("error") else []
    res = r.get("resume")
    if res:
        diff = res.get("max_abs_diff")
        notes.append(f"resume: {res['error'][:100]}" if res.get("error") else
                     f"resume: {diff['error'][:100]}" if failed(diff) else "resume: exact" if res.get("exact") else
                     f"resume: max diff {diff:.2e}")
    state = r.get("optimizer_state_mb")
    if state is not None:
        notes.append(f"optimizer state: {state['error'][:100]}" if failed(state) else
                     f"optimizer state {state:.2f} MiB")
    keys = r.get("wrapper_keys")
    if keys:
        notes.append(f"saved keys: {keys['error'][:100]}" if failed(keys) else f"wrapper names in keys ({keys[0]})")
    e = r.get("engine")
    if e:
        notes.append(f"engine state: {e['error']}" if failed(e) else
                     f"equals the engine's state ({'/'.join(e['saved_dtypes'])})" if e["equal_in_saved_dtype"] else
                     f"differs from the engine's state (max {e['max_abs_diff_to_engine']}, missing "
                     f"{len(e['missing_in_engine_state'])})")
    load = r.get("load")
    if load:
        notes.append(f"load_lora_weights: {load['error']}" if failed(load) else
                     "load_lora_weights: every key, same values" if not load["keys_not_loaded"] and
                     load["max_abs_diff"] == 0 else f"load_lora_weights: {load}")
    return "; ".join(notes)


def table(result):
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    rows = [[r["id"], num(r.get("steps_per_second"), ".2f"), num(r.get("steps_per_second") and
                                                                 1 / r["steps_per_second"], ".2f"),
             num(r.get("ratio_to_baseline"), ".2f"), num(r.get("samples_per_second"), ".1f"),
             num(r.get("wall_s"), ".0f"), num(r.get("first_step_s"), ".0f"),
             num(r.get("peak_memory_mb") and r["peak_memory_mb"] / 1024, ".2f"),
             num(r.get("training_peak_memory_mb") and r["training_peak_memory_mb"] / 1024, ".2f"),
             "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f} %", checks_text(r)] for r in result["runs"]]
    return run_bench.markdown_table(["run", "steps/s", "s/step", "vs baseline", "samples/s", "whole run s",
                                     "first step s", "peak GiB", "training peak GiB", "MFU", "checks"], rows)


# ---- run: the pieces in order --------------------------------------------------------------------------------


def run_pieces(args):
    cfg = load_config(args.config)
    wanted = args.pieces.split(",") if args.pieces else cfg["order"]
    unknown = [p for p in wanted if p not in cfg["pieces"]]
    if unknown:
        raise UserError(f"--pieces: no piece {', '.join(unknown)} (there are {', '.join(cfg['order'])})")
    order = [p for p in cfg["order"] if p in wanted]
    start = time.time()
    budget_deadline = start + args.budget_s if args.budget_s else float("inf")
    done = {p: stored_result(cfg, p) for p in order}
    pending = [p for p in order if args.rerun or done[p] is None or done[p]["status"] in ("cut", "failed")]
    for pid in order:
        if pid not in pending:
            r = done[pid]
            print(f"{pid}: skipped: its result is there ({r['status']}, {r['machine']['date']}, "
                  f"{r['machine']['device']}): {rel(result_file(cfg, pid))}", flush=True)
    if not pending:
        print("gpu-evidence: every piece asked for has its result")
        return 0

    problems = preflight_problems(cfg, essential_only=True)
    if problems:
        raise UserError(preflight_error(problems))
    others = preflight_problems(cfg)
    if others:  # (a piece that needs such a package says so in one line, and the others run)
        print(f"preflight: {'; '.join(others)}: the pieces that need these will not run", flush=True)
    import torch

    device = torch.device(cfg.get("device", "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"no CUDA device: torch {torch.__version__} sees none; make gpu-evidence measures on one GPU "
                        "(make bench is the CPU benchmark)")
    not_run, left, written = {}, [], []
    for pid in pending:
        problem = piece_problem(cfg, pid)
        if problem:
            not_run[pid] = problem
            print(f"{pid}: not run: {problem}", flush=True)
    runnable = [p for p in pending if p not in not_run]
    if not runnable:
        return finish(not_run, left, written)
    ensure_data(cfg)
    facts = machine_facts(device)
    peers_source = None
    source = os.path.join(at_root(cfg["peers"]), "SOURCE.json")
    if os.path.isfile(source):
        with open(source) as f:
            peers_source = json.load(f)
    for i, pid in enumerate(runnable):
        piece = cfg["pieces"][pid]
        model = cfg["models"][piece["model"]]
        there = built(cfg, piece["model"])
        need = piece["estimate_s"] + (0 if there else model.get("estimate_s", 0))
        remaining = budget_deadline - time.time()
        if remaining < need:
            left.append(pid)
            print(f"{pid}: left for the next call: it takes about {need} s"
                  f"{'' if there else ' with its model build'}, {remaining:.0f} s of --budget_s left", flush=True)
            continue
        keep = {cfg["pieces"][p]["model"] for p in runnable[i:]}
        problem, build_s = ensure_model(cfg, piece["model"], device, keep,
                                        min(remaining, 3 * model.get("estimate_s", 200)))
        if problem:
            not_run[pid] = problem
            print(f"{pid}: not run: {problem}", flush=True)
            continue
        remaining = budget_deadline - time.time()
        if remaining < piece["estimate_s"]:
            left.append(pid)
            print(f"{pid}: left for the next call: the model's build took the time", flush=True)
            continue
        print(f"{pid}: {piece['title']}", flush=True)
        piece_start = time.time()
        if "clips" in piece:
            ensure_clips(cfg, piece)
        deadline = piece_start + piece.get("limit_s", cfg["max_piece_s"])
        flops = None
        if piece.get("mfu") and device.type == "cuda":
            try:
                flops = step_flops(cfg, piece, device)
            except Exception as err:  # the runs are the evidence: go on without the MFU
                print(f"{pid}: no MFU: counting the step's FLOPs failed ({type(err).__name__}: {err})"[:400],
                      flush=True)
        def result_of(status, runs):
            result = {"piece": pid, "title": piece["title"], "status": status, "machine": facts, "call": CALL,
                      "command": args.command, "settings": {k: v for k, v in piece.items() if k != "runs"},
                      "common": piece.get("common", cfg["common"]), "peers_source": peers_source,
                      "flops_per_step": flops, "model": {"path": model_path(cfg, piece["model"]), "build_s": build_s},
                      "wall_s": round(time.time() - piece_start, 1), "runs": runs}
            result["table"] = table(result)
            return result

        def progress(records):  # each finished run kept at once, in case the call is cut: a result of status cut
            ratios(cfg, pid, device, records, flops)
            save_result(cfg, pid, result_of("cut", [dict(r) for r in records.values()]), args.export_dir)

        outcome = run_piece(cfg, pid, device, deadline, budget_deadline, flops, progress)
        if not args.keep_outputs:
            shutil.rmtree(os.path.join(at_root(cfg["work"]), pid), ignore_errors=True)
        result = result_of(outcome["status"], outcome["runs"])
        written.append(save_result(cfg, pid, result, args.export_dir))
        if outcome["status"] == "cut":
            left.append(pid)
            print(f"{pid}: stopped at the end of --budget_s; what finished is kept (status cut), and the piece runs "
                  f"again, whole, next call:\n{result['table']}", flush=True)
            continue
        print(f"{pid}: {outcome['status']} in {result['wall_s']:.0f} s: {rel(written[-1])}\n{result['table']}",
              flush=True)
    return finish(not_run, left, written)


def finish(not_run, left, written):
    print(f"gpu-evidence: {len(written)} piece(s) measured now"
          + (f"; left for the next call: {', '.join(left)}" if left else "")
          + (f"; not run: {', '.join(not_run)} (why: above)" if not_run else ""), flush=True)
    return 1 if any(not why.startswith("not available yet") for why in not_run.values()) else 0


# ---- preflight: the pack against the machine's packages ------------------------------------------------------


def pack_manifest(cfg):
    path = os.path.join(at_root(cfg["pack"]), "manifest.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def unmet(requirement, who):
    """Why `requirement` (a string) is not met by the version that imports first here, or None. `who`: "X needs"."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return None  # (not for this Python or platform)
    have = installed_version(req.name)
    if have is None:
        return f"{who} {req}: not installed"
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        return f"{who} {req}, this machine has {req.name} {have}"
    return None


def preflight_problems(cfg, essential_only=False):
    """-> [problem, ...] (one line each), in about a second, nothing imported: each wheel of the pack
    (.gpu-pack/manifest.json) installed at its version and first on the path (the device call's pip line puts it
    there), what each needs met by what this machine has (its own packages or packed ones), and the recipes' own
    needs of the machine's packages (workloads.toml's device_needs). Without a pack, the last only. `essential_only`:
    the problems of what every piece needs (`packages`, device_needs); the others stop only the pieces that need
    their package (each piece checks its imports)."""
    problems = []
    pack = pack_manifest(cfg)
    essential = {canonical(p) for p in cfg.get("packages", ())}
    for name, wheel in (pack or {}).get("wheels", {}).items():
        if essential_only and canonical(name) not in essential:
            continue
        have = installed_version(name)
        if have != wheel["version"]:
            problems.append(f"{name} {wheel['version']} is packed, " + (f"{name} {have} imports first" if have else
                                                                        "not installed"))
            continue
        problems += [why for why in (unmet(r, f"{name} {have} needs") for r in wheel["requirements"]) if why]
    problems += [why for why in (unmet(r, "the recipes need") for r in cfg.get("device_needs", ())) if why]
    return problems


def preflight_error(problems):
    return (f"the pack does not fit this machine's packages ({'; '.join(problems)}): install the pack first (the "
            "device call's pip line), or pack versions that fit (`make gpu-evidence-pack`; the machine's packages: "
            "/work/.library/device/KINDS.md)")


def preflight(args):
    cfg = load_config(args.config)
    problems = preflight_problems(cfg)
    if problems:
        raise UserError(preflight_error(problems))
    pack = pack_manifest(cfg)
    wheels = ", ".join(f"{n} {w['version']}" for n, w in sorted((pack or {}).get("wheels", {}).items()))
    have = ", ".join(f"{n} {installed_version(n)}" for n in ("torch", "accelerate", "transformers", "peft"))
    print(f"preflight: {'the pack fits (' + wheels + ')' if pack else 'no pack here'}; this machine: {have}")
    pieces = [f"{pid} ({cfg['pieces'][pid]['model']}, ~{cfg['pieces'][pid]['estimate_s']} s)" for pid in cfg["order"]]
    print(f"the pieces in order (model, time without its build): {', '.join(pieces) or 'none'}")
    return 0


# ---- list, report --------------------------------------------------------------------------------------------


def list_pieces(args):
    """Each piece: its result, or what it would take, or why it cannot run on this machine."""
    cfg = load_config(args.config)
    for pid in cfg["order"]:
        r = stored_result(cfg, pid)
        if r:
            state = f"{r['status']}, {r['machine']['date'][:10]}, {r['machine']['device']}"
        else:
            problem = piece_problem(cfg, pid)
            state = f"no result yet: {problem}" if problem else \
                f"no result yet (about {cfg['pieces'][pid]['estimate_s']} s)"
        print(f"{pid}: {cfg['pieces'][pid]['title']}\n    {state}")
    return 0


def doc_table(header, rows):
    """A markdown table as the docs write them (no padding)."""
    return "\n".join("| " + " | ".join(map(str, row)) + " |" for row in [header, ["---"] * len(header), *rows])


def report(args):
    """docs/performance.md's GPU evidence: one row a piece (its goal; date, device, command; or not run yet), then
    each measured piece's own table."""
    cfg = load_config(args.config)
    rows, details = [], []
    for pid in cfg["order"]:
        piece, r = cfg["pieces"][pid], stored_result(cfg, pid)
        if r is None:
            rows.append([pid, piece["title"], piece.get("goal", ""), "not run yet", "", "",
                         f"`make gpu-evidence PIECES={pid}`"])
            continue
        m = r["machine"]
        rows.append([pid, piece["title"], piece.get("goal", ""), r["status"].replace("_", " "), m["date"][:10],
                     m["device"], f"`{r['command']}`"])
        versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
        peers = r.get("peers_source") or {}
        details.append(f"**{pid}.** {piece['title']}. {m['date'][:10]}, {m['device']} (driver {m.get('driver')}), "
                       f"CUDA {m['cuda']}, Python {m['python']}, {versions}"
                       + (f"; diffusers' scripts from {peers.get('tag')}" if peers else "")
                       + f" (`{rel(result_file(cfg, pid))}`):\n\n{r['table']}\n")
    out = doc_table(["piece", "what", "goal", "status", "date", "device", "command"], rows)
    print("\n\n".join([out, *details]))
    return 0


# ---- pack: what a GPU machine without the network lacks ------------------------------------------------------

# The device's Python and platform tags (its README: pip download for another machine), and the CUDA version of its
# torch build: bitsandbytes keeps only that library and its CPU one (the wheel holds one per CUDA version).
DEVICE_PYTHON = "3.12"
DEVICE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
DEVICE_CUDA = "130"
# What the GPU machine's image holds (its package list, read there on 2026-11-17): a requirement of a packed wheel
# that is not among these is packed too, at this venv's version.
DEVICE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split())
# What the pieces need that the machine lacks, and where each version comes from (a requirements file's pin); and
# two it holds in a version that may be outside what the packed ones accept (datasets: fsspec<=2026.9.0; pydantic:
# typing-extensions>=4.16), at this venv's version. Their own requirements follow (DEVICE_HAS).
PACKED = (("diffusers", "requirements.txt"), ("datasets", "requirements.txt"), ("prodigyopt", "requirements.txt"),
          ("bitsandbytes", "requirements-extras.txt"), ("deepspeed", "requirements-deepspeed.txt"),
          ("fsspec", "venv"), ("typing_extensions", "venv"))
# Versions of what they need that this venv does not hold (DeepSpeed's needs: `make install` leaves DeepSpeed out).
PINS = {"hjson": "3.1.0"}
# DeepSpeed publishes source only: built here into a pure-Python wheel (its CUDA ops compile on the GPU machine when
# first used).
FROM_SOURCE = ("deepspeed",)
PEERS = ("examples/text_to_image/train_text_to_image_lora.py",
         "examples/text_to_image/train_text_to_image_lora_sdxl.py",
         "examples/dreambooth/train_dreambooth_lora_flux.py", "examples/dreambooth/train_dreambooth_lora_sd3.py",
         "examples/research_projects/flux_lora_quantization/train_dreambooth_lora_flux_miniature.py",
         "examples/dreambooth/train_dreambooth_lora_qwen_image.py",
         "examples/dreambooth/train_dreambooth_lora_z_image.py",
         "examples/dreambooth/train_dreambooth_lora_flux_kontext.py")


def pinned(requirements, package):
    with open(os.path.join(ROOT, requirements)) as f:
        for line in f:
            name, _, version = line.split("#")[0].strip().partition("==")
            if name.strip().lower().replace("_", "-") == package.replace("_", "-"):
                return version.strip()
    raise UserError(f"{requirements} pins no {package}")


def pack_version(package, source):
    if source == "venv":
        version = installed_version(package) or PINS.get(canonical(package))
        if version is None:
            raise UserError(f"{package} is neither in this Python ({sys.executable}) nor pinned in gpu_evidence.py's "
                            "PINS: give it a version there")
        return version
    return pinned(source, package) if source.endswith(".txt") else source


def pip(*args, env=None):
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")] or proc.stderr.splitlines()
        raise UserError(f"pip {args[0]} {args[-1]} failed: {(lines or ['(no message)'])[-1][:300]}")


def fetch_wheel(package, version, wheels):
    """NAME-VERSION-*.whl for the device in `wheels` (kept when already there). -> its path."""
    stem = f"{package.replace('-', '_')}-{version}-"
    have = [p for p in glob.glob(os.path.join(wheels, "*.whl")) if os.path.basename(p).lower().startswith(stem.lower())]
    if have:
        return have[0]
    spec = f"{package}=={version}"
    if package in FROM_SOURCE:
        sdist = os.path.join(wheels, "..", "sdist")
        pip("download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", sdist, spec)
        (archive,) = glob.glob(os.path.join(sdist, f"{package}-{version}.*"))
        pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels, archive,
            env=dict(os.environ, DS_BUILD_OPS="0"))
        shutil.rmtree(sdist)
    else:
        platforms = [a for p in DEVICE_PLATFORMS for a in ("--platform", p)]
        pip("download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", DEVICE_PYTHON,
            "--implementation", "cp", *platforms, "-d", wheels, spec)
    have = [p for p in glob.glob(os.path.join(wheels, "*.whl")) if os.path.basename(p).lower().startswith(stem.lower())]
    if not have:
        raise UserError(f"pip left no wheel of {spec} in {wheels}")
    path = have[0]
    if package == "bitsandbytes":
        strip_bitsandbytes(path)
    return path


def strip_bitsandbytes(path, cuda=DEVICE_CUDA):
    """Keep the CPU library and the one for the device's CUDA; the others (one per CUDA, ROCm, XPU version) make up
    most of the wheel. RECORD loses their lines."""
    keep = re.compile(rf"libbitsandbytes_(cpu|cuda{cuda})\.(so|dylib|dll)$")
    drop = re.compile(r"libbitsandbytes_\w+\.(so|dylib|dll)$")
    with zipfile.ZipFile(path) as old:
        items = [(info, old.read(info)) for info in old.infolist()]
    if not any(drop.search(i.filename) and not keep.search(i.filename) for i, _ in items):
        return
    gone = {i.filename for i, _ in items if drop.search(i.filename) and not keep.search(i.filename)}
    with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as new:
        for info, data in items:
            if info.filename in gone:
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if line.split(",")[0] not in gone).encode()
            new.writestr(info, data)
    os.replace(path + ".tmp", path)


def git_dir(repo):
    path = os.path.join(repo, ".git")
    return path if os.path.exists(path) else repo


def git(repo, *args):
    proc = subprocess.run(["git", "--git-dir", git_dir(repo), *args], capture_output=True)
    if proc.returncode != 0:
        raise UserError(f"git {' '.join(args)} in {repo} failed: {proc.stderr.decode(errors='replace').strip()[:200]}")
    return proc.stdout


def peer_tag(repo, version):
    """-> (tag, note): v<version>, else the nearest tag below it (the scripts ask for at most that diffusers)."""
    def key(tag):
        return tuple(int(x) for x in tag[1:].split("."))

    tags = [t for t in git(repo, "tag", "-l", "v*").decode().split() if re.fullmatch(r"v\d+\.\d+\.\d+", t)]
    if f"v{version}" in tags:
        return f"v{version}", ""
    below = [t for t in tags if key(t) < key(f"v{version}")]
    if not below:
        raise UserError(f"{repo} has no release tag at or below v{version}")
    tag = max(below, key=key)
    return tag, f"the repository has no tag v{version}: {tag}, the nearest below it"


def copy_peers(repo, peers, version):
    if not repo:
        raise UserError("--diffusers_repo: give a clone of diffusers' repository (make gpu-evidence-pack "
                        "DIFFUSERS_REPO=...)")
    if not os.path.isdir(repo):
        raise UserError(f"--diffusers_repo: {repo} is not a folder: give a clone of diffusers' repository "
                        "(make gpu-evidence-pack DIFFUSERS_REPO=...)")
    tag, note = peer_tag(repo, version)
    commit = git(repo, "rev-parse", f"{tag}^{{commit}}").decode().strip()
    os.makedirs(peers, exist_ok=True)
    for path in PEERS:
        with open(os.path.join(peers, os.path.basename(path)), "wb") as f:
            f.write(git(repo, "show", f"{tag}:{path}"))
    source = {"repository": os.path.abspath(repo), "tag": tag, "commit": commit, "pinned_diffusers": version,
              "note": note, "files": list(PEERS)}
    write_json(os.path.join(peers, "SOURCE.json"), source)
    return source


def tree_bytes():
    """What a device call sends besides the carried folders: tracked and untracked-not-ignored files."""
    proc = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True)
    if proc.returncode != 0:
        return None
    paths = [os.path.join(ROOT, p) for p in proc.stdout.decode().split("\0") if p]
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def folder_bytes(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_requirements(path):
    """The requirements of a wheel that hold on the device (its Python, Linux x86-64; no extras)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(path) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        text = wheel.read(meta).decode()
    env = {"python_version": DEVICE_PYTHON, "python_full_version": f"{DEVICE_PYTHON}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def pack_wheels(wheels):
    """PACKED and whatever they need that the device lacks, one version each. -> {canonical name: record}."""
    todo, packed = [(name, pack_version(name, where), "") for name, where in PACKED], {}
    while todo:
        name, version, why = todo.pop(0)
        path = fetch_wheel(name, version, wheels)
        packed[canonical(name)] = {"version": version, "wheel": os.path.basename(path), "bytes": os.path.getsize(path),
                                   "requirements": [str(r) for r in wheel_requirements(path)], "needed_by": why}
        for req in wheel_requirements(path):
            dep = canonical(req.name)
            if dep in DEVICE_HAS or dep in packed or any(canonical(t[0]) == dep for t in todo):
                continue
            todo.append((req.name, pack_version(req.name, "venv"), name))
    from packaging.requirements import Requirement

    for name, record in packed.items():  # what they ask of each other
        for req in map(Requirement, record["requirements"]):
            other = packed.get(canonical(req.name))
            if other and not req.specifier.contains(other["version"], prereleases=True):
                raise UserError(f"{name} asks for {req}, and {req.name} {other['version']} is packed: pin one that "
                                "fits in requirements*.txt or this venv")
    return packed


def pack(args):
    out = at_root(args.pack_dir)
    wheels = os.path.join(out, "wheels")
    os.makedirs(wheels, exist_ok=True)
    source = copy_peers(args.diffusers_repo, os.path.join(out, "peers"), pinned("requirements.txt", "diffusers"))
    print(f"diffusers' peer scripts from {source['tag']} ({source['commit'][:10]})"
          + (f"; {source['note']}" if source["note"] else "") + ": "
          + ", ".join(os.path.basename(p) for p in PEERS), flush=True)
    packed = pack_wheels(wheels)
    stale = set(os.listdir(wheels)) - {p["wheel"] for p in packed.values()}
    for name in stale:  # one version of each: two stop the whole install
        os.remove(os.path.join(wheels, name))
    total, tree = folder_bytes(out), tree_bytes()
    manifest = {"wheels": packed, "peers": source, "python": DEVICE_PYTHON, "platforms": list(DEVICE_PLATFORMS),
                "cuda": DEVICE_CUDA, "pack_bytes": total, "tree_bytes": tree}
    write_json(os.path.join(out, "manifest.json"), manifest)
    mib = 2**20
    for package, p in sorted(packed.items(), key=lambda kv: -kv[1]["bytes"]):
        print(f"  {p['wheel']:70} {p['bytes'] / mib:6.2f} MiB"
              + (f"  (for {p['needed_by']})" if p["needed_by"] else ""), flush=True)
    print(f"packed {len(packed)} wheels and {len(PEERS)} peer scripts in {args.pack_dir}: {total / mib:.1f} MiB")
    if tree is None:
        print("(not a git checkout: the size of the working tree that travels is unknown)")
        return 0
    carried = (tree + total) / mib
    print(f"a device call carries the working tree ({tree / mib:.1f} MiB) and {args.pack_dir} ({total / mib:.1f} MiB): "
          f"{carried:.1f} MiB of {DEVICE_LIMIT_MIB} MiB")
    if carried > DEVICE_LIMIT_MIB:
        biggest = max(packed.items(), key=lambda kv: kv[1]["bytes"])
        raise UserError(f"{carried - DEVICE_LIMIT_MIB:.1f} MiB over what a device call carries: leave out the largest "
                        f"wheel ({biggest[1]['wheel']}, {biggest[1]['bytes'] / mib:.1f} MiB) and the pieces that "
                        "need it, or make the working tree smaller")
    return 0


# ---- the command line ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = RecipeArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="what", required=True, parser_class=RecipeArgumentParser)
    go = commands.add_parser("run", help="Run the pieces that have no result yet.")
    go.add_argument("--pieces", default=None, help="Comma-separated pieces (default: every one, in workloads.toml's "
                    "order).")
    go.add_argument("--budget_s", type=float, default=None, help="Start no piece (or model build) that would not end "
                    "within this many seconds of the start, and stop the one running at its end: for a device "
                    "command of 9 minutes, 510 (the pack's install and the preflight take the rest).")
    go.add_argument("--export_dir", default=None, help=f"Also write {BUNDLE} here: every result this machine has "
                    "written (a device call's $OUT; `take` reads it back).")
    go.add_argument("--rerun", action="store_true", help="Run the pieces again even where their result is there.")
    go.add_argument("--keep_outputs", action="store_true", help="Keep the runs' output folders (default: removed "
                    "after each piece; the logs stay in the work folder).")
    pk = commands.add_parser("pack", help="Wheels and diffusers' peer scripts for a GPU machine without the network.")
    pk.add_argument("--diffusers_repo", required=True, help="A clone of diffusers' repository (bare or not).")
    pk.add_argument("--pack_dir", default=PACK_DIR, help="Where (ignored by git).")
    commands.add_parser("preflight", help="The pack against this machine's packages (`run` does it first).")
    em = commands.add_parser("embeddings", help="The prompt embeddings file of diffusers' Flux QLoRA script.")
    em.add_argument("--model", required=True, help="A FluxPipeline folder.")
    em.add_argument("--data", required=True, help="An imagefolder with a text column.")
    em.add_argument("--output", required=True, help="The parquet file to write.")
    tk = commands.add_parser("take", help="Write the results a device call brought back into the results folder.")
    tk.add_argument("source", help=f"The call's files folder (with {BUNDLE}), or that file.")
    commands.add_parser("list", help="Each piece: its result, or none yet.")
    commands.add_parser("report", help="The markdown of docs/performance.md's GPU evidence.")
    for sub in commands.choices.values():
        sub.add_argument("--config", default=CONFIG, help="The settings (workloads.toml).")
    args = parser.parse_args(argv)
    args.command = driver_command(sys.argv[1:] if argv is None else argv)
    return args


def main(args):
    code = {"run": run_pieces, "pack": pack, "take": take, "list": list_pieces, "report": report,
            "preflight": preflight, "embeddings": flux_embeddings}[args.what](args)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    run_cli(main, parse_args)
