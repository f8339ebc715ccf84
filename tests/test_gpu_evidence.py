"""`make gpu-evidence`'s driver (tests/benchmarks/gpu_evidence.py) on the CPU with tiny models, so that the device
command works on the day a GPU is lent: the preflight (one line for a pack that does not fit), a model built by the fast
builder into its RAM folder, pieces in their order, a result file a piece (command, versions, device, date, call), a
piece stopped past its time and recorded as such while the next one runs, a resume compared, a run whose flag
train_lora.py lacks noted and skipped, the skip of a piece whose result is there, the call's budget (a piece it cuts
keeps its finished runs, and runs again), and one line for a missing peer script, a family train_lora.py lacks and a
machine without CUDA. The prompt embeddings file of diffusers' Flux QLoRA script, from the tiny Flux.1. `pack`'s
offline parts: the peer scripts from the nearest tag, bitsandbytes stripped."""
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

import pytest
from conftest import ROOT, assert_one_line_error, offline_env

DRIVER = str(ROOT / "tests" / "benchmarks" / "gpu_evidence.py")
sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))


def driver_config(tmp_path, data, device, extra):
    """The [gpu_evidence] table and its env of a test's workloads.toml: its folders under tmp_path (no peers, no pack),
    one CPU process a run; `extra`: the test's own lines of the table."""
    return f"""[gpu_evidence]
data = {json.dumps(str(data))}
results = {json.dumps(str(tmp_path / "results"))}
work = {json.dumps(str(tmp_path / "work"))}
models_dir = {json.dumps(str(tmp_path / "ram"))}
peers = {json.dumps(str(tmp_path / "no-peers"))}
pack = {json.dumps(str(tmp_path / "no-pack"))}
device = "{device}"
max_piece_s = 480
launch = ["launch", "--config_file", "accelerate_configs/cpu.yaml", "--num_cpu_threads_per_process", "1"]
packages = ["diffusers"]
{extra}

[gpu_evidence.env]
HF_HUB_OFFLINE = "1"
ACCELERATE_USE_CPU = "1"
OMP_NUM_THREADS = "1"
"""


def config(tmp_path, digits, tiny_sd, device="cpu"):
    """Five pieces: one stopped at its 3 s limit, one that trains and resumes (on a model the fast builder makes, with a
    run whose flag train_lora.py lacks), one whose diffusers script is missing, one for a family train_lora.py lacks,
    one that trains."""
    text = driver_config(tmp_path, digits, device, """order = ["slow", "ok", "peer", "later", "fresh"]
common = ["--mixed_precision", "no", "--rank", "4", "--seed", "42", "--max_train_samples", "8", "--center_crop"]
lora_targets = ["to_k", "to_q", "to_v", "to_out.0"]""") + f"""

[gpu_evidence.models.tiny]
path = {json.dumps(str(tiny_sd))}

[gpu_evidence.models.built]
architecture = "tiny"
memory_gb = 0.01
estimate_s = 20

[gpu_evidence.pieces.slow]
title = "a piece over its time"
model = "tiny"
resolution = 32
batch_size = 2
steps = 4
warmup = 1
estimate_s = 3
limit_s = 3
runs = [{{id = "ours"}}, {{id = "never"}}]

[gpu_evidence.pieces.ok]
title = "a run and its resume"
model = "built"
resolution = 32
batch_size = 2
steps = 4
warmup = 1
checkpoint_at = 2
estimate_s = 30
runs = [{{id = "adamw", args = ["--cache_latents"], resume = true}},
        {{id = "later", args = ["--no_such_flag"], help_shows = "--no_such_flag"}}]

[gpu_evidence.pieces.fresh]
title = "a piece that does not fit the budget"
model = "tiny"
resolution = 32
batch_size = 2
steps = 4
warmup = 1
estimate_s = 30
runs = [{{id = "ours"}}]

[gpu_evidence.pieces.peer]
title = "against diffusers' script"
model = "tiny"
resolution = 32
batch_size = 2
steps = 4
warmup = 1
estimate_s = 30
runs = [{{id = "diffusers", peer = "train_text_to_image_lora.py"}}, {{id = "ours", baseline = "diffusers"}}]

[gpu_evidence.pieces.later]
title = "a family to come"
family = "Flux"
help_shows = "(?i)no such family here"
model = "tiny"
resolution = 32
batch_size = 1
steps = 4
warmup = 1
estimate_s = 30
runs = []
"""
    path = tmp_path / "workloads.toml"
    path.write_text(text)
    return path


def driver(*args):
    env = offline_env()
    env.pop("TQDM_DISABLE")  # the runs are timed by their progress bars
    return subprocess.run([sys.executable, DRIVER, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_pieces_run_in_order_record_their_results_and_are_skipped_once_there(digits, tiny_sd, tmp_path):
    cfg, out = config(tmp_path, digits, tiny_sd), tmp_path / "out"
    proc = driver("run", "--config", cfg, "--pieces", "slow,ok,peer,later", "--export_dir", out)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # something was missing: the peer script
    lines = proc.stdout.splitlines()
    peer = [line for line in lines if line.startswith("peer: not run: ")]
    assert len(peer) == 1 and f"train_text_to_image_lora.py is not in {tmp_path / 'no-peers'}" in peer[0]
    assert "make gpu-evidence-pack" in peer[0]
    assert "later: not run: not available yet: train_lora.py has no Flux family" in lines

    slow = json.loads((tmp_path / "results" / "slow.json").read_text())
    assert slow["status"] == "timed_out"  # stopped at its limit, recorded as such ...
    assert [r.get("error") for r in slow["runs"]] == ["stopped: out of time", "not run: the piece was out of time"]
    assert slow["runs"][0]["returncode"] is None and slow["runs"][0]["wall_s"] < 30
    ok = json.loads((tmp_path / "results" / "ok.json").read_text())  # ... and the next piece ran
    assert lines.index("slow: a piece over its time") < lines.index("ok: a run and its resume")
    assert ok["status"] == "done" and ok["command"].startswith("python tests/benchmarks/gpu_evidence.py run --config")
    assert ok["machine"]["device"] == "cpu" and ok["machine"]["date"][:4] >= "2026" and ok["call"] == slow["call"]
    assert ok["machine"]["versions"]["torch"] and ok["machine"]["versions"]["diffusers"]
    assert ok["model"]["path"] == str(tmp_path / "ram" / "built") and ok["model"]["build_s"] > 0  # built in RAM
    assert (tmp_path / "ram" / "built" / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    run, later = ok["runs"]
    assert later == {"id": "later", "error": "not available yet: train_lora.py --help shows no '--no_such_flag'"}
    assert run["command"].startswith("accelerate launch --config_file accelerate_configs/cpu.yaml")
    assert "train_lora.py" in run["command"] and "--checkpointing_steps 2" in run["command"]
    assert run["returncode"] == 0 and run["peak_memory_mb"] > 0 and run["optimizer_state_mb"] > 0
    assert "training_peak_memory_mb" not in run  # (a GPU's alone)
    assert run["wrapper_keys"] == []
    assert run["resume"]["returncode"] == 0 and run["resume"]["exact"]  # bitwise on a CPU
    assert "--resume_from_checkpoint latest" in run["resume"]["command"]
    assert "| adamw" in ok["table"] and "resume: exact" in ok["table"]
    assert json.loads((out / "gpu-evidence-results.json").read_text()) == {"slow": slow, "ok": ok}  # for $OUT
    assert not (tmp_path / "results" / "peer.json").exists() and not (tmp_path / "results" / "later.json").exists()

    again = driver("run", "--config", cfg, "--pieces", "slow,ok,fresh", "--budget_s", "1")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [line.split(" (")[0] for line in again.stdout.splitlines()[:2]] == \
        ["slow: skipped: its result is there", "ok: skipped: its result is there"]
    assert "fresh: left for the next call: it takes about 30 s" in again.stdout
    assert json.loads((tmp_path / "results" / "ok.json").read_text()) == ok  # nothing written over
    assert not (tmp_path / "results" / "fresh.json").exists()

    (tmp_path / "results" / "ok.json").write_text(json.dumps(dict(ok, status="failed")))  # a failed piece runs again
    failed = driver("run", "--config", cfg, "--pieces", "ok", "--budget_s", "1")
    assert failed.returncode == 0 and "ok: left for the next call" in failed.stdout, failed.stdout + failed.stderr
    (tmp_path / "results" / "ok.json").unlink()  # as in a fresh checkout: the results come back from $OUT
    took = driver("take", "--config", cfg, out)
    assert took.returncode == 0 and took.stdout.startswith("ok: done, "), took.stdout + took.stderr
    assert json.loads((tmp_path / "results" / "ok.json").read_text()) == ok

    report = driver("report", "--config", cfg)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in report.stdout.splitlines() if line.startswith("| ")}
    assert rows["slow"][2:5] == ["timed out", ok["machine"]["date"][:10], "cpu"]
    assert rows["ok"][2] == "done" and rows["peer"][2:] == ["not run yet", "", "", "`make gpu-evidence PIECES=peer`"]


def test_a_call_cut_by_its_budget_keeps_the_runs_that_finished(monkeypatch):
    """Each finished run is handed on at once (to the call's --export_dir, as a result of status cut); a piece the
    budget stops keeps what finished, and a later call runs it again, whole."""
    import gpu_evidence
    import torch

    piece = {"runs": [{"id": "first"}, {"id": "second", "baseline": "first"}, {"id": "third"}], "steps": 4,
             "warmup": 1, "batch_size": 1}
    cfg = {"pieces": {"p": piece}, "work": "outputs/never", "models": {}}
    launched = iter([{"returncode": 0, "steps_per_second": 2.0}, {"returncode": None}])
    monkeypatch.setattr(gpu_evidence, "launch_run", lambda *args, **kwargs: dict(next(launched)))
    seen = []
    now = time.time()
    outcome = gpu_evidence.run_piece(cfg, "p", torch.device("cpu"), now + 600, now + 60, None,
                                     lambda records: seen.append([dict(r) for r in records.values()]))
    assert outcome["status"] == "cut"
    first, second = outcome["runs"]
    assert first["steps_per_second"] == 2.0 and second["error"] == "stopped: the call's --budget_s ended"
    assert seen == [[{"id": "first", "returncode": 0, "steps_per_second": 2.0}]]


def test_a_pack_that_does_not_fit_the_machine_is_one_line(tmp_path):
    """The preflight (seconds, nothing heavy imported): a packed wheel that is not the one that imports, a packed
    wheel's requirement this machine does not meet, and a need of the recipes; with a pack that fits, one line that
    says so."""
    from gpu_evidence import installed_version

    (tmp_path / "pack").mkdir()
    cfg = tmp_path / "workloads.toml"
    cfg.write_text(f"""[gpu_evidence]
results = "r"
work = "w"
pack = {json.dumps(str(tmp_path / "pack"))}
max_piece_s = 60
device_needs = ["torch>=2.0"]
pieces = {{}}
""")
    wheels = {"diffusers": {"version": installed_version("diffusers"), "requirements": ["safetensors>=0.3"]},
              "peft": {"version": installed_version("peft"), "requirements": []}}
    (tmp_path / "pack" / "manifest.json").write_text(json.dumps({"wheels": wheels}))
    start = time.time()
    fits = driver("preflight", "--config", cfg)
    assert fits.returncode == 0 and fits.stdout.startswith("preflight: the pack fits (diffusers "), fits.stderr
    assert time.time() - start < 10
    wheels = {"diffusers": {"version": "0.1.0", "requirements": []},
              "peft": {"version": installed_version("peft"), "requirements": ["safetensors>=99"]}}
    (tmp_path / "pack" / "manifest.json").write_text(json.dumps({"wheels": wheels}))
    cfg.write_text(cfg.read_text().replace("torch>=2.0", "torch>=99"))
    line = assert_one_line_error(driver("preflight", "--config", cfg), "the pack does not fit this machine's packages")
    assert f"diffusers 0.1.0 is packed, diffusers {installed_version('diffusers')} imports first" in line
    assert f"peft {installed_version('peft')} needs safetensors>=99, this machine has safetensors" in line
    assert "the recipes need torch>=99" in line


def test_the_flux_qlora_scripts_embeddings_file(digits, tiny_flux, tmp_path):
    """What diffusers' research_projects/flux_lora_quantization/compute_embeddings.py writes, from a local Flux.1 and
    image folder: one row per image, keyed by the sha256 of its pixels as the training script looks it up, with the
    prompt embeddings at 77 tokens, the pooled embedding and the text ids, flattened."""
    from argparse import Namespace

    import gpu_evidence
    import pandas as pd
    from datasets import load_dataset
    from huggingface_hub.utils import insecure_hashlib

    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    rows = [json.loads(line) for line in (digits / "train" / "metadata.jsonl").read_text().splitlines()[:3]]
    for row in rows:
        shutil.copy(digits / "train" / row["file_name"], data / "train" / row["file_name"])
    (data / "train" / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "embeddings.parquet"
    gpu_evidence.flux_embeddings(Namespace(model=str(tiny_flux), data=str(data), output=str(out)))
    frame = pd.read_parquet(out)
    images = load_dataset("imagefolder", data_dir=str(data), split="train")
    assert list(frame["image_hash"]) == [insecure_hashlib.sha256(i["image"].tobytes()).hexdigest() for i in images]
    width = json.loads((tiny_flux / "text_encoder_2" / "config.json").read_text())["d_model"]
    assert [len(frame[c][0]) for c in ("prompt_embeds", "text_ids")] == [77 * width, 77 * 3]


def test_no_cuda_device_is_one_line(digits, tiny_sd, tmp_path):
    proc = driver("run", "--config", config(tmp_path, digits, tiny_sd, device="cuda"), "--pieces", "ok")
    assert_one_line_error(proc, "no CUDA device", "make gpu-evidence measures on one GPU")
    assert not (tmp_path / "results").exists()


def test_pack_takes_the_peer_scripts_from_the_nearest_tag_below_the_pin(tmp_path):
    import gpu_evidence

    repo = tmp_path / "diffusers"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for version in ("0.39.0", "0.40.0", "0.43.0"):
        for path in gpu_evidence.PEERS:
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text(f"# {path} at {version}\n")
        subprocess.run([*git, "add", "."], check=True)
        subprocess.run([*git, "commit", "-q", "-m", version], check=True)
        subprocess.run([*git, "tag", f"v{version}"], check=True)
    source = gpu_evidence.copy_peers(str(repo), str(tmp_path / "peers"), "0.42.1")
    assert source["tag"] == "v0.40.0" and "no tag v0.42.1" in source["note"]
    for path in gpu_evidence.PEERS:
        assert (tmp_path / "peers" / path.rsplit("/", 1)[1]).read_text() == f"# {path} at 0.40.0\n"
    assert gpu_evidence.copy_peers(str(repo), str(tmp_path / "exact"), "0.43.0")["note"] == ""


def test_pack_keeps_bitsandbytes_cpu_and_device_cuda_libraries_only(tmp_path):
    import gpu_evidence

    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    names = [f"bitsandbytes/{name}" for name in ("__init__.py", "libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so",
                                                 "libbitsandbytes_cuda128.so", "libbitsandbytes_rocm72.so")]
    with zipfile.ZipFile(wheel, "w") as z:
        for name in names:
            z.writestr(name, name)
        z.writestr("bitsandbytes-0.50.2.dist-info/RECORD", "".join(f"{n},sha256=x,1\n" for n in names))
    gpu_evidence.strip_bitsandbytes(str(wheel), cuda="130")
    with zipfile.ZipFile(wheel) as z:
        kept = sorted(z.namelist())
        record = z.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    assert kept == sorted(names[:3] + ["bitsandbytes-0.50.2.dist-info/RECORD"])
    assert [line.split(",")[0] for line in record.splitlines()] == names[:3]


WAN_PIECES = ("f-wan", "f-wan-a14b", "f-wan-81", "f-wan-a14b-noswap")


@pytest.fixture(scope="module")
def wan_builds(tmp_path_factory):
    """demo/wan_architectures.py's two layouts (Wan 2.1 T2V, Wan 2.2 A14B: transformer_2 a link to transformer) at
    demo/tiny_wan.py's sizes, through the fast build (every weight drawn at once) and the save the GPU pieces use."""
    from demo.tiny_wan import TINY
    from demo.wan_architectures import CONFIGS, write_random_wan

    folder = tmp_path_factory.mktemp("wan-builds")
    for arch, configs in CONFIGS.items():
        tiny = {**configs, "vae": TINY["vae"], "transformer": TINY["transformer"],
                "text": dict(TINY["text"], vocab_size=256)}
        write_random_wan(str(folder / arch), arch, fast=True, configs=tiny)
    return {arch: folder / arch for arch in CONFIGS}


def test_the_fast_builds_keep_t5s_tied_embedding_table_one_tensor(wan_builds):
    """The fast build (weights drawn at once) ties the text encoder's embedding table again, as the published T5 and
    UMT5 have it: one tensor in memory and in the saved file (Flux.1's T5-XXL table alone is 0.26 GB in bf16)."""
    from safetensors import safe_open

    from demo.tiny_flow import CONFIGS, build_random_flow
    from demo.tiny_sd import materialize

    pipe = build_random_flow(CONFIGS["tiny-flux"](), empty=True)
    materialize(pipe, "cpu")
    t5 = pipe.text_encoder_2
    assert t5.encoder.embed_tokens.weight is t5.shared.weight and not t5.shared.weight.is_meta
    for arch, folder in wan_builds.items():
        (weights,) = (folder / "text_encoder").glob("*.safetensors")
        with safe_open(weights, "pt") as f:
            assert [k for k in f.keys() if k.endswith("embed_tokens.weight") or k == "shared.weight"] == \
                ["shared.weight"], arch


def test_the_wan_pieces_commands_parse_and_take_480x832_clips(tmp_path, wan_builds):
    """Each run of the Wan pieces (workloads.toml), as the driver launches it, parses in train_lora.py (every flag is
    one it has; the base a tiny build of the same layout in place of the real one), swaps at most the real model's
    blocks, trains on the frames the piece's clips have, and its --resolution's bucket for the clips' aspect is 480x832;
    the real models' parameter counts, built from the published configs on the meta device, are pinned."""
    import gpu_evidence
    from PIL import Image

    from common.buckets import bucket_sizes, nearest_bucket
    from demo.wan_architectures import CONFIGS, build_random_wan
    from train_lora import parse_args

    counts = {arch: {name: sum(p.numel() for p in m.parameters())
                     for name, m in build_random_wan(CONFIGS[arch], device="meta").components.items()
                     if hasattr(m, "parameters")} for arch in CONFIGS}
    assert counts["wan21-1.3b"] == {"vae": 126_892_531, "text_encoder": 5_680_910_336, "transformer": 1_418_996_800}
    assert counts["wan22-a14b"]["transformer"] == 14_288_491_584

    cfg = gpu_evidence.load_config()
    cfg.update(models_dir=str(tmp_path / "ram"), work=str(tmp_path / "work"))
    assert [p for p in cfg["order"] if p.startswith("f-")] == list(WAN_PIECES)
    assert cfg["order"].index("f-wan") == cfg["order"].index("b-flux-noswap") + 1
    for pid in WAN_PIECES:
        piece = cfg["pieces"][pid]
        arch = cfg["models"][piece["model"]]["architecture"]
        clips = piece["clips"]
        folder = gpu_evidence.ensure_clips(cfg, piece)  # (as the piece starts)
        written = sorted(os.listdir(folder))
        assert written == [f"{i:04d}{ext}" for i in range(clips["count"]) for ext in ("", ".txt")]
        assert len(os.listdir(os.path.join(folder, "0000"))) == clips["frames"]
        with Image.open(os.path.join(folder, "0000", "000.png")) as frame:
            assert frame.size == (clips["width"], clips["height"])
        buckets = bucket_sizes(piece["resolution"], 16)  # (Wan 2.1's factor: the VAE's 8 x the patch's 2)
        assert buckets[nearest_bucket((clips["height"], clips["width"]), buckets)] == (480, 832)
        for run in piece["runs"]:
            cmd = gpu_evidence.run_command(cfg, piece, run, str(tmp_path / "out"))
            argv = cmd[cmd.index(os.path.join(gpu_evidence.ROOT, "train_lora.py")) + 1:]
            assert argv[argv.index("--pretrained_model_name_or_path") + 1] == str(tmp_path / "ram" / piece["model"])
            assert argv[argv.index("--train_data_dir") + 1] == gpu_evidence.clips_folder(cfg, piece)
            argv[argv.index("--pretrained_model_name_or_path") + 1] = str(wan_builds[arch])
            args = parse_args(argv)
            assert args.num_frames == clips["frames"] and args.resolution == 640 and args.buckets == "auto"
            assert args.mixed_precision == "bf16" and args.gradient_checkpointing and args.cache_latents
            assert (args.wan_expert == "high") == (arch == "wan22-a14b")
            assert (args.blocks_to_swap or 0) <= CONFIGS[arch]["transformer"]["num_layers"]


def test_a_wan_piece_writes_its_clips_and_trains_one_expert_in_fp8_with_block_swap(tmp_path, wan_builds):
    """A Wan piece at a tiny scale on the CPU, as the real f-wan-a14b runs: the A14B layout of
    demo/wan_architectures.py's builder (transformer_2 a link to transformer), the clips written by the driver (folders
    of frames, 2:1, upscaled to their bucket), --wan_expert high with fp8 and block swap."""
    from safetensors import safe_open

    base = wan_builds["wan22-a14b"]
    assert (base / "transformer_2").is_symlink() and os.readlink(base / "transformer_2") == "transformer"
    assert json.loads((base / "model_index.json").read_text())["boundary_ratio"] == 0.875
    with safe_open(str(base / "text_encoder" / "model.safetensors"), "pt") as f:  # UMT5's one embedding table
        assert [k for k in f.keys() if "embed_tokens" in k or "shared" in k] == ["shared.weight"]
    (tmp_path / "images" / "train").mkdir(parents=True)  # (the image pieces' data: none here)
    (tmp_path / "images" / "train" / "metadata.jsonl").write_text("")
    cfg = tmp_path / "workloads.toml"
    cfg.write_text(driver_config(tmp_path, tmp_path / "images", "cpu", "common = []") + f"""

[gpu_evidence.models.a14b]
path = {json.dumps(str(base))}

[gpu_evidence.pieces.wan]
title = "a Wan expert"
family = "Wan"
help_shows = "--wan_expert"
model = "a14b"
resolution = 48
batch_size = 1
steps = 4
warmup = 1
clips = {{count = 2, frames = 9, width = 32, height = 16}}
common = ["--rank", "4", "--seed", "0", "--gradient_checkpointing", "--cache_latents", "--buckets", "auto",
          "--num_frames", "9", "--mixed_precision", "no", "--wan_expert", "high"]
estimate_s = 30
runs = [{{id = "fp8-swap", args = ["--quantize_base", "fp8", "--blocks_to_swap", "1"]}}]
""")
    proc = driver("run", "--config", cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "wrote 2 clips of 9 frames, 32x16, to " in proc.stdout
    result = json.loads((tmp_path / "results" / "wan.json").read_text())
    (run,) = result["runs"]
    assert result["status"] == "done" and run["returncode"] == 0, run
    assert "--num_frames 9" in run["command"] and "--wan_expert high --quantize_base fp8 --blocks_to_swap 1" in \
        run["command"] and f"--train_data_dir {tmp_path / 'work' / 'clips-2x9f-32x16'}" in run["command"]
    assert run["peak_memory_mb"] > 0
    assert (tmp_path / "work" / "clips-2x9f-32x16" / "0001.txt").read_text().startswith("a handwritten digit ")
