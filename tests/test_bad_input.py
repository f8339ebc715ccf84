"""Bad input, script by script: one `error:` line that names the problem and what to do, a non-zero exit, no
traceback, and nothing written: every case runs with an output folder that already holds a file and a previous
checkpoint, and that folder (and any other path the case names) must be exactly as it was, down to mtimes.

Most cases fail while the flags parse, before torch loads (a fraction of a second each); the data and model cases
need their imports (4-10 s each), so there are few of them. Each case is a real subprocess (`python <script>`).
Plus: a mixed folder of sizes and PIL modes that must train, a full disk while a checkpoint is written, and the
Makefile's check of a malformed accelerate yaml.
"""
import errno
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import MAKE, ROOT, assert_one_line_error, offline_env, read_results, run_script

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@dataclass
class Case:
    id: str
    args: list  # "{name}" items are paths from the `paths` fixture; "{out}" is this case's own output folder
    needles: tuple = ()
    watched: list = field(default_factory=list)  # other paths that must stay untouched


def case(id, args, *needles, watched=()):
    return Case(id, args, needles, list(watched))


# ------------------------------------------------------------------------------------------------- the tables
CLASSIFIER_BASE = ["--train_data_dir", "{good}", "--output_dir", "{out}", "--report_to", "none"]
CLASSIFIER = [
    case("missing-dataset-folder", ["--train_data_dir", "{missing}"], "does not exist", "make data"),
    case("empty-dataset-folder", ["--train_data_dir", "{empty}"], "holds no image files", "put images in it"),
    case("folder-without-images", ["--train_data_dir", "{no_images}"], "holds no image files"),
    case("corrupt-image", ["--train_data_dir", "{corrupt}"], "cannot read image", "broken.png",
         "image file is truncated", "delete or replace that file"),
    case("missing-image-column", ["--image_column", "picture"],
         "--image_column 'picture' is not a column of the dataset; columns are: image, label, text"),
    case("missing-label-column", ["--label_column", "digit"], "--label_column 'digit' is not a column"),
    case("zero-batch-size", ["--train_batch_size", "0"], "--train_batch_size", "'0'"),
    case("negative-steps", ["--max_train_steps", "-3"], "--max_train_steps"),
    case("zero-steps", ["--max_train_steps", "0"], "--max_train_steps", "positive integer"),
    case("zero-epochs", ["--num_train_epochs", "0"], "--num_train_epochs"),
    case("zero-learning-rate", ["--learning_rate", "0"], "--learning_rate", "positive number"),
    case("negative-learning-rate", ["--learning_rate", "-0.001"], "--learning_rate"),
    case("unknown-lr-scheduler", ["--lr_scheduler", "warmup_sine"], "--lr_scheduler", "invalid choice",
         "warmup_cosine"),
    case("zero-resolution", ["--resolution", "0"], "--resolution"),
    case("train-val-split-of-one", ["--train_val_split", "1"], "--train_val_split must be between 0 and 1"),
    case("lr-groups-syntax", ["--lr_groups", "resnet"], "--lr_groups"),
    case("text-column-alone", ["--text_column", "text"], "go together"),
    case("resume-from-missing-checkpoint", ["--resume_from_checkpoint", "checkpoint-77"],
         "no checkpoint at 'checkpoint-77'", "latest"),
    case("output-dir-is-a-file", ["--output_dir", "{a_file}"], "is a file; give a folder", watched=["{a_file}"]),
    case("output-dir-inside-a-file", ["--output_dir", "{a_file}/out"], "is a file, not a folder",
         watched=["{a_file}"]),
    case("output-dir-not-writable", ["--output_dir", "{read_only}/out"], "cannot write in", "make that folder writable",
         watched=["{read_only}"]),
    case("model-of-another-kind", ["--model_name_or_path", "{sd}"], "is not an image classifier",
         "no config.json"),
    case("model-path-missing", ["--model_name_or_path", "{missing}"], "does not exist"),
]

DDPM_BASE = ["--train_data_dir", "{good}", "--output_dir", "{out}", "--report_to", "none"]
DDPM = [
    case("missing-dataset-folder", ["--train_data_dir", "{missing}"], "does not exist"),
    case("empty-dataset-folder", ["--train_data_dir", "{empty}"], "holds no image files"),
    case("corrupt-image", ["--train_data_dir", "{corrupt}"], "cannot read image", "broken.png",
         "delete or replace that file"),
    case("missing-class-column", ["--class_column", "digit"], "--class_column 'digit' is not a column of the dataset"),
    case("zero-batch-size", ["--train_batch_size", "0"], "--train_batch_size"),
    case("zero-steps", ["--max_train_steps", "0"], "--max_train_steps"),
    case("negative-learning-rate", ["--learning_rate", "-0.5"], "--learning_rate"),
    case("unknown-prediction-type", ["--prediction_type", "noise"], "--prediction_type", "invalid choice",
         "epsilon"),
    case("unknown-lr-scheduler", ["--lr_scheduler", "cosine_annealing"], "--lr_scheduler", "invalid choice"),
    case("unknown-validation-scheduler", ["--validation_scheduler", "heun"], "--validation_scheduler"),
    case("resolution-vs-unet-depth", ["--resolution", "10"],
         "--resolution 10 is not divisible by 4", "3 down blocks"),
    case("config-with-one-channel", ["--model_config_name_or_path", "{unet_1ch}"],
         "has in_channels=1, out_channels=1, but the images have 3"),
    case("pretrained-path-missing", ["--pretrained_model_name_or_path", "{missing}"],
         "is neither a folder nor a hub id"),
    case("pretrained-classifier", ["--pretrained_model_name_or_path", "{classifier}"],
         "is not a UNet2DModel (it holds a resnet)", "train_ddpm.py output"),
    case("pretrained-stable-diffusion", ["--pretrained_model_name_or_path", "{sd}"],
         "is not a UNet2DModel (it holds a UNet2DConditionModel)"),
    case("beta-end-below-start", ["--ddpm_beta_end", "1e-5"], "--ddpm_beta_end must be larger"),
    case("block-out-channels-syntax", ["--block_out_channels", "16,x"], "--block_out_channels"),
    case("output-dir-not-writable", ["--output_dir", "{read_only}/out"], "cannot write in",
         watched=["{read_only}"]),
]

LORA_BASE = ["--train_data_dir", "{good}", "--pretrained_model_name_or_path", "{sd}", "--output_dir", "{out}",
             "--report_to", "none"]
LORA = [
    case("missing-dataset-folder", ["--train_data_dir", "{missing}"], "does not exist"),
    case("empty-dataset-folder", ["--train_data_dir", "{empty}"], "holds no image files"),
    case("corrupt-image", ["--train_data_dir", "{corrupt}"], "cannot read image", "broken.png"),
    case("missing-image-column", ["--image_column", "img"], "--image_column 'img' is not a column"),
    case("zero-batch-size", ["--train_batch_size", "0"], "--train_batch_size"),
    case("zero-steps", ["--max_train_steps", "0"], "--max_train_steps"),
    case("zero-learning-rate", ["--learning_rate", "0"], "--learning_rate"),
    case("unknown-lr-scheduler", ["--lr_scheduler", "exponential"], "--lr_scheduler", "invalid choice"),
    case("unknown-prediction-type", ["--prediction_type", "x0"], "--prediction_type", "invalid choice"),
    case("zero-rank", ["--rank", "0"], "--rank"),
    case("resolution-vs-vae-factor", ["--resolution", "30"],
         "--resolution 30 is not divisible by 4, the VAE's downsampling factor", "use 28 or 32"),
    case("base-without-native-size", ["--pretrained_model_name_or_path", "{sd_no_size}"],
         "has no sample_size to take the training size from", "give --resolution"),
    case("base-is-a-classifier", ["--pretrained_model_name_or_path", "{classifier}"],
         "is not a pipeline folder", "make tiny-sd"),
    case("base-path-missing", ["--pretrained_model_name_or_path", "{missing}"], "is neither a pipeline folder"),
    case("guidance-input-the-base-lacks", ["--pretrained_model_name_or_path", "{flux_digits}", "--guidance_scale",
                                           "3.5"], "--guidance_scale 3.5", "has no guidance embedding", "leave it out"),
    case("output-dir-is-a-file", ["--output_dir", "{a_file}"], "is a file", watched=["{a_file}"]),
    case("output-dir-not-writable", ["--output_dir", "{read_only}/out"], "cannot write in",
         watched=["{read_only}"]),
]

SAMPLE_BASE = ["--model", "{sd}", "--prompt", "a digit", "--num_images", "1", "--num_inference_steps", "1",
               "--output_dir", "{out}/samples"]
SAMPLE = [
    case("model-is-a-classifier", ["--model", "{classifier}"], "is not a diffusion pipeline", "model_index.json"),
    case("model-path-missing", ["--model", "{missing}"], "is neither a folder nor a hub id"),
    case("zero-images", ["--num_images", "0"], "--num_images"),
    case("unknown-scheduler", ["--scheduler", "lms"], "--scheduler", "invalid choice"),
    case("unknown-dtype", ["--dtype", "fp8"], "--dtype"),
    case("z-image-guidance-flag-on-sd", ["--cfg_truncation", "0.5"], "--cfg_truncation means nothing",
         "Stable Diffusion 1.x/2.x"),
    case("lora-missing", ["--lora", "{missing}.safetensors"], "no such file or folder"),
    case("lora-not-safetensors", ["--lora", "{not_safetensors}"], "is not a readable .safetensors file"),
    case("output-dir-inside-a-file", ["--output_dir", "{a_file}/samples"], "is a file, not a folder",
         watched=["{a_file}"]),
    case("output-dir-not-writable", ["--output_dir", "{read_only}/samples"], "cannot write in",
         watched=["{read_only}"]),
]

INSPECT_BASE = ["--save_trajectory", "{out}/x0.png", "--num_inference_steps", "2", "--trajectory_steps", "2"]
INSPECT = [  # the model is the positional argument: each case names its own
    case("model-is-a-classifier", ["{classifier}"], "is not a diffusion pipeline", "model_index.json"),
    case("model-path-missing", ["{missing}"], "is neither a folder nor a hub id"),
    case("zero-steps", ["{sd}", "--num_inference_steps", "0"], "--num_inference_steps"),
    case("unknown-dtype", ["{sd}", "--dtype", "int8"], "--dtype"),
    case("lora-missing", ["{sd}", "--lora", "{missing}"], "is neither a .safetensors file nor a folder"),
    case("lora-not-safetensors", ["{sd}", "--lora", "{not_safetensors}"], "is not a readable .safetensors file"),
    case("trajectory-not-writable", ["{sd}", "--save_trajectory", "{read_only}/x0.png"], "--save_trajectory",
         "cannot write in", watched=["{read_only}"]),
]

TABLES = {"train_classifier.py": (CLASSIFIER_BASE, CLASSIFIER), "train_ddpm.py": (DDPM_BASE, DDPM),
          "train_lora.py": (LORA_BASE, LORA), "sample.py": (SAMPLE_BASE, SAMPLE),
          "inspect_pipeline.py": (INSPECT_BASE, INSPECT)}


# ---------------------------------------------------------------------------------------------------- fixtures
def write_imagefolder(folder, images):
    """images: {file name: PIL image}; labels alternate 0/1, captions in `text`."""
    (folder / "train").mkdir(parents=True)
    rows = []
    for i, (name, image) in enumerate(images.items()):
        image.save(folder / "train" / name)
        rows.append({"file_name": name, "label": i % 2, "text": f"a picture number {i}"})
    (folder / "train" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def gradient(size):
    """A left-to-right 8-bit gradient in mode L."""
    import numpy as np
    from PIL import Image

    w, h = size
    return Image.fromarray(np.tile(np.linspace(0, 255, w).round().astype(np.uint8), (h, 1)), "L")


def mixed_images():
    """Every PIL mode a folder of real images holds, at various sizes (some smaller than the training size)."""
    import numpy as np
    from PIL import Image

    sixteen = (np.asarray(gradient((40, 30)), dtype=np.uint16) * 257).astype("<u2")  # full 16-bit range
    transparent = gradient((30, 30)).convert("P")
    transparent.info["transparency"] = 0
    return {"l.png": gradient((32, 32)), "la.png": gradient((40, 30)).convert("LA"),
            "rgba.png": gradient((24, 48)).convert("RGBA"), "p.png": gradient((64, 64)).convert("P"),
            "p_transparent.png": transparent, "i16.png": Image.frombytes("I;16", (40, 30), sixteen.tobytes()),
            "cmyk.jpg": gradient((33, 35)).convert("CMYK"), "bilevel.png": gradient((32, 40)).convert("1"),
            "rgb.png": gradient((20, 28)).convert("RGB")}


@pytest.fixture(scope="module")
def read_only(tmp_path_factory):
    """A folder this user cannot write: chmod 555, or for root (who ignores permissions) a read-only tmpfs."""
    path = tmp_path_factory.mktemp("read_only")
    if not IS_ROOT:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
    elif shutil.which("mount") and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                                                  capture_output=True).returncode == 0:
        yield path
        subprocess.run(["umount", str(path)], check=False)
    else:
        yield None


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory):
    """One real train_classifier.py run on the mixed folder (2 steps, a checkpoint at each): it must train, and its
    output is the model of the wrong kind for the other scripts, and the previous checkpoint of the disk-full test."""
    data = write_imagefolder(tmp_path_factory.mktemp("mixed") / "mixed", mixed_images())
    out = tmp_path_factory.mktemp("classifier") / "run"
    proc = run_script("train_classifier.py", "--train_data_dir", data, "--output_dir", out, "--max_train_steps", 2,
                      "--checkpointing_steps", 1, "--train_batch_size", 4, "--report_to", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"data": data, "out": out}


@pytest.fixture(scope="module")
def paths(tmp_path_factory, tiny_sd, classifier_run, read_only):
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("bad_input")
    good = {f"{i}.png": Image.new("RGB", (32, 32), (30 * i, 100, 200 - 20 * i)) for i in range(8)}
    corrupt = write_imagefolder(root / "corrupt", {**good, "broken.png": good["0.png"]})
    png = (corrupt / "train" / "broken.png").read_bytes()
    (corrupt / "train" / "broken.png").write_bytes(png[:len(png) // 2])  # a valid header, then truncated
    (root / "empty").mkdir()
    (root / "no_images").mkdir()
    (root / "no_images" / "notes.txt").write_text("no pictures here\n")
    (root / "a_file").write_text("not a folder\n")
    (root / "unet_1ch.json").write_text(json.dumps({
        "in_channels": 1, "out_channels": 1, "block_out_channels": [16, 32], "down_block_types": ["DownBlock2D"] * 2,
        "up_block_types": ["UpBlock2D"] * 2, "norm_num_groups": 4}))
    (root / "not.safetensors").write_text("a text file that took the wrong name\n")
    # A LoRA whose keys name modules this base does not have (made for another architecture): diffusers loads it
    # without a word and adapts nothing.
    save_file({"transformer_blocks.0.ff.net.0.proj.lora_A.weight": torch.zeros(4, 64),
               "transformer_blocks.0.ff.net.0.proj.lora_B.weight": torch.zeros(64, 4)}, root / "foreign.safetensors")
    # A base whose VAE config does not say its native size: train_lora.py cannot pick a default --resolution.
    shutil.copytree(tiny_sd, root / "sd_no_size")
    vae_config = json.loads((root / "sd_no_size" / "vae" / "config.json").read_text())
    del vae_config["sample_size"]
    (root / "sd_no_size" / "vae" / "config.json").write_text(json.dumps(vae_config))
    return {"good": write_imagefolder(root / "good", good), "corrupt": corrupt, "empty": root / "empty",
            "no_images": root / "no_images", "missing": root / "no-such-folder", "a_file": root / "a_file",
            "unet_1ch": root / "unet_1ch.json", "not_safetensors": root / "not.safetensors",
            "foreign_lora": root / "foreign.safetensors", "sd": tiny_sd, "sd_no_size": root / "sd_no_size",
            "classifier": classifier_run["out"], "read_only": read_only, "root": root,
            "flux_digits": ROOT / "assets" / "tiny-flux-digits"}  # (a Flux.1 base without a guidance embedding)


def snapshot(path):
    """Everything under `path` that a write could change: names, bytes, mtimes (the folder's own mtime moves when
    anything is created in it, even if it is deleted again)."""
    path = Path(path)
    if not path.exists():
        return None
    files = [path, *sorted(path.rglob("*"))] if path.is_dir() else [path]
    return {str(p.relative_to(path)): (p.stat().st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest()
                                       if p.is_file() else "dir") for p in files}


def resolve(arg, paths, out):
    if not (isinstance(arg, str) and "{" in arg):
        return arg
    names = {**{k: str(v) for k, v in paths.items() if v is not None}, "out": str(out)}
    try:
        return arg.format(**names)
    except KeyError:
        return None  # a path this machine cannot provide (read_only for root without mount)


def check(script, c, paths):
    """Run one case with an output folder that already holds an earlier run's files; nothing may change."""
    base, _ = TABLES[script]
    out = paths["root"] / "outputs" / script.removesuffix(".py") / c.id
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "optimizer.bin").write_bytes(os.urandom(64))
    (out / "notes.txt").write_text("written before this run\n")
    args = [resolve(a, paths, out) for a in [*base, *c.args]]
    watched = [out, *(resolve(w, paths, out) for w in c.watched)]
    if None in args or None in watched:
        pytest.skip("no read-only folder here: running as root (which ignores permissions), and mount is refused")
    before = [snapshot(w) for w in watched]
    assert_one_line_error(run_script(script, *args, timeout=300), *c.needles)
    assert [snapshot(w) for w in watched] == before, "an existing output was changed or something new was written"


@pytest.mark.parametrize(("script", "c"), [(script, c) for script, (_, cases) in TABLES.items() for c in cases],
                         ids=lambda value: value.id if isinstance(value, Case) else value.removesuffix(".py"))
def test_bad_input(paths, script, c):
    check(script, c, paths)


# ------------------------------------------------------------------------------------------ beyond the tables
def test_images_of_mixed_sizes_and_modes_train(classifier_run):
    from PIL import Image

    from common.image_data import decode_image

    files = sorted((classifier_run["data"] / "train").glob("*.*g"))
    assert {Image.open(f).mode for f in files} >= {"L", "LA", "RGBA", "P", "I;16", "CMYK", "1", "RGB"}
    results = read_results(classifier_run["out"])
    assert results["global_step"] == 2 and math.isfinite(results["final_loss"])
    # 16-bit: the gradient survives the conversion to 8-bit RGB (not clipped to white, not crushed to black)
    pixels = decode_image({"path": str(classifier_run["data"] / "train" / "i16.png"), "bytes": None}, 30).float()
    assert pixels.shape == (3, 30, 40) and pixels[0].min() < 10 and pixels[0].max() > 245
    columns = pixels[0].mean(0)
    assert (columns[1:] >= columns[:-1] - 1).all()  # still dark on the left, light on the right
    assert (pixels[0] == pixels[1]).all() and (pixels[1] == pixels[2]).all()  # gray stays gray


def fill_up(folder):
    """Write zeros until the file system is full."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError as err:
            assert err.errno == errno.ENOSPC


def test_disk_full_while_saving_keeps_the_previous_checkpoint(classifier_run, tmp_path):
    """A real full disk (a 16 MB tmpfs, filled up) when root may mount one; else every file capped at 256 KiB
    (RLIMIT_FSIZE: writes fail with EFBIG), which fails the same checkpoint write the same way."""
    from safetensors.torch import load_file

    from common.checkpoints import resolve_resume

    out = tmp_path / "out"
    out.mkdir()
    mounted = IS_ROOT and shutil.which("mount") and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(out)], capture_output=True).returncode == 0
    try:
        # checkpoint-1 lies inside epoch 0, so the first write of the resumed run is checkpoint-2 (from a checkpoint of
        # an epoch's last step, the run would first evaluate that epoch and write best_model/).
        shutil.copytree(classifier_run["out"] / "checkpoint-1", out / "checkpoint-1")
        before = snapshot(out / "checkpoint-1")
        if mounted:
            fill_up(out)

        def cap_file_size():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write instead of a killed process
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18))

        cmd = [sys.executable, str(ROOT / "train_classifier.py"), "--train_data_dir", str(classifier_run["data"]),
               "--output_dir", str(out), "--max_train_steps", "3", "--checkpointing_steps", "1",
               "--train_batch_size", "4", "--report_to", "none", "--resume_from_checkpoint", "latest"]
        proc = subprocess.run(cmd, cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=300,
                              preexec_fn=None if mounted else cap_file_size)
        line = assert_one_line_error(proc, "cannot save checkpoint-2", "the previous checkpoint",
                                     "checkpoint-1 is intact", "--resume_from_checkpoint latest")
        assert ("no space left on device" if mounted else "file too large") in line
        assert snapshot(out / "checkpoint-1") == before
        assert sorted(p.name for p in out.iterdir()) == sorted(["checkpoint-1", *(["filler"] if mounted else [])])
        assert resolve_resume("latest", str(out)) == str(out / "checkpoint-1")
        assert load_file(out / "checkpoint-1" / "model" / "model.safetensors")  # still readable
    finally:
        if mounted:
            subprocess.run(["umount", str(out)], check=False)


def test_lora_for_another_architecture_is_refused(paths):
    """A LoRA whose keys name no module of the base: diffusers loads it without a word and adapts nothing (sample.py
    then failed in set_adapters with a traceback). In-process: the base loads in a second, not in a 10 s subprocess;
    the UserError -> one line path is what every case above checks."""
    import torch

    import inspect_pipeline
    import sample
    from common.cli import UserError

    out = paths["root"] / "foreign"
    args = sample.parse_args(["--model", str(paths["sd"]), "--lora", str(paths["foreign_lora"]), "--prompt", "a digit",
                              "--num_images", "1", "--num_inference_steps", "1", "--output_dir", str(out)])
    with pytest.raises(UserError, match="adapts no layer of the base model .*another architecture"):
        sample.sample_pipeline(args)
    args = inspect_pipeline.parse_args([str(paths["sd"]), "--lora", str(paths["foreign_lora"])])
    pipe, _, _ = inspect_pipeline.load_pipeline(args, torch.float32)
    with pytest.raises(UserError, match="adapts no module of"):
        inspect_pipeline.load_lora(pipe, args)
    assert not out.exists()


def test_write_errors_are_one_line_and_bugs_keep_their_traceback(capsys):
    from common.cli import run, write_error_reason

    assert write_error_reason(OSError(errno.ENOSPC, "No space left on device")) == "no space left on device"
    assert write_error_reason(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"))
    assert write_error_reason(RuntimeError("shape mismatch")) is None
    assert write_error_reason(ValueError("No space left on device")) is None  # not an I/O error type

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/out/model.safetensors")

    with pytest.raises(SystemExit) as exit_info:
        run(full, lambda argv: None)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("error: no space left on device at '/data/out/model.safetensors' ([Errno 28] "
                                       "No space left on device: '/data/out/model.safetensors'); free some space or "
                                       "fix the folder's permissions, or choose another output folder\n")

    def bug(args):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run(bug, lambda argv: None)


def test_corrupt_image_found_in_a_dataloader_worker_is_one_line(paths, capsys):
    """Sets too large for the decode-once cache decode in the loader's workers: torch wraps the worker's error in
    its traceback; the user still gets the one line."""
    import datasets
    import torch

    from common.cli import run
    from common.image_data import ImageDataset, collate_batch

    files = sorted(str(p) for p in (paths["corrupt"] / "train").glob("*.png"))
    ds = datasets.Dataset.from_dict({"image": files}).cast_column("image", datasets.Image())
    data = ImageDataset(ds, "image", 16, cache_limit_gb=0)

    def main(args):
        for _ in torch.utils.data.DataLoader(data, batch_size=4, num_workers=1, collate_fn=collate_batch):
            pass

    with pytest.raises(SystemExit):
        run(main, lambda argv: None)
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read image '") and "broken.png" in err and "Traceback" not in err
    assert len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------ a malformed accelerate yaml
YAMLS = {"syntax-error": "distributed_type: [oops\n  : :", "not-a-mapping": "- MULTI_GPU\n- 2\n",
         "no-distributed-type": "num_processes: 2\n"}


@pytest.mark.parametrize("target", ["train-classifier", "train-ddpm", "train-lora"])
@pytest.mark.parametrize("kind", [*YAMLS, "missing-file"])
def test_malformed_accelerate_yaml_through_make(tmp_path, target, kind):
    config = tmp_path / "config.yaml"
    if kind in YAMLS:
        config.write_text(YAMLS[kind])
    # -o: never (re)build the venv, the digits or the tiny SD for this; the check must stop the target first
    proc = subprocess.run([*MAKE, "-o", "models/tiny-sd/model_index.json", target,
                           f"CONFIG={config}", f"OUTPUT={tmp_path / 'out'}"],
                          cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, f"accelerate config '{config}'")
    assert not (tmp_path / "out").exists()
