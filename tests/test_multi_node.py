"""Several machines, tried on one: two `accelerate launch` of one CPU process each (machine_rank 0 and 1) meet over
127.0.0.1 (accelerate_configs/cpu_multi_node.yaml: static rendezvous, gloo). With a folder per machine, as on machines
that share no disk, each training script finishes, keeps a copy of every checkpoint on each machine and resumes from
them bitwise as if never stopped; a machine without a checkpoint, or with other data, is one error line. With one
folder on a disk both share, a checkpoint of two machines resumes on one machine of two processes (cpu_2proc.yaml)
bitwise as if never stopped; a machine that never comes is one error line."""
import json
import shutil
import subprocess

import pytest
import torch
from conftest import (
    CONFIGS,
    MAKE,
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
    assert "not on a filesystem" not in nodes[0].stderr  # found shared: the main process wrote everything


def own_disks(disks):
    """node_args giving each machine its own output folder, as on machines that share no disk."""
    return {rank: ["--output_dir", disk] for rank, disk in enumerate(disks)}


def assert_a_copy_on_each_disk(nodes, disks, steps, weights):
    """Each machine's folder holds a complete copy of every checkpoint, with the RNG states of its own processes;
    the trained model, results and logs are on the main machine's disk only."""
    assert_both_finished(nodes)
    assert "not on a filesystem the 2 machines share" in nodes[0].stderr
    results = read_results(disks[0])
    assert results["num_processes"] == 2 and results["global_step"] == 4
    assert (disks[0] / weights).is_file() and (disks[0] / "logs").is_dir()
    assert not (disks[1] / weights).exists() and not (disks[1] / "logs").exists()
    assert not (disks[1] / "all_results.json").exists()
    for rank, disk in enumerate(disks):
        assert sorted(p.name for p in disk.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in steps], rank
        assert not list(disk.glob(".shared-folder-check*"))  # the check's own files, removed
    for step in steps:
        main, other = [{str(p.relative_to(folder)) for p in folder.rglob("*")}
                       for folder in (disk / f"checkpoint-{step}" for disk in disks)]
        assert {f for f in main if "random_states" in f} == {"random_states_0.pkl"}
        assert {f for f in other if "random_states" in f} == {"random_states_1.pkl"}
        assert main - {"random_states_0.pkl"} == other - {"random_states_1.pkl"}, step


# What else each script's two-process run checks (the two machines are its two processes: DDP over gloo as with
# cpu_2proc.yaml): its less common settings, and that their outputs load.
EXTRA = {
    "train_ddpm.py": ["--prediction_type", "v_prediction"],  # unconditional: no --class_column
    "train_lora.py": ["--snr_gamma", "5", "--noise_offset", "0.05", "--prediction_type", "v_prediction", "--use_dora",
                      "--gradient_checkpointing", "--use_ema", "--offload_ema"],
    "train_text_to_image.py": ["--use_ema"],  # and a UNet from --unet_config, below
}


# train_classifier.py: in the tests below.
@pytest.mark.parametrize("script", ["train_ddpm.py", "train_lora.py", "train_text_to_image.py"])
def test_two_machines_without_a_shared_disk_finish_and_resume_exactly(script, digits, tiny_sd, tmp_path):
    """Each machine its own output folder, as on machines that share no disk: a run of 4 steps, then `latest` from
    checkpoint-2 (the newest checkpoint both machines hold: the other machine lost checkpoint-4), each machine from
    its own copy; the resumed run ends bitwise as the first one."""
    disks, extra, weights = [tmp_path / "machine0", tmp_path / "machine1"], list(EXTRA[script]), RUNS[script][1]
    if script == "train_text_to_image.py":  # a smaller UNet than the base's, trained from scratch
        config = json.loads((tiny_sd / "unet" / "config.json").read_text())
        (tmp_path / "unet.json").write_text(json.dumps({**config, "block_out_channels": [16, 32],
                                                        "norm_num_groups": 8}))
        extra += ["--unet_config", tmp_path / "unet.json"]
    args = [*run_args(script, digits, tiny_sd, disks[0]), *extra]
    nodes = launch_nodes(script, *args, node_args=own_disks(disks), timeout=300)
    assert_a_copy_on_each_disk(nodes, disks, [2, 4], weights)
    reference, trained = logged_losses(disks[0]), load_file(disks[0] / weights)
    shutil.rmtree(disks[1] / "checkpoint-4")
    nodes = launch_nodes(script, *args, "--resume_from_checkpoint", "latest", node_args=own_disks(disks), timeout=300)
    assert_a_copy_on_each_disk(nodes, disks, [2, 4], weights)
    assert "resumed from" in nodes[0].stderr and "checkpoint-2 at step 2" in nodes[0].stderr
    after, resumed = logged_losses(disks[0]), load_file(disks[0] / weights)
    assert [after[s] for s in (3, 4)] == [reference[s] for s in (3, 4)]
    assert not [k for k in trained if not torch.equal(trained[k], resumed[k])]

    out = disks[0]  # what each script's run checks besides
    if script == "train_ddpm.py":
        from diffusers import DDPMPipeline

        assert not (out / "labels.json").exists() and (out / "samples/step-4.png").exists()
        pipe = DDPMPipeline.from_pretrained(out)
        image = pipe(batch_size=1, num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
        assert image.size == (8, 8)
    elif script == "train_lora.py":
        info = json.loads((out / "lora_info.json").read_text())
        assert info["use_dora"] and info["prediction_type"] == "v_prediction"
        for disk in disks:
            assert (disk / "checkpoint-2" / "unet" / "adapter_model.safetensors").is_file()
            assert json.loads((disk / "checkpoint-2" / "lora_info.json").read_text()) == info
        # the EMA of the LoRA weights (kept on the CPU) is what is exported, the trained weights in raw/
        ema, exported = load_file(out / "checkpoint-4" / "lora_ema.safetensors"), load_file(out / weights)
        raw = load_file(out / "raw" / weights)
        ema = {k.replace(".default.weight", "").replace(".default", ""): v for k, v in ema.items()}  # peft's names
        assert ema.keys() == {k.removesuffix(".weight") for k in exported} and info["ema_weights"]
        assert all(torch.equal(v, ema[k.removesuffix(".weight")]) for k, v in exported.items())
        assert any(not torch.equal(exported[k], raw[k]) for k in raw)
    else:
        assert json.loads((out / "unet" / "config.json").read_text())["block_out_channels"] == [16, 32]
        for disk in disks:
            assert (disk / "checkpoint-2" / "unet_ema" / "config.json").is_file()


def test_the_classifier_without_a_shared_disk_evaluates_its_best_model_and_resumes_exactly(digits, tiny_sd, tmp_path):
    """Each machine its own output folder (no shared disk). The run's end reads best_model/ back: only the main
    machine's disk holds it (the main process sends it to the others). `latest` resumes every process from the
    newest checkpoint all machines hold (here the main machine lost checkpoint-4), each from its own copy, and the
    resumed run ends bitwise as the first one; a machine that holds no checkpoint at all is one line, not a run from
    step 0 beside the others' resumed one."""
    script, weights = "train_classifier.py", RUNS["train_classifier.py"][1]
    disks = [tmp_path / "machine0", tmp_path / "machine1"]
    args = run_args(script, digits, tiny_sd, disks[0])
    nodes = launch_nodes(script, *args, node_args=own_disks(disks), timeout=300)
    assert_a_copy_on_each_disk(nodes, disks, [2, 4], weights)
    first = read_results(disks[0])
    assert first["best_model_test_accuracy"] is not None and (disks[0] / "best_model").is_dir()
    reference, trained = logged_losses(disks[0]), load_file(disks[0] / weights)

    shutil.rmtree(disks[0] / "checkpoint-4")  # a save cut short on the main machine: checkpoint-2 is everywhere
    nodes = launch_nodes(script, *args, "--resume_from_checkpoint", "latest", node_args=own_disks(disks), timeout=300)
    assert_a_copy_on_each_disk(nodes, disks, [2, 4], weights)
    assert "resuming from checkpoint-2, the newest checkpoint every process finds" in nodes[0].stderr
    after = logged_losses(disks[0])
    assert [after[s] for s in (3, 4)] == [reference[s] for s in (3, 4)]
    resumed = load_file(disks[0] / weights)
    assert not [k for k in trained if not torch.equal(trained[k], resumed[k])]
    assert read_results(disks[0])["best_model_test_accuracy"] == first["best_model_test_accuracy"]

    for checkpoint in disks[1].glob("checkpoint-*"):  # a machine whose disk was wiped
        shutil.rmtree(checkpoint)
    nodes = launch_nodes(script, *args, "--resume_from_checkpoint", "latest", node_args=own_disks(disks), timeout=300,
                         launcher="common")  # as make runs it: the script's error line is the last word
    for node in nodes:  # every machine says it
        assert_one_line_error(node, "--resume_from_checkpoint latest: no checkpoint is in every machine's",
                              f"process 1 finds none in '{disks[1]}'", "copy checkpoint-4 into each machine's")


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


def test_machines_whose_data_differ_stop_with_one_line_not_a_hang(digits, tiny_sd, tmp_path):
    """Each machine reads its own copy of the data: a copy that differs (here a data flag given on one machine only)
    would give the machines other step counts, and the run would wait forever where one of them skips a collective.
    Every machine says what differs, on its own output."""
    script = "train_ddpm.py"
    nodes = launch_nodes(script, *run_args(script, digits, tiny_sd, tmp_path / "out"), timeout=300, launcher="common",
                         node_args={1: ["--max_train_samples", "24"]})
    for node in nodes:
        assert_one_line_error(node, "the processes do not read the same data (32 training images on process 0, 24 "
                                    "on process 1; 4 batches on process 0, 3 on process 1)")
    assert not (tmp_path / "out").exists()


def test_a_machine_that_never_comes_is_one_line_not_a_hang(digits, tmp_path):
    """Through make (common/launch.py) the main machine waits --ddp_timeout seconds for the other, then says which
    command to start where; the other machine alone says it cannot reach the main one."""
    port, other_port = free_port(), free_port()
    while other_port == port:
        other_port = free_port()
    make = [*MAKE, "train-classifier", "CONFIG=accelerate_configs/cpu_multi_node.yaml", f"OUTPUT={tmp_path / 'out'}",
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


