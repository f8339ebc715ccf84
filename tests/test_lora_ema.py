"""train_lora.py --use_ema: an EMA of the LoRA weights, exported in their place (runs on the tiny random-init SD)."""
import json
import shutil

import pytest
import torch
from conftest import assert_one_line_error, launch, logged_losses, read_results, run_script
from safetensors.torch import load_file

STEPS = 4
EMA = ["--max_train_samples", "32", "--train_batch_size", "8", "--max_train_steps", str(STEPS),
       "--checkpointing_steps", "1", "--rank", "4", "--lora_alpha", "8", "--learning_rate", "1e-2",
       "--train_text_encoder", "--logging_steps", "1", "--cache_latents",
       "--validation_prompt", "a handwritten digit seven", "--validation_steps", "100", "--num_validation_images", "1",
       "--validation_inference_steps", "2", "--use_ema", "--ema_max_decay", "0.9"]
LORA = "pytorch_lora_weights.safetensors"
KOHYA = "pytorch_lora_weights_ui.safetensors"


def ema_args(digits, tiny_sd, out, *extra):
    return ["--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sd, "--output_dir", out, *EMA, *extra]


@pytest.fixture(scope="module")
def ema_run(digits, tiny_sd, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_ema") / "run"
    launch("train_lora.py", *ema_args(digits, tiny_sd, out))
    return out


def common_name(key):
    """A LoRA weight's name in any of the files (peft's, the parameter's with `.default`, diffusers' export of the text
    encoder with CLIP's `text_model.` level and its own lora_linear_layer names) -> one form."""
    key = key.replace(".default", "").replace("text_encoder.text_model.", "text_encoder.")
    return key.replace("lora_linear_layer.down", "lora_A").replace("lora_linear_layer.up", "lora_B")


def named(weights, prefix=""):
    return {common_name(prefix + key): value for key, value in weights.items()}


def raw_at(checkpoint):
    """The trained (raw) LoRA weights a checkpoint holds, for resuming: unet/ and text_encoder/ adapters."""
    return {**named(load_file(checkpoint / "unet" / "adapter_model.safetensors"), "unet."),
            **named(load_file(checkpoint / "text_encoder" / "adapter_model.safetensors"), "text_encoder.")}


def test_the_ema_is_exported_and_the_raw_weights_beside_it(ema_run):
    ema = named(load_file(ema_run / f"checkpoint-{STEPS}" / "lora_ema.safetensors"))
    exported, raw = named(load_file(ema_run / LORA)), named(load_file(ema_run / "raw" / LORA))
    assert exported.keys() == raw.keys() == ema.keys() == raw_at(ema_run / f"checkpoint-{STEPS}").keys()
    assert all(torch.equal(exported[k], ema[k]) for k in ema)  # the EMA is what gets exported
    assert all(torch.equal(raw[k], v) for k, v in raw_at(ema_run / f"checkpoint-{STEPS}").items())
    assert any(not torch.equal(exported[k], raw[k]) for k in raw)
    # The EMA by hand from each step's raw weights: warm-up decay 1 - (1 + (step - 1)) ** -0.75, at most 0.9
    # (0 at step 1: the EMA starts as the raw weights).
    state = json.loads((ema_run / f"checkpoint-{STEPS}" / "lora_ema.json").read_text())
    assert state["optimization_step"] == STEPS and state["decay"] == 0.9 and state["use_ema_warmup"] is True
    expected = None
    for step in range(1, STEPS + 1):
        weights = raw_at(ema_run / f"checkpoint-{step}")
        decay = min(1 - (1 + (step - 1)) ** -0.75, 0.9) if step > 1 else 0.0
        expected = weights if expected is None else {k: v - (1 - decay) * (v - weights[k]) for k, v in expected.items()}
    assert max((expected[k] - ema[k]).abs().max().item() for k in ema) < 1e-6
    info = json.loads((ema_run / "lora_info.json").read_text())
    assert info["ema_weights"] is True and json.loads((ema_run / "raw" / "lora_info.json").read_text())[
        "ema_weights"] is False
    assert "the EMA of the trained ones" in (ema_run / "README.md").read_text()
    assert (ema_run / "raw" / KOHYA).is_file() and (ema_run / "samples" / f"step-{STEPS}" / "0-0.png").is_file()
    decays = logged_losses(ema_run, "ema_decay")
    assert decays[1] == 0.0 and decays[STEPS] == pytest.approx(1 - STEPS ** -0.75)


def test_load_lora_weights_loads_both_folders(ema_run, tiny_sd):
    from diffusers import StableDiffusionPipeline

    g = torch.Generator().manual_seed(0)
    x, hidden = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 77, 32, generator=g)
    outputs = []
    for folder in (ema_run, ema_run / "raw"):
        pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
        pipe.load_lora_weights(folder)
        with torch.no_grad():
            outputs.append(pipe.unet(x, torch.tensor([500]), hidden).sample)
    assert (outputs[0] - outputs[1]).abs().max() > 1e-6  # two different LoRAs


def test_resume_matches_the_uninterrupted_run(ema_run, digits, tiny_sd, tmp_path):
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(ema_run / "checkpoint-2", out / "checkpoint-2")
    # --offload_ema changes where the EMA waits between updates, not its values
    launch("train_lora.py", *ema_args(digits, tiny_sd, out, "--resume_from_checkpoint", "latest", "--offload_ema"))
    assert read_results(out)["global_step"] == STEPS
    assert (out / f"checkpoint-{STEPS}" / "lora_ema.safetensors").read_bytes() == (
        ema_run / f"checkpoint-{STEPS}" / "lora_ema.safetensors").read_bytes()
    for name in (LORA, KOHYA, f"raw/{LORA}"):  # bitwise (their headers name the output folder)
        a, b = load_file(ema_run / name), load_file(out / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    image = f"samples/step-{STEPS}/0-0.png"
    assert (out / image).read_bytes() == (ema_run / image).read_bytes()
    assert (json.loads((out / f"checkpoint-{STEPS}" / "lora_ema.json").read_text())
            == json.loads((ema_run / f"checkpoint-{STEPS}" / "lora_ema.json").read_text()))


def test_ema_mismatch_on_resume_is_one_line_and_writes_nothing(ema_run, digits, tiny_sd, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(ema_run / "checkpoint-2", out / "checkpoint-2")
    args = [a for a in ema_args(digits, tiny_sd, out, "--resume_from_checkpoint", "latest") if a != "--use_ema"]
    assert_one_line_error(run_script("train_lora.py", *args), "holds an EMA of the weights", "--use_ema")
    assert_one_line_error(run_script("train_lora.py", *args, "--use_ema", "--ema_power", "0.5"),
                          "--ema_power 0.75 (now 0.5)")
    assert_one_line_error(run_script("train_lora.py", *args, "--offload_ema"), "--offload_ema", "--use_ema")
    (out / "checkpoint-2" / "lora_ema.json").unlink()  # as if trained without --use_ema
    (out / "checkpoint-2" / "lora_ema.safetensors").unlink()
    assert_one_line_error(run_script("train_lora.py", *args, "--use_ema"), "has no lora_ema.json")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]
    assert sorted(p.name for p in (out / "checkpoint-2").iterdir()) == sorted(
        p.name for p in (ema_run / "checkpoint-2").iterdir() if not p.name.startswith("lora_ema"))
