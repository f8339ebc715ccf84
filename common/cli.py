"""User mistakes end in one clear line and a non-zero exit, never a traceback."""
import argparse
import errno
import logging
import os
import re
import sys


class UserError(Exception):
    """Something the user can fix (a path, a flag, a dataset column). Printed as one line, exit code 2."""


class RecipeArgumentParser(argparse.ArgumentParser):
    """argparse, but an invalid flag is one line on stderr (no usage block), exit code 2."""

    def error(self, message):
        raise UserError(message)


def _is_first_of_its_machine():
    """Local rank 0: each machine's launcher shows its own processes' output, so an error said there reaches the
    user who watches that machine (a machine whose data or checkpoint differs says so on its own screen)."""
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"


class _DropMessages(logging.Filter):
    def __init__(self, *needles):
        super().__init__()
        self.needles = needles

    def filter(self, record):
        return not any(needle in record.getMessage() for needle in self.needles)


def quiet_libraries():
    """Drop library notices that say nothing about a run: transformers' fallback to the PIL image processors (this
    project does not install torchvision), and diffusers' note that a LoRA file has no text-encoder weights."""
    logging.getLogger("transformers.utils.import_utils").addFilter(_DropMessages("requires torchvision"))
    logging.getLogger("diffusers.loaders.lora_base").addFilter(_DropMessages("No LoRA keys associated to"))


def quiet_loading_bars(libraries=("diffusers", "transformers")):
    """No tqdm bar for every local load or save of a model (diffusers' "Loading pipeline components", transformers'
    "Loading weights" and "Writing model shards"), so that the run's own progress bar stays readable; downloads from
    the hub keep theirs. Imports the libraries: call it where a script imports them anyway."""
    from huggingface_hub.utils import enable_progress_bars

    if "diffusers" in libraries:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
    if "transformers" in libraries:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        enable_progress_bars()  # (transformers' switch turns the hub's off too)


def run(main, parse_args, argv=None):
    """Parse the flags and run `main(args)`; turn a UserError, or a write that failed for want of space or
    permission, into `error: <message>` and exit 2. A process of a multi-process run leaves through `leave`."""
    # A handler for the scripts' own INFO loggers; libraries keep their WARNING levels.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    quiet_libraries()
    args, message, rank_one_too, code = None, None, False, 0
    try:
        args = parse_args(argv)
        main(args)
    except UserError as err:
        message = _one_line(str(err))
    except SystemExit as err:  # a preemption's 130 / 143, a second Ctrl-C
        code = err.code
    except Exception as err:  # a full disk or a read-only folder is the user's to fix, not a bug: one line too
        if _distributed_error(err, r"timed out|timeout"):
            message, rank_one_too = _timeout_message(err, getattr(args, "ddp_timeout", None)), True
        elif _distributed_error(err, r"closed by peer|reset by peer|remote worker"):  # not this process's failure
            print(f"process {os.environ.get('RANK', '?')} stopped: another process failed (its message is above, "
                  "or in its machine's output)", file=sys.stderr, flush=True)
            code = 1
        else:
            reason = write_error_reason(err)
            if reason is None:
                raise
            where = f" at '{err.filename}'" if getattr(err, "filename", None) else ""
            message = (f"{reason}{where} ({_one_line(str(err))[:200]}); free some space or fix the folder's "
                       "permissions, or choose another output folder")
    if message is not None:
        _say_error(message, rank_one_too)
        code = 2
    leave(code)


def leave(code=0):
    """End the script with exit code `code` (0: return, in one process). A process of a multi-process run
    (WORLD_SIZE > 1) exits without the interpreter's teardown, its output flushed: gloo's worker threads may still hold
    the last collective (DDP's gradient all-reduce, kept by the final barrier), whose Python state they free while the
    interpreter goes away, and the process aborts ("terminate called without an active exception", SIGABRT, a
    launcher traceback) after a run that finished: a third of two-process launches on a busy 2-core machine did.
    (torch's `destroy_process_group` does not join those threads; see pytorch/pytorch#179291.)"""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if code:
            sys.exit(code)
        return
    if not isinstance(code, int):  # sys.exit(None) or sys.exit("message"), as the interpreter reads them
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    import gc

    gc.collect()  # what finalizers close (data loader workers, files) closed now
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def first_line(err, limit=300):
    """The first line of an exception's message (its type when the message is empty), cut at `limit` characters:
    hub and loader errors run to paragraphs, and the first line says what went wrong."""
    line = (str(err).strip().splitlines() or [""])[0].strip() or type(err).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def one_line(err, limit=300):
    """An exception's whole message on one line (whitespace collapsed; its type when empty), cut at `limit`: for
    short messages that wrap, where a later line says where (a YAML line, a file)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _say_error(message, rank_one_too=False):
    """One line per machine, not one per process; `rank_one_too`: for the errors the main process need not see (a
    wait for it that timed out), rank 1 says it."""
    if _is_first_of_its_machine():
        print(f"error: {message}", file=sys.stderr, flush=True)
    elif rank_one_too and os.environ.get("RANK") == "1":  # on a line of its own, not after the main one's progress bar
        print(f"\nerror: {message}", file=sys.stderr, flush=True)


def _distributed_error(err, pattern):
    """True when `err` is raised by torch.distributed (a collective, a barrier, the process group's start) and its
    message matches `pattern`: gloo raises a peer's timeout as a RuntimeError "Timed out waiting 3000ms for recv
    operation", a peer that died as "Connection closed by peer"."""
    tb, last = err.__traceback__, ""
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    in_distributed = f"{os.sep}torch{os.sep}distributed{os.sep}" in last
    return in_distributed and isinstance(err, RuntimeError) and bool(re.search(pattern, str(err), re.I))


def _timeout_message(err, ddp_timeout):
    limit = f"--ddp_timeout ({ddp_timeout} s)" if ddp_timeout else "the process group's timeout"
    rank = os.environ.get("RANK", "?")
    detail = re.sub(r"^\[[^\]]*\]\s*", "", first_line(err, 300))[:120]  # gloo's message starts with its source file
    return (f"process {rank} waited longer than {limit} for the other processes ({detail}): the main "
            "process validates, samples and saves while the others wait; raise --ddp_timeout, or make the validation "
            "shorter (fewer --num_validation_images or --validation_inference_steps)")


def _one_line(message):
    """A UserError raised in a DataLoader worker reaches the main process wrapped in the worker's traceback
    ("Caught UserError in DataLoader worker process 0. Original Traceback ..."): keep only its own message."""
    if "Original Traceback" in message:
        last = message.strip().splitlines()[-1]
        message = re.sub(r"^[\w.]*UserError: ", "", last)
    return " ".join(message.split())


_WRITE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                 errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EFBIG: "file too large"}
# The same conditions as other libraries word them: safetensors (Rust io::Error) and torch.save (its zip writer
# reports a short write as "unexpected pos" or "file write failed", without the errno).
_WRITE_MESSAGES = (("No space left on device", "no space left on device"), ("os error 28", "no space left on device"),
                   ("Disk quota exceeded", "disk quota exceeded"), ("Read-only file system", "read-only file system"),
                   ("File too large", "file too large"), ("file write failed", "a write failed (disk full?)"),
                   ("unexpected pos", "a write failed (disk full?)"))


def write_error_reason(err):
    """-> a short reason when `err` is a failed write for want of space or permission, else None."""
    if isinstance(err, OSError) and err.errno in _WRITE_ERRNOS:
        return _WRITE_ERRNOS[err.errno]
    if isinstance(err, (OSError, RuntimeError)) or type(err).__name__ == "SafetensorError":
        text = str(err)
        for needle, reason in _WRITE_MESSAGES:
            if needle in text:
                return reason
    return None
