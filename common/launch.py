"""`python -m common.launch <accelerate launch flags> script.py <flags>`: `accelerate launch` for the Makefile, with
a script's own error line as the last word.

accelerate's launchers end every failure with a traceback of their own, after the script's one `error:` line: the
single-process launcher raises CalledProcessError, and stops waiting at a Ctrl-C (KeyboardInterrupt) while the
script still writes its checkpoint; torchrun's launcher raises ChildFailedError or SignalException. This
wrapper keeps the launcher waiting through a Ctrl-C (the training processes get the signal from the terminal, or
from torchrun, and stop after a checkpoint) and turns the launcher's exceptions into one line and the script's exit
code (2: a user error, 130 / 143: stopped by SIGINT / SIGTERM). It first checks that the --config_file yaml reads
(accelerate answers an unreadable one with a traceback); accelerate validates the values itself.
Everything else is accelerate's.
"""
import os
import signal
import subprocess
import sys

from .cli import one_line


def check_accelerate_config(path):
    """-> None when `path` is a readable YAML mapping, else the reason in one line (no torch import: fast)."""
    import yaml

    if not os.path.isfile(path):
        return f"accelerate config '{path}' does not exist (see accelerate_configs/)"
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as err:
        return f"accelerate config '{path}' cannot be read: {one_line(err)}"
    if not isinstance(config, dict) or "distributed_type" not in config:
        return f"accelerate config '{path}' is not an accelerate config (no distributed_type); see accelerate_configs/"
    return None


def exit_code(returncode):
    """A child's return code as a shell reports it (-N, killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv):
    config_file = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config_file"), None)
    problem = config_file and check_accelerate_config(config_file)
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    # A Python-level handler (not SIG_IGN): the launched processes get the default again when they start.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    try:
        launch_command(args)
    except subprocess.CalledProcessError as err:  # the one process failed: its own message is above
        sys.exit(exit_code(err.returncode))
    except ChildFailedError as err:  # a process of several failed: its own message is above
        codes = {rank: failure.exitcode for rank, failure in sorted(err.failures.items())}
        print(f"accelerate launch: {len(codes)} of the processes exited with "
              f"{', '.join(f'{code} (rank {rank})' for rank, code in codes.items())}; the message above says why",
              file=sys.stderr, flush=True)
        sys.exit(next((exit_code(code) for code in codes.values() if code), 1))
    except SignalException as err:  # torchrun got SIGINT/SIGTERM, forwarded it and waited for the processes
        sys.exit(128 + int(err.sigval))


if __name__ == "__main__":
    main(sys.argv[1:])
