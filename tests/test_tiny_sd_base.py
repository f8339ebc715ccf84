"""The shipped tiny digits base (assets/tiny-sd-digits): its files, what it draws, its rebuild, and a style LoRA
trained on it that must really learn the style (real `accelerate launch` runs)."""
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, assert_one_line_error, launch, offline_env, read_results, run_in_process, run_script

BASE = ROOT / "assets" / "tiny-sd-digits"
JUDGE = ROOT / "assets" / "digit-classifier"
STYLE_TARGETS = "to_k,to_q,to_v,to_out.0,proj_in,proj_out,ff.net.0.proj,ff.net.2,conv1,conv2,conv_shortcut,conv_in," \
                "conv_out,time_emb_proj"


def pipeline(path):
    from diffusers import StableDiffusionPipeline

    from common.diffusion import sampling_scheduler
    from common.families import sd

    pipe = StableDiffusionPipeline.from_pretrained(path)
    pipe.scheduler = sampling_scheduler(sd.SAMPLER, pipe.scheduler.config, sd.SAMPLERS)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def draw(pipe, per_digit, style=False, **kwargs):
    from common.families import sd
    from demo.digit_eval import digit_prompts, generate

    prompts, labels = digit_prompts(per_digit, style=style)
    return generate(pipe, sd, prompts, sd.SAMPLE_GUIDANCE, sd.SAMPLE_STEPS, **kwargs), labels


def test_shipped_files_match_their_checksums_and_load():
    from common.base_models import CHECKSUMS, file_sha256

    listed = dict(reversed(line.split(maxsplit=1)) for line in (BASE / CHECKSUMS).read_text().splitlines())
    files = {str(p.relative_to(BASE)) for p in BASE.rglob("*") if p.is_file()}
    assert set(listed) == files - {CHECKSUMS, "README.md", "samples.png", "base_metrics.json"}
    assert all(file_sha256(BASE / name) == digest for name, digest in listed.items())
    assert sum((BASE / name).stat().st_size for name in files) < 10e6
    card = (BASE / "README.md").read_text()
    metrics = json.loads((BASE / "base_metrics.json").read_text())
    assert metrics["accuracy"] >= 0.9 and f"{metrics['accuracy']:.1%}" in card and "make tiny-sd-base" in card


def test_the_base_draws_the_prompted_digit():
    # A smaller sample than the model card's (20 per digit): the base alone, sample.py's default settings.
    from demo.digit_eval import Judge, score

    images, labels = draw(pipeline(BASE), per_digit=3)
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
    proc = launch("train_lora.py", "--train_data_dir", data / "red", "--output_dir", out, "--cache_latents",
           "--learning_rate", "3e-3", "--train_batch_size", "16", "--max_train_steps", "150",
           "--caption_dropout_prob", "0.1", "--target_modules",
           STYLE_TARGETS, "--validation_prompt", "a handwritten digit three, red ink on paper",
           "--num_validation_images", "4", "--validation_split", "0.05", "--checkpointing_steps", "1000",
           "--report_to", "none", fresh=True)  # (a new interpreter: what its imports print is checked below)
    (data / "stderr.txt").write_text(proc.stderr)  # beside the run, not in it
    return out


def test_a_normal_run_prints_no_library_warnings(style_lora):
    # Only the recipe's own lines: no library notice (torchvision fallback, missing text-encoder LoRA keys,
    # deprecations), no per-load progress bars.
    stderr = (style_lora.parent / "stderr.txt").read_text()
    noisy = [line for line in stderr.splitlines()
             if re.search(r"warn|deprecat|torchvision|Loading (weights|pipeline)|Writing model", line, re.I)]
    assert not noisy, noisy[:5]


def test_load_lora_weights_and_kohya_give_the_trained_models_images(style_lora):
    # The final validation images come from the in-memory trained LoRA; the saved files must draw the same ones.
    from PIL import Image

    from common.families import sd
    from demo.digit_eval import in_style

    step = read_results(style_lora)["global_step"]
    trained = np.stack([np.asarray(Image.open(style_lora / "samples" / f"step-{step}" / f"0-{j}.png"))
                        for j in range(4)])
    for weights in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ui.safetensors"):
        pipe = pipeline(BASE)
        pipe.load_lora_weights(style_lora, weight_name=weights)
        generators = [torch.Generator().manual_seed(42 + j) for j in range(4)]
        images = pipe(["a handwritten digit three, red ink on paper"] * 4, num_inference_steps=20,
                      guidance_scale=sd.SAMPLE_GUIDANCE, generator=generators, output_type="np").images
        loaded = (images * 255).round().astype(np.uint8)
        assert np.abs(loaded.astype(int) - trained.astype(int)).max() <= 2, weights
        as_tensor = torch.from_numpy(loaded).permute(0, 3, 1, 2).float() / 255
        assert in_style(as_tensor).float().mean() >= 0.5, weights


def test_the_style_report_measures_and_draws(style_lora, capsys):
    # The short LoRA must really have learned the style (scale 0 equals the base: the sample.py sweep test below).
    run_in_process("demo/style_report.py", "--lora", style_lora, "--per_digit", "1")
    printed = capsys.readouterr().out
    results = read_results(style_lora)
    sweep = results["style_eval"]["lora_scale_sweep"]
    assert [row["lora_scale"] for row in sweep] == [0.0, 0.5, 1.0]
    assert results["style_rate_without_lora"] <= 0.1 and results["style_rate"] >= 0.6, results
    assert (style_lora / "side_by_side.png").is_file() and "style rate" in printed
    # the held-out red-ink digits (--validation_split 0.05) are denoised better with the LoRA than by the base alone
    losses = results["validation_losses"]
    assert sorted(losses, key=int) == ["0", "100", "150"] and losses["150"] < 0.95 * losses["0"], losses
    assert "held-out loss (val/loss)" in printed


def test_rebuild_with_tiny_step_counts_and_a_changed_file_is_refused(digits, tmp_path):
    # `make tiny-sd-base`'s three commands with tiny step counts: a complete, checksummed pipeline folder.
    work, shipped = tmp_path / "work", tmp_path / "shipped"
    env = offline_env()
    vae = subprocess.run([sys.executable, "-m", "demo.tiny_sd_base", "vae", "--data_dir", digits, "--output_dir",
                          work / "init", "--max_train_steps", "3"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert vae.returncode == 0, vae.stderr[-3000:]
    unet = run_script("train_text_to_image.py", "--pretrained_model_name_or_path", work / "init", "--unet_config",
                      work / "init" / "unet_config.json", "--train_data_dir", digits, "--caption_column", "captions",
                      "--max_train_samples", "32", "--train_batch_size", "8", "--max_train_steps", "2", "--use_ema",
                      "--report_to", "none", "--output_dir", work / "unet")
    assert unet.returncode == 0, unet.stderr[-3000:]
    finish = subprocess.run([sys.executable, "-m", "demo.tiny_sd_base", "finish", "--model", work / "unet", "--init",
                             work / "init", "--output_dir", shipped, "--per_digit", "1", "--min_accuracy", "0",
                             "--commands", "one ;; two"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert finish.returncode == 0, finish.stderr[-3000:]
    card = (shipped / "README.md").read_text()
    assert "one\ntwo" in card and "diffusers" in card
    pipeline(shipped)  # loads
    from safetensors import safe_open

    with safe_open(str(shipped / "text_encoder" / "model.safetensors"), "pt") as f:  # what ComfyUI's CLIP loader reads
        assert all(key.startswith("text_model.") for key in f.keys())
    assert (shipped / "checksums.sha256").read_text().count("\n") >= 8
    # A changed or missing file of a checksummed base: one line, nothing written.
    out = tmp_path / "lora"
    args = ["--pretrained_model_name_or_path", shipped, "--train_data_dir", digits, "--output_dir", out]
    config = shipped / "unet" / "config.json"
    config.write_text(config.read_text().replace("\n", "\n "))
    assert_one_line_error(run_script("train_lora.py", *args), "unet/config.json has changed", "checksums.sha256")
    (shipped / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    shutil.rmtree(shipped / "unet")
    assert_one_line_error(run_script("train_text_to_image.py", *args), "is missing")
    assert not out.exists()


def test_sample_py_lora_scale_sweep_grows_the_style_from_the_base(style_lora, tmp_path):
    from PIL import Image

    from demo.digit_eval import in_style

    prompt = ["--prompt", "a handwritten digit three, red ink on paper", "--num_images", "4"]
    for model, out, extra in ((style_lora, "sweep", ["--lora_scale", "0", "0.5", "1"]), (BASE, "base", [])):
        run_in_process("sample.py", "--model", model, *prompt, *extra, "--output_dir", tmp_path / out)

    def read(folder, n):
        return torch.stack([torch.from_numpy(np.asarray(Image.open(tmp_path / folder / f"{i:04d}.png"))).permute(
            2, 0, 1).float() / 255 for i in range(n)])

    sweep, base = read("sweep", 12), read("base", 4)
    assert torch.equal(sweep[:4], base)  # scale 0: the base alone, pixel for pixel
    rates = [in_style(sweep[i:i + 4]).float().mean().item() for i in (0, 4, 8)]
    assert rates[0] <= rates[1] <= rates[2] and rates[2] > rates[0], rates
    assert json.loads(Image.open(tmp_path / "sweep" / "0011.png").text["parameters"])["lora_scale"] == 1.0
