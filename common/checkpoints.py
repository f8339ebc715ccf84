"""Resumable checkpoints: checkpoint-N folders saved atomically on every process, rotation, where a resumed run
picks up, and the save/load-state hooks through which `accelerator.save_state` writes each model in from_pretrained
form (`load_state` reads it back).

Several machines: --output_dir is either one folder they all share (a shared filesystem: the main process writes each
checkpoint) or a folder on each machine's own disk (the first process of every machine writes a complete copy,
accelerate's `save_on_each_node`, so that each machine resumes from its own disk); `detect_shared_output_dir` finds
out which at the start of a run. Where a run resumes is agreed by every process (`agreed_checkpoint`), never read
from one disk alone.

The hooks: the save hook writes every prepared model with `save_pretrained` into its own subfolder and pops its
weights so accelerate does not write them a second time; the load hook pops the models and loads them back from
those subfolders. Extra objects (an EMA model) ride along through `extra_save`/`extra_load`. Under FSDP accelerate
writes and reads the sharded models and optimizer itself (pytorch_model_fsdp_N/, optimizer_N/); the save hook still
writes the from_pretrained subfolders, from the full weights that every process gathers (common/fsdp.py).
"""
import contextlib
import json
import logging
import os
import re
import shutil

from .cli import UserError, first_line, one_line, write_error_reason

logger = logging.getLogger(__name__)

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


def writes_checkpoints(accelerator):
    """Whether this process writes the checkpoint files: the main process, or, when each machine has its own
    --output_dir (`save_on_each_node`, set by detect_shared_output_dir), the first process of every machine. Every
    process writes its own RNG state (accelerate's save_state) whatever this says."""
    if accelerator.project_configuration.save_on_each_node:
        return accelerator.is_local_main_process
    return accelerator.is_main_process


class StateFilesAtDebug(logging.Filter):
    """accelerate's INFO line for every file of a state it saves or loads (optimizer, scheduler, sampler, random
    states, ...) made a DEBUG line, shown only where DEBUG is on for its logger: save_checkpoint says one line per
    checkpoint instead, the scripts one per resume."""
    MESSAGES = ("Saving current state to", " saved in ", "Saving the state of", "Loading states from",
                "loaded successfully", "Loading the state of", "custom states")

    def filter(self, record):
        if record.levelno == logging.INFO and any(message in record.getMessage() for message in self.MESSAGES):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_state_files():
    """StateFilesAtDebug on accelerate's loggers of save_state and load_state (once)."""
    for name in ("accelerate.accelerator", "accelerate.checkpointing"):
        log = logging.getLogger(name)
        if not any(isinstance(f, StateFilesAtDebug) for f in log.filters):
            log.addFilter(StateFilesAtDebug())


def save_checkpoint(accelerator, output_dir, global_step, total_limit=None, info=None):
    """Every process calls this (DeepSpeed/FSDP need all of them in save_state).

    The state is written under `checkpoint-N.tmp` and renamed when complete, so an interrupted save is never
    picked by `latest`; old checkpoints are removed only after the new one is complete. Each folder that holds a
    copy (one shared folder, or each machine's own) is written, renamed and rotated by one process, which logs one
    line for it (accelerate's line per file: at DEBUG).
    """
    quiet_state_files()
    final = os.path.join(output_dir, f"checkpoint-{global_step}")
    tmp = final + ".tmp"
    writer = writes_checkpoints(accelerator)
    if writer:  # this save's own leftover, or any other a killed run left behind
        for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
            if name.startswith("checkpoint-") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(tmp)
        accelerator.wait_for_everyone()
        if writer:
            with open(os.path.join(tmp, INFO_FILE), "w") as f:
                json.dump({"global_step": global_step, **(info or {})}, f, indent=2)
    except Exception as err:  # a full disk: one line, and the previous checkpoint stays the `latest` one
        reason = write_error_reason(err)
        if reason is None:
            raise
        raise _save_error(accelerator, output_dir, tmp, reason, err) from None
    if writer:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        if total_limit is not None:
            for old in list_checkpoints(output_dir)[:-total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        logger.info(f"saved {final}")
    accelerator.wait_for_everyone()
    return final


def _save_error(accelerator, output_dir, tmp, reason, err):
    """The UserError for a checkpoint that could not be written; its half-written folder is removed."""
    if "disk full?" in reason and shutil.disk_usage(output_dir).free < 2**20:
        reason = "no space left on device"  # torch.save words a full disk as "unexpected pos"
    if writes_checkpoints(accelerator):
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

    quiet_state_files()
    try:
        init_optimizer_states(accelerator)  # (under FSDP only)
        accelerator.load_state(path)
    except (pickle.UnpicklingError, RuntimeError, OSError, KeyError, ValueError) as err:
        raise UserError(f"--resume_from_checkpoint: cannot load '{path}' ({first_line(err, 200)}); "
                        "resume from another checkpoint-N or start without the flag") from None


def resolve_resume(resume_from_checkpoint, output_dir):
    """`latest` -> newest complete checkpoint in output_dir (None if there is none); else a checkpoint path.

    In a process of a multi-process run (WORLD_SIZE > 1) a path missing here is None, not an error: another machine
    may hold it, and a process that stopped alone before the others meet would leave them waiting (--ddp_timeout);
    agreed_checkpoint says what is missing where, on every process."""
    if resume_from_checkpoint is None:
        return None
    if resume_from_checkpoint == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = _checkpoint_path(resume_from_checkpoint, output_dir)
    if path is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return None
        raise UserError(f"--resume_from_checkpoint: no checkpoint at '{resume_from_checkpoint}' "
                        f"(use 'latest' or a checkpoint-N folder of {output_dir})")
    checkpoint_step(path)
    return path


def _checkpoint_path(resume_from_checkpoint, output_dir):
    """A --resume_from_checkpoint path as given, or inside output_dir; None when neither is a folder."""
    for path in (resume_from_checkpoint, os.path.join(output_dir, resume_from_checkpoint)):
        if os.path.isdir(path):
            return path
    return None


SHARE_CHECK = ".shared-folder-check"  # name start of the files detect_shared_output_dir writes, and removes


def detect_shared_output_dir(accelerator, output_dir):
    """Whether `output_dir` is one folder that every process sees (a shared filesystem), or each machine's own;
    every process calls it, right after the Accelerator is made. -> True when shared (always with one process).

    Every process writes a file of its own there and looks for the others' files: a process that sees all of them
    shares the folder; one that sees exactly the files of its own machine's processes has a folder of its own
    machine. Not shared: the first process of every machine writes a complete copy of each checkpoint into its
    folder (accelerate's `save_on_each_node`, read by writes_checkpoints), so that every machine resumes from its own
    disk, and a warning says so; what is not a checkpoint (the trained model, samples, logs, all_results.json) is
    written on the main machine only. A one-line UserError, on every process, for a mix (some machines share the
    folder, some do not), and for FSDP or DeepSpeed without a shared folder: they write each checkpoint in shards,
    one per process, which resume only when every process can read every shard. The folder is removed again when
    this check made it (nothing is written before a run starts)."""
    if accelerator.num_processes == 1:
        return True
    from accelerate.utils import DistributedType, broadcast_object_list, gather_object

    made = os.path.abspath(output_dir)  # the topmost folder this check creates, if any
    while not os.path.exists(os.path.dirname(made)):
        made = os.path.dirname(made)
    made = None if os.path.exists(made) else made
    os.makedirs(output_dir, exist_ok=True)
    run_id = broadcast_object_list([os.urandom(8).hex() if accelerator.is_main_process else None])[0]

    def token(rank):
        return os.path.join(output_dir, f"{SHARE_CHECK}-{run_id}-{rank}")

    rank, machine = accelerator.process_index, accelerator.process_index - accelerator.local_process_index
    with open(token(rank), "w"):
        pass
    accelerator.wait_for_everyone()
    seen = [other for other in range(accelerator.num_processes) if os.path.exists(token(other))]
    views = gather_object([(rank, machine, seen, os.path.abspath(output_dir))])  # every process's, by rank
    accelerator.wait_for_everyone()  # every process has looked: the files can go
    os.remove(token(rank))
    accelerator.wait_for_everyone()
    if made is not None:  # rmdir up to the folder that existed: only empty folders, whoever removes them first
        for folder in _up_to(os.path.abspath(output_dir), made):
            try:
                os.rmdir(folder)
            except OSError:
                break
    if folder_sharing(views) == "shared":
        accelerator.project_configuration.save_on_each_node = False
        return True
    machines = len({machine for _, machine, _, _ in views})
    kind = {DistributedType.FSDP: "FSDP", DistributedType.DEEPSPEED: "DeepSpeed"}.get(accelerator.distributed_type)
    if kind:
        raise UserError(f"--output_dir '{output_dir}' is not on a filesystem all {machines} machines share "
                        f"(each sees only its own folder): {kind} writes each checkpoint in shards, one per process, "
                        "and resumes only where every process reads them all; give an --output_dir on a shared "
                        "filesystem (NFS, Lustre, ...), or train with DDP (accelerate_configs/multi_node.yaml)")
    accelerator.project_configuration.save_on_each_node = True
    if accelerator.is_main_process:
        logger.warning(f"--output_dir '{output_dir}' is not on a filesystem the {machines} machines share "
                       "(each sees only its own folder): every machine keeps a complete copy of each checkpoint in "
                       "its own --output_dir, to resume from; the trained model, samples, logs and all_results.json "
                       "are written on the main machine only")
    return False


def folder_sharing(views):
    """views: [(process index, index of its machine's first process, [the processes whose files it sees], its
    folder)] of every process -> "shared" (every process sees every file) or "per machine" (each sees exactly its own
    machine's), else a UserError (detect_shared_output_dir)."""
    everyone = [rank for rank, _, _, _ in views]
    if all(seen == everyone for _, _, seen, _ in views):
        return "shared"
    machines = {}
    for rank, machine, _, _ in views:
        machines.setdefault(machine, []).append(rank)
    for rank, machine, seen, folder in views:
        if seen != machines[machine]:
            raise UserError(f"--output_dir: process {rank} sees the files of processes {_ranks(seen)} in '{folder}', "
                            f"but the processes of its machine are {_ranks(machines[machine])}: give every machine "
                            "one folder on a filesystem all of them share, or each machine a folder on its own disk "
                            "(the same folder for all processes of a machine)")
    return "per machine"


def _up_to(folder, top):
    """folder, its parent, ..., top (folder lies inside top, or is it)."""
    folders = [folder]
    while folders[-1] != top:
        folders.append(os.path.dirname(folders[-1]))
    return folders


def _ranks(ranks):
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def agreed_checkpoint(accelerator, resume_from_checkpoint, output_dir):
    """The checkpoint every process resumes from, as a path on this process's disk, or None (a fresh start): the
    same step on every process. Every process calls it (it gathers what each one's folder holds); the trainers
    pass its answer on as --resume_from_checkpoint.

    `latest`: the newest checkpoint that every process finds in its --output_dir (one shared folder, or each
    machine's own copy); a warning when a machine holds a newer one that another lacks (a save cut short on one
    machine). None when no process finds any; a UserError when some do and others find none or none in common:
    a machine must not start from step 0 while the others resume. A path: the same checkpoint-N on every process,
    else a UserError naming the process that lacks it. Every process raises the same error."""
    if resume_from_checkpoint is None:
        return None
    if accelerator.num_processes == 1:
        return resolve_resume(resume_from_checkpoint, output_dir)
    from accelerate.utils import gather_object

    latest = resume_from_checkpoint == "latest"
    if latest:
        mine = [checkpoint_step(path) for path in list_checkpoints(output_dir)]
    else:
        path = _checkpoint_path(resume_from_checkpoint, output_dir)
        mine = [] if path is None else [checkpoint_step(path)]
    views = gather_object([(accelerator.process_index, mine, output_dir)])
    step = choose_resume_step(resume_from_checkpoint, views)
    if step is None:
        return None
    newest = max(s for _, steps, _ in views for s in steps)
    if latest and step < newest and accelerator.is_main_process:
        logger.warning(f"--resume_from_checkpoint latest: resuming from checkpoint-{step}, the newest checkpoint "
                       f"every process finds; checkpoint-{newest} is not in every machine's --output_dir")
    return os.path.join(output_dir, f"checkpoint-{step}") if latest else path


def choose_resume_step(resume_from_checkpoint, views):
    """views: [(process index, [steps of the complete checkpoints it finds], its --output_dir)] of every process ->
    the step all resume from (None: a fresh start), or a UserError (agreed_checkpoint)."""
    everywhere = set.intersection(*(set(steps) for _, steps, _ in views))
    if everywhere:  # (a path: one step, found by every process)
        return max(everywhere)
    if resume_from_checkpoint == "latest":
        found = {s for _, steps, _ in views for s in steps}
        if not found:
            return None
        newest = max(found)
        holder = next(rank for rank, steps, _ in views if newest in steps)
        rank, steps, folder = next(view for view in views if newest not in view[1])
        has = ", ".join(f"checkpoint-{s}" for s in steps) or "none"
        raise UserError(f"--resume_from_checkpoint latest: no checkpoint is in every machine's --output_dir (process "
                        f"{rank} finds {has} in '{folder}', process {holder} finds checkpoint-{newest}): copy "
                        f"checkpoint-{newest} into each machine's --output_dir (each machine resumes from its own "
                        "copy), or start a new run without --resume_from_checkpoint")
    lacking = [(rank, folder) for rank, steps, folder in views if not steps]
    if len(lacking) == len(views):
        raise UserError(f"--resume_from_checkpoint: no checkpoint at '{resume_from_checkpoint}' "
                        f"(use 'latest' or a checkpoint-N folder of {views[0][2]})")
    if lacking:
        rank, folder = lacking[0]
        raise UserError(f"--resume_from_checkpoint: process {rank} finds no checkpoint at '{resume_from_checkpoint}' "
                        f"(nor in its --output_dir '{folder}'), other processes do: each machine resumes from its own "
                        "copy; copy the checkpoint there, or give a path every machine has")
    steps = sorted({s for _, found, _ in views for s in found})
    raise UserError(f"--resume_from_checkpoint '{resume_from_checkpoint}' is checkpoint-{steps[0]} on some processes "
                    f"and checkpoint-{steps[-1]} on others: give every machine the same checkpoint")


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
        with _saved_by_this_process(model):
            model.save_pretrained(path, safe_serialization=True)
    else:
        os.makedirs(path, exist_ok=True)
        import safetensors.torch  # here: importing torch costs seconds, and --help needs none

        safetensors.torch.save_model(model, os.path.join(path, "model.safetensors"))


@contextlib.contextmanager
def _saved_by_this_process(model):
    """transformers' save_pretrained writes nothing on a process other than the process group's rank 0, whatever its
    is_main_process says (`should_save_on_this_rank`): inside, it writes wherever it is called, as a machine with its
    own copy of each checkpoint needs (only the processes that write checkpoints call it). The models it holds too
    (the image+text classifier's image and text models)."""
    patched = [module for module in model.modules() if hasattr(module, "should_save_on_this_rank")]
    for module in patched:  # an instance attribute shadows the method
        module.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        for module in patched:
            del module.should_save_on_this_rank


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
            # (under FSDP the main process is the only writer: detect_shared_output_dir refuses FSDP otherwise)
            full = full_models(accelerator, {folder_of(m): m for m in models}, main_only=True)
            writer = writes_checkpoints(accelerator)
            for name, model in full.items():
                if writer:
                    save_fn(model, os.path.join(output_dir, name))
                if weights:
                    weights.pop()  # written above; accelerate must not write it again
            if extra_save is not None and writer:
                extra_save(output_dir, full)

    def load_hook(models, input_dir):
        while models:
            model = models.pop()
            load_fn(unwrap(model), os.path.join(input_dir, folder_of(model)))
        if extra_load is not None:
            extra_load(input_dir)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
