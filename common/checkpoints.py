"""Resumable checkpoints: checkpoint-N folders saved atomically on every process, rotation, where a resumed run
picks up, and the save/load-state hooks through which `accelerator.save_state` writes each model in from_pretrained
form (`load_state` reads it back).

The hooks: the save hook writes every prepared model with `save_pretrained` into its own subfolder and pops its
weights so accelerate does not write them a second time; the load hook pops the models and loads them back from
those subfolders. Extra objects (an EMA model) ride along through `extra_save`/`extra_load`. Under FSDP accelerate
writes and reads the sharded models and optimizer itself (pytorch_model_fsdp_N/, optimizer_N/); the save hook still
writes the from_pretrained subfolders, from the full weights that every process gathers (common/fsdp.py).
"""
import json
import os
import re
import shutil

from .cli import UserError, first_line, one_line, write_error_reason

_NAME = re.compile(r"^checkpoint-(\d+)$")
INFO_FILE = "checkpoint_info.json"
_FSDP_FILE = re.compile(r"^(pytorch_model_fsdp(_\d+)?(_rank\d+)?(\.bin)?|optimizer_\d+)$")  # accelerate's FSDP state


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
    detail = one_line(err, 160)
    return UserError(f"cannot save {os.path.basename(tmp[:-4])} in '{output_dir}': {reason} ({detail}); {kept}")


def load_checkpoint(accelerator, path):
    """`accelerator.load_state(path)` (every process), an unreadable checkpoint reported in one line.

    accelerate reads its .bin/.pkl files with `torch.load(weights_only=True)`: a pickle that carries code is refused,
    never run; the models come from safetensors through the load hooks.
    """
    import pickle

    from .fsdp import init_optimizer_states

    try:
        init_optimizer_states(accelerator)  # (under FSDP only)
        accelerator.load_state(path)
    except (pickle.UnpicklingError, RuntimeError, OSError, KeyError, ValueError) as err:
        raise UserError(f"--resume_from_checkpoint: cannot load '{path}' ({first_line(err, 200)}); "
                        "resume from another checkpoint-N or start without the flag") from None


def check_fsdp_checkpoint(path, fsdp):
    """A checkpoint resumes only under the kind of run that wrote it, FSDP or not: accelerate writes an FSDP run's
    model and optimizer state sharded (pytorch_model_fsdp_N/, optimizer_N/), which a run without FSDP cannot read,
    and the other way round. One line saying which (common/fsdp.py's check_fsdp_run calls it before anything loads)."""
    sharded = any(_FSDP_FILE.match(name) for name in os.listdir(path))
    if sharded == fsdp:
        return
    written, now = ("an FSDP run", "without FSDP") if sharded else ("a run without FSDP", "under FSDP")
    raise UserError(f"--resume_from_checkpoint: '{path}' was written by {written} and cannot resume {now} (accelerate "
                    "keeps an FSDP run's optimizer state sharded): resume with the accelerate config that wrote it, "
                    "or start a new run from its weights (the from_pretrained folders in it)")


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


def _has_pretrained_io(model):
    return hasattr(model, "save_pretrained") and hasattr(type(model), "from_pretrained")


def _save(model, path):
    if _has_pretrained_io(model):
        model.save_pretrained(path, safe_serialization=True)
    else:
        os.makedirs(path, exist_ok=True)
        import safetensors.torch  # here: importing torch costs seconds, and --help needs none

        safetensors.torch.save_model(model, os.path.join(path, "model.safetensors"))


def _load(model, path):
    if _has_pretrained_io(model):
        loaded = type(model).from_pretrained(path)
        model.load_state_dict(loaded.state_dict())
    else:
        import safetensors.torch

        safetensors.torch.load_model(model, os.path.join(path, "model.safetensors"))


def register_state_hooks(accelerator, named_models, save_fn=_save, load_fn=_load, extra_save=None, extra_load=None):
    """named_models: {subfolder: model} (the models that were passed to `prepare`, unwrapped with
    keep_torch_compile=False).

    save_fn(model, path) / load_fn(model, path) override how a model is written and read (e.g. LoRA weights only).
    extra_save(output_dir, models) / extra_load(input_dir) handle state that is not a prepared model, such as EMA;
    `models`: {subfolder: the model with all its weights} (under FSDP a full copy, common/fsdp.py's full_models).
    """

    def unwrap(model):  # without DDP and torch.compile wrappers: the weights' own names, for from_pretrained
        return accelerator.unwrap_model(model, keep_torch_compile=False)

    def folder_of(model):
        model = unwrap(model)
        for name, candidate in named_models.items():
            if candidate is model:
                return name
        raise ValueError(f"save/load hook: {type(model).__name__} is not one of {list(named_models)}")

    def save_hook(models, weights, output_dir):
        import torch

        from .fsdp import full_models

        # RNG-neutral: some savers build a model to write (diffusers' EMAModel.save_pretrained inits a UNet from its
        # config), which draws from the global generator; a run that saves at step N must draw the same numbers
        # afterwards as one that does not, or a stop-and-resume at N would not match the uninterrupted run.
        with torch.random.fork_rng(devices=[]):
            full = full_models(accelerator, {folder_of(m): m for m in models}, main_only=True)
            for name, model in full.items():
                if accelerator.is_main_process:
                    save_fn(model, os.path.join(output_dir, name))
                if weights:
                    weights.pop()  # written above; accelerate must not write it again
            if extra_save is not None and accelerator.is_main_process:
                extra_save(output_dir, full)

    def load_hook(models, input_dir):
        while models:
            model = models.pop()
            load_fn(unwrap(model), os.path.join(input_dir, folder_of(model)))
        if extra_load is not None:
            extra_load(input_dir)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
