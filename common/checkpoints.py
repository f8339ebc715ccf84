"""checkpoint-N folders: atomic saving on every process, rotation, and where a resumed run picks up."""
import json
import os
import re
import shutil

from .cli import UserError

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
    if accelerator.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(os.path.join(tmp, INFO_FILE), "w") as f:
            json.dump({"global_step": global_step, **(info or {})}, f, indent=2)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        if total_limit is not None:
            for old in list_checkpoints(output_dir)[:-total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


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
