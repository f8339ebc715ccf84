"""train_lora.py on a Stable Diffusion XL base (the tiny random-init one of `make tiny-sdxl`): both text encoders
trained, what it writes (diffusers' and kohya's SDXL formats, read back by StableDiffusionXLPipeline to the trained
models), an exact resume, two processes with aspect-ratio buckets, and SDXL's per-image time ids."""
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, launch, logged_losses, read_results, run_in_process, run_script
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from test_buckets import write_mixed_folder
from test_sdxl_sampling import pixels

TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
UNET_TARGETS = ["to_k", "to_q", "to_v", "to_out.0", "conv1", "conv2", "conv"]  # "conv": the down/upsamplers
TINY = ["--max_train_samples", "32", "--train_batch_size", "8", "--max_train_steps", "4", "--checkpointing_steps", "2",
        "--rank", "4", "--lora_alpha", "8", "--learning_rate", "1e-2", "--train_text_encoder", "--random_flip",
        "--logging_steps", "1", "--target_modules", ",".join(UNET_TARGETS), "--validation_prompt",
        "a handwritten digit seven", "--validation_steps", "4", "--num_validation_images", "1",
        "--validation_inference_steps", "2", "--caption_prefix", "sks, "]
KOHYA = "pytorch_lora_weights_ui.safetensors"


@pytest.fixture(scope="module")
def trained(digits, tiny_sdxl, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-sdxl") / "run"
    launch("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sdxl,
           "--output_dir", out, *TINY)
    return out


def fixed_outputs(pipe):
    """The UNet's output on fixed inputs (with SDXL's added conditioning) and both text encoders' on one prompt."""
    g = torch.Generator().manual_seed(0)
    x, hidden = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 96, generator=g)
    added = {"text_embeds": torch.randn(2, 64, generator=g),
             "time_ids": torch.tensor([[32.0, 48, 0, 8, 32, 32], [40, 24, 4, 0, 40, 24]])}
    ids = pipe.tokenizer(["sks, a handwritten digit seven"], padding="max_length", max_length=77,
                         return_tensors="pt").input_ids
    with torch.no_grad():
        return (pipe.unet(x, torch.tensor([10, 700]), hidden, added_cond_kwargs=added).sample,
                pipe.text_encoder(ids)[0], pipe.text_encoder_2(ids)[0])


def trained_reference(tiny_sdxl, checkpoint):
    """The trained models as the run held them: the base with peft adapters set from the checkpoint's own state."""
    from diffusers import StableDiffusionXLPipeline
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
    first_layer = [f"layers.0.self_attn.{t}" for t in TEXT_TARGETS]  # the 2-layer first encoder's last is unread
    for name, targets in (("unet", UNET_TARGETS), ("text_encoder", first_layer), ("text_encoder_2", TEXT_TARGETS)):
        model = getattr(pipe, name)
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=targets))
        result = set_peft_model_state_dict(model, load_file(checkpoint / name / "adapter_model.safetensors"))
        assert not result.unexpected_keys
    return pipe


def test_an_sdxl_lora_trains_both_text_encoders_and_says_what_it_is(trained, tiny_sdxl):
    results = read_results(trained)
    assert results["global_step"] == 4 and results["resolution"] == 32
    info = json.loads((trained / "lora_info.json").read_text())
    assert info["base_model"] == str(tiny_sdxl) and info["train_text_encoder"] and info["trigger"] == "sks"
    for step in (2, 4):
        assert {p.name for p in (trained / f"checkpoint-{step}").iterdir() if p.is_dir()} == {
            "unet", "text_encoder", "text_encoder_2"}
    with safe_open(trained / "pytorch_lora_weights.safetensors", "pt") as f:
        metadata, keys = f.metadata(), list(f.keys())
    assert metadata["ss_base_model_version"] == "sdxl_base_v1-0"
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    from common.lora_files import describe_lora  # what sample.py prints of it

    assert "and both CLIP text encoders" in describe_lora(metadata)[1]
    assert any(k.startswith("text_encoder_2.") for k in keys) and any(k.startswith("text_encoder.") for k in keys)
    # no LoRA on the first text encoder's last layer: SDXL reads its penultimate hidden states
    assert not any(k.startswith("text_encoder.text_model.encoder.layers.1.") for k in keys)
    assert any(k.startswith("text_encoder_2.text_model.encoder.layers.1.") for k in keys)
    assert "StableDiffusionXLPipeline.from_pretrained" in (trained / "README.md").read_text()
    assert (trained / "samples" / "step-4" / "0-0.png").is_file()


def test_load_lora_weights_and_the_kohya_file_give_back_the_trained_models(trained, tiny_sdxl):
    from diffusers import StableDiffusionXLPipeline

    expected = fixed_outputs(trained_reference(tiny_sdxl, trained / "checkpoint-4"))
    base = fixed_outputs(StableDiffusionXLPipeline.from_pretrained(tiny_sdxl))
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(expected, base))  # all three learned
    for weight_name in (None, KOHYA):
        pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
        pipe.load_lora_weights(trained, weight_name=weight_name)
        for what, a, b in zip(("unet", "text_encoder", "text_encoder_2"), fixed_outputs(pipe), expected):
            assert (a - b).abs().max() < 1e-5, (weight_name, what)
    keys = load_file(trained / KOHYA).keys()  # kohya's SDXL names: the sgm UNet's modules, lora_te1 and lora_te2
    for key in ("lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q", "lora_unet_input_blocks_1_0_in_layers_2",
                "lora_unet_input_blocks_2_0_op", "lora_unet_middle_block_2_out_layers_3",
                "lora_unet_output_blocks_1_2_conv", "lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
                "lora_te2_text_model_encoder_layers_1_self_attn_out_proj"):
        assert f"{key}.lora_down.weight" in keys and f"{key}.alpha" in keys, key


def test_validation_images_are_what_sample_py_draws(trained, tmp_path):
    """The run's last validation image (in-memory peft layers on the UNet and both encoders, an SDXL pipeline built
    from the parts) against sample.py on the saved LoRA: same sampler, seed, steps and guidance. sample.py itself is
    checked against diffusers' pipeline in test_sdxl_sampling.py."""
    run_in_process("sample.py", "--model", trained, "--prompt", "a handwritten digit seven", "--num_images", "1",
                   "--num_inference_steps", "2", "--seed", "42", "--output_dir", tmp_path / "samples")
    validation, sampled = pixels(trained / "samples" / "step-4" / "0-0.png"), pixels(tmp_path / "samples" / "0000.png")
    assert validation.shape == sampled.shape == (32, 32, 3)
    assert np.abs(validation - sampled).max() <= 1


def test_the_card_code_draws_what_sample_py_draws(trained, tmp_path, monkeypatch):
    from test_snippets import card_draws_what_sample_py_draws

    assert "StableDiffusionXLPipeline" in card_draws_what_sample_py_draws(trained, tmp_path, monkeypatch)


def test_a_resumed_sdxl_run_matches_the_uninterrupted_one(trained, digits, tiny_sdxl, tmp_path):
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(trained / "checkpoint-2", out / "checkpoint-2")
    launch("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sdxl,
           "--output_dir", out, *TINY, "--resume_from_checkpoint", "latest")
    for name in ("pytorch_lora_weights.safetensors", KOHYA):
        a, b = load_file(trained / name), load_file(out / name)
        assert a.keys() == b.keys() and not [k for k in a if not torch.equal(a[k], b[k])], name
    reference, resumed = logged_losses(trained), logged_losses(out)
    assert [resumed[s] for s in (3, 4)] == [reference[s] for s in (3, 4)]


def test_two_processes_with_buckets(tiny_sdxl, tmp_path):
    """Wide, tall and square images in their buckets, cached latents of both flips and the time ids of each, the
    text encoders training, on two processes; the held-out loss at step 0 is the one-process value (the same images,
    shared out)."""
    data = write_mixed_folder(tmp_path / "mixed")
    args = ["--train_data_dir", data, "--pretrained_model_name_or_path", tiny_sdxl, "--resolution", "32",
            "--buckets", "auto", "--train_batch_size", "2", "--max_train_steps", "2", "--rank", "2",
            "--train_text_encoder", "--cache_latents", "--random_flip", "--validation_split", "0.15",
            "--validation_steps", "2", "--checkpointing_steps", "100", "--report_to", "tensorboard"]
    two = launch("train_lora.py", *args, "--output_dir", tmp_path / "two", config="cpu_2proc.yaml")
    assert "aspect-ratio buckets at 32 px" in two.stderr
    results = read_results(tmp_path / "two")
    assert results["num_processes"] == 2 and results["global_step"] == 2
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
    pipe.load_lora_weights(tmp_path / "two")
    assert {"unet", "text_encoder", "text_encoder_2"} <= set(pipe.get_list_adapters())
    image = pipe("a gradient, wide", height=24, width=40, num_inference_steps=2, output_type="np").images[0]
    assert image.shape == (24, 40, 3) and np.isfinite(image).all()
    one = launch("train_lora.py", *args, "--max_train_steps", "1", "--output_dir", tmp_path / "one")
    assert one.returncode == 0
    assert abs(read_results(tmp_path / "one")["validation_losses"]["0"]
               - results["validation_losses"]["0"]) < 1e-5


@pytest.mark.parametrize("random_flip", [False, True])
@pytest.mark.parametrize("buckets", [False, True])
def test_time_ids_say_where_each_training_crop_came_from(tmp_path, random_flip, buckets):
    """SDXL's time ids (original size, crop top-left, trained size) against the pixels the dataset really returns:
    the crop at (top, left) of the resized original is the training image (mirrored back when flipped)."""
    import datasets

    from common.image_data import ImageDataset, image_sizes

    shapes = [(48, 32), (32, 60), (40, 40), (90, 50)]  # (width, height)
    paths = []
    for i, (w, h) in enumerate(shapes):
        y, x = np.mgrid[0:h, 0:w]
        pixels = np.stack([x * 255 // w, y * 255 // h, (x * y) % 251], -1).astype(np.uint8)
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(pixels).save(paths[-1])
    ds = datasets.Dataset.from_dict({"image": paths}).cast_column("image", datasets.Image())
    originals = image_sizes(ds, "image")[0]
    sizes = [(24, 40), (40, 24), (32, 32), (24, 40)] if buckets else None
    data = ImageDataset(ds, "image", 32, center_crop=False, random_flip=random_flip, seed=3, sizes=sizes,
                        original_sizes=originals)
    seen_flip = False
    for epoch in range(4):
        data.set_epoch(epoch)
        ids = data.time_ids(range(len(shapes)))
        for i, (oh, ow, top, left, th, tw) in enumerate(ids.int().tolist()):
            assert (oh, ow) == originals[i] and (th, tw) == data.crop_size(i)
            image = Image.open(paths[i])
            scale = max(th / oh, tw / ow) if buckets else 32 / min(oh, ow)
            h, w = max(th, round(oh * scale)), max(tw, round(ow * scale))
            resized = torch.from_numpy(np.asarray(image.resize((w, h), Image.BILINEAR)).copy()).permute(2, 0, 1)
            flipped = data.placement(i, *(data.crop_size(i) if buckets else (h, w)))[2]
            seen_flip |= flipped
            view = resized.flip(-1) if flipped else resized  # a flipped item's crop lies in the mirrored image
            assert torch.equal(view[:, top:top + th, left:left + tw], data.crop(i)), (epoch, i)
    assert seen_flip == random_flip


def test_an_unknown_pipeline_class_is_one_line(digits, tiny_sdxl, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_sdxl, base)
    index = json.loads((base / "model_index.json").read_text())
    (base / "model_index.json").write_text(json.dumps({**index, "_class_name": "KandinskyV22Pipeline"}))
    proc = run_script("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", base,
                      "--output_dir", tmp_path / "out")
    assert_one_line_error(proc, "KandinskyV22Pipeline", "StableDiffusionXLPipeline", "FluxPipeline")
    assert not (tmp_path / "out").exists()
