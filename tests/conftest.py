"""Shared test helpers: launch a real script through `accelerate launch` in a subprocess, offline."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
sys.path.insert(0, str(ROOT))


def offline_env(**extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline",
               ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT), TQDM_DISABLE="1")
    env.update(extra)
    return env


def launch(script, *args, config="cpu.yaml", cwd=ROOT, env=None, timeout=900, check=True):
    """`accelerate launch --config_file accelerate_configs/<config> <script> <args>`; returns CompletedProcess."""
    script = Path(script)
    script = script if script.is_absolute() else Path(cwd) / script
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
           "--num_cpu_threads_per_process", "1", str(script), *map(str, args)]
    proc = subprocess.run(cmd, cwd=cwd, env=env or offline_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_script(script, *args, cwd=ROOT, env=None, timeout=600):
    """`python <script> <args>` without accelerate launch (for --help and bad-input cases)."""
    cmd = [sys.executable, str(Path(cwd) / script), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env or offline_env(), capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc, *needles):
    """A user mistake: non-zero exit, no traceback, and an `error:` line that says what is wrong."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def read_results(output_dir):
    return json.loads((Path(output_dir) / "all_results.json").read_text())


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """The built-in digits imagefolder (data/digits/{train,test}), written once per test session."""
    from common.digits_data import write_digits

    path = tmp_path_factory.mktemp("data") / "digits"
    write_digits(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory):
    """The tiny random-init Stable Diffusion pipeline of `make tiny-sd`, built once per test session."""
    from common.tiny_sd import write_tiny_sd

    path = tmp_path_factory.mktemp("models") / "tiny-sd"
    write_tiny_sd(str(path))
    return path
