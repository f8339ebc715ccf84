"""FSDP (accelerate's fsdp_version 1): what the trainers do differently when the trained models are sharded.

Under FSDP every process holds only a shard of each prepared model's weights, so the unwrapped model cannot be saved
or sampled from as it is, and a main-process-only `state_dict()` or forward would wait forever for the others
(FSDP gathers weights with collectives). `full_models` gathers the full weights on every process, for the main
process (or every process) to save or sample with a plain copy of each model; `load_full_weights` loads full weights
back; `clip_grad_norm` clips by the norm over all shards; `check_fsdp_run` refuses, in one line, what does not run
under FSDP here. Without FSDP each is what the trainers did before: the unwrapped models themselves, their
`load_state_dict`, `accelerator.clip_grad_norm_`, nothing to refuse. Under DeepSpeed, `uniform_dtype`, `full_models`
and `check_fsdp_run` do what DeepSpeed needs instead (common/deepspeed_engine.py).
"""
import os
import re

from .cli import UserError

_FSDP_FILE = re.compile(r"^(pytorch_model_fsdp(_\d+)?(_rank\d+)?(\.bin)?|optimizer_\d+)$")  # accelerate's FSDP state


def is_fsdp(accelerator):
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def check_fsdp_run(accelerator, args):
    """One line for an FSDP run that would not do what it says: an accelerate config asking for FSDP where accelerate
    does not apply it (on a CPU it trains unsharded, silently), FSDP2, a flag that does not run under FSDP here, or a
    checkpoint to resume that another kind of run wrote (FSDP or not). Right after the Accelerator is made: before
    anything loads or is written."""
    from .deepspeed_engine import check_deepspeed_run

    check_deepspeed_run(accelerator, args)  # (the same for DeepSpeed)
    if args.resume_from_checkpoint:  # (agreed_checkpoint's: a checkpoint folder every process has)
        check_fsdp_checkpoint(args.resume_from_checkpoint, is_fsdp(accelerator))
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not is_fsdp(accelerator):
        if asked:
            raise UserError("the accelerate config asks for FSDP, but accelerate applies FSDP only on GPUs (and other "
                            "accelerators): here this launch would train unsharded (DDP on a CPU). On a CPU use "
                            "accelerate_configs/cpu_2proc.yaml, or run on GPUs")
        return
    if accelerator.state.fsdp_plugin.fsdp_version != 1:
        raise UserError("the accelerate config asks for fsdp_version 2; the recipes run FSDP with fsdp_version: 1 "
                        "(accelerate_configs/fsdp.yaml)")
    plugin = accelerator.state.fsdp_plugin
    if accelerator.num_processes == 1 or str(plugin.sharding_strategy).endswith("NO_SHARD"):
        # NO_SHARD (torch's choice for one process) never reshards a unit, and a unit whose weights are all frozen
        # gets no backward hook to make them parameters again after a forward: its state_dict would lack them (a
        # checkpoint fails, "FSDP assumes ... is in the state_dict"). Unsharded, nested units save nothing: one unit.
        plugin.auto_wrap_policy = None
    for flag, why in (("use_ema", "the EMA would average sharded weights"),
                      ("train_text_encoder", "accelerate's FSDP checkpoints pair each optimizer with one model, and "
                                             "one optimizer trains both"),
                      ("text_column", "the image+text classifier is not a transformers model that can be rebuilt "
                                      "to save")):
        if getattr(args, flag, None):
            raise UserError(f"--{flag} does not run under FSDP here ({why}): leave it out, or train with DDP "
                            "(accelerate_configs/multi_gpu.yaml)")


def check_fsdp_checkpoint(path, fsdp):
    """A checkpoint resumes only under the kind of run that wrote it, FSDP or not: accelerate writes an FSDP run's
    model and optimizer state sharded (pytorch_model_fsdp_N/, optimizer_N/), which a run without FSDP cannot read,
    and the other way round. One line saying which (check_fsdp_run calls it before anything loads)."""
    sharded = any(_FSDP_FILE.match(name) for name in os.listdir(path))
    if sharded == fsdp:
        return
    written, now = ("an FSDP run", "without FSDP") if sharded else ("a run without FSDP", "under FSDP")
    raise UserError(f"--resume_from_checkpoint: '{path}' was written by {written} and cannot resume {now} (accelerate "
                    "keeps an FSDP run's optimizer state sharded): resume with the accelerate config that wrote it, "
                    "or start a new run from its weights (the from_pretrained folders in it)")


def uniform_dtype(accelerator, models, dtype):
    """Under FSDP: every weight of the trained `models` in `dtype` (FSDP flattens a model's frozen weights and its
    trained ones, e.g. LoRA's, into one tensor per unit, of one dtype); the accelerator's mixed precision becomes
    FSDP's, which computes in the low precision. Under DeepSpeed in bf16/fp16 the models' inputs are cast to DeepSpeed's
    dtype (common/deepspeed_engine.py). Otherwise nothing changes."""
    from .deepspeed_engine import prepare_models

    prepare_models(accelerator, models)
    if is_fsdp(accelerator):
        for model in models:
            model.to(dtype)


def full_models(accelerator, prepared, main_only=False):
    """{name: a model holding every weight} for the prepared models {name: model}; every process calls it (a
    collective under FSDP). Without FSDP: the unwrapped models themselves. Under FSDP: plain copies built from the full
    weights, on every process, or with `main_only` on the main process only (None on the others); a copy is a new
    model (changing it does not reach training) in the weights' dtype, on their device: the memory of one unsharded
    model more, for as long as it is kept. Under DeepSpeed: copies holding its fp32 master weights
    (common/deepspeed_engine.py's full_copies)."""
    from .deepspeed_engine import full_copies, is_deepspeed

    if is_deepspeed(accelerator):
        return full_copies(accelerator, prepared, main_only, plain_copy)
    unwrapped = {name: accelerator.unwrap_model(model, keep_torch_compile=False) for name, model in prepared.items()}
    if not is_fsdp(accelerator):
        return unwrapped
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    copies = {}
    for name, model in prepared.items():
        # The whole module tree gathered (every process takes part); its state_dict has the weights' own names.
        with FSDP.summon_full_params(model, writeback=False):
            state = unwrapped[name].state_dict()
            keep = accelerator.is_main_process or not main_only
            copies[name] = plain_copy(unwrapped[name], {k: v.detach().clone() for k, v in state.items()}) if keep \
                else None
    return copies


def load_full_weights(accelerator, prepared, state_dict):
    """Load a full state dict (the weights' own names) into a prepared model, on every process."""
    if not is_fsdp(accelerator):
        accelerator.unwrap_model(prepared, keep_torch_compile=False).load_state_dict(state_dict)
        return
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(prepared, StateDictType.FULL_STATE_DICT):  # each process keeps its shard of it
        prepared.load_state_dict(state_dict)


def plain_copy(model, state_dict):
    """A new model of `model`'s class and config (its peft adapters too) holding `state_dict`: no FSDP wrappers, so
    its save_pretrained, state_dict and forward run on one process. diffusers and transformers models only."""
    from accelerate import init_empty_weights

    with init_empty_weights():  # no memory, no random init: the weights come from state_dict
        if hasattr(type(model), "from_config") and hasattr(model, "config"):  # diffusers
            copy = type(model).from_config(model.config)
        elif hasattr(type(model), "config_class") and hasattr(model, "config"):  # transformers
            copy = type(model)(model.config)
        else:
            raise UserError(f"under FSDP a {type(model).__name__} cannot be saved here (not a diffusers or "
                            "transformers model): train it with DDP (accelerate_configs/multi_gpu.yaml)")
        for adapter, config in getattr(model, "peft_config", {}).items():
            copy.add_adapter(config, adapter_name=adapter)
    copy.load_state_dict(state_dict, strict=True, assign=True)
    device = next(iter(state_dict.values())).device
    return copy.to(device).requires_grad_(False).train(model.training)  # (buffers outside the state_dict: to device)


def clip_grad_norm(accelerator, models, params, max_norm):
    """`accelerator.clip_grad_norm_(params, max_norm)`, by the norm of all the gradients. Under FSDP each process holds
    a shard of them: accelerate computes the norm over all shards only when `params` are all of one model's
    parameters, and otherwise clips each shard by its own norm (LoRA: frozen weights beside the trained ones). Here
    the FSDP model's own clipping runs (over every process; weights without a gradient left out)."""
    if not is_fsdp(accelerator):
        return accelerator.clip_grad_norm_(params, max_norm)
    if len(models) != 1:  # check_fsdp_run refuses the recipes' runs of two trained models
        raise ValueError("clip_grad_norm under FSDP: one prepared model expected")
    accelerator.unscale_gradients()
    return models[0].clip_grad_norm_(max_norm)


def init_optimizer_states(accelerator):
    """Before `load_state` under FSDP: give every optimizer its state (moments at zero, from one step with zero
    gradients at LR 0: no weight changes). accelerate reads a sharded optimizer checkpoint into the optimizer's own
    state dict as the template, so a fresh optimizer (no state before its first step) would load only its LR groups
    and resume with its Adam moments reset, silently."""
    import torch

    if not is_fsdp(accelerator):
        return
    for optimizer in accelerator._optimizers:  # the prepared ones, in accelerate's order
        optimizer = optimizer.optimizer  # AcceleratedOptimizer -> torch's
        if optimizer.state:
            continue
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        for param in params:
            param.grad = torch.zeros_like(param)
        lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
