"""The test suite's one-process launches without an interpreter's start-up each (tests/conftest.py's `launch`).

Started once per test process with the environment those launches get (conftest's offline_env and the one CPU
process's accelerate variables), it imports the libraries every script imports (torch, accelerate, datasets,
transformers, peft, diffusers' models and training utilities: about 5 s of CPU an interpreter, most of a tiny run's)
and nothing of the project (a copied recipe's own `common/` must be the one it imports). Then, for each request on
stdin (a JSON line: argv, cwd, stdout and stderr paths), it forks a process that runs the script as `python script
args` would: `__main__`, argv, the script's folder first on sys.path, the working directory, stdout and stderr to
the files, no stdin; at its end the non-daemon threads joined and the atexit functions run, and the exit code (or the
signal) is the script's. It writes the child's pid, then its return code (negative: the signal), as JSON lines.
"""
import atexit
import json
import os
import runpy
import signal
import sys
import threading
import traceback

import accelerate  # noqa: F401
import datasets  # noqa: F401
import diffusers  # noqa: F401
import diffusers.training_utils  # noqa: F401 (most of diffusers' models, torch._dynamo)
import peft  # noqa: F401
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
from diffusers import AutoencoderKL, UNet2DConditionModel  # noqa: F401
from transformers import CLIPTextModel  # noqa: F401


def run_script(argv, cwd, stdout, stderr):
    """In the forked child: the script as its own interpreter would run it; never returns."""
    code = 1
    try:
        os.chdir(cwd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, stdout), (2, stderr)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:  # as the interpreter: the traceback, then death by SIGINT
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:  # noqa: BLE001 (as the interpreter: the traceback, exit code 1)
            traceback.print_exc()
            code = 1
        threading._shutdown()  # the interpreter's exit: wait for the non-daemon threads, then the atexit functions
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def main():
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_script(request["argv"], request["cwd"], request["stdout"], request["stderr"])
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
