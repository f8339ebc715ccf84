"""DeepSpeed (accelerate's DeepSpeed plugin, ZeRO stage 2 or 3): what the trainers do differently under it.

DeepSpeed keeps the trained model in the precision of its config (bf16: every weight of the prepared model, LoRA's
too, cast to bf16) and the trained weights' fp32 master copies in its optimizer, partitioned over the processes; under
ZeRO-3 it partitions the model's weights as well. So:
- `cast_inputs`: the prepared model's floating inputs are cast to its dtype, as DeepSpeed's own fp16 `auto_cast`
  does (accelerate turns it on for fp16, and DeepSpeed has none for bf16: fp32 latents would meet bf16 weights);
- `full_copies`: what is saved or sampled is a copy holding the fp32 master weights of what trains (gathered from
  every process), the frozen weights as they are (gathered under ZeRO-3): the saved LoRA is DeepSpeed's fp32 LoRA;
- `zero3_init_disabled`: the frozen parts (text encoders, VAE) load whole, not partitioned by ZeRO-3's `zero.Init`,
  as diffusers' examples load them: they never reach DeepSpeed, and a partitioned CLIP has no weights to run;
- `check_deepspeed_run`: one line for a DeepSpeed config that accelerate would drop (it trains plainly when
  ACCELERATE_USE_CPU is set) and for what does not run under DeepSpeed here.
The trainers reach these through common/fsdp.py's entry points (uniform_dtype, full_models, check_fsdp_run); without
DeepSpeed each does nothing.
"""
import contextlib
import os

from .cli import UserError


def is_deepspeed(accelerator):
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def asks_for_deepspeed():
    """Whether the launch asked for DeepSpeed (accelerate's launcher sets this for a DeepSpeed config)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def cpu_backend():
    """The process group's backend for DeepSpeed on its CPU accelerator (DS_ACCELERATOR=cpu, or no GPU), else None.
    accelerate picks a backend only for GPU-like devices: without one given, it would count each process of a
    DeepSpeed run on CPUs as the only one (every process the main one, the data unsplit)."""
    from accelerate.utils import parse_flag_from_env

    if not asks_for_deepspeed() or parse_flag_from_env("ACCELERATE_USE_CPU") or "LOCAL_RANK" not in os.environ:
        return None  # (not launched by DeepSpeed's launcher, or a launch whose DeepSpeed accelerate drops)
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return accelerator.communication_backend_name() if accelerator.device_name() == "cpu" else None


def check_deepspeed_run(accelerator, args):
    """One line for a DeepSpeed launch that would not do what it says: accelerate drops the DeepSpeed config where
    ACCELERATE_USE_CPU is set (a CPU run: it then trains without DeepSpeed, silently), and flags that do not run under
    DeepSpeed here. Right after the Accelerator is made: before anything loads or is written."""
    if not is_deepspeed(accelerator):
        if asks_for_deepspeed():
            raise UserError("the accelerate config asks for DeepSpeed, but ACCELERATE_USE_CPU is set: accelerate then "
                            "drops DeepSpeed and trains without it. Unset ACCELERATE_USE_CPU (on a machine without "
                            "GPUs, DeepSpeed runs on its CPU accelerator with DS_ACCELERATOR=cpu), or use "
                            "accelerate_configs/cpu.yaml or cpu_2proc.yaml")
        return
    zero3 = accelerator.state.deepspeed_plugin.zero_stage == 3
    if getattr(args, "use_ema", False) and (zero3 or compute_dtype(accelerator) is not None):
        raise UserError("--use_ema does not run under DeepSpeed in bf16/fp16 or ZeRO-3 here (the model holds bf16 "
                        "copies or shards of the trained weights; their fp32 values live in DeepSpeed's optimizer): "
                        "leave it out, train in fp32 under ZeRO-2, or with DDP (accelerate_configs/multi_gpu.yaml)")
    if zero3 and getattr(args, "quantize_base", None):
        raise UserError(f"--quantize_base {args.quantize_base} does not run under ZeRO-3 (it partitions every weight "
                        "of the trained model, and a quantized weight cannot be split): use ZeRO-2 "
                        "(accelerate_configs/deepspeed_zero2.yaml) or one GPU")
    for flag, why in (("train_text_encoder", "accelerate's DeepSpeed engine trains one model per run"),
                      ("text_column", "the image+text classifier is two models, and accelerate's DeepSpeed engine "
                                      "trains one")):
        if getattr(args, flag, None):
            raise UserError(f"--{flag} does not run under DeepSpeed here ({why}): leave it out, or train with DDP "
                            "(accelerate_configs/multi_gpu.yaml)")


def compute_dtype(accelerator):
    """The dtype DeepSpeed gives the prepared model's weights: its config's bf16 or fp16, else None (fp32)."""
    import torch

    config = accelerator.state.deepspeed_plugin.deepspeed_config
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if str(config.get(key, {}).get("enabled", False)).lower() == "true":
            return dtype
    return None


def cast_inputs(model, dtype):
    """A forward pre-hook on `model` that casts its floating tensor inputs (positional and keyword, one level into
    lists, tuples and dicts) to `dtype`; integer inputs (timesteps, token ids) stay as they are."""
    import torch

    def cast(value):
        if isinstance(value, torch.Tensor):
            return value.to(dtype) if value.is_floating_point() else value
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        if isinstance(value, dict):
            return {k: cast(v) for k, v in value.items()}
        return value

    def hook(module, args, kwargs):
        return cast(args), cast(kwargs)

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def prepare_models(accelerator, models):
    """Before `prepare`: under DeepSpeed in bf16/fp16, the trained models' inputs cast to that dtype (cast_inputs)."""
    dtype = compute_dtype(accelerator) if is_deepspeed(accelerator) else None
    if dtype is not None:
        for model in models:
            cast_inputs(model, dtype)


@contextlib.contextmanager
def gathered(model):
    """ZeRO-3: every weight of `model` whole on every process for the block (a collective); otherwise nothing."""
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def full_copies(accelerator, prepared, main_only, plain_copy):
    """{name: a plain copy of the model} for the prepared models {name: DeepSpeed engine}; every process calls it (the
    fp32 master weights and, under ZeRO-3, the weights are gathered from every process). A copy's trained weights
    are DeepSpeed's fp32 masters; its frozen weights are the model's own tensors (ZeRO-2) or gathered clones
    (ZeRO-3); it casts its inputs to the weights' dtype as the prepared model does. `main_only`: None on the other
    processes. `plain_copy(model, state_dict)`: common/fsdp.py's."""
    from deepspeed.utils import safe_get_full_fp32_param

    dtype = compute_dtype(accelerator)
    copies = {}
    for name, engine in prepared.items():
        model = accelerator.unwrap_model(engine, keep_torch_compile=False)
        named = dict(model.named_parameters())
        masters = {k: safe_get_full_fp32_param(p) for k, p in named.items() if p.requires_grad}  # (a collective)
        with gathered(model):
            state = model.state_dict()
            zero3 = any(hasattr(p, "ds_id") for p in named.values())
            state = {k: (masters[k].detach().clone() if masters.get(k) is not None else
                         v.detach().clone() if zero3 else v.detach()) for k, v in state.items()}
        if accelerator.is_main_process or not main_only:
            copies[name] = plain_copy(model, state)
            if dtype is not None:
                cast_inputs(copies[name], dtype)
        else:
            copies[name] = None
    return copies


@contextlib.contextmanager
def zero3_init_disabled():
    """A context in which transformers' models load whole under ZeRO-3 (its `zero.Init` would partition them as they
    load), for the frozen parts that DeepSpeed never sees; diffusers' models always load whole. accelerate's
    `zero3_init_context_manager(enable=False)` does nothing when the config's zero3_init_flag is already false, while
    transformers still reads the stage from the DeepSpeed config that accelerate registers with it: unregistered
    here for the block, registered again after. Nothing without DeepSpeed."""
    plugin = None
    if asks_for_deepspeed():
        from accelerate.state import AcceleratorState

        plugin = AcceleratorState().deepspeed_plugin if AcceleratorState._shared_state else None
    if plugin is None or not plugin.hf_ds_config.is_zero3():
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()
