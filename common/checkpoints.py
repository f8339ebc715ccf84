"""checkpoint-N folders: atomic saving on every process, rotation, and where a resumed run picks up."""
import json
import os
import re
import shutil

from .cli import UserError, write_error_reason

_NAME = re.compile(r"^checkpoint-(\d+)$")
INFO_FILE = "checkpoint_info.json"


def list_checkpoints(output_dir):
    """Complete checkpoints (never the `.tmp` ones), oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _NAME.match(name))]
    return [os.path.join(output_dir, name) for _, name in sorted(found)]


def checkpoint_step(path):
    match = _NAME.match(os.path.basename(os.path.normpath(path)))
    if not match:
        raise UserError(f"--resume_from_checkpoint: '{path}' is not a checkpoint-N folder")
    return int(match.group(1))


def save_checkpoint(accelerator, output_dir, global_step, total_limit=None, info=None):
    """Every process calls this (DeepSpeed/FSDP need all of them in save_state).

    The state is written under `checkpoint-N.tmp` and renamed when complete, so an interrupted save is never
    picked by `latest`; old checkpoints are removed only after the new one is complete.
    """
    final = os.path.join(output_dir, f"checkpoint-{global_step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:  # this save's own leftover, or any other a killed run left behind
        for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
            if name.startswith("checkpoint-") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(tmp)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            with open(os.path.join(tmp, INFO_FILE), "w") as f:
                json.dump({"global_step": global_step, **(info or {})}, f, indent=2)
    except Exception as err:  # a full disk: one line, and the previous checkpoint stays the `latest` one
        reason = write_error_reason(err)
        if reason is None:
            raise
        raise _save_error(accelerator, output_dir, tmp, reason, err) from None
    if accelerator.is_main_process:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        if total_limit is not None:
            for old in list_checkpoints(output_dir)[:-total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _save_error(accelerator, output_dir, tmp, reason, err):
    """The UserError for a checkpoint that could not be written; its half-written folder is removed."""
    if "disk full?" in reason and shutil.disk_usage(output_dir).free < 2**20:
        reason = "no space left on device"  # torch.save words a full disk as "unexpected pos"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    fix = "make the folder writable" if reason in ("permission denied", "read-only file system") else "free some space"
    previous = list_checkpoints(output_dir)
    kept = (f"the previous checkpoint {previous[-1]} is intact: {fix}, then run the same command with "
            "--resume_from_checkpoint latest" if previous else f"no checkpoint was written: {fix} and rerun")
    detail = " ".join(str(err).split())[:160]
    return UserError(f"cannot save {os.path.basename(tmp[:-4])} in '{output_dir}': {reason} ({detail}); {kept}")


def load_checkpoint(accelerator, path):
    """`accelerator.load_state(path)` (every process), an unreadable checkpoint reported in one line.

    accelerate reads its .bin/.pkl files with `torch.load(weights_only=True)`: a pickle that carries code is refused,
    never run; the models come from safetensors through the load hooks.
    """
    import pickle

    try:
        accelerator.load_state(path)
    except (pickle.UnpicklingError, RuntimeError, OSError, KeyError, ValueError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"--resume_from_checkpoint: cannot load '{path}' ({reason[:200]}); "
                        "resume from another checkpoint-N or start without the flag") from None


def resolve_resume(resume_from_checkpoint, output_dir):
    """`latest` -> newest complete checkpoint in output_dir (None if there is none); else a checkpoint path."""
    if resume_from_checkpoint is None:
        return None
    if resume_from_checkpoint == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = resume_from_checkpoint
    if not os.path.isdir(path) and os.path.isdir(os.path.join(output_dir, path)):
        path = os.path.join(output_dir, path)
    if not os.path.isdir(path):
        raise UserError(f"--resume_from_checkpoint: no checkpoint at '{resume_from_checkpoint}' "
                        f"(use 'latest' or a checkpoint-N folder of {output_dir})")
    checkpoint_step(path)
    return path


def read_checkpoint_info(path):
    info_path = os.path.join(path, INFO_FILE)
    if not os.path.isfile(info_path):
        return {}
    with open(info_path) as f:
        return json.load(f)
