"""`python -m common.launch <accelerate launch flags> script.py <flags>`: `accelerate launch` for the Makefile, with
a script's own error line as the last word.

accelerate's launchers end every failure with a traceback of their own, after the script's one `error:` line: the
single-process launcher raises CalledProcessError, and stops waiting at a Ctrl-C (KeyboardInterrupt) while the
script still writes its checkpoint; torchrun's launcher raises ChildFailedError or SignalException. This
wrapper keeps the launcher waiting through a Ctrl-C (the training processes get the signal from the terminal, or
from torchrun, and stop after a checkpoint) and turns the launcher's exceptions into one line and the script's exit
code (2: a user error, 130 / 143: stopped by SIGINT / SIGTERM). It first checks that the --config_file yaml reads
(accelerate answers an unreadable one with a traceback), and that the engine it asks for (DeepSpeed, FSDP) would run:
accelerate drops one silently under --cpu (and DeepSpeed under ACCELERATE_USE_CPU), and a DeepSpeed config without
deepspeed installed ends in an ImportError traceback. accelerate validates the values itself.

Several machines (--num_machines > 1): each machine's launcher meets the others at --main_process_ip:port before any
training process starts; torchrun's wait is 900 s, or the script's --ddp_timeout when the command gives one
(passed as the rendezvous timeout). A machine that never comes ends in one line saying which command to start where.
Everything else is accelerate's.
"""
import os
import signal
import subprocess
import sys

from .cli import first_line, one_line


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


def engine_problem(config_file, use_deepspeed=False, use_fsdp=False, cpu=False):
    """-> None, or why the launch cannot run the engine (DeepSpeed or FSDP) that its config or flags ask for, in one
    line: accelerate would drop it silently (`--cpu`; ACCELERATE_USE_CPU for DeepSpeed: it then trains without it),
    or DeepSpeed is not installed (accelerate's launcher would end in an ImportError traceback). An FSDP config with
    ACCELERATE_USE_CPU is the scripts' to refuse (common/fsdp.py's check_fsdp_run): they run after accelerate's
    own set-up, which a test may change."""
    import importlib.util

    import yaml

    kind = None
    if config_file:
        with open(config_file) as f:
            kind = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP"}.get(str(yaml.safe_load(f).get("distributed_type")))
    kind = "DeepSpeed" if use_deepspeed else "FSDP" if use_fsdp else kind
    if kind is None:
        return None
    where = f"the accelerate config '{config_file}'" if config_file else "this launch"
    on_cpu = os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes", "y", "on", "t")
    if cpu or (kind == "DeepSpeed" and on_cpu):
        why = "--cpu is given" if cpu else "ACCELERATE_USE_CPU is set"
        return (f"{where} asks for {kind}, but {why}: accelerate then drops {kind} and trains without it. Leave "
                f"{'--cpu out' if cpu else 'ACCELERATE_USE_CPU unset'} (DeepSpeed runs on a machine without GPUs on "
                "its CPU accelerator, DS_ACCELERATOR=cpu), or use accelerate_configs/cpu.yaml or cpu_2proc.yaml")
    if kind == "DeepSpeed" and importlib.util.find_spec("deepspeed") is None:
        return (f"{where} asks for DeepSpeed, which is not installed here: run `make install-deepspeed` "
                "(requirements-deepspeed.txt), or use another config")
    return None


def exit_code(returncode):
    """A child's return code as a shell reports it (-N, killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


TORCHRUN_RDZV_TIMEOUT = 900  # torch.distributed.launcher.api's default rendezvous timeout, in seconds


def script_flag(script_args, flag):
    """The value of `flag` among the script's own arguments (`--flag V` or `--flag=V`), else None."""
    for i, arg in enumerate(script_args):
        if arg == flag and i + 1 < len(script_args):
            return script_args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def with_rdzv_timeout(rdzv_conf, script_args):
    """--rdzv_conf with `timeout=<the script's --ddp_timeout>` added, unless it sets a timeout already."""
    ddp_timeout = script_flag(script_args, "--ddp_timeout")
    conf = [item for item in (rdzv_conf or "").split(",") if item]
    if ddp_timeout is None or not ddp_timeout.isdigit() or any(item.startswith("timeout=") for item in conf):
        return rdzv_conf
    return ",".join([*conf, f"timeout={ddp_timeout}"])


def rendezvous_message(args, err):
    """One line for a launcher that waited in vain for the other machines (rank 0) or for the main one (rank > 0)."""
    conf = dict(item.split("=", 1) for item in (args.rdzv_conf or "").split(",") if "=" in item)
    seconds = conf.get("timeout", TORCHRUN_RDZV_TIMEOUT)
    where = f"{args.main_process_ip}:{args.main_process_port}"
    num_machines, rank = int(args.num_machines or 1), int(args.machine_rank or 0)
    if rank == 0:
        others = "1" if num_machines == 2 else f"1 ... {num_machines - 1} on the others"
        return (f"no answer from the other machine(s) at {where} within {seconds} s ({first_line(err, 100)}): start "
                f"the same command with --machine_rank {others} (--main_process_ip {args.main_process_ip}), or give "
                "them longer with the script's --ddp_timeout")
    return (f"machine {rank} could not reach the main machine at {where} within {seconds} s "
            f"({first_line(err, 100)}): start the same command with --machine_rank 0 on {args.main_process_ip} "
            "(it waits for the others), and check --main_process_ip, --main_process_port and the firewall")


def main(argv):
    config_file = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config_file"), None)
    problem = config_file and check_accelerate_config(config_file)
    flags = set(argv[:next((i for i, a in enumerate(argv) if a.endswith(".py")), len(argv))])  # the launcher's
    problem = problem or engine_problem(config_file, *(f in flags for f in ("--use_deepspeed", "--use_fsdp", "--cpu")))
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    # A Python-level handler (not SIG_IGN): the launched processes get the default again when they start.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    # torch's C++ log prints every failed try to reach the other machines with a stack dump; the launcher says it in
    # one line instead. Read once, when torch loads: the training processes keep the default.
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    args = launch_command_parser().parse_args(argv)
    args.rdzv_conf = with_rdzv_timeout(args.rdzv_conf, args.training_script_args)
    try:
        launch_command(args)
    except (DistError, RendezvousError) as err:  # the launchers of several machines did not meet
        if int(args.num_machines or 1) <= 1:
            raise
        print(f"error: {rendezvous_message(args, err)}", file=sys.stderr, flush=True)
        sys.exit(2)
    except subprocess.CalledProcessError as err:  # the one process failed: its own message is above
        sys.exit(exit_code(err.returncode))
    except ChildFailedError as err:  # a process of several failed: its own message is above
        codes = {rank: failure.exitcode for rank, failure in sorted(err.failures.items())}
        print(f"accelerate launch: {len(codes)} of the processes exited with "
              f"{', '.join(f'{code} (rank {rank})' for rank, code in codes.items())}; the message above says why",
              file=sys.stderr, flush=True)
        # The cause first: a user error's 2 (its line is above), then any other exit, then the processes that
        # torchrun itself stopped with a signal once one had failed.
        failed = sorted((code for code in codes.values() if code), key=lambda code: (code != 2, code < 0))
        sys.exit(exit_code(failed[0]) if failed else 1)
    except SignalException as err:  # torchrun got SIGINT/SIGTERM, forwarded it and waited for the processes
        sys.exit(128 + int(err.sigval))


if __name__ == "__main__":
    main(sys.argv[1:])
