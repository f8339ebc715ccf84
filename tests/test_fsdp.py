"""FSDP, for real, on two CPU processes (gloo): fsdp.yaml's sharding (fsdp_version 1, FULL_SHARD, sharded checkpoints,
use_orig_params) with nested FSDP units, through a checkpoint, a resume and the final save.

accelerate 1.15 applies FSDP only on GPUs: on CPU processes it trains with plain DDP. These tests put
tests/fsdp_cpu/ on PYTHONPATH, whose sitecustomize.py lifts that one gate (see its docstring); torch's FSDP and
accelerate's FSDP code run as they would on GPUs. Without it, an FSDP config on a CPU is one error line (last test).

What runs where (a launch of two processes costs 15-40 s of CPU, so the trainers share the checks):
- train_lora.py (a diffusers UNet with LoRA beside its frozen weights in the FSDP units, bf16 mixed precision;
  validation images from copies gathered on every process): a run, its resume from checkpoint-2, bitwise, and its
  checkpoint resumed without FSDP (one line). The resume path (the optimizer states made first, then accelerate's
  sharded model and optimizer load) is the same for every trainer.
- train_lora.py on Flux.1 (the tiny random-init one): a run, its LoRA against FSDP's own checkpoint.
- train_classifier.py (a transformers model; the state hooks' default save; the best model loaded back on every
  process): a run.
- train_text_to_image.py and train_ddpm.py are not run under FSDP here: their FSDP lines are full_models of their one
  diffusers UNet (the copy train_lora.py's run builds, less the adapter) for validation and for the final pipeline,
  and the state hooks' default save (the classifier's run); test_skeleton.py checks the shared lines identical.
- common/fsdp.py's clipping and loading against an unsharded copy: tests/fsdp_cpu/clip_and_load.py.
"""
import os
import shutil
import subprocess

import torch
from conftest import (
    CONFIGS,
    ROOT,
    assert_one_line_error,
    launch,
    launch_command,
    launch_nodes,
    logged_losses,
    offline_env,
    read_results,
)
from safetensors.torch import load_file

FSDP_DIR = ROOT / "tests" / "fsdp_cpu"
CONFIG = str(FSDP_DIR / "cpu_fsdp.yaml")
WRAPPERS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")  # and a leading "module." (DDP's)
STEPS = ["--max_train_steps", "4", "--checkpointing_steps", "2", "--logging_steps", "1"]
SD = ["--max_train_samples", "16", "--train_batch_size", "4", "--cache_latents"]
VALIDATION = ["--validation_prompt", "a handwritten digit seven", "--num_validation_images", "1",
              "--validation_inference_steps", "1"]  # at the end of the run


def launch_fsdp(script, *args, check=True):
    env = offline_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(FSDP_DIR)]))
    return launch(script, *args, config=CONFIG, env=env, check=check)


def assert_fsdp_ran(out):
    """Two processes, and checkpoints that accelerate wrote as FSDP's: the sharded models and optimizer (proof that
    FSDP, not DDP, trained), every process's RNG state, beside the recipe's own from_pretrained folders."""
    assert read_results(out)["num_processes"] == 2
    for step in (2, 4):
        names = {p.name for p in (out / f"checkpoint-{step}").iterdir()}
        assert {"optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl", "random_states_1.pkl"} <= names, names


def assert_plain_names(out):
    files = sorted(out.rglob("*.safetensors"))
    assert files
    for path in files:
        bad = [k for k in load_file(path) if k.startswith("module.") or any(w in k for w in WRAPPERS)]
        assert not bad, (path.relative_to(out), bad[:3])


def fsdp_weights(checkpoint, index=0):
    """FSDP's own sharded checkpoint of model `index`, gathered into one state dict (torch's converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    full = checkpoint.parent / f"{checkpoint.name}-fsdp-{index}.pt"
    dcp_to_torch_save(checkpoint / f"pytorch_model_fsdp_{index}", full)
    return torch.load(full, weights_only=True)["model"]


def test_lora_under_fsdp_resumes_exactly_and_saves_loadable_weights(digits, tiny_sd, tmp_path):
    from diffusers import StableDiffusionPipeline

    run, resumed = tmp_path / "run", tmp_path / "resumed"
    # bf16 as in fsdp.yaml: FSDP then flattens the frozen weights with the fp32 LoRA ones, which must share a dtype
    args = ["--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sd, *SD, "--rank", "4",
            "--mixed_precision", "bf16", *STEPS]
    launch_fsdp("train_lora.py", *args, *VALIDATION, "--output_dir", run)
    assert_fsdp_ran(run)
    assert (run / "samples" / "step-4" / "0-0.png").is_file()

    # What the recipe saved from the gathered weights is what FSDP itself checkpointed: the adapters of checkpoint-2
    # and checkpoint-4, and the final LoRA file.
    for step in (2, 4):
        sharded = fsdp_weights(run / f"checkpoint-{step}")
        adapters = load_file(run / f"checkpoint-{step}" / "unet" / "adapter_model.safetensors")
        assert adapters and all(torch.equal(v, sharded[k.replace(".weight", ".default.weight")])
                                for k, v in adapters.items()), step
    final = load_file(run / "pytorch_lora_weights.safetensors")
    assert final.keys() == {f"unet.{k}" for k in adapters}
    assert all(torch.equal(final[f"unet.{k}"], v) for k, v in adapters.items())
    assert_plain_names(run)
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    pipe.load_lora_weights(run)
    assert set(pipe.get_list_adapters()) == {"unet"}

    # Resumed from checkpoint-2 under FSDP: the same losses after it and the same LoRA, bitwise (without the
    # optimizer states made before the load, accelerate would resume with Adam's moments at zero).
    resumed.mkdir()
    shutil.copytree(run / "checkpoint-2", resumed / "checkpoint-2")
    launch_fsdp("train_lora.py", *args, "--output_dir", resumed, "--resume_from_checkpoint", "latest")
    reference, after = logged_losses(run), logged_losses(resumed)
    assert [after[s] for s in (3, 4)] == [reference[s] for s in (3, 4)]
    again = load_file(resumed / "pytorch_lora_weights.safetensors")
    assert not [k for k in final if not torch.equal(final[k], again[k])]

    # The FSDP checkpoint resumed without FSDP (one process): one line before anything loads, the folder as it was.
    before = sorted((p.relative_to(resumed), p.stat().st_mtime_ns) for p in resumed.rglob("*"))
    proc = launch("train_lora.py", *args, "--output_dir", resumed, "--resume_from_checkpoint", "checkpoint-2",
                  check=False)
    assert_one_line_error(proc, "checkpoint-2' was written by an FSDP run and cannot resume without FSDP",
                          "the accelerate config that wrote it")
    assert sorted((p.relative_to(resumed), p.stat().st_mtime_ns) for p in resumed.rglob("*")) == before


def test_flux_lora_under_fsdp_saves_what_fsdp_checkpointed(digits, tiny_flux, tmp_path):
    """A flow-matching family under FSDP: the Flux transformer's LoRA (packed latents, the guidance input) beside its
    frozen weights in the FSDP units, bf16; the saved LoRA is FSDP's own checkpointed adapter state, with plain names,
    and FluxPipeline loads it."""
    from diffusers import FluxPipeline

    run = tmp_path / "run"
    launch_fsdp("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_flux, *SD,
                "--rank", "4", "--mixed_precision", "bf16", "--max_sequence_length", "16", *VALIDATION, *STEPS,
                "--output_dir", run)
    assert_fsdp_ran(run)
    sharded = fsdp_weights(run / "checkpoint-4")
    adapters = load_file(run / "checkpoint-4" / "transformer" / "adapter_model.safetensors")
    assert adapters and all(torch.equal(v, sharded[k.replace(".weight", ".default.weight")])
                            for k, v in adapters.items())
    final = load_file(run / "pytorch_lora_weights.safetensors")
    assert all(torch.equal(final[f"transformer.{k}"], v) for k, v in adapters.items())
    assert_plain_names(run)
    pipe = FluxPipeline.from_pretrained(tiny_flux)
    pipe.load_lora_weights(run)
    assert set(pipe.get_list_adapters()) == {"transformer"}


def test_classifier_under_fsdp_saves_and_reloads_the_full_model(digits, tmp_path):
    from transformers import AutoModelForImageClassification

    run = tmp_path / "run"
    proc = launch_fsdp("train_classifier.py", "--train_data_dir", digits, "--max_train_samples", "64",
                       "--train_batch_size", "8", "--eval_batch_size", "64", *STEPS, "--output_dir", run)
    assert_fsdp_ran(run)
    assert "--channels_last left out" in proc.stderr  # FSDP's sharded checkpoints take contiguous weights only
    results = read_results(run)
    assert results["best_model_test_samples"] == results["test_samples"] > 0  # best_model/ loaded on every process
    model = AutoModelForImageClassification.from_pretrained(run)
    # BatchNorm statistics are buffers, kept per process under FSDP (DDP broadcasts them); the weights are shared.
    sharded, saved = fsdp_weights(run / "checkpoint-4"), dict(model.named_parameters())
    assert not [k for k in saved if not torch.equal(saved[k], sharded[k])]
    assert_plain_names(run)


def test_fsdp_helpers_match_unsharded_models():
    proc = launch_fsdp(FSDP_DIR / "clip_and_load.py")
    assert proc.stdout.strip().endswith("ok"), proc.stdout[-2000:]


def test_an_fsdp_config_on_cpu_processes_is_one_line(digits, tmp_path):
    """What users get on a CPU (no sitecustomize), through make's launcher: accelerate would train unsharded; the
    recipe says so instead, before anything is written."""
    cmd = launch_command("train_classifier.py", "--train_data_dir", digits, "--output_dir", tmp_path / "out",
                         config=CONFIG)
    cmd[1:3] = ["-m", "common.launch"]
    proc = subprocess.run(cmd, cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, "asks for FSDP, but accelerate applies FSDP only on GPUs", "cpu_2proc.yaml")
    assert not (tmp_path / "out").exists()


def test_fsdp_on_machines_without_a_shared_disk_is_one_line(digits, tmp_path):
    """FSDP writes each checkpoint in shards, one per process, that resume only where every process reads them all:
    two machines with a folder each stop at the start, every machine with one line, before anything is written."""
    import yaml

    config = yaml.safe_load(open(CONFIG))
    multi_node = yaml.safe_load(open(CONFIGS / "cpu_multi_node.yaml"))
    config.update({key: multi_node[key] for key in ("num_machines", "main_process_ip", "rdzv_backend", "same_network")})
    (tmp_path / "fsdp_two_machines.yaml").write_text(yaml.safe_dump(config))
    disks = [tmp_path / "machine0", tmp_path / "machine1"]
    nodes = launch_nodes("train_classifier.py", "--train_data_dir", digits, "--max_train_steps", "1",
                         config=tmp_path / "fsdp_two_machines.yaml", launcher="common", timeout=300,
                         node_args={rank: ["--output_dir", disk] for rank, disk in enumerate(disks)},
                         env=offline_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(FSDP_DIR)])))
    for node in nodes:
        assert_one_line_error(node, "is not on a filesystem all 2 machines share", "FSDP writes each checkpoint in "
                                    "shards", "give an --output_dir on a shared filesystem")
    assert not disks[0].exists() and not disks[1].exists()
