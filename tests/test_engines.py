"""The distributed engines, for real, on CPU processes: DeepSpeed ZeRO-2 and ZeRO-3 on DeepSpeed's CPU accelerator
(DS_ACCELERATOR=cpu, gloo), FSDP with one process; and the launches that accelerate would run without the engine
they ask for, which are one line.

What runs where (docs/reliability.md, "Which combinations are tested where"):
- in CI (`make test`, no deepspeed installed): the one-line launches (a DeepSpeed config without deepspeed, or with
  ACCELERATE_USE_CPU; an engine config with --cpu), check_deepspeed_run's refusals on a stand-in accelerator, and
  FSDP with one process through a checkpoint and a bitwise resume;
- in `make test-engines` (installs deepspeed; run before a change to the engines' code is submitted): train_lora.py
  under ZeRO-2 in bf16 with one process (tiny Flux.1) and two (tiny SD), under ZeRO-3 in bf16 with two (tiny SD,
  validation images and a held-out loss: the frozen CLIP runs whole), each through a checkpoint, a bitwise resume and
  the final save, its LoRA equal to DeepSpeed's own fp32 weights (`zero_to_fp32`); and a DeepSpeed config that
  ACCELERATE_USE_CPU would drop, launched as users do, one line. Without deepspeed these skip.
That DeepSpeed really ran: its checkpoint layout (ZeRO-2: one model file and a bf16 optimizer partition per process;
ZeRO-3: a model partition per process as well) and the process count in all_results.json.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, assert_one_line_error, launch, logged_losses, offline_env, read_results, run_script
from safetensors.torch import load_file

CONFIGS = ROOT / "accelerate_configs"
FSDP_DIR = ROOT / "tests" / "fsdp_cpu"
STEPS = ["--max_train_steps", "4", "--checkpointing_steps", "2", "--logging_steps", "1"]
SD = ["--max_train_samples", "16", "--train_batch_size", "4", "--cache_latents", "--rank", "4"]
# The end-to-end runs (30-90 s each on 2 CPU cores) run in `make test-engines`, which sets ENGINE_TESTS=1.
engine_run = pytest.mark.skipif(os.environ.get("ENGINE_TESTS") != "1", reason="make test-engines runs it")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or
                                     os.environ.get("ENGINE_TESTS") != "1",
                                     reason="make test-engines runs it (with deepspeed installed)")


def through_make_launcher(*argv, env, hide_deepspeed=False):
    """`python -m common.launch <argv>` (the Makefile's launch); `hide_deepspeed`: as on a machine without it (CI)."""
    hide = "sys.modules['deepspeed'] = None; " if hide_deepspeed else ""
    code = (f"import runpy, sys; {hide}sys.argv = ['common.launch', *sys.argv[1:]]; "
            "runpy.run_module('common.launch', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("case", ["no deepspeed", "ACCELERATE_USE_CPU", "--cpu fsdp"])
def test_an_engine_that_would_not_run_is_one_line_at_launch(case, tmp_path):
    """`make train-classifier CONFIG=accelerate_configs/deepspeed_zero2.yaml` without deepspeed installed (accelerate's
    launcher would end in an ImportError traceback), a DeepSpeed config with ACCELERATE_USE_CPU set and an FSDP one
    with --cpu (accelerate would drop them and train plainly): one line from the launcher, nothing started."""
    out = tmp_path / "out"
    script = ["train_classifier.py", "--train_data_dir", tmp_path / "digits", "--output_dir", out]
    if case == "no deepspeed":  # (through make, a DeepSpeed config gets no ACCELERATE_USE_CPU)
        env = {k: v for k, v in offline_env().items() if k != "ACCELERATE_USE_CPU"}
        proc = through_make_launcher("--config_file", CONFIGS / "deepspeed_zero2.yaml", *script, env=env,
                                     hide_deepspeed=True)
        assert_one_line_error(proc, "asks for DeepSpeed, which is not installed", "make install-deepspeed")
    elif case == "ACCELERATE_USE_CPU":
        proc = through_make_launcher("--config_file", CONFIGS / "deepspeed_zero2.yaml", *script, env=offline_env(),
                                     hide_deepspeed=True)
        assert_one_line_error(proc, "asks for DeepSpeed, but ACCELERATE_USE_CPU is set", "drops DeepSpeed")
    else:
        proc = through_make_launcher("--config_file", CONFIGS / "fsdp.yaml", "--cpu", *script, env=offline_env())
        assert_one_line_error(proc, "asks for FSDP, but --cpu is given", "drops FSDP")
    assert proc.returncode == 2
    assert not out.exists()


def stand_in(stage=2, bf16=True, deepspeed=True):
    """What check_deepspeed_run reads of an Accelerator under DeepSpeed (or not)."""
    from accelerate.utils import DistributedType

    config = {"bf16": {"enabled": bf16}, "fp16": {"enabled": False}}
    plugin = SimpleNamespace(zero_stage=stage, deepspeed_config=config)
    return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED if deepspeed else DistributedType.NO,
                           state=SimpleNamespace(deepspeed_plugin=plugin))


@pytest.mark.parametrize("accelerator, flags, needle", [
    (stand_in(deepspeed=False), {}, "asks for DeepSpeed, but ACCELERATE_USE_CPU is set"),
    (stand_in(bf16=True), {"use_ema": True}, "--use_ema does not run under DeepSpeed in bf16/fp16 or ZeRO-3"),
    (stand_in(stage=3, bf16=False), {"use_ema": True}, "--use_ema does not run under DeepSpeed"),
    (stand_in(stage=3), {"quantize_base": "nf4"}, "--quantize_base nf4 does not run under ZeRO-3"),
    (stand_in(), {"train_text_encoder": True}, "--train_text_encoder does not run under DeepSpeed"),
])
def test_what_does_not_run_under_deepspeed_is_one_line(accelerator, flags, needle, monkeypatch):
    from common.cli import UserError
    from common.deepspeed_engine import check_deepspeed_run

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    args = SimpleNamespace(**{"use_ema": False, "quantize_base": None, "train_text_encoder": False, **flags})
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace("+", r"\+")):
        check_deepspeed_run(accelerator, args)
    check_deepspeed_run(stand_in(bf16=False), SimpleNamespace(use_ema=True))  # ZeRO-2 in fp32: the EMA is exact
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    check_deepspeed_run(stand_in(deepspeed=False), args)  # not DeepSpeed, not asked for: nothing to refuse


def test_fsdp_with_one_process_trains_as_one_unit():
    """CI's cheap check of what the end-to-end run below (make test-engines) needs: with one process (or NO_SHARD)
    check_fsdp_run turns FSDP's nested units off, with two it leaves accelerate's wrap policy as configured."""
    from accelerate.utils import DistributedType

    from common.fsdp import check_fsdp_run

    args = SimpleNamespace(resume_from_checkpoint=None)
    cases = [(1, "FULL_SHARD", False), (2, "NO_SHARD", False), (2, "FULL_SHARD", True)]
    for processes, strategy, nested in cases:
        plugin = SimpleNamespace(fsdp_version=1, sharding_strategy=f"ShardingStrategy.{strategy}",
                                 auto_wrap_policy="SIZE_BASED_WRAP")
        accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=processes,
                                      state=SimpleNamespace(fsdp_plugin=plugin))
        check_fsdp_run(accelerator, args)
        assert (plugin.auto_wrap_policy is not None) == nested, (processes, strategy)


@engine_run
def test_fsdp_with_one_process_checkpoints_and_resumes_exactly(digits, tiny_sd, tmp_path):
    """torch runs FSDP on one process as NO_SHARD, which never reshards a unit: a unit whose weights are all frozen
    kept them as plain tensors after a forward, and the first checkpoint failed ("FSDP assumes ... is in the
    state_dict"). One process trains as one FSDP unit (common/fsdp.py): checkpoints in FSDP's layout, a bitwise
    resume, the saved LoRA equal to FSDP's own checkpoint."""
    from test_fsdp import fsdp_weights

    env = offline_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(FSDP_DIR)]))
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    args = ["--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sd, *SD, "--mixed_precision", "bf16",
            *STEPS]
    fsdp = dict(config=str(FSDP_DIR / "cpu_fsdp.yaml"), env=env, launch_args=["--num_processes", "1"])
    launch("train_lora.py", *args, "--output_dir", run, **fsdp)
    assert read_results(run)["num_processes"] == 1
    for step in (2, 4):
        assert {"optimizer_0", "pytorch_model_fsdp_0"} <= {p.name for p in (run / f"checkpoint-{step}").iterdir()}
    sharded = fsdp_weights(run / "checkpoint-4")
    final = load_file(run / "pytorch_lora_weights.safetensors")
    assert final and all(torch.equal(v, sharded[k.removeprefix("unet.").replace(".weight", ".default.weight")])
                         for k, v in final.items())
    resumed.mkdir()
    shutil.copytree(run / "checkpoint-2", resumed / "checkpoint-2")
    launch("train_lora.py", *args, "--output_dir", resumed, "--resume_from_checkpoint", "latest", **fsdp)
    reference, after = logged_losses(run), logged_losses(resumed)
    assert [after[s] for s in (3, 4)] == [reference[s] for s in (3, 4)]
    again = load_file(resumed / "pytorch_lora_weights.safetensors")
    assert not [k for k in final if not torch.equal(final[k], again[k])]


def deepspeed_env():
    env = {k: v for k, v in offline_env().items() if k != "ACCELERATE_USE_CPU"}  # (it would drop DeepSpeed)
    return {**env, "DS_ACCELERATOR": "cpu"}


def launch_deepspeed(processes, *args, stage=2, check=True):
    launch_args = ["--num_processes", str(processes)] + (["--zero_stage", "3"] if stage == 3 else [])
    return launch("train_lora.py", *args, config="deepspeed_zero2.yaml", env=deepspeed_env(), check=check,
                  launch_args=launch_args)


def assert_deepspeed_ran(out, processes, stage):
    """DeepSpeed's own checkpoint files (not accelerate's plain ones): the bf16 optimizer's fp32 partitions, one per
    process, and the model states (ZeRO-3: one partition per process)."""
    assert read_results(out)["num_processes"] == processes
    for step in (2, 4):
        names = {p.name for p in (out / f"checkpoint-{step}" / "pytorch_model").iterdir()}
        ranks = range(processes)
        expected = {f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks}
        expected |= ({f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks} if stage == 3
                     else {"mp_rank_00_model_states.pt"})
        assert expected <= names, names
        assert not (out / f"checkpoint-{step}" / "model.safetensors").exists()


def assert_lora_is_deepspeeds(out, denoiser):
    """The recipe's LoRA files hold DeepSpeed's fp32 master weights (its own converter, zero_to_fp32), not the bf16
    copies the model computes with."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    masters = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoint-4"), tag="pytorch_model")
    adapters = load_file(out / "checkpoint-4" / denoiser / "adapter_model.safetensors")
    assert adapters and all(v.dtype == torch.float32 for v in adapters.values())
    assert all(torch.equal(v, masters[k.replace(".weight", ".default.weight")]) for k, v in adapters.items())
    final = load_file(out / "pytorch_lora_weights.safetensors")
    assert final.keys() == {f"{denoiser}.{k}" for k in adapters}
    assert all(torch.equal(final[f"{denoiser}.{k}"], v) for k, v in adapters.items())


def assert_resumes_exactly(out, resumed, *args, processes, stage):
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    launch_deepspeed(processes, *args, "--output_dir", resumed, "--resume_from_checkpoint", "latest", stage=stage)
    reference, after = logged_losses(out), logged_losses(resumed)
    assert [after[s] for s in (3, 4)] == [reference[s] for s in (3, 4)]
    final, again = (load_file(path / "pytorch_lora_weights.safetensors") for path in (out, resumed))
    assert not [k for k in final if not torch.equal(final[k], again[k])]


@needs_deepspeed
@pytest.mark.parametrize("base, processes", [("tiny_flux", 1), ("tiny_sd", 2)])
def test_zero2_in_bf16_resumes_exactly_and_saves_deepspeeds_fp32_lora(base, processes, digits, request, tmp_path):
    from diffusers import DiffusionPipeline

    path = request.getfixturevalue(base)
    denoiser = "transformer" if base == "tiny_flux" else "unet"
    out = tmp_path / "run"
    args = ["--train_data_dir", digits, "--pretrained_model_name_or_path", path, *SD, "--mixed_precision", "bf16",
            *STEPS, *(["--max_sequence_length", "16"] if base == "tiny_flux" else [])]
    launch_deepspeed(processes, *args, "--output_dir", out)
    assert_deepspeed_ran(out, processes, stage=2)
    assert_lora_is_deepspeeds(out, denoiser)
    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.load_lora_weights(out)
    assert set(pipe.get_list_adapters()) == {denoiser}
    assert_resumes_exactly(out, tmp_path / "resumed", *args, processes=processes, stage=2)


@needs_deepspeed
def test_zero3_keeps_the_frozen_text_encoder_whole(digits, tiny_sd, tmp_path):
    """ZeRO-3 partitions the trained UNet; the frozen CLIP loads whole (transformers would load it partitioned, with
    no weights to run: "max_position_embeddings: 0"), embeds the captions, draws the validation images and computes
    the held-out loss from copies that gather the UNet's shards."""
    out = tmp_path / "run"
    args = ["--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sd, *SD, "--mixed_precision", "bf16",
            *STEPS, "--validation_split", "0.1"]
    launch_deepspeed(2, *args, "--validation_prompt", "a handwritten digit seven", "--num_validation_images", "1",
                     "--validation_inference_steps", "1", "--output_dir", out, stage=3)
    assert_deepspeed_ran(out, 2, stage=3)
    assert_lora_is_deepspeeds(out, "unet")
    assert (out / "samples" / "step-4" / "0-0.png").is_file()
    assert set(read_results(out)["validation_losses"]) == {"0", "4"}
    assert_resumes_exactly(out, tmp_path / "resumed", *args, processes=2, stage=3)


@needs_deepspeed
def test_a_deepspeed_config_that_accelerate_would_drop_is_one_line(digits, tiny_sd, tmp_path):
    """A DeepSpeed launch with ACCELERATE_USE_CPU set, past the launcher (`accelerate launch` typed by hand: what its
    DeepSpeed launcher gives the script): accelerate would train without DeepSpeed, silently; the script says so,
    before anything is written."""
    out = tmp_path / "out"
    env = {**deepspeed_env(), "ACCELERATE_USE_CPU": "1", "ACCELERATE_USE_DEEPSPEED": "true",
           "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_MIXED_PRECISION": "bf16"}
    proc = run_script("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sd, *SD,
                      "--max_train_steps", "1", "--output_dir", out, env=env)
    assert_one_line_error(proc, "asks for DeepSpeed, but ACCELERATE_USE_CPU is set")
    assert proc.returncode == 2 and not out.exists()
