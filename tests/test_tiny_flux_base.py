"""The shipped tiny Flux.1-architecture base (assets/tiny-flux-digits, `make tiny-flux-base`): its files match their
checksums and load in FluxPipeline, its model card's numbers are its build's own measurement, it draws the prompted
digit, a short style LoRA on it learns the style (the files load back to the trained model's images), and a rebuild
with tiny step counts makes a checksummed folder whose damage is one line."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, assert_one_line_error, launch, offline_env, read_results, run_script

BASE = ROOT / "assets" / "tiny-flux-digits"
JUDGE = str(ROOT / "assets" / "digit-classifier")


def pipeline(path):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def draw(pipe, per_digit, style=False, **kwargs):
    from common.families import flux
    from demo.digit_eval import digit_prompts, generate

    prompts, labels = digit_prompts(per_digit, style=style)
    return generate(pipe, flux, prompts, flux.SAMPLE_GUIDANCE, flux.SAMPLE_STEPS, **kwargs), labels


def test_shipped_files_match_their_checksums_and_load():
    from common.base_models import CHECKSUMS, file_sha256

    listed = dict(reversed(line.split(maxsplit=1)) for line in (BASE / CHECKSUMS).read_text().splitlines())
    files = {str(p.relative_to(BASE)) for p in BASE.rglob("*") if p.is_file()}
    assert set(listed) == files - {CHECKSUMS, "README.md", "samples.png", "base_metrics.json"}
    assert all(file_sha256(BASE / name) == digest for name, digest in listed.items())
    assert sum((BASE / name).stat().st_size for name in files) < 10e6
    card = (BASE / "README.md").read_text()
    metrics = json.loads((BASE / "base_metrics.json").read_text())  # the build's own measurement, not typed
    assert metrics["accuracy"] >= 0.85 and f"**{metrics['accuracy']:.1%}**" in card and "make tiny-flux-base" in card
    assert f"{metrics['per_digit']}" in card and metrics["sampler"] == "euler" and metrics["guidance_scale"] == 3.5
    pipe = pipeline(BASE)
    assert pipe.tokenizer_2.model_max_length == 16 and not pipe.transformer.config.guidance_embeds


def test_the_base_draws_the_prompted_digit():
    # A smaller sample than the model card's (20 per digit): the base alone, sample.py's default settings.
    from demo.digit_eval import Judge, score

    images, labels = draw(pipeline(BASE), per_digit=2)
    result = score(images, labels, Judge(JUDGE))
    assert result["content"] >= 0.8, result
    assert result["style_rate"] == 0.0  # white on black: never the red-ink style


@pytest.fixture(scope="module")
def style_lora(tmp_path_factory):
    """A short style LoRA on the shipped base (the demo's settings, fewer steps) from the red-ink digits."""
    from demo.digits import write_digits

    data = tmp_path_factory.mktemp("data")
    write_digits(str(data / "digits"), styled_dir=str(data / "red"))
    out = data / "lora"
    launch("train_lora.py", "--pretrained_model_name_or_path", BASE, "--train_data_dir", data / "red",
           "--output_dir", out, "--cache_latents", "--learning_rate", "3e-3", "--train_batch_size", "16",
           "--max_train_steps", "100", "--caption_dropout_prob", "0.1", "--validation_prompt",
           "a handwritten digit three, red ink on paper", "--num_validation_images", "2", "--validation_split", "0.05",
           "--checkpointing_steps", "1000", "--report_to", "none")
    return out


def test_a_short_lora_changes_the_samples_and_loads_back(style_lora):
    """The saved LoRA (both files) draws the run's own validation images, which are not the base's."""
    from PIL import Image

    from common.families import flux

    step = read_results(style_lora)["global_step"]
    trained = np.stack([np.asarray(Image.open(style_lora / "samples" / f"step-{step}" / f"0-{j}.png")).astype(int)
                        for j in range(2)])

    def images(pipe):
        guidance = flux.guidance_kwargs(pipe.transformer.config, flux.SAMPLE_GUIDANCE, 2)[0]
        out = pipe(["a handwritten digit three, red ink on paper"] * 2, num_inference_steps=20, height=32, width=32,
                   max_sequence_length=16, generator=[torch.Generator().manual_seed(42 + j) for j in range(2)],
                   output_type="np", **guidance).images
        return (out * 255).round().astype(int)

    assert np.abs(images(pipeline(BASE)) - trained).max() > 40  # the LoRA changed the samples
    for weights in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ui.safetensors"):
        pipe = pipeline(BASE)
        pipe.load_lora_weights(style_lora, weight_name=weights)
        assert np.abs(images(pipe) - trained).max() <= 2, weights
    losses = read_results(style_lora)["validation_losses"]
    assert losses[str(step)] < losses["0"], losses  # the held-out red-ink digits: better than the base alone


def test_the_style_report_measures_the_flux_lora(style_lora):
    proc = subprocess.run([sys.executable, "-m", "demo.style_report", "--lora", style_lora, "--per_digit", "1"],
                          cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = read_results(style_lora)
    assert results["style_eval"]["sampler"] == "euler" and results["style_rate_without_lora"] <= 0.1
    assert results["style_rate"] > results["style_rate_without_lora"], results


def test_rebuild_with_tiny_step_counts_and_damage_is_refused(digits, tmp_path):
    """`make tiny-flux-base`'s three commands with tiny step counts: a complete, checksummed FluxPipeline folder;
    a changed file and a missing component of it are one line each, with nothing written."""
    work, shipped = tmp_path / "work", tmp_path / "shipped"
    env = offline_env()
    init = subprocess.run([sys.executable, "-m", "demo.tiny_flux_base", "init", "--output_dir", work / "init"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert init.returncode == 0, init.stderr[-3000:]
    config = json.loads((work / "init" / "transformer_config.json").read_text())
    assert config["in_channels"] == 16 and config["guidance_embeds"] is False
    fit = run_script("train_text_to_image.py", "--pretrained_model_name_or_path", work / "init", "--transformer_config",
                     work / "init" / "transformer_config.json", "--train_data_dir", digits, "--caption_column",
                     "captions", "--max_train_samples", "32", "--train_batch_size", "8", "--max_train_steps", "2",
                     "--use_ema", "--report_to", "none", "--output_dir", work / "transformer")
    assert fit.returncode == 0, fit.stderr[-3000:]
    finish = subprocess.run([sys.executable, "-m", "demo.tiny_flux_base", "finish", "--model", work / "transformer",
                             "--output_dir", shipped, "--per_digit", "1", "--min_accuracy", "0", "--commands",
                             "one ;; two"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert finish.returncode == 0, finish.stderr[-3000:]
    card = (shipped / "README.md").read_text()  # the commands, and the call sample.py reads its defaults from
    assert "one\ntwo" in card and 'true_cfg_scale=3.5, negative_prompt=""' in " ".join(card.split())
    pipeline(shipped)  # loads
    out = tmp_path / "lora"
    args = ["--pretrained_model_name_or_path", shipped, "--train_data_dir", digits, "--output_dir", out]
    config_file = shipped / "transformer" / "config.json"
    config_file.write_text(config_file.read_text().replace("\n", "\n "))
    assert_one_line_error(run_script("train_lora.py", *args), "transformer/config.json has changed",
                          "checksums.sha256")
    shutil.rmtree(shipped / "text_encoder_2")
    assert_one_line_error(run_script("sample.py", "--model", shipped, "--prompt", "x", "--output_dir", out),
                          "is missing")
    assert not out.exists()
