"""Shared test helpers: launch a real script through `accelerate launch` in a subprocess, offline."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
sys.path.insert(0, str(ROOT))


# `make` as the tests run a target: never (re)build the venv or the bundled data (a test gives its own data; two makes
# at once in a fresh clone would each write data/). The Makefile's `data` prerequisites and more, by their files.
MAKE = ["make", "--no-print-directory"] + [arg for target in (
    ".venv/.installed", "data/digits/train/metadata.jsonl", "data/digits-red-ink/train/metadata.jsonl",
    "data/digits-captions/0", "data/digits-red-ink-masks/train", "data/digits-red-ink-blot-masks/train")
    for arg in ("-o", target)]


def offline_env(**extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline",
               ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT), TQDM_DISABLE="1")
    env.update(extra)
    return env


def free_port():
    """A TCP port nobody listens on now: each multi-process launch gets its own, so that tests running side by side
    (pytest -n 2) do not meet on accelerate's default port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(script, *args, config="cpu.yaml", cwd=ROOT, launch_args=()):
    script = Path(script)
    script = script if script.is_absolute() else Path(cwd) / script
    port = [] if "--main_process_port" in launch_args else ["--main_process_port", str(free_port())]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
            "--num_cpu_threads_per_process", "1", *port, *launch_args, str(script), *map(str, args)]


ONE_PROCESS_ENV = {"ACCELERATE_USE_CPU": "true", "ACCELERATE_MIXED_PRECISION": "no"}  # cpu.yaml's, as its launcher sets


def launch(script, *args, config="cpu.yaml", cwd=ROOT, env=None, timeout=900, check=True, launch_args=(),
           fresh=False):
    """`accelerate launch --config_file accelerate_configs/<config> [launch_args] <script> <args>`; returns
    CompletedProcess.

    One CPU process (cpu.yaml, no launch_args) runs `python <script> <args>` with the environment accelerate's
    launcher would give it (CPU, no mixed precision): the same run, without the launcher's ~2 s start-up. With the
    default `env`, that process is forked from tests/scripts/launch_server.py, whose libraries are imported already
    (about 5 s of CPU a launch saved); `fresh` (or TEST_FRESH_INTERPRETERS=1) starts a new interpreter, for what the
    imports themselves print. The launcher itself runs in every multi-process test and in the tests that go through
    `make`.
    """
    own_env = env is None
    env = env or offline_env()
    if config == "cpu.yaml" and not launch_args:
        script = Path(script) if Path(script).is_absolute() else Path(cwd) / script
        cmd = [sys.executable, str(script), *map(str, args)]
        env = {**env, **ONE_PROCESS_ENV}
        if own_env and not fresh and os.environ.get("TEST_FRESH_INTERPRETERS") != "1":
            proc = LaunchServer.run(cmd, cwd, timeout)
        else:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    else:
        cmd = launch_command(script, *args, config=config, cwd=cwd, launch_args=launch_args)
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


class LaunchServer:
    """This test process's tests/scripts/launch_server.py, started at its first launch."""

    proc = None

    @classmethod
    def run(cls, cmd, cwd, timeout):
        import select
        import tempfile

        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen([sys.executable, str(ROOT / "tests/scripts/launch_server.py")], cwd=ROOT,
                                        env={**offline_env(), **ONE_PROCESS_ENV}, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, bufsize=0)
        fd = cls.proc.stdout.fileno()

        def answer():  # one JSON line, read unbuffered (select sees what is not read yet)
            line = b""
            while not line.endswith(b"\n"):
                byte = os.read(fd, 1)
                if not byte:
                    raise RuntimeError("tests/scripts/launch_server.py ended")
                line += byte
            return json.loads(line)

        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": cmd[1:], "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
            cls.proc.stdin.write((json.dumps(request) + "\n").encode())
            pid = answer()["pid"]
            if not select.select([fd], [], [], timeout)[0]:
                os.kill(pid, signal.SIGKILL)
                answer()
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_bytes(), err.read_bytes())
            returncode = answer()["returncode"]
            return subprocess.CompletedProcess(cmd, returncode, out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))


def launch_nodes(script, *args, config="cpu_multi_node.yaml", timeout=600, node_args=None, launcher="accelerate",
                 env=None):
    """The same `accelerate launch` on two "machines" of this one (machine_rank 0 and 1, 127.0.0.1, one free port),
    started together; -> [CompletedProcess of machine 0, of machine 1]. `node_args`: {rank: extra script args};
    launcher "common": through `python -m common.launch`, as `make` runs it. Both are killed when one outlives
    `timeout` (raised as subprocess.TimeoutExpired), with the processes they started."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        cmd = launch_command(script, *args, *(node_args or {}).get(rank, ()), config=config,
                             launch_args=["--main_process_port", port, "--machine_rank", str(rank)])
        if launcher == "common":
            cmd[1:3] = ["-m", "common.launch"]
        procs.append((cmd, subprocess.Popen(cmd, cwd=ROOT, env=env or offline_env(), stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True, start_new_session=True)))
    deadline, results = time.time() + timeout, []
    try:
        for cmd, proc in procs:
            stdout, stderr = proc.communicate(timeout=max(1, deadline - time.time()))
            results.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    finally:
        for _, proc in procs:
            if proc.poll() is None:  # the launcher and the training processes it started (each in its own session)
                kill_tree(proc.pid)
                proc.communicate()
    return results


def kill_tree(pid):
    """SIGKILL a process and every process it started: torchrun starts each worker in a session of its own, out of
    reach of a kill of the launcher's process group, and a worker left alive keeps the launcher's pipes open."""
    import psutil  # (an accelerate requirement)

    try:
        tree = psutil.Process(pid)
        procs = [tree, *tree.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def run_script(script, *args, cwd=ROOT, env=None, timeout=600, fresh=False):
    """`python <script> <args>` without accelerate launch (for --help and bad-input cases). With the default `env`,
    forked from the launch server as `launch` runs one process (its libraries imported already: the CPU environment
    `accelerate launch` gives a script, which a bad-input case does not reach); `fresh` (or TEST_FRESH_INTERPRETERS=1)
    starts a new interpreter."""
    cmd = [sys.executable, str(Path(cwd) / script), *map(str, args)]
    if env is None and not fresh and os.environ.get("TEST_FRESH_INTERPRETERS") != "1":
        return LaunchServer.run(cmd, cwd, timeout)
    return subprocess.run(cmd, cwd=cwd, env=env or offline_env(), capture_output=True, text=True, timeout=timeout)


def run_in_process(script, *args):
    """A script's main (sample.py, inspect_pipeline.py, demo/style_report.py) in this process, on one thread as its
    subprocess runs (OMP_NUM_THREADS=1: the same float order): a success path without a new interpreter's ~5 s of
    imports. What it prints is the test's (capsys)."""
    import importlib

    import torch

    module = importlib.import_module(str(Path(script).with_suffix("")).replace("/", "."))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module.main(module.parse_args([str(arg) for arg in args]))
    finally:
        torch.set_num_threads(threads)


def assert_one_line_error(proc, *needles):
    """A user mistake: non-zero exit, no traceback, and an `error:` line that says what is wrong."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def signal_when_ready(cmd, ready, signum=signal.SIGTERM, timeout=600):
    """Start `cmd`, send it `signum` once the path `ready` exists, and wait: -> (returncode, stderr).

    The scripts install their signal handler before anything writes to --output_dir, so any file there means the
    handler is in place.
    """
    proc = subprocess.Popen(cmd, cwd=ROOT, env=offline_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + timeout
    while not Path(ready).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    if proc.poll() is None:
        proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=timeout)
    return proc.returncode, stderr


def logged_losses(output_dir, tag="train/loss"):
    """{step: value} of a scalar over every TensorBoard event file of a run (a resumed run adds its own file)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for events in sorted(Path(output_dir, "logs").rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            values.update({event.step: event.value for event in accumulator.Scalars(tag)})
    return values


def read_results(output_dir):
    return json.loads((Path(output_dir) / "all_results.json").read_text())


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """The built-in digits imagefolder (data/digits/{train,test}), written once per test session."""
    from demo.digits import write_digits

    path = tmp_path_factory.mktemp("data") / "digits"
    write_digits(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory):
    """The tiny random-init Stable Diffusion pipeline of `make tiny-sd`, built once per test session."""
    from demo.tiny_sd import write_tiny_sd

    path = tmp_path_factory.mktemp("models") / "tiny-sd"
    write_tiny_sd(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory):
    """The tiny random-init Stable Diffusion XL pipeline of `make tiny-sdxl`, built once per test session."""
    from demo.tiny_sd import write_tiny_sd

    path = tmp_path_factory.mktemp("models") / "tiny-sdxl"
    write_tiny_sd(str(path), architecture="tiny-sdxl")
    return path


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory):
    """The tiny random-init Stable Diffusion 3 pipeline of `make tiny-sd3`, built once per test session."""
    from demo.tiny_sd import write_tiny_sd

    path = tmp_path_factory.mktemp("models") / "tiny-sd3"
    write_tiny_sd(str(path), architecture="tiny-sd3")
    return path


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory):
    """The tiny random-init Flux.1 pipeline (Flux.1-dev's layout, guidance embedding) of `make tiny-flux`, built once
    per test session."""
    from demo.tiny_sd import write_tiny_sd

    path = tmp_path_factory.mktemp("models") / "tiny-flux"
    write_tiny_sd(str(path), architecture="tiny-flux")
    return path


@pytest.fixture(scope="session")
def tiny_qwen_image(tmp_path_factory):
    """The tiny random-init Qwen-Image pipeline of `make tiny-qwen-image`, built once per test session."""
    from demo.tiny_qwen_image import write_tiny_qwen_image

    path = tmp_path_factory.mktemp("models") / "tiny-qwen-image"
    write_tiny_qwen_image(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory):
    """The tiny random-init Wan 2.1 text-to-video pipeline of `make tiny-wan`, built once per test session."""
    from demo.tiny_wan import write_tiny_wan

    path = tmp_path_factory.mktemp("models") / "tiny-wan"
    write_tiny_wan(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_wan_a14b(tmp_path_factory):
    """The tiny random-init Wan 2.2 A14B pipeline (two experts, boundary_ratio 0.875) of demo/tiny_wan.py --variant
    a14b, built once per test session."""
    from demo.tiny_wan import write_tiny_wan

    path = tmp_path_factory.mktemp("models") / "tiny-wan-a14b"
    write_tiny_wan(str(path), variant="a14b")
    return path


@pytest.fixture(scope="session")
def tiny_flux2_klein(tmp_path_factory):
    """The tiny random-init FLUX.2 klein pipeline of `make tiny-flux2-klein`, built once per test session."""
    from demo.tiny_flux2 import write_tiny_flux2_klein

    path = tmp_path_factory.mktemp("models") / "tiny-flux2-klein"
    write_tiny_flux2_klein(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_z_image(tmp_path_factory):
    """The tiny random-init Z-Image pipeline of `make tiny-z-image`, built once per test session."""
    from demo.tiny_z_image import write_tiny_z_image

    path = tmp_path_factory.mktemp("models") / "tiny-z-image"
    write_tiny_z_image(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_flux2(tmp_path_factory):
    """The tiny random-init FLUX.2 dev pipeline of `make tiny-flux2`, built once per test session."""
    from demo.tiny_flux2 import write_tiny_flux2

    path = tmp_path_factory.mktemp("models") / "tiny-flux2"
    write_tiny_flux2(str(path))
    return path


# Modules whose family-parametrized tests run side by side, one family a worker at a time; every other module's tests
# run on one worker together, so that its module-scoped builds are made once (`make test`: pytest-xdist, --dist
# loadgroup). pytest-xdist 3.8 groups by a suffix it writes into the node ids, which pytest 9 no longer lets it write
# (each test then went to either worker, and each module's builds were made on both): the scheduler below groups by
# the node ids as they are.
SPLIT_BY_FAMILY = {"test_lora_flow"}


def xdist_scope(nodeid):
    """tests/<module>.py, or for SPLIT_BY_FAMILY modules the module and the family its id names ([flux], [sd3], ...;
    other parameters: the module's group)."""
    from common.families import FAMILIES

    module, _, test = nodeid.partition("::")
    family = test.rpartition("[")[2].rstrip("]") if test.endswith("]") else None
    if Path(module).stem in SPLIT_BY_FAMILY and family in FAMILIES.values():
        return f"{module}[{family}]"
    return module


# Each scope's seconds in the last whole run (setup, call and teardown of its tests): the scheduler hands out the
# longest first, so that no long module starts last while the other worker idles. A run of the whole suite writes
# them to .pytest_cache (read first); tests/scope_seconds.json holds a fresh clone's (copy the cache's file over it
# when modules change much). A scope in neither counts 2 s a test.
SCOPE_SECONDS = "scope_seconds.json"


def scope_seconds(config):
    for path in (Path(config.cache.mkdir("scopes")) / SCOPE_SECONDS, Path(__file__).parent / SCOPE_SECONDS):
        if path.is_file():
            return json.loads(path.read_text())
    return {}


def longest_scope_first(config, log, seconds):
    """pytest-xdist's LoadScopeScheduling over xdist_scope's scopes, handing out the one of most `seconds` first."""
    from xdist.scheduler import LoadScopeScheduling

    class LongestScopeFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return xdist_scope(nodeid)

        def _assign_work_unit(self, node):
            if not getattr(self, "ordered", False):
                cost = {scope: seconds.get(scope, 2.0 * len(tests)) for scope, tests in self.workqueue.items()}
                for scope in sorted(cost, key=cost.get, reverse=True):
                    self.workqueue.move_to_end(scope)
                self.ordered = True
            super()._assign_work_unit(node)

    return LongestScopeFirst(config, log)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    config.pluginmanager.register(ScopeClock(config), "scope-clock")
    return longest_scope_first(config, log, scope_seconds(config))


class ScopeClock:
    """Sums each scope's seconds as the workers report them; a run that collected every test writes them (see
    SCOPE_SECONDS)."""

    def __init__(self, config):
        self.config, self.seconds = config, {}

    def pytest_runtest_logreport(self, report):
        scope = xdist_scope(report.nodeid)
        self.seconds[scope] = round(self.seconds.get(scope, 0.0) + report.duration, 1)

    def pytest_sessionfinish(self, session):
        whole = not self.config.args or [Path(a).resolve() for a in self.config.args] == [Path(__file__).parent]
        if whole and not self.config.getoption("keyword") and self.seconds:
            path = Path(self.config.cache.mkdir("scopes")) / SCOPE_SECONDS
            path.write_text(json.dumps(dict(sorted(self.seconds.items(), key=lambda kv: -kv[1])), indent=0) + "\n")
