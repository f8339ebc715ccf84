"""train_lora.py end to end on the tiny random-init SD (real `accelerate launch` runs), and sample.py for SD."""
import json
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import (
    ROOT,
    assert_one_line_error,
    launch,
    logged_losses,
    offline_env,
    read_results,
    run_in_process,
    run_script,
    signal_when_ready,
)
from safetensors.torch import load_file

TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]
TINY = ["--max_train_samples", "64", "--train_batch_size", "8", "--max_train_steps", "12", "--checkpointing_steps", "6",
        "--rank", "4", "--lora_alpha", "8", "--learning_rate", "1e-2", "--train_text_encoder", "--text_encoder_lr",
        "5e-3", "--random_flip", "--caption_dropout_prob", "0.2", "--logging_steps", "1", "--validation_prompt",
        "a handwritten digit seven", "--validation_steps", "6", "--num_validation_images", "1",
        "--validation_inference_steps", "2", "--caption_prefix", "sks style, "]
KOHYA = "pytorch_lora_weights_ui.safetensors"


@pytest.fixture(scope="module")
def trained(digits, tiny_sd, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    proc = launch("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sd,
                  "--output_dir", out, *TINY, "--cache_latents")
    (out.parent / "stderr.txt").write_text(proc.stderr)  # beside the run, not in it
    return out


@pytest.fixture(scope="module")
def base_128px(tiny_sd, tmp_path_factory):
    """The tiny base, but its VAE config says 128 px is its native size (the weights work at any size)."""
    path = tmp_path_factory.mktemp("base") / "tiny-sd-128px"
    shutil.copytree(tiny_sd, path)
    config = json.loads((path / "vae" / "config.json").read_text())
    (path / "vae" / "config.json").write_text(json.dumps({**config, "sample_size": 128}))
    return path


def lora_args(digits, tiny_sd, out, *extra):
    return ["--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sd, "--output_dir", out,
            *TINY, *extra]


def fixed_unet_output(unet):
    g = torch.Generator().manual_seed(0)
    x, hidden = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 32, generator=g)
    with torch.no_grad():
        return unet(x, torch.tensor([10, 700]), hidden).sample


def fixed_text_output(pipe):
    ids = pipe.tokenizer(["a handwritten digit seven"], padding="max_length", max_length=77,
                         return_tensors="pt").input_ids
    with torch.no_grad():
        return pipe.text_encoder(ids)[0]


def trained_reference(tiny_sd, checkpoint):
    """The trained models as the run held them: base + peft adapters set from the checkpoint's own state."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    for name, model, targets in (("unet", pipe.unet, TARGETS),
                                 ("text_encoder", pipe.text_encoder, ["q_proj", "k_proj", "v_proj", "out_proj"])):
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=targets))
        set_peft_model_state_dict(model, load_file(checkpoint / name / "adapter_model.safetensors"))
    return pipe


def test_outputs_and_only_lora_parameters_train(trained, tiny_sd):
    from diffusers import StableDiffusionPipeline

    results = read_results(trained)
    assert results["global_step"] == 12 and results["num_processes"] == 1
    # No --resolution: the tiny base's native size (its VAE's sample_size), 32, and no warning about it.
    assert results["resolution"] == 32
    stderr = (trained.parent / "stderr.txt").read_text()
    assert "training images at 32 px" in stderr and "less than half the base's native" not in stderr
    base = StableDiffusionPipeline.from_pretrained(tiny_sd)
    expected = 0
    for model, targets in ((base.unet, TARGETS), (base.text_encoder, ["q_proj", "k_proj", "v_proj", "out_proj"])):
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and any(name.endswith("." + t) for t in targets):
                expected += 4 * (module.in_features + module.out_features)  # A: r x in, B: out x r
    assert results["trainable_parameters"] == expected
    info = json.loads((trained / "lora_info.json").read_text())
    assert info["base_model"] == str(tiny_sd) and info["rank"] == 4 and info["lora_alpha"] == 8
    assert info["target_modules"] == TARGETS and info["train_text_encoder"] is True
    for step in (6, 12):
        checkpoint = trained / f"checkpoint-{step}"
        assert json.loads((checkpoint / "checkpoint_info.json").read_text())["rank"] == 4
        assert (checkpoint / "lora_info.json").is_file() and (checkpoint / "pytorch_lora_weights.safetensors").is_file()
        assert sorted(p.name for p in (trained / "samples" / f"step-{step}").glob("*.png")) == ["0-0.png"]
    card = (trained / "README.md").read_text()
    assert str(tiny_sd) in card and "rank / alpha**: 4 / 8" in card and "samples/step-12/0-0.png" in card


def test_load_lora_weights_and_kohya_reproduce_the_trained_models(trained, tiny_sd):
    from diffusers import StableDiffusionPipeline

    reference = trained_reference(tiny_sd, trained / "checkpoint-12")
    base = StableDiffusionPipeline.from_pretrained(tiny_sd)
    assert (fixed_unet_output(base.unet) - fixed_unet_output(reference.unet)).abs().max() > 1e-4  # it learned
    for weight_name in (None, KOHYA):
        pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
        pipe.load_lora_weights(trained, weight_name=weight_name)
        assert (fixed_unet_output(pipe.unet) - fixed_unet_output(reference.unet)).abs().max() < 1e-5, weight_name
        assert (fixed_text_output(pipe) - fixed_text_output(reference)).abs().max() < 1e-5, weight_name
    keys = load_file(trained / KOHYA).keys()
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0.lora_down.weight" in keys
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha" in keys


def test_lora_files_carry_training_metadata(trained, tiny_sd, digits):
    """What A1111, ComfyUI and the model sites read from a LoRA's header (kohya's ss_* keys, ModelSpec's), and this
    recipe's own keys; in both files, and in each checkpoint's with its own step count. The adapter configs that
    diffusers' loader reads stay beside them (the round trip above loads alpha from them)."""
    from safetensors import safe_open

    def metadata(path):
        with safe_open(path, framework="pt") as f:
            return f.metadata()

    expected = {
        "base_model": str(tiny_sd), "resolution": "32", "rank": "4", "lora_alpha": "8",
        "target_modules": ",".join(TARGETS), "text_encoder_target_modules": "q_proj,k_proj,v_proj,out_proj",
        "steps": "12", "dataset": str(digits), "trigger": "sks style",
        "ss_base_model_version": "sd_v1", "ss_v2": "False", "ss_sd_model_name": "tiny-sd",
        "ss_network_module": "networks.lora", "ss_network_dim": "4", "ss_network_alpha": "8.0",
        "ss_resolution": "(32, 32)", "ss_steps": "12", "ss_max_train_steps": "12", "ss_learning_rate": "0.01",
        "ss_unet_lr": "0.01", "ss_text_encoder_lr": "0.005", "ss_optimizer": "torch.optim.AdamW",
        "ss_num_train_images": "64", "ss_dataset_dirs": json.dumps({"digits": {"n_repeats": 1, "img_count": 64}}),
        "ss_output_name": "run", "ss_training_comment": "train_lora.py; trigger: sks style", "ss_cache_latents": "True",
        "ss_flip_aug": "True", "ss_caption_dropout_rate": "0.2", "ss_mixed_precision": "no",
        "modelspec.architecture": "stable-diffusion-v1/lora", "modelspec.resolution": "32x32",
        "modelspec.trigger_phrase": "sks style", "modelspec.prediction_type": "epsilon", "modelspec.title": "run"}
    for path in (trained / "pytorch_lora_weights.safetensors", trained / KOHYA):
        found = metadata(path)
        assert {key: found.get(key) for key in expected} == expected, path.name
        assert all(isinstance(value, str) for value in found.values())
    assert "lora_adapter_metadata" in metadata(trained / "pytorch_lora_weights.safetensors")
    at_6 = metadata(trained / "checkpoint-6" / "pytorch_lora_weights.safetensors")
    assert (at_6["ss_steps"], at_6["steps"], at_6["ss_max_train_steps"]) == ("6", "6", "12")


def test_the_card_code_draws_what_sample_py_draws(trained, tmp_path, monkeypatch):
    """The LoRA's README.md, run as printed: sample.py's sampler (DPM-Solver++ with the base's schedule), steps and
    guidance at the run's size, the LoRA on the UNet and the text encoder."""
    from test_snippets import card_draws_what_sample_py_draws

    code = card_draws_what_sample_py_draws(trained, tmp_path, monkeypatch)
    assert "DPMSolverMultistepScheduler.from_config" in code and "num_inference_steps=30, guidance_scale=7.5" in code


@pytest.mark.parametrize("use_dora", [False, True])
@pytest.mark.parametrize("unet_targets", [TARGETS, [*TARGETS, "proj_in", "conv1", "conv_in"]],
                         ids=["attention", "attention+conv"])
def test_saved_lora_weights_load_back_into_both_models(tiny_sd, tmp_path, use_dora, unet_targets):
    """save_lora_weights, then `pipe.load_lora_weights`: the UNet and the text encoder as they were in memory, with
    LoRA and with DoRA. Pins the text encoder's DoRA magnitudes, which the file held without the `.weight` that
    transformers' load_adapter expects: it dropped them (UNEXPECTED/MISSING) and the text output moved by ~1. And
    the text encoder's keys, which lacked CLIP's `text_model.` level: transformers 4's CLIPTextModel has it, so they
    matched none of its modules there (diffusers strips the level for transformers 5, whose model has none). And a
    LoRA on attention and convolutions: diffusers' key conversion renamed only the attention keys, and the loader,
    seeing the two formats, dropped the attention layers with only a warning."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig

    from common.families import sd
    from common.lora_files import save_lora_weights

    trained = StableDiffusionPipeline.from_pretrained(tiny_sd)
    before = fixed_unet_output(trained.unet), fixed_text_output(trained)
    torch.manual_seed(0)
    text_targets = ["q_proj", "k_proj", "v_proj", "out_proj"]
    for model, targets in ((trained.unet, unet_targets), (trained.text_encoder, text_targets)):
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=targets,
                                     use_dora=use_dora))
        with torch.no_grad():  # as if trained: every LoRA weight (B starts at zero) and DoRA magnitude moved
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(0.2 * torch.randn_like(p))
    expected = fixed_unet_output(trained.unet), fixed_text_output(trained)
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(before, expected))
    save_lora_weights(tmp_path, sd, {"unet": trained.unet, "text_encoder": trained.text_encoder},
                      {"base_model": str(tiny_sd), "rank": 4, "lora_alpha": 8})
    keys = [key for key in load_file(tmp_path / "pytorch_lora_weights.safetensors") if key.startswith("text_encoder.")]
    assert keys and all(key.startswith("text_encoder.text_model.encoder.layers.") for key in keys), keys[:3]
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight" in load_file(tmp_path / KOHYA)
    for weight_name in (None,) if use_dora else (None, KOHYA):
        pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
        pipe.load_lora_weights(tmp_path, weight_name=weight_name)
        assert (fixed_unet_output(pipe.unet) - expected[0]).abs().max() < 1e-5, weight_name
        assert (fixed_text_output(pipe) - expected[1]).abs().max() < 1e-5, weight_name


def test_training_loss_on_the_training_set_falls(trained, tiny_sd, digits):
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    rows = [json.loads(line) for line in (digits / "train" / "metadata.jsonl").read_text().splitlines()[:64]]
    pixels = torch.stack([torch.tensor(np.array(Image.open(digits / "train" / r["file_name"]).convert("RGB")))
                          for r in rows]).permute(0, 3, 1, 2) / 127.5 - 1

    def loss(pipe):
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            latents = pipe.vae.encode(pixels).latent_dist.mean * pipe.vae.config.scaling_factor
            noise = torch.randn(latents.shape, generator=g)
            timesteps = torch.randint(0, 1000, (len(rows),), generator=g)
            ids = pipe.tokenizer(["sks style, " + r["text"] for r in rows], padding="max_length", max_length=77,
                                 return_tensors="pt").input_ids
            pred = pipe.unet(pipe.scheduler.add_noise(latents, noise, timesteps), timesteps,
                             pipe.text_encoder(ids)[0]).sample
        return torch.nn.functional.mse_loss(pred, noise).item()

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    before = loss(pipe)
    pipe.load_lora_weights(trained)
    after = loss(pipe)
    assert after < before - 0.005, (before, after)


def test_cached_and_uncached_latents_train_the_same(trained, digits, tiny_sd, tmp_path):
    # --cache_latents implies --center_crop; the uncached twin asks for it. Same seed -> the same batches, flips,
    # captions and noise, so the same losses and weights (up to the VAE's batch-dependent float rounding).
    twin = tmp_path / "uncached"
    launch("train_lora.py", *lora_args(digits, tiny_sd, twin, "--center_crop"))
    assert read_results(twin)["final_loss"] == pytest.approx(read_results(trained)["final_loss"], rel=1e-4)
    a, b = load_file(trained / "pytorch_lora_weights.safetensors"), load_file(twin / "pytorch_lora_weights.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


def test_resume_and_ctrl_c_stop_match_the_uninterrupted_run(trained, digits, tiny_sd, tmp_path):
    # From checkpoint-6 (the adapters must really be restored), Ctrl-C (SIGINT) stops after a complete step with
    # exit 130; `latest` finishes. Losses, LoRA weights and the final validation image equal the uninterrupted run's.
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(trained / "checkpoint-6", out / "checkpoint-6")
    args = lora_args(digits, tiny_sd, out, "--cache_latents", "--resume_from_checkpoint", "latest")
    returncode, stderr = signal_when_ready([sys.executable, ROOT / "train_lora.py", *args], out / "logs",
                                           signal.SIGINT)
    assert returncode == 130, stderr[-3000:]
    assert "SIGINT received: stopped after a complete optimizer step" in stderr and "Traceback" not in stderr
    assert max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) > 6
    launch("train_lora.py", *args)
    assert read_results(out)["global_step"] == 12
    for name in ("pytorch_lora_weights.safetensors", KOHYA):
        a, b = load_file(trained / name), load_file(out / name)
        assert a.keys() == b.keys()
        differing = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differing, differing[:5]
    reference, resumed = logged_losses(trained), logged_losses(out)
    assert [resumed[s] for s in range(7, 13)] == [reference[s] for s in range(7, 13)]
    assert read_results(out)["final_loss"] == read_results(trained)["final_loss"]
    final_image = "samples/step-12/0-0.png"
    assert (out / final_image).read_bytes() == (trained / final_image).read_bytes()


def test_load_hook_sets_the_adapter_and_upcasts(tiny_sd, tmp_path):
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    from common.lora_files import load_lora_state, save_lora_state

    unet = UNet2DConditionModel.from_pretrained(tiny_sd / "unet").requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=TARGETS))
    for name, p in unet.named_parameters():
        if "lora_B" in name:
            p.data.normal_()
    saved = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
    save_lora_state(unet, tmp_path / "unet")
    for p in unet.parameters():
        if p.requires_grad:
            p.data.zero_()  # as if restarted untrained
    load_lora_state(unet, tmp_path / "unet", torch.float32)
    restored = {n: p for n, p in unet.named_parameters() if p.requires_grad}
    assert restored.keys() == saved.keys()
    assert all(torch.equal(p, saved[n]) for n, p in restored.items())
    for p in restored.values():
        p.data = p.data.half()  # LoRA weights that came back in fp16 are upcast again
    load_lora_state(unet, tmp_path / "unet", torch.float32)
    assert all(p.dtype == torch.float32 and torch.allclose(p, saved[n], atol=1e-2) for n, p in restored.items())


def test_fp16_in_the_accelerate_config_keeps_lora_weights_fp32(tiny_sd):
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    from common.base_models import lora_dtypes

    assert lora_dtypes("fp16") == (torch.float16, torch.float32)  # the accelerator's value, e.g. from fp16.yaml
    assert lora_dtypes("bf16") == (torch.bfloat16, torch.float32)
    assert lora_dtypes("no") == (torch.float32, torch.float32)
    frozen, trainable = lora_dtypes("fp16")
    unet = UNet2DConditionModel.from_pretrained(tiny_sd / "unet", dtype=frozen).requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, init_lora_weights="gaussian", target_modules=TARGETS))
    cast_training_params(unet, dtype=trainable)  # what train_lora.py does with them
    params = dict(unet.named_parameters())
    assert all(p.dtype == torch.float32 for n, p in params.items() if p.requires_grad)
    assert all(p.dtype == torch.float16 for n, p in params.items() if not p.requires_grad)
    assert sum(p.requires_grad for p in params.values()) > 0


def test_bad_input_is_one_line_and_writes_nothing(trained, digits, tiny_sd, tmp_path):
    out = tmp_path / "out"
    base = ["--train_data_dir", digits, "--output_dir", out]
    assert_one_line_error(run_script("train_lora.py", *base, "--pretrained_model_name_or_path", digits),
                          "is not a pipeline folder", "make tiny-sd")
    sd = [*base, "--pretrained_model_name_or_path", tiny_sd, "--max_train_steps", "1"]
    assert_one_line_error(run_script("train_lora.py", *sd, "--target_modules", "to_q,to_kk"),
                          "'to_kk' matches no module of the UNet", "closest module names: to_k")
    assert_one_line_error(run_script("train_lora.py", *sd, "--caption_column", "caption"),
                          "--caption_column 'caption' is not a column", "text")
    assert not out.exists()
    out.mkdir()
    shutil.copytree(trained / "checkpoint-6", out / "checkpoint-6")
    assert_one_line_error(run_script("train_lora.py", *sd, "--rank", "8", "--resume_from_checkpoint", "latest"),
                          "rank=4 (now 8)")
    assert_one_line_error(run_script("train_lora.py", *sd, "--rank", "4", "--lora_alpha", "8", "--train_text_encoder",
                                     "--target_modules", "to_q", "--resume_from_checkpoint", "latest"),
                          "target_modules=")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6"]


def test_sample_py_with_a_train_lora_output_and_another_lora(trained, tiny_sd, digits, tmp_path, capsys):
    samples = tmp_path / "samples"
    run_in_process("sample.py", "--model", trained, "--lora", f"{trained / KOHYA}:0.5", "--prompt", "a digit one",
                   "--prompt", "a handwritten digit seven", "--num_images", "2", "--num_inference_steps", "3",
                   "--scheduler", "euler_a", "--negative_prompt", "blurry", "--output_dir", samples)
    printed = capsys.readouterr().out
    # Each LoRA's training metadata, one short block before the images.
    assert printed.startswith(f"LoRA {trained} (scale 1):\n  base model: {tiny_sd} (sd_v1), trained at 32x32\n"
                              "  rank 4, alpha 8, on to_k, to_q, to_v, to_out.0 and the text encoder\n"
                              f"  trained 12 steps on {digits} (64 images), learning rate 0.01, torch.optim.AdamW\n"
                              "  trigger: sks style (put it in the prompt)\n"
                              f"LoRA {trained / KOHYA} (scale 0.5):\n"), printed
    from PIL import Image

    images = sorted(samples.glob("0*.png"))
    assert len(images) == 4 and Image.open(samples / "grid.png").size == (64, 64)
    meta = Image.open(images[3]).text
    assert meta["prompt"] == "a handwritten digit seven" and meta["seed"] == "1" and meta["scheduler"] == "euler_a"
    assert meta["lora"] == f"{trained}:1,{trained / KOHYA}:0.5" and meta["negative_prompt"] == "blurry"

    import sample  # the same image again, alone, in this process: its seed is in its metadata

    flags = ["--model", str(trained), "--lora", f"{trained / KOHYA}:0.5", "--prompt", "a handwritten digit seven",
             "--num_images", "1", "--seed", "1", "--num_inference_steps", "3", "--scheduler", "euler_a",
             "--negative_prompt", "blurry"]
    again = [sample.sample_pipeline(sample.parse_args([*flags, "--output_dir", str(tmp_path / f"again{i}")]))[0]
             for i in range(2)]
    pixels = [np.asarray(Image.open(path), dtype=np.int16) for path in (*again, images[3])]
    assert np.array_equal(pixels[0], pixels[1])  # the same command, the same pixels
    assert np.abs(pixels[0] - pixels[2]).max() <= 2  # alone vs in a batch of 4: float rounding only


def test_sample_py_bad_input(tiny_sd, tmp_path):
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from demo.tiny_sd import build_tiny_sd

    assert_one_line_error(run_script("sample.py", "--model", tiny_sd), "give at least one --prompt")
    other = build_tiny_sd(unet_channels=(64, 128)).unet  # a LoRA made for another base: other shapes
    other.add_adapter(LoraConfig(r=4, init_lora_weights="gaussian", target_modules=TARGETS))
    StableDiffusionPipeline.save_lora_weights(tmp_path / "other", unet_lora_layers=convert_state_dict_to_diffusers(
        get_peft_model_state_dict(other)))
    proc = run_script("sample.py", "--model", tiny_sd, "--lora", tmp_path / "other", "--prompt", "x",
                      "--output_dir", tmp_path / "s")
    assert_one_line_error(proc, "does not fit the base model", "size mismatch")
    assert not (tmp_path / "s").exists()


def test_defaults_suit_a_real_base(digits, tiny_sd, base_128px, tmp_path):
    """Pins the defaults that suited only the tiny base (32 px, LR 2e-3, batch 32): a user who changed only the base
    to SD 1.5 trained at 32 px with 20x the usual LR. Now: the base's native size, LR 1e-4, batch 16."""
    from train_lora import parse_args

    proc = subprocess.run([sys.executable, str(ROOT / "train_lora.py"), "--help"], env=offline_env(),
                          capture_output=True, text=True, timeout=60)
    text = " ".join(proc.stdout.split())
    assert "--learning_rate LEARNING_RATE Peak learning rate (after any warm-up). (default: 0.0001)" in text
    assert "--train_batch_size TRAIN_BATCH_SIZE Batch size per device. (default: 16)" in text
    assert "--resolution RESOLUTION Square training resolution; default: the base model's native one" in text
    flags = ["--train_data_dir", str(digits), "--output_dir", str(tmp_path / "parsed")]
    assert parse_args([*flags, "--pretrained_model_name_or_path", str(tiny_sd)]).resolution == 32
    assert parse_args([*flags, "--pretrained_model_name_or_path", str(base_128px)]).resolution == 128
    args = parse_args([*flags, "--pretrained_model_name_or_path", str(base_128px), "--resolution", "48"])
    assert (args.resolution, args.learning_rate, args.train_batch_size) == (48, 1e-4, 16)
    # --cache_latents encodes a quarter of a training batch at once by default
    assert args.vae_encode_batch_size == 4
    assert parse_args([*flags, "--train_batch_size", "2"]).vae_encode_batch_size == 1
    assert parse_args([*flags, "--vae_encode_batch_size", "32"]).vae_encode_batch_size == 32


def test_a_resolution_far_below_the_bases_warns_and_trains(digits, base_128px, tmp_path):
    out = tmp_path / "small"
    proc = run_script("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", base_128px,
                      "--output_dir", out, "--resolution", "32", "--max_train_samples", "8", "--train_batch_size", "4",
                      "--max_train_steps", "1", "--cache_latents", "--report_to", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "less than half the base's native" in line]
    assert len(warnings) == 1 and "--resolution 32 is less than half the base's native 128 px" in warnings[0]
    assert "leave --resolution out to train at 128" in warnings[0]
    assert read_results(out)["resolution"] == 32  # a warning, not an error
    # cached latents and prompt embeddings, no validation images: the VAE and the text encoder leave the device
    assert "the VAE and the text encoder moved to the CPU" in proc.stderr


def test_help_is_fast():
    start = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "train_lora.py"), "--help"], env=offline_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--target_modules" in proc.stdout and "--cache_latents" in proc.stdout
    assert time.time() - start < 5
    assert "import torch" not in (ROOT / "train_lora.py").read_text().split("def main")[0]
