"""train_text_to_image.py end to end on the tiny random-init SD (real `accelerate launch` runs)."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, assert_one_line_error, launch, logged_losses, offline_env, read_results, run_script
from safetensors.torch import load_file

TINY = ["--max_train_samples", "64", "--train_batch_size", "8", "--max_train_steps", "12", "--checkpointing_steps", "6",
        "--learning_rate", "1e-3", "--caption_column", "captions", "--caption_dropout_prob", "0.2", "--random_flip",
        "--use_ema", "--ema_max_decay", "0.9", "--snr_gamma", "5", "--logging_steps", "1", "--validation_prompt",
        "a handwritten digit seven", "--validation_steps", "6", "--num_validation_images", "1",
        "--validation_inference_steps", "2"]
WEIGHTS = "diffusion_pytorch_model.safetensors"


def t2i_args(digits, base, out, *extra):
    return ["--train_data_dir", digits, "--pretrained_model_name_or_path", base, "--output_dir", out, *TINY, *extra]


@pytest.fixture(scope="module")
def trained(digits, tiny_sd, tmp_path_factory):
    out = tmp_path_factory.mktemp("t2i") / "run"
    launch("train_text_to_image.py", *t2i_args(digits, tiny_sd, out, "--cache_latents", "--prediction_type",
                                               "v_prediction"))
    return out


def test_outputs_a_pipeline_with_the_ema_unet(trained, tiny_sd):
    from diffusers import StableDiffusionPipeline

    results = read_results(trained)
    assert results["global_step"] == 12 and results["trainable_parameters"] > 100_000
    pipe = StableDiffusionPipeline.from_pretrained(trained)
    assert pipe.scheduler.config.prediction_type == "v_prediction"  # the trained target travels with the model
    exported = load_file(trained / "unet" / WEIGHTS)
    ema = load_file(trained / "checkpoint-12" / "unet_ema" / WEIGHTS)
    raw = load_file(trained / "checkpoint-12" / "unet" / WEIGHTS)
    base = load_file(tiny_sd / "unet" / WEIGHTS)
    assert all(torch.equal(exported[k], ema[k]) for k in exported)  # the EMA is what gets exported
    assert any(not torch.equal(exported[k], raw[k]) for k in exported)
    assert any(not torch.equal(raw[k], base[k]) for k in raw)  # and the UNet did train
    frozen = load_file(trained / "text_encoder" / "model.safetensors")
    assert all(torch.equal(frozen[k], v) for k, v in load_file(tiny_sd / "text_encoder" / "model.safetensors").items())
    assert (trained / "samples" / "step-12" / "0-0.png").is_file() and (trained / "README.md").is_file()


def test_the_card_code_draws_what_sample_py_draws(trained, tmp_path, monkeypatch):
    """The output's README.md, run as printed (the trained v-prediction travels in its scheduler config)."""
    from test_snippets import card_draws_what_sample_py_draws

    code = card_draws_what_sample_py_draws(trained, tmp_path, monkeypatch)
    assert f'StableDiffusionPipeline.from_pretrained("{trained}")' in code and "height=32, width=32" in code


def test_resume_matches_the_uninterrupted_run(trained, digits, tiny_sd, tmp_path):
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(trained / "checkpoint-6", out / "checkpoint-6")
    launch("train_text_to_image.py", *t2i_args(digits, tiny_sd, out, "--cache_latents", "--prediction_type",
                                               "v_prediction", "--resume_from_checkpoint", "latest"))
    reference, resumed = logged_losses(trained), logged_losses(out)
    assert [resumed[s] for s in range(7, 13)] == [reference[s] for s in range(7, 13)]
    for folder in ("unet", "checkpoint-12/unet_ema"):
        a, b = load_file(trained / folder / WEIGHTS), load_file(out / folder / WEIGHTS)
        assert all(torch.equal(a[k], b[k]) for k in a), folder


def test_bad_input_is_one_line_and_writes_nothing(trained, digits, tiny_sd, tmp_path):
    out = tmp_path / "out"
    args = ["--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sd, "--output_dir", out,
            "--max_train_steps", "1"]
    assert_one_line_error(run_script("train_text_to_image.py", *args, "--caption_column", "caption"),
                          "--caption_column 'caption' is not a column")
    config = json.loads((tiny_sd / "unet" / "config.json").read_text())
    (tmp_path / "wide.json").write_text(json.dumps({**config, "cross_attention_dim": 768}))
    assert_one_line_error(run_script("train_text_to_image.py", *args, "--unet_config", tmp_path / "wide.json"),
                          "--unet_config: cross_attention_dim is 768", "hidden size", "is 32")
    (tmp_path / "broken.json").write_text("{")
    assert_one_line_error(run_script("train_text_to_image.py", *args, "--unet_config", tmp_path / "broken.json"),
                          "--unet_config:", "is not a json config")
    assert_one_line_error(run_script("train_text_to_image.py", *args, "--pretrained_model_name_or_path", digits),
                          "is not a pipeline folder")
    assert not out.exists()
    out.mkdir()
    shutil.copytree(trained / "checkpoint-6", out / "checkpoint-6")
    assert_one_line_error(run_script("train_text_to_image.py", *args, "--resume_from_checkpoint", "latest"),
                          "holds an EMA of the weights")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6"]


def test_help_imports_no_torch():
    # --help answers at once: nothing at module level may import torch (seconds on a CPU machine).
    code = "import sys, train_text_to_image; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=offline_env(), capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout[-500:] + proc.stderr[-2000:]
    assert "--unet_config" in run_script("train_text_to_image.py", "--help").stdout
