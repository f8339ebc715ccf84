"""sample.py and inspect_pipeline.py on the tiny SDXL (two text encoders, a pooled embedding, six time ids): the
pixels of diffusers' own StableDiffusionXLPipeline, with and without a LoRA, the same bytes from two runs, the trace's
shapes, and one error line for a LoRA made for the other kind of base."""
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, run_script
from PIL import Image

from common.cli import UserError

PROMPT, STEPS, SEED = "a handwritten digit seven", 3, 3
DRAW = ["--prompt", PROMPT, "--num_images", "1", "--num_inference_steps", str(STEPS), "--seed", str(SEED),
        "--width", "48"]


def add_lora(pipe, components):
    """peft LoRA layers on the pipeline's UNet and text encoders, their weights moved as if trained (B starts at 0)."""
    from peft import LoraConfig

    torch.manual_seed(0)
    for name in components:
        targets = ["to_q", "to_k", "to_v", "to_out.0"] if name == "unet" else ["q_proj", "k_proj", "v_proj", "out_proj"]
        getattr(pipe, name).add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                                   target_modules=targets))
        with torch.no_grad():
            for key, p in getattr(pipe, name).named_parameters():
                if "lora_B" in key:
                    p.add_(0.5 * torch.randn_like(p))
    return {name: getattr(pipe, name) for name in components}


@pytest.fixture(scope="module")
def loras(tmp_path_factory, tiny_sd, tiny_sdxl):
    """An SDXL LoRA on the UNet and both text encoders in train_lora.py's layout (diffusers and kohya files with the
    metadata train_lora.py writes, lora_info.json naming the base), an SD one, and both without metadata."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from safetensors.torch import load_file, save_file

    from common.families import family_module
    from common.lora_files import LORA_WEIGHTS, UI_WEIGHTS, save_lora_weights

    root = tmp_path_factory.mktemp("sdxl-loras")
    paths = {}
    for kind, base, pipeline_class, parts in (
            ("sdxl", tiny_sdxl, StableDiffusionXLPipeline, ("unet", "text_encoder", "text_encoder_2")),
            ("sd", tiny_sd, StableDiffusionPipeline, ("unet", "text_encoder"))):
        pipe = pipeline_class.from_pretrained(base)
        family = family_module(kind)
        metadata = {"base_model": str(base), **family.base_metadata(pipe.unet.config, "epsilon")}
        save_lora_weights(str(root / kind), family, add_lora(pipe, parts), {"base_model": str(base), "rank": 4,
                                                                    "lora_alpha": 4}, metadata=metadata)
        paths[kind] = root / kind
    for name, file in (("sdxl_keys", root / "sdxl" / LORA_WEIGHTS), ("sdxl_kohya_keys", root / "sdxl" / UI_WEIGHTS),
                       ("sd_kohya_keys", root / "sd" / UI_WEIGHTS)):
        paths[name] = root / f"{name}.safetensors"  # the same tensors, no metadata: the keys must tell
        save_file(load_file(file), paths[name])
    return paths


@pytest.fixture(scope="module")
def drawn(loras, tmp_path_factory):
    """sample.py twice on the SDXL LoRA's train_lora.py-style folder at LoRA scales 0 and 1: -> the two folders."""
    root = tmp_path_factory.mktemp("sdxl-samples")
    for run in ("a", "b"):
        proc = run_script("sample.py", "--model", loras["sdxl"], *DRAW, "--lora_scale", "0", "1",
                          "--output_dir", root / run)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "sdxl_base_v1-0" in proc.stdout  # the LoRA's metadata, printed before drawing
    return root / "a", root / "b"


def pixels(path):
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def test_two_runs_write_the_same_bytes(drawn):
    a, b = drawn
    names = sorted(p.name for p in a.iterdir())
    assert names == ["0000.png", "0001.png", "grid.png"] == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    params = [json.loads(Image.open(a / f"000{i}.png").text["parameters"]) for i in (0, 1)]
    assert [p["lora_scale"] for p in params] == [0, 1] and {p["width"] for p in params} == {48}
    assert Image.open(a / "0000.png").size == (48, 32) and params[0]["seed"] == SEED


def test_sdxl_samples_are_what_diffusers_draws_and_the_lora_shows(drawn, loras, tiny_sdxl):
    """sample.py's defaults (DPM-Solver++ on the base's schedule, guidance 7.5) against diffusers' own pipeline with
    that sampler written out by hand, the base alone (LoRA scale 0) and with the LoRA."""
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionXLPipeline

    torch.set_num_threads(1)  # as sample.py ran: with the strong random LoRA, 2 threads' sums move pixels by ~4 levels
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
    pipe.scheduler = DPMSolverMultistepScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                                 timestep_spacing="leading", steps_offset=1)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(loras["sdxl"], adapter_name="lora")
    reference = []
    for scale in (0.0, 1.0):
        pipe.set_adapters(["lora"], adapter_weights=[scale])
        reference.append(np.asarray(pipe(PROMPT, num_inference_steps=STEPS, width=48, guidance_scale=7.5,
                                         generator=torch.Generator().manual_seed(SEED)).images[0]).astype(int))
    sampled = [pixels(drawn[0] / f"000{i}.png") for i in (0, 1)]
    for ours, theirs in zip(sampled, reference):
        assert np.abs(ours - theirs).max() <= 1
    assert np.abs(sampled[1] - sampled[0]).mean() > 5  # the LoRA changes the picture


def test_base_alone_and_lora_file_on_the_base(drawn, loras, tiny_sdxl, tmp_path, capsys):
    """--model <SDXL base> alone, and with --lora FILE:SCALE (times --lora_scale): the pictures of the LoRA folder
    at scales 0 and 1. In-process: the subprocess path is the one above."""
    import sample

    torch.set_num_threads(1)
    sample.main(sample.parse_args(["--model", str(tiny_sdxl), *DRAW, "--output_dir", str(tmp_path / "base")]))
    lora_file = loras["sdxl"] / "pytorch_lora_weights.safetensors"
    sample.main(sample.parse_args(["--model", str(tiny_sdxl), "--lora", f"{lora_file}:0.5", "--lora_scale", "2",
                                   *DRAW, "--output_dir", str(tmp_path / "file")]))
    capsys.readouterr()
    assert np.abs(pixels(tmp_path / "base/0000.png") - pixels(drawn[0] / "0000.png")).max() <= 1
    assert np.abs(pixels(tmp_path / "file/0000.png") - pixels(drawn[0] / "0001.png")).max() <= 1
    with pytest.raises(UserError, match="--clip_skip 2: the text encoder of this base has 2 layers; give at most 1"):
        sample.main(sample.parse_args(["--model", str(tiny_sdxl), *DRAW, "--clip_skip", "2", "--output_dir",
                                       str(tmp_path / "skip")]))  # SDXL takes hidden state -(clip_skip + 2)
    assert not (tmp_path / "skip").exists()


@pytest.mark.parametrize("guidance,batch", [(7.5, 2), (1.0, 1)])
def test_trace_shows_both_encoders_the_pooled_embedding_and_the_time_ids(tiny_sdxl, guidance, batch):
    import inspect_pipeline as ip

    torch.set_num_threads(1)
    args = ip.parse_args([str(tiny_sdxl), "--trace", "--num_inference_steps", "2", "--guidance_scale", str(guidance),
                          "--num_images", str(batch)])
    pipe, labels, _ = ip.load_pipeline(args, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    report, images, _ = ip.trace(pipe, args, labels, torch.device("cpu"))
    stages = {s["stage"]: s for s in report["stages"]}
    widths = [pipe.text_encoder.config.hidden_size, pipe.text_encoder_2.config.hidden_size]  # 32, 64
    pooled = pipe.text_encoder_2.config.projection_dim  # 64 (1280 in SDXL)
    assert stages["text_encoder"]["hidden_states[-2]"] == [1, 77, widths[0]]
    assert stages["text_encoder_2"]["hidden_states[-2]"] == [1, 77, widths[1]]
    assert stages["text_encoder_2"]["text_embeds"] == [1, pooled]
    assert stages["_get_add_time_ids"]["values"] == [32, 32, 0, 0, 32, 32]  # original size, crop, target size
    cfg = 2 if guidance > 1 else 1
    n = cfg * batch  # [2B, ...] under classifier-free guidance
    unet_in = {"sample": [n, 4, 8, 8], "encoder_hidden_states": [n, 77, sum(widths)], "text_embeds": [n, pooled],
               "time_ids": [n, 6]}
    steps = [s for s in report["stages"] if s["stage"] == "denoise"]
    assert len(steps) == 2 and all(s["unet_in"] == unet_in for s in steps)
    assert steps[0]["callback_on_step_end"]["add_time_ids"] == [n, 6]
    assert sum(widths) == pipe.unet.config.cross_attention_dim == 96 and report["guided"] == (cfg == 2)
    assert ("force_zeros_for_empty_prompt" in report["how"]) == (cfg == 2)
    direct = pipe(args.prompt, num_inference_steps=2, guidance_scale=guidance, num_images_per_prompt=batch,
                  generator=torch.Generator().manual_seed(args.seed)).images
    assert [i.tobytes() for i in images] == [i.tobytes() for i in direct]  # the hooks changed nothing


def test_a_lora_for_the_other_base_and_an_unknown_pipeline_are_one_line(loras, tiny_sd, tiny_sdxl, tmp_path):
    """Told from the file's metadata, else its keys, before anything loads; nothing is written."""
    out = tmp_path / "out"
    sdxl, sd = "is a Stable Diffusion XL LoRA", "is a Stable Diffusion 1.x/2.x LoRA"
    for base, lora, needles in (
            (tiny_sd, loras["sdxl"], (sdxl, "ss_base_model_version sdxl_base_v1-0", "is Stable Diffusion 1.x/2.x")),
            (tiny_sdxl, f"{loras['sd']}/pytorch_lora_weights.safetensors:0.5", (sd, "sd_v1", "is Stable Diffusion XL")),
            (tiny_sd, loras["sdxl_keys"], (sdxl, "its key text_encoder_2.")),
            (tiny_sd, loras["sdxl_kohya_keys"], (sdxl, "its key lora_te1_")),
            (tiny_sdxl, loras["sd_kohya_keys"], (sd, "its key lora_te_"))):
        proc = run_script("sample.py", "--model", base, "--lora", lora, "--prompt", "a digit", "--output_dir", out)
        assert_one_line_error(proc, *needles)
    assert_one_line_error(run_script("inspect_pipeline.py", tiny_sdxl, "--lora", loras["sd"]), sd)
    odd = tmp_path / "odd"
    shutil.copytree(tiny_sdxl, odd)
    index = json.loads((odd / "model_index.json").read_text())
    (odd / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionXLInpaintPipeline"}))
    assert_one_line_error(run_script("sample.py", "--model", odd, "--prompt", "a digit", "--output_dir", out),
                          "names the pipeline class 'StableDiffusionXLInpaintPipeline'", "sample.py draws from")
    assert not out.exists()
