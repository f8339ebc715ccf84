"""Several machines, tried on one: two `accelerate launch` of one CPU process each (machine_rank 0 and 1) meet over
127.0.0.1 (accelerate_configs/cpu_multi_node.yaml: static rendezvous, gloo), as on two real machines that share the
output folder's disk. Each training script finishes on both; a checkpoint of two machines resumes on one machine of
two processes (cpu_2proc.yaml) bitwise as if never stopped; a machine that never comes is one error line."""
import json
import shutil
import subprocess

import pytest
import torch
from conftest import (
    CONFIGS,
    ROOT,
    assert_one_line_error,
    free_port,
    launch,
    launch_nodes,
    logged_losses,
    offline_env,
    read_results,
)
from safetensors.torch import load_file

STEPS = ["--max_train_steps", "4", "--checkpointing_steps", "2", "--logging_steps", "1"]
SD = ["--max_train_samples", "16", "--train_batch_size", "4", "--cache_latents", "--validation_prompt",
      "a handwritten digit seven", "--validation_steps", "2", "--num_validation_images", "1",
      "--validation_inference_steps", "1"]
RUNS = {  # the tiniest settings of each script, and the file that holds its trained weights
    "train_classifier.py": (["--max_train_samples", "64", "--train_batch_size", "8", "--eval_batch_size", "64"],
                            "model.safetensors"),
    "train_ddpm.py": (["--resolution", "8", "--block_out_channels", "16,32", "--max_train_samples", "32",
                       "--train_batch_size", "8", "--ddpm_num_steps", "100", "--validation_steps", "2",
                       "--num_validation_images", "1", "--validation_inference_steps", "1"],
                      "unet/diffusion_pytorch_model.safetensors"),
    "train_lora.py": ([*SD, "--rank", "4"], "pytorch_lora_weights.safetensors"),
    "train_text_to_image.py": (SD, "unet/diffusion_pytorch_model.safetensors"),
}


def run_args(script, digits, tiny_sd, out):
    args, _ = RUNS[script]
    base = ["--pretrained_model_name_or_path", tiny_sd] if "--cache_latents" in args else []
    return ["--train_data_dir", digits, *base, "--output_dir", out, *args, *STEPS]


def assert_both_finished(nodes):
    for rank, proc in enumerate(nodes):
        assert proc.returncode == 0, f"machine {rank} exited {proc.returncode}\n{proc.stderr[-4000:]}"


def assert_two_machines_ran(nodes, out, weights):
    assert_both_finished(nodes)
    results = read_results(out)
    assert results["num_processes"] == 2 and results["global_step"] == 4
    assert (out / weights).is_file()
    # Every process saved its own RNG state into the checkpoint; only machine 0 (the main process) wrote and logged
    # the outputs.
    assert sorted(p.name for p in (out / "checkpoint-2").glob("random_states_*")) == [
        "random_states_0.pkl", "random_states_1.pkl"]
    assert "saved to" in nodes[0].stderr and "saved to" not in nodes[1].stderr


# What else each script's two-process run checks (the two machines are its two processes: DDP over gloo as with
# cpu_2proc.yaml): its less common settings, and that their outputs load.
EXTRA = {
    "train_ddpm.py": ["--prediction_type", "v_prediction"],  # unconditional: no --class_column
    "train_lora.py": ["--snr_gamma", "5", "--noise_offset", "0.05", "--prediction_type", "v_prediction", "--use_dora",
                      "--gradient_checkpointing", "--use_ema", "--offload_ema"],
    "train_text_to_image.py": ["--use_ema"],  # and a UNet from --unet_config, below
}


# train_classifier.py: in the resume test below.
@pytest.mark.parametrize("script", ["train_ddpm.py", "train_lora.py", "train_text_to_image.py"])
def test_two_machines_on_loopback(script, digits, tiny_sd, tmp_path):
    out, extra = tmp_path / "out", list(EXTRA[script])
    if script == "train_text_to_image.py":  # a smaller UNet than the base's, trained from scratch
        config = json.loads((tiny_sd / "unet" / "config.json").read_text())
        (tmp_path / "unet.json").write_text(json.dumps({**config, "block_out_channels": [16, 32],
                                                        "norm_num_groups": 8}))
        extra += ["--unet_config", tmp_path / "unet.json"]
    nodes = launch_nodes(script, *run_args(script, digits, tiny_sd, out), *extra, "--report_to", "none")
    assert_two_machines_ran(nodes, out, RUNS[script][1])
    if script == "train_ddpm.py":
        from diffusers import DDPMPipeline

        assert not (out / "labels.json").exists() and (out / "samples/step-4.png").exists()
        pipe = DDPMPipeline.from_pretrained(out)
        image = pipe(batch_size=1, num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
        assert image.size == (8, 8)
    elif script == "train_lora.py":
        info = json.loads((out / "lora_info.json").read_text())
        assert info["use_dora"] and info["prediction_type"] == "v_prediction"
        assert (out / "checkpoint-2" / "unet" / "adapter_model.safetensors").is_file()
        # the EMA of the LoRA weights (kept on the CPU) is what is exported, the trained weights in raw/
        ema, exported = load_file(out / "checkpoint-4" / "lora_ema.safetensors"), load_file(out / RUNS[script][1])
        raw = load_file(out / "raw" / RUNS[script][1])
        ema = {k.replace(".default.weight", "").replace(".default", ""): v for k, v in ema.items()}  # peft's names
        assert ema.keys() == {k.removesuffix(".weight") for k in exported} and info["ema_weights"]
        assert all(torch.equal(v, ema[k.removesuffix(".weight")]) for k, v in exported.items())
        assert any(not torch.equal(exported[k], raw[k]) for k in raw)
    else:
        assert json.loads((out / "unet" / "config.json").read_text())["block_out_channels"] == [16, 32]
        assert (out / "checkpoint-2" / "unet_ema" / "config.json").is_file()


def test_a_two_machine_checkpoint_resumes_exactly_on_one_machine(digits, tiny_sd, tmp_path):
    """Stopped at checkpoint-2 of 4 and resumed with two processes on one machine, the run ends bitwise as the
    two-machine one did: the same losses after the checkpoint and the same weights (the machines computed what one
    machine's processes compute)."""
    script, weights = "train_classifier.py", RUNS["train_classifier.py"][1]
    machines, resumed = tmp_path / "machines", tmp_path / "resumed"
    assert_two_machines_ran(launch_nodes(script, *run_args(script, digits, tiny_sd, machines)), machines, weights)
    resumed.mkdir()
    shutil.copytree(machines / "checkpoint-2", resumed / "checkpoint-2")
    launch(script, *run_args(script, digits, tiny_sd, resumed), "--resume_from_checkpoint", "latest",
           config="cpu_2proc.yaml")
    reference, after = logged_losses(machines), logged_losses(resumed)
    assert [after[s] for s in (3, 4)] == [reference[s] for s in (3, 4)]
    a, b = load_file(machines / weights), load_file(resumed / weights)
    assert not [k for k in a if not (a[k] == b[k]).all()]


def test_a_machine_that_never_comes_is_one_line_not_a_hang(digits, tmp_path):
    """Through make (common/launch.py) the main machine waits --ddp_timeout seconds for the other, then says which
    command to start where; the other machine alone says it cannot reach the main one."""
    port, other_port = free_port(), free_port()
    while other_port == port:
        other_port = free_port()
    make = ["make", "--no-print-directory", "-o", ".venv/.installed", "-o", "data/digits/train/metadata.jsonl",
            "train-classifier", "CONFIG=accelerate_configs/cpu_multi_node.yaml", f"OUTPUT={tmp_path / 'out'}",
            f"ARGS=--train_data_dir {digits} --ddp_timeout 3"]
    main, other = [subprocess.Popen(cmd, cwd=ROOT, env=offline_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
                   for cmd in ([*make, "MACHINE_RANK=0", "MAIN_IP=127.0.0.1", f"MAIN_PORT={port}"],  # alone
                               [*make, "MACHINE_RANK=1", f"MAIN_PORT={other_port}"])]  # no main machine there
    procs = []
    for proc in (main, other):
        stdout, stderr = proc.communicate(timeout=120)
        procs.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert_one_line_error(procs[0], f"no answer from the other machine(s) at 127.0.0.1:{port} within 3 s",
                          "--machine_rank 1")
    assert_one_line_error(procs[1], "could not reach the main machine at 127.0.0.1:", "within 3 s",
                          "--machine_rank 0")
    assert not (tmp_path / "out").exists()
    assert (CONFIGS / "multi_node.yaml").read_text().count("--machine_rank") >= 2  # the commands for each machine
