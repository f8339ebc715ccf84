"""The flow-matching families end to end on the tiny random-init SD3, Flux.1, FLUX.2 klein and dev, Qwen-Image and
Z-Image (`make tiny-sd3`, `make tiny-flux`, `make tiny-flux2-klein`, `make tiny-flux2`, `make tiny-qwen-image`, `make
tiny-z-image`): train_lora.py with LoRA on the transformer and the CLIP text encoder(s) where the family offers it
(none on the LLMs of FLUX.2, Qwen-Image and Z-Image), its files read back by the pipelines' load_lora_weights, an exact
resume, two processes, sample.py against the pipeline itself, the validation image against sample.py,
inspect_pipeline.py's trace, train_text_to_image.py's full fine-tune, a copy of train_lora.py with one family module
alone, and the one-line errors of the flags and files that do not fit these families. FLUX.2 dev shares everything
with klein but its text encoder and guidance input: it joins the tests of those (training, loading back, sampling,
the trace), not the multi-process and full fine-tune runs."""
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import ROOT, assert_one_line_error, launch, logged_losses, read_results, run_script
from PIL import Image
from safetensors.torch import load_file
from test_snippets import one_thread, pixels, sample_py

from common.families import family_module

STEPS = ["--max_train_samples", "32", "--train_batch_size", "4", "--max_train_steps", "6", "--checkpointing_steps",
         "3", "--rank", "4", "--lora_alpha", "8", "--learning_rate", "1e-2", "--resolution", "32",
         "--max_sequence_length", "40", "--caption_dropout_prob", "0.2", "--random_flip", "--logging_steps", "1",
         "--cache_latents"]
SIZE = ["--height", "32", "--width", "32"]  # sample.py's and inspect_pipeline.py's (Qwen-Image's default is 512 here)
VALIDATION = ["--validation_prompt", "a handwritten digit seven", "--validation_steps", "6",
              "--num_validation_images", "1", "--validation_inference_steps", "2", "--validation_split", "0.1"]
PIPELINES = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline", "flux2_klein": "Flux2KleinPipeline",
             "flux2": "Flux2Pipeline", "qwen_image": "QwenImagePipeline", "z_image": "ZImagePipeline"}
NAMES = FAMILIES = list(PIPELINES)
UI_PREFIX = {"flux": "transformer", "sd3": "transformer", "qwen_image": "diffusion_model",
             "z_image": "diffusion_model"}  # the UI file's: ComfyUI's own names where it has no diffusers branch


@pytest.fixture(scope="module")
def bases(tiny_flux, tiny_sd3, tiny_flux2_klein, tiny_flux2, tiny_qwen_image, tiny_z_image):
    return {"flux": tiny_flux, "sd3": tiny_sd3, "flux2_klein": tiny_flux2_klein, "flux2": tiny_flux2,
            "qwen_image": tiny_qwen_image, "z_image": tiny_z_image}


def family_flags(name, base):
    """The text encoders' LoRA where the family offers it; validation images at the training size (32 px) for a base
    whose pipeline draws at another size by default (QwenImagePipeline: 128 latents, 512 px here) through the square
    bucket of --buckets auto."""
    from common.base_models import component_configs

    family = family_module(name)
    flags = ["--train_text_encoder", "--text_encoder_lr", "5e-3"] if family.LORA_TEXT_ENCODERS else []
    if family.native_resolution(component_configs(base, ("vae", family.DENOISER))) != 32:
        flags += ["--buckets", "auto"]
    return flags


ONE_VARIANT = [name for name in NAMES if name != "flux2"]  # (FLUX.2 dev: klein's runs but its encoder and guidance)


def text_lora(name):
    """The text encoders' LoRA flags, for the families that put LoRA on one."""
    return ["--train_text_encoder", "--text_encoder_lr", "5e-3"] if family_module(name).LORA_TEXT_ENCODERS else []


TRAINED = {}  # family -> its run, once a test process: the tests that pick their families (indirect=True) below
# would otherwise make pytest build the module fixture again


@pytest.fixture(scope="module", params=NAMES)
def trained(request, bases, digits, tmp_path_factory):
    name = request.param
    if name not in TRAINED:
        out = tmp_path_factory.mktemp(f"lora-{name}") / "run"
        proc = launch("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", bases[name],
                      "--output_dir", out, *STEPS, *VALIDATION, *family_flags(name, bases[name]))
        (out.parent / "stderr.txt").write_text(proc.stderr)
        TRAINED[name] = name, bases[name], out
    return TRAINED[name]


def pipeline(name, base):
    import diffusers

    return getattr(diffusers, PIPELINES[name]).from_pretrained(base)


def fixed_outputs(name, pipe):
    """The transformer's output on fixed inputs (16 latent channels in every tiny build), and each CLIP text
    encoder's on one prompt."""
    family = family_module(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 8, 8, generator=g)
    ids = family.tokenize(pipe.components, ["a handwritten digit seven"] * 2, 40)
    with torch.no_grad():
        cond = family.encode_prompts(pipe.components, ids)
        out = family.denoise(pipe.transformer, x, torch.tensor([100.0, 700.0]), cond, family.TRAINING_GUIDANCE)
        texts = [pipe.components[enc](ids[i])[0] for i, enc in enumerate(family.TEXT_ENCODERS)
                 if enc in family.LORA_TEXT_ENCODERS]
    return out, texts


def reference(name, base, checkpoint):
    """The trained models as the run held them: the base plus peft adapters set from the checkpoint's own state."""
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    from common.lora_adapters import expand_targets

    family, pipe = family_module(name), pipeline(name, base)
    models = {"transformer": expand_targets(pipe.transformer, family.LORA_TARGETS.split(",")),
              **{enc: list(family.TEXT_LORA_TARGETS) for enc in family.LORA_TEXT_ENCODERS}}
    for part, targets in models.items():
        pipe.components[part].add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                     target_modules=targets))
        set_peft_model_state_dict(pipe.components[part], load_file(checkpoint / part / "adapter_model.safetensors"))
    return pipe


def test_the_lora_loads_back_exactly(trained):
    name, base, out = trained
    results = read_results(out)
    assert results["global_step"] == 6 and results["resolution"] == 32
    assert set(results["validation_losses"]) == {"0", "6"}
    expected = fixed_outputs(name, reference(name, base, out / "checkpoint-6"))
    plain = fixed_outputs(name, pipeline(name, base))
    assert (plain[0] - expected[0]).abs().max() > 1e-4  # it learned
    pipe = pipeline(name, base)
    pipe.load_lora_weights(out)
    got = fixed_outputs(name, pipe)
    assert (got[0] - expected[0]).abs().max() < 1e-5
    assert len(got[1]) == len(family_module(name).LORA_TEXT_ENCODERS)
    for ours, theirs, base_text in zip(got[1], expected[1], plain[1]):
        assert (ours - theirs).abs().max() < 1e-5 and (base_text - theirs).abs().max() > 1e-5
    info = json.loads((out / "lora_info.json").read_text())
    assert info["target_modules"] == family_module(name).LORA_TARGETS.split(",")
    # the UI file: the same weights under the names ComfyUI reads for this family (tests/test_ui_lora.py holds them
    # against ComfyUI's map), each module with its alpha: alpha / rank as trained
    ui = load_file(out / "pytorch_lora_weights_ui.safetensors")
    alphas = {key.removesuffix(".alpha"): value.item() for key, value in ui.items() if key.endswith(".alpha")}
    ranks = {module: ui.get(f"{module}.lora_down.weight", ui.get(f"{module}.lora_A.weight")).shape[0]
             for module in alphas}
    assert alphas and all(alpha / ranks[module] == 2 for module, alpha in alphas.items())
    if name in UI_PREFIX:  # the module paths, as they are, under the prefix ComfyUI reads for this family
        adapter = load_file(out / "checkpoint-6" / "transformer" / "adapter_model.safetensors")
        assert adapter and all(torch.equal(ui[f"{UI_PREFIX[name]}.{key}"], value) for key, value in adapter.items())
    else:  # the base's own module names (FLUX.2's fused q, k, v): diffusers' loader reads them back to the same model
        pipe = pipeline(name, base)
        pipe.load_lora_weights(out, weight_name="pytorch_lora_weights_ui.safetensors")
        assert (fixed_outputs(name, pipe)[0] - expected[0]).abs().max() < 1e-5
    card = (out / "README.md").read_text()
    assert PIPELINES[name] in card


@pytest.mark.parametrize("trained", ["flux", "sd3", "flux2_klein"], indirect=True)  # (dev resumes as klein does)
def test_resume_is_exact(trained, digits, tmp_path):
    """From checkpoint-3, the same steps 4-6 (losses) and the same LoRA, bit for bit."""
    name, base, out = trained
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-3", resumed / "checkpoint-3")
    launch("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", base, "--output_dir",
           resumed, *STEPS, *VALIDATION, *family_flags(name, base), "--resume_from_checkpoint", "latest")
    full, again = logged_losses(out), logged_losses(resumed)
    assert [again[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]
    a, b = load_file(out / "pytorch_lora_weights.safetensors"), load_file(resumed / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sample_py_is_the_pipeline_and_the_validation_image(trained, tmp_path):
    """sample.py on the run's output draws what the pipeline draws with the LoRA loaded (within one level), and what
    the run drew for its last validation (same prompt, seed, steps, sampler)."""
    name, base, out = trained
    family = family_module(name)
    with one_thread():  # as sample.py and the run draw (OMP_NUM_THREADS=1): the same float order
        drawn = sample_py(out, "a handwritten digit seven", 42, tmp_path, "--num_inference_steps", "2", *SIZE)
        params = json.loads(Image.open(tmp_path / "0000.png").text["parameters"])
        assert params["scheduler"] == "euler"
        pipe = pipeline(name, base)
        pipe.load_lora_weights(out)
        guidance = family.guidance_kwargs(pipe.transformer.config, params["guidance_scale"], 1)[0]  # as drawn
        image = pipe(prompt="a handwritten digit seven", num_inference_steps=2, height=32, width=32,
                     max_sequence_length=40, generator=torch.Generator().manual_seed(42), **guidance).images[0]
        assert params["max_sequence_length"] == 40  # the run's T5 length (lora_info.json), sample.py's default
        assert np.abs(drawn - np.asarray(image).astype(int)).max() <= 1
        assert np.abs(drawn - pixels(out / "samples" / "step-6" / "0-0.png")).max() <= 1
        # the base alone: sample.py's defaults are the pipeline's own (steps aside), at the base's T5 length
        plain_drawn = sample_py(base, "a handwritten digit seven", 0, tmp_path / "base", "--num_inference_steps", "2",
                                *SIZE)
        plain = pipeline(name, base)(prompt="a handwritten digit seven", num_inference_steps=2, height=32, width=32,
                                     generator=torch.Generator().manual_seed(0), **guidance).images[0]
    assert np.abs(plain_drawn - np.asarray(plain).astype(int)).max() <= 1


def test_the_card_code_draws_what_sample_py_draws(trained, tmp_path, monkeypatch):
    """The LoRA's README.md, run as printed: the run's size and T5 length (40), the family's guidance (Flux.1-dev's
    input; SD3's CFG)."""
    from test_snippets import card_draws_what_sample_py_draws

    name, _, out = trained
    code = card_draws_what_sample_py_draws(out, tmp_path, monkeypatch)
    assert "height=32," in code and "max_sequence_length=40" in code  # (the guidance: the family's, as drawn above)


def test_inspect_traces_the_flow_pipeline(trained, capsys):
    name, base, _ = trained
    cfg = ["--guidance_scale", "4"] if name == "qwen_image" else []  # (true CFG, which it draws without by default)
    import inspect_pipeline  # (in this process: its imports are already here)

    with one_thread():
        inspect_pipeline.main(inspect_pipeline.parse_args([str(base), "--trace", "--json", "--num_inference_steps",
                                                           "2", "--prompt", "a handwritten digit seven", *SIZE, *cfg]))
    report = json.loads(capsys.readouterr().out)
    stages = report["trace"]["stages"]
    schedule = next(s for s in stages if s["stage"] == "scheduler.set_timesteps")
    assert schedule["sigmas"][0] == 1.0 and schedule["sigmas"][-1] == 0.0 and len(schedule["sigmas"]) == 3
    steps = [s for s in stages if s["stage"] == "denoise"]
    if name == "qwen_image":  # packed 2 x 2 like Flux; the text mask and the latent grid are inputs; true CFG: 2 calls
        text = [s for s in stages if s["stage"] == "text_encoder"]
        assert report["vae"]["packed_latent_shape"] == [1, 16, 64] and len(steps) == 2 and report["trace"]["guided"]
        assert all(len(s["true_cfg_passes"]) == 1 and s["guidance"]["out"] == [1, 16, 64] for s in steps)
        assert [s["text"] for s in text] == ["prompt", "negative prompt"] and text[0]["last_hidden_state"][2] == 32
        assert all(s["transformer_in"]["sample"] == [1, 16, 64] and s["transformer_in"]["img_shapes"] == [[[1, 4, 4]]]
                   and "encoder_hidden_states_mask" not in s["transformer_in"] for s in steps)  # (one prompt: no pad)
        return
    if name.startswith("flux2"):  # 2 x 2 patches of 4 channels: 16 tokens of 16, 4-axis ids; 3 Qwen3/Mistral3 layers
        assert report["vae"]["packed_latent_shape"] == [1, 16, 16]
        assert all(s["transformer_in"]["sample"] == [1, 16, 16] and s["transformer_in"]["img_ids"] == [1, 16, 4]
                   and s["transformer_in"]["encoder_hidden_states"] == [1, 512, 48] for s in steps)
        text = [s for s in stages if s["stage"] == "text_encoder"]
        assert all(s["hidden_states[-2]"] == [1, 512, 16] for s in text)
        if name == "flux2":  # the guidance is an input: one call a step
            assert len(steps) == 2 and len(text) == 1
            assert all(s["transformer_in"]["guidance"] == {"shape": [1], "value": 4.0} for s in steps)
        else:  # klein: true CFG, the prompt's call and the empty prompt's each step
            assert len(steps) == 2 and len(text) == 2 and all("guidance" not in s["transformer_in"] for s in steps)
            assert all(len(s["true_cfg_passes"]) == 1 for s in steps)  # (the second call of each step)
        return
    text = {"flux": "text_encoder_2", "sd3": "text_encoder_3", "z_image": "text_encoder"}[name]  # T5, Qwen3
    t5 = next(s for s in stages if s["stage"] == text)
    if name == "z_image":  # lists: latents [C, 1, h, w], each prompt's own tokens (Qwen3's penultimate layer)
        assert all(s["transformer_in"] == {"sample": [2, 16, 1, 8, 8], "encoder_hidden_states": [2, None, 32]}
                   for s in steps)
        assert [s["t"] for s in steps] == [0, 0.25]  # (1000 - t) / 1000, as the pipeline gives it
        assert report["trace"]["guided"] and t5["hidden_states[-2]"] == [1, 512, 32]
    elif name == "flux":  # packed 2 x 2: 16 tokens of 64 for an 8 x 8 x 16 latent; the guidance is an input
        assert report["vae"]["packed_latent_shape"] == [1, 16, 64]
        assert all(s["transformer_in"]["sample"] == [1, 16, 64] and s["transformer_in"]["img_ids"] == [16, 3]
                   and s["transformer_in"]["guidance"] == {"shape": [1], "value": 3.5}
                   and s["transformer_in"]["pooled_projections"] == [1, 32] for s in steps)
        assert "mu" in schedule and not report["trace"]["guided"] and t5["last_hidden_state"] == [1, 512, 64]
    else:  # CLIP states (77) then T5's (256) in one sequence of T5's width; both CLIPs' pooled together
        assert all(s["transformer_in"] == {"sample": [2, 16, 8, 8], "encoder_hidden_states": [2, 333, 96],
                                           "pooled_projections": [2, 80]} for s in steps)
        assert report["trace"]["guided"] and t5["last_hidden_state"] == [1, 256, 96]


@pytest.mark.parametrize("trained", ONE_VARIANT, indirect=True)
def test_two_processes(trained, digits, tmp_path):
    """Two CPU processes on the trained run's flags: the held-out loss at step 0 is the one-process run's (the images
    are shared out and the sums reduced), the run finishes and saves."""
    name, base, out = trained
    two = launch("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", base, *STEPS,
                 "--validation_split", "0.1", *family_flags(name, base), "--max_train_steps", "2", "--output_dir",
                 tmp_path / "two", config="cpu_2proc.yaml")
    assert "2 process(es)" in two.stderr and read_results(tmp_path / "two")["num_processes"] == 2
    assert abs(read_results(out)["validation_losses"]["0"]
               - read_results(tmp_path / "two")["validation_losses"]["0"]) < 1e-5
    assert (tmp_path / "two" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("name", ONE_VARIANT)
def test_full_fine_tune_saves_a_pipeline(name, bases, digits, tmp_path, monkeypatch):
    """train_text_to_image.py on the transformer (Flux: a fresh one from --transformer_config), with its EMA: the
    output loads with from_pretrained and holds the EMA weights, and samples; its card's code draws what sample.py
    draws (at the run's T5 length)."""
    from test_snippets import card_draws_what_sample_py_draws

    base = bases[name]
    fresh = ["--transformer_config", base / "transformer"] if name == "flux" else []
    launch("train_text_to_image.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", base,
           "--output_dir", tmp_path / "out", *fresh, "--max_train_samples", "16", "--train_batch_size", "4",
           "--max_train_steps", "4", "--checkpointing_steps", "4", "--use_ema", "--ema_max_decay", "0.9",
           "--max_sequence_length", "40", "--learning_rate", "1e-3", "--cache_latents", "--resolution", "32")
    pipe = pipeline(name, tmp_path / "out")
    raw = load_file(next((tmp_path / "out" / "checkpoint-4" / "transformer").glob("*.safetensors")))
    ema = load_file(next((tmp_path / "out" / "checkpoint-4" / "transformer_ema").glob("*.safetensors")))
    saved = pipe.transformer.state_dict()
    key = next(k for k in raw if k.endswith(".weight") and raw[k].ndim == 2)
    assert torch.equal(saved[key], ema[key]) and not torch.equal(saved[key], raw[key])
    image = pipe(prompt="a handwritten digit seven", num_inference_steps=2, height=32, width=32,
                 max_sequence_length=40, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (32, 32)
    assert "max_sequence_length=40" in card_draws_what_sample_py_draws(tmp_path / "out", tmp_path, monkeypatch)


@pytest.mark.parametrize("name", ["flux2_klein"])
def test_train_lora_copied_with_the_family_module_alone(name, bases, digits, tmp_path):
    """The copy list plus the base's family module (common/families/flux2_klein.py, which imports no other) trains on
    that base; without that module, one line says so."""
    from conftest import offline_env
    from test_copy_list import copy_into

    copy_into(tmp_path, "train_lora.py")
    args = ["--train_data_dir", digits, "--pretrained_model_name_or_path", bases[name], "--output_dir", "out",
            "--max_train_samples", "8", "--train_batch_size", "4", "--max_train_steps", "1", "--max_sequence_length",
            "8", "--report_to", "none"]
    proc = launch(tmp_path / "train_lora.py", *args, cwd=tmp_path, env=offline_env(PYTHONPATH=""), check=False)
    assert_one_line_error(proc, f"common/families/{name}.py")
    assert not (tmp_path / "out").exists()
    shutil.copy(ROOT / "common" / "families" / f"{name}.py", tmp_path / "common" / "families" / f"{name}.py")
    assert sorted(p.name for p in (tmp_path / "common" / "families").glob("*.py")) == ["__init__.py", f"{name}.py"]
    launch(tmp_path / "train_lora.py", *args, cwd=tmp_path, env=offline_env(PYTHONPATH=""))
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").is_file()


@pytest.fixture(scope="module")
def qwen_without_tokenizer(tiny_qwen_image, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen") / "no-tokenizer"
    shutil.copytree(tiny_qwen_image, path, ignore=shutil.ignore_patterns("tokenizer"))
    return path


@pytest.fixture(scope="module")
def sd3_without_t5(tiny_sd3, tmp_path_factory):
    path = tmp_path_factory.mktemp("sd3") / "no-t5"
    shutil.copytree(tiny_sd3, path, ignore=shutil.ignore_patterns("text_encoder_3", "tokenizer_3"))
    return path


@pytest.fixture(scope="module")
def klein_without(tiny_flux2_klein, tmp_path_factory):
    """The tiny FLUX.2 klein folder without its text encoder, and without its tokenizer."""
    paths = {}
    for part in ("text_encoder", "tokenizer"):
        paths[part] = tmp_path_factory.mktemp("klein") / f"no-{part}"
        shutil.copytree(tiny_flux2_klein, paths[part], ignore=shutil.ignore_patterns(part))
    return paths


BAD = {
    "prediction-type-on-flux": (["--pretrained_model_name_or_path", "{flux}", "--prediction_type", "v_prediction"],
                                "--prediction_type", "Flux.1", "flow matching"),
    "snr-gamma-on-sd3": (["--pretrained_model_name_or_path", "{sd3}", "--snr_gamma", "5"], "--snr_gamma",
                         "Stable Diffusion 3"),
    "weighting-on-sd": (["--pretrained_model_name_or_path", "{sd}", "--weighting_scheme", "logit_normal"],
                        "--weighting_scheme", "DDPM"),
    "t5-length-on-sd": (["--pretrained_model_name_or_path", "{sd}", "--max_sequence_length", "16"],
                        "--max_sequence_length", "Stable Diffusion 1.x/2.x"),
    "flux-resolution": (["--pretrained_model_name_or_path", "{flux}", "--resolution", "36"],
                        "--resolution 36", "32 or 40", "packs 2 x 2"),
    "sd3-without-t5": (["--pretrained_model_name_or_path", "{sd3_no_t5}"], "text_encoder_3", "--drop_t5"),
    "drop-t5-on-flux": (["--pretrained_model_name_or_path", "{flux}", "--drop_t5"], "--drop_t5", "Flux.1"),
    "nf4-without-bitsandbytes": (["--pretrained_model_name_or_path", "{flux}", "--quantize_base", "nf4"],
                                 "--quantize_base nf4", "bitsandbytes"),
    "qwen-image-resolution": (["--pretrained_model_name_or_path", "{qwen_image}", "--resolution", "36"],
                              "--resolution 36", "32 or 40", "packs 2 x 2"),
    "qwen-image-text-encoder-lora": (["--pretrained_model_name_or_path", "{qwen_image}", "--train_text_encoder"],
                                     "--train_text_encoder", "Qwen-Image's text encoder"),
    "qwen-image-without-tokenizer": (["--pretrained_model_name_or_path", "{qwen_no_tokenizer}"],
                                     "not a Qwen-Image pipeline folder", "no tokenizer"),
    "z-image-resolution": (["--pretrained_model_name_or_path", "{z_image}", "--resolution", "36"],
                           "--resolution 36", "32 or 40", "2 x 2 patches"),
    "z-image-text-encoder-lora": (["--pretrained_model_name_or_path", "{z_image}", "--train_text_encoder"],
                                  "--train_text_encoder", "Z-Image's text encoder"),
    "z-image-text-encoder-lr": (["--pretrained_model_name_or_path", "{z_image}", "--text_encoder_lr", "1e-5"],
                                "--text_encoder_lr", "Z-Image's text encoder"),
    "z-image-without-its-text-encoder": (["--pretrained_model_name_or_path", "{z_image_no_text}"],
                                         "not a Z-Image pipeline folder", "tokenizer, text_encoder"),
    "guidance-on-z-image": (["--pretrained_model_name_or_path", "{z_image}", "--guidance_scale", "4"],
                            "--guidance_scale", "Z-Image"),
    "flux2-resolution": (["--pretrained_model_name_or_path", "{flux2_klein}", "--resolution", "36"],
                         "--resolution 36", "32 or 40", "2 x 2 patches"),
    "text-encoder-lora-on-flux2-klein": (["--pretrained_model_name_or_path", "{flux2_klein}", "--train_text_encoder"],
                                         "--train_text_encoder", "FLUX.2 klein", "leave it out"),
    "text-encoder-lr-on-flux2-dev": (["--pretrained_model_name_or_path", "{flux2}", "--text_encoder_lr", "1e-5"],
                                     "--text_encoder_lr", "FLUX.2 dev"),
    "guidance-on-flux2-klein": (["--pretrained_model_name_or_path", "{flux2_klein}", "--guidance_scale", "3"],
                                "--guidance_scale", "FLUX.2 klein"),
    "flux2-without-text-encoder": (["--pretrained_model_name_or_path", "{klein_no_text_encoder}"],
                                   "FLUX.2 klein", "no text_encoder"),
    "flux2-without-tokenizer": (["--pretrained_model_name_or_path", "{klein_no_tokenizer}"], "FLUX.2 klein",
                                "no tokenizer"),
}


@pytest.fixture(scope="module")
def z_image_without_text(tiny_z_image, tmp_path_factory):
    path = tmp_path_factory.mktemp("z_image") / "no-text"
    shutil.copytree(tiny_z_image, path, ignore=shutil.ignore_patterns("text_encoder", "tokenizer"))
    return path


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_writes_nothing(case, bases, tiny_sd, sd3_without_t5, qwen_without_tokenizer,
                                                  z_image_without_text, klein_without, digits, tmp_path):
    flags, *needles = BAD[case]
    paths = {**bases, "sd": tiny_sd, "sd3_no_t5": sd3_without_t5, "qwen_no_tokenizer": qwen_without_tokenizer,
             "z_image_no_text": z_image_without_text,
             **{f"klein_no_{part}": path for part, path in klein_without.items()}}
    flags = [flag.format(**paths) for flag in flags]
    proc = run_script("train_lora.py", "--train_data_dir", digits, "--output_dir", tmp_path / "out", *flags)
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "out").exists()


def test_sd3_trains_and_samples_without_t5(sd3_without_t5, digits, tmp_path, monkeypatch):
    """--drop_t5 is recorded in lora_info.json: sample.py and the card's code draw the LoRA without T5, as it
    trained; the base folder alone still needs the flag."""
    from test_snippets import card_draws_what_sample_py_draws

    launch("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", sd3_without_t5,
           "--output_dir", tmp_path / "out", "--drop_t5", "--max_train_samples", "8", "--train_batch_size", "4",
           "--max_train_steps", "2")
    assert json.loads((tmp_path / "out" / "lora_info.json").read_text())["drop_t5"] is True
    code = card_draws_what_sample_py_draws(tmp_path / "out", tmp_path, monkeypatch)
    assert "text_encoder_3=None, tokenizer_3=None" in code and "max_sequence_length=77" in code
    proc = run_script("sample.py", "--model", sd3_without_t5, "--prompt", "a digit", "--num_images", "1",
                      "--num_inference_steps", "2", "--output_dir", tmp_path / "s")
    assert_one_line_error(proc, "--drop_t5")


def test_a_lora_of_another_family_is_one_line(bases, tiny_sd, tmp_path):
    """An SD LoRA on Flux and a Flux LoRA on SD, told from the files' metadata before anything loads."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig

    from common.families import sd
    from common.lora_files import save_lora_weights

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    pipe.unet.add_adapter(LoraConfig(r=2, target_modules=["to_q"]))
    metadata = sd.base_metadata(pipe.unet.config, "epsilon")
    save_lora_weights(str(tmp_path / "sd-lora"), sd, {"unet": pipe.unet}, {"base_model": str(tiny_sd), "rank": 2,
                                                                            "lora_alpha": 2}, metadata=metadata)
    proc = run_script("sample.py", "--model", bases["flux"], "--lora", tmp_path / "sd-lora", "--prompt", "x",
                      "--output_dir", tmp_path / "s")
    assert_one_line_error(proc, "Stable Diffusion 1.x/2.x LoRA", "Flux.1")
    flux_pipe = pipeline("flux", bases["flux"])
    flux_pipe.transformer.add_adapter(LoraConfig(r=2, target_modules=["attn.to_q"]))
    flux = family_module("flux")
    save_lora_weights(str(tmp_path / "flux-lora"), flux, {"transformer": flux_pipe.transformer},
                      {"base_model": str(bases["flux"]), "rank": 2, "lora_alpha": 2},
                      metadata=flux.base_metadata(flux_pipe.transformer.config, None))
    proc = run_script("sample.py", "--model", tiny_sd, "--lora", tmp_path / "flux-lora", "--prompt", "x",
                      "--output_dir", tmp_path / "s")
    assert_one_line_error(proc, "Flux.1 LoRA", "Stable Diffusion 1.x/2.x")


def test_qwen_image_lora_and_flux_lora_cross_is_one_line(bases, tmp_path):
    """A Qwen-Image LoRA on Flux.1 and a Flux.1 LoRA on Qwen-Image (their default targets share module names), told
    from the files' metadata before anything loads; what Qwen-Image refuses in the flags before anything loads."""
    import argparse

    from peft import LoraConfig

    from common.cli import UserError
    from common.lora_adapters import check_lora_args
    from common.lora_files import save_lora_weights

    for name, other in (("qwen_image", "flux"), ("flux", "qwen_image")):
        family, pipe = family_module(name), pipeline(name, bases[name])
        pipe.transformer.add_adapter(LoraConfig(r=2, target_modules=["to_q"]))
        save_lora_weights(str(tmp_path / name), family, {"transformer": pipe.transformer},
                          {"base_model": str(bases[name]), "rank": 2, "lora_alpha": 2},
                          metadata=family.base_metadata(pipe.transformer.config, None))
        proc = run_script("sample.py", "--model", bases[other], "--lora", tmp_path / name, "--prompt", "x",
                          "--output_dir", tmp_path / "s")
        assert_one_line_error(proc, f"{family.NAME} LoRA", family_module(other).NAME)
    qwen = family_module("qwen_image")
    flags = dict(target_modules=None, offload_ema=False, use_ema=False, adapter="lora", lokr_factor=-1,
                 use_dora=False, lora_dropout=0.0, quantize_base=None, train_text_encoder=False)
    with pytest.raises(UserError, match="--text_encoder_lr: LoRA on Qwen-Image's text encoder"):
        check_lora_args(argparse.Namespace(**flags, text_encoder_lr=1e-4), qwen)
    with pytest.raises(UserError, match="--max_sequence_length 2000: QwenImagePipeline takes prompts of at most 1024"):
        qwen.text_length({}, 2000, training=True)


def test_a_z_image_lora_on_flux_and_a_flux_lora_on_z_image_are_one_line(bases, tmp_path):
    """Told apart before anything loads: the Z-Image LoRA by its tensor names alone (no metadata, as ai-toolkit's and
    others' files come), the Flux.1 LoRA by its metadata."""
    from peft import LoraConfig

    from common.lora_files import save_lora_weights

    for name, targets, metadata in (("z_image", ["to_q"], False), ("flux", ["attn.to_q"], True)):
        pipe, family = pipeline(name, bases[name]), family_module(name)
        pipe.transformer.add_adapter(LoraConfig(r=2, target_modules=targets))
        save_lora_weights(str(tmp_path / name), family, {"transformer": pipe.transformer},
                          {"base_model": str(bases[name]), "rank": 2, "lora_alpha": 2},
                          metadata=family.base_metadata(pipe.transformer.config, None) if metadata else None)
    proc = run_script("sample.py", "--model", bases["flux"], "--lora", tmp_path / "z_image", "--prompt", "x",
                      "--output_dir", tmp_path / "s")
    assert_one_line_error(proc, "Z-Image LoRA", "its key transformer.", "Flux.1")
    proc = run_script("sample.py", "--model", bases["z_image"], "--lora", tmp_path / "flux", "--prompt", "x",
                      "--output_dir", tmp_path / "s")
    assert_one_line_error(proc, "Flux.1 LoRA", "Z-Image")


def test_sample_py_draws_a_distilled_base_as_its_model_card_says(tiny_z_image, tmp_path):
    """The tiny Z-Image base with Z-Image-Turbo's model card: sample.py draws with its 9 steps and no guidance (one
    pass a step), what the pipeline draws given them."""
    from diffusers import ZImagePipeline
    from test_families import TURBO_CARD

    base = tmp_path / "turbo"
    shutil.copytree(tiny_z_image, base)
    (base / "README.md").write_text(TURBO_CARD)
    with one_thread():  # as sample.py draws (OMP_NUM_THREADS=1): the same float order
        drawn = sample_py(base, "a handwritten digit seven", 0, tmp_path / "s", "--height", "32", "--width", "32")
        params = json.loads(Image.open(tmp_path / "s" / "0000.png").text["parameters"])
        assert params["num_inference_steps"] == 9 and params["guidance_scale"] == 0.0  # (the card's size is 1024)
        image = ZImagePipeline.from_pretrained(base)("a handwritten digit seven", num_inference_steps=9,
                                                     guidance_scale=0.0, height=32, width=32,
                                                     generator=torch.Generator().manual_seed(0))
    assert np.abs(drawn - np.asarray(image.images[0]).astype(int)).max() <= 1


def flux2_lora(name, base, folder, metadata=True):
    """A LoRA file of the FLUX.2 family `name` as save_lora_weights writes it (its metadata says its base, or not)."""
    from peft import LoraConfig

    from common.lora_files import save_lora_weights

    family, pipe = family_module(name), pipeline(name, base)
    pipe.transformer.add_adapter(LoraConfig(r=2, target_modules=["to_qkv_mlp_proj", "to_q"]))
    save_lora_weights(str(folder), family, {"transformer": pipe.transformer}, {"base_model": str(base), "rank": 2,
                                                                                "lora_alpha": 2},
                      metadata=family.base_metadata(pipe.transformer.config, None) if metadata else None)
    return folder


def test_a_flux2_lora_on_the_other_flux2_or_on_flux1_is_one_line(bases, tmp_path):
    """FLUX.2 dev's LoRA on klein (sample.py: one line, before anything loads), and each way between dev, klein and
    Flux.1, told from the file's metadata; without metadata, FLUX.2's own tensor names tell FLUX.2 from Flux.1, and a
    FLUX.2 LoRA passes on either FLUX.2 base (their names are the same)."""
    from common.cli import UserError
    from common.families import check_lora_base
    from common.lora_files import check_safetensors, lora_file_metadata, lora_weights_file

    files = {name: flux2_lora(name, bases[name], tmp_path / name) for name in ("flux2", "flux2_klein")}
    proc = run_script("sample.py", "--model", bases["flux2_klein"], "--lora", files["flux2"], "--prompt", "x",
                      "--output_dir", tmp_path / "s")
    assert_one_line_error(proc, "FLUX.2 dev LoRA", "modelspec.architecture flux-2-dev", "FLUX.2 klein")
    assert not (tmp_path / "s").exists()

    def check(name, base, metadata=True):
        path = files[name] if metadata else flux2_lora(name, bases[name], tmp_path / f"{name}-bare", False)
        keys = check_safetensors(lora_weights_file(str(path)), "--lora")
        check_lora_base("--lora", str(path), lora_file_metadata(str(path)), keys, str(bases[base]), base)

    for name, base in (("flux2_klein", "flux2"), ("flux2", "flux"), ("flux2_klein", "flux")):
        with pytest.raises(UserError, match=f"is a {family_module(name).NAME} LoRA"):
            check(name, base)
    for base in ("flux2", "flux2_klein"):
        check("flux2", base, metadata=False)
    with pytest.raises(UserError, match="is a FLUX.2"):
        check("flux2", "flux", metadata=False)
