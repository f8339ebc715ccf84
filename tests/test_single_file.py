"""The single-file checkpoint (common/single_file_checkpoint.py, train_text_to_image.py --save_model_as
safetensors): read back by diffusers' from_single_file to the same models, with the key set ComfyUI's checkpoint
loader reads (pinned from its live run by tests/tools/check_single_file.py, in tests/pinned/), written by a real
train_text_to_image.py run; and the `text_model.` keys of every CLIP text encoder the project saves
(common/text_encoder_keys.py)."""
import json
import shutil

import pytest
import torch
from conftest import ROOT, assert_one_line_error, launch, run_script
from safetensors import safe_open
from safetensors.torch import load_file, save_file

PINNED = json.loads((ROOT / "tests" / "pinned" / "comfyui_checkpoint_keys.json").read_text())
SHIPPED_TEXT_ENCODER = ROOT / "assets" / "tiny-sd-digits" / "text_encoder"
# What ComfyUI's model has and a diffusers pipeline has not, so the file cannot hold it: the text projection of SD 2's
# OpenCLIP tower (nothing in SD 2 reads it) and OpenCLIP's logit_scale (for image-text matching). ComfyUI's loader
# leaves them at their initial values and logs them at DEBUG only (comfy/sd.py filters exactly these two).
MISSING_OK = {"sd2": ("cond_stage_model.model.text_projection", "cond_stage_model.model.logit_scale"),
              "sdxl": ("conditioner.embedders.1.model.logit_scale",)}


def outputs(pipe, seed=0):
    """The UNet's, text encoders' and VAE's outputs on fixed inputs."""
    g = torch.Generator().manual_seed(seed)
    unet, vae = pipe.unet, pipe.vae
    x = torch.randn(2, 4, 8, 8, generator=g)
    context = torch.randn(2, 77, unet.config.cross_attention_dim, generator=g)
    added = None
    if unet.config.addition_embed_type == "text_time":
        added = {"text_embeds": torch.randn(2, pipe.text_encoder_2.config.projection_dim, generator=g),
                 "time_ids": torch.tensor([[32.0, 32, 0, 0, 32, 32]] * 2)}
    ids = pipe.tokenizer(["a handwritten digit seven", ""], padding="max_length", max_length=77,
                         return_tensors="pt").input_ids
    image = torch.rand(2, 3, 32, 32, generator=g) * 2 - 1
    with torch.no_grad():
        out = {"unet": unet(x, torch.tensor([10, 700]), context, added_cond_kwargs=added).sample,
               "vae.decode": vae.decode(x).sample, "vae.encode": vae.encode(image).latent_dist.mean}
        for name in ("text_encoder", "text_encoder_2"):
            if getattr(pipe, name, None) is not None:
                result = getattr(pipe, name)(ids)
                out[name] = result.last_hidden_state
                if hasattr(result, "text_embeds"):
                    out[name + ".projected"] = result.text_embeds
    return out


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_from_single_file_reads_back_the_same_models(kind, tiny_sd, tiny_sdxl, tmp_path):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    from common.single_file_checkpoint import save_single_file

    base, cls = (tiny_sd, StableDiffusionPipeline) if kind == "sd" else (tiny_sdxl, StableDiffusionXLPipeline)
    pipe = cls.from_pretrained(base)
    path = tmp_path / "model.safetensors"
    metadata = save_single_file(pipe, str(path))
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == metadata
        keys = set(f.keys())
    assert metadata["modelspec.architecture"] == ("stable-diffusion-xl-v1-base" if kind == "sdxl"
                                                  else "stable-diffusion-v1")
    prefixes = ["model.diffusion_model.", "first_stage_model.",
                *(["conditioner.embedders.0.transformer.text_model.", "conditioner.embedders.1.model."]
                  if kind == "sdxl" else ["cond_stage_model.transformer.text_model."])]
    assert all(any(key.startswith(p) for key in keys) for p in prefixes)
    assert all(key.startswith(tuple(prefixes)) for key in keys)
    back = cls.from_single_file(str(path), config=str(base), local_files_only=True)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if getattr(pipe, name, None) is None:
            continue
        ours, theirs = getattr(pipe, name).state_dict(), getattr(back, name).state_dict()
        assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours), name
    expected, got = outputs(pipe), outputs(back)
    for name, value in expected.items():
        assert (value - got[name]).abs().max().item() < 1e-5, name


def meta_pipeline(architecture):
    """The real architecture's models, without memory (meta tensors): the converter only renames and reshapes."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from demo.tiny_sd import SD2, SD15, SDXL

    configs = {"sd15": SD15, "sd2": SD2, "sdxl": SDXL}[architecture]
    with torch.device("meta"):
        models = [UNet2DConditionModel(**configs["unet"]), AutoencoderKL(**configs["vae"]),
                  [CLIPTextModel(CLIPTextConfig(**configs["text"]))]]
        if "text_2" in configs:
            models[2].append(CLIPTextModelWithProjection(CLIPTextConfig(**configs["text_2"])))
    return models


@pytest.mark.parametrize("architecture", sorted(PINNED))
def test_the_keys_are_those_comfyuis_checkpoint_loader_reads(architecture):
    from common.single_file_checkpoint import single_file_weights

    pinned = PINNED[architecture]["keys"]
    ours = {key: list(tensor.shape) for key, tensor in single_file_weights(*meta_pipeline(architecture)).items()}
    assert sorted(set(ours) - set(pinned)) == []  # nothing ComfyUI would leave over
    missing = set(pinned) - set(ours)
    assert all(key in MISSING_OK.get(architecture, ()) for key in missing), sorted(missing)[:5]
    assert {key: shape for key, shape in ours.items() if pinned[key] != shape} == {}
    expected = {"sd15": "SD15", "sd2": "SD20", "sdxl": "SDXL"}[architecture]
    assert PINNED[architecture]["model_config"] == expected  # what ComfyUI detected in the live run


def test_train_text_to_image_writes_the_single_file(digits, tiny_sd, tmp_path):
    from diffusers import StableDiffusionPipeline

    out = tmp_path / "digits-run"
    launch("train_text_to_image.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sd,
           "--output_dir", out, "--caption_column", "captions", "--max_train_samples", "16", "--train_batch_size",
           "8", "--max_train_steps", "2", "--prediction_type", "v_prediction", "--save_model_as", "safetensors",
           "--report_to", "none")
    path = out / "digits-run.safetensors"
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["modelspec.prediction_type"] == "v" and "v_pred" in f.keys()  # ComfyUI's marker
    with safe_open(str(out / "text_encoder" / "model.safetensors"), "pt") as f:
        assert all(key.startswith("text_model.") for key in f.keys())
    back = StableDiffusionPipeline.from_single_file(str(path), config=str(out), local_files_only=True)
    trained = load_file(out / "unet" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(back.unet.state_dict()[k], v) for k, v in trained.items())
    base_unet = load_file(tiny_sd / "unet" / "diffusion_pytorch_model.safetensors")
    assert any(not torch.equal(base_unet[k], v) for k, v in trained.items())  # the trained UNet, not the base's
    assert back.scheduler.config.prediction_type == "v_prediction"


def test_a_model_the_layout_cannot_hold_is_one_line_and_writes_nothing(digits, tiny_sd, tmp_path):
    out = tmp_path / "out"
    args = ["--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sd, "--output_dir", out,
            "--caption_column", "captions", "--max_train_steps", "1"]
    assert_one_line_error(run_script("train_text_to_image.py", *args, "--save_model_as", "ckpt"),
                          "--save_model_as", "invalid choice")
    config = json.loads((tiny_sd / "unet" / "config.json").read_text())
    (tmp_path / "class.json").write_text(json.dumps({**config, "class_embed_type": "timestep"}))
    assert_one_line_error(run_script("train_text_to_image.py", *args, "--save_model_as", "safetensors",
                                     "--unet_config", tmp_path / "class.json"),
                          "--save_model_as safetensors: the UNet has class_embed_type 'timestep'", "cannot hold")
    (tmp_path / "uneven.json").write_text(json.dumps({**config, "layers_per_block": [1, 2]}))
    assert_one_line_error(run_script("train_text_to_image.py", *args, "--save_model_as", "safetensors",
                                     "--unet_config", tmp_path / "uneven.json"), "differs from level to level")
    assert not out.exists()


def test_the_converter_refuses_what_has_no_place_in_one_line():
    from diffusers import UNet2DConditionModel

    from common.cli import UserError
    from common.single_file_checkpoint import unet_weights

    config = dict(block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32, norm_num_groups=16,
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), attention_head_dim=4,
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    with torch.device("meta"):
        plain = UNet2DConditionModel(**config)
        projected = UNet2DConditionModel(**config, class_embed_type="projection",
                                         projection_class_embeddings_input_dim=8)
    assert len(unet_weights(plain.state_dict(), dict(plain.config), "flag")) == len(plain.state_dict())
    with pytest.raises(UserError, match="class_embed_type 'projection'") as err:
        unet_weights(projected.state_dict(), dict(projected.config), "flag")
    assert "\n" not in str(err.value)
    state = dict(plain.state_dict(), **{"mid_block.attentions.1.norm.weight": torch.zeros(1)})
    with pytest.raises(UserError, match="mid_block.attentions.1.norm.weight has no place"):
        unet_weights(state, dict(plain.config), "flag")


def test_every_saved_clip_text_encoder_names_its_keys_text_model(tiny_sd, tiny_sdxl, tmp_path):
    from transformers import CLIPTextModel

    from common.text_encoder_keys import add_text_model_prefix

    for folder in (SHIPPED_TEXT_ENCODER, tiny_sd / "text_encoder", tiny_sdxl / "text_encoder",
                   tiny_sdxl / "text_encoder_2"):
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            assert all(key.startswith("text_model.") or key == "text_projection.weight" for key in f.keys()), folder
    # The shipped file as transformers 5 wrote it (no prefix): transformers reads both to the same model, and the
    # rewrite keeps every tensor bit for bit, and the file's metadata.
    plain = tmp_path / "text_encoder"
    plain.mkdir()
    shutil.copy(SHIPPED_TEXT_ENCODER / "config.json", plain)
    with safe_open(str(SHIPPED_TEXT_ENCODER / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
        shipped = {key: f.get_tensor(key) for key in f.keys()}
    save_file({key.removeprefix("text_model."): t for key, t in shipped.items()}, plain / "model.safetensors",
              metadata=metadata)
    old, info = CLIPTextModel.from_pretrained(plain, output_loading_info=True)
    new, new_info = CLIPTextModel.from_pretrained(SHIPPED_TEXT_ENCODER, output_loading_info=True)
    assert not any(info.values()) and not any(new_info.values())  # no missing, unexpected or mismatched keys
    assert all(torch.equal(old.state_dict()[k], v) for k, v in new.state_dict().items())
    assert add_text_model_prefix(plain) == [str(plain / "model.safetensors")]
    assert add_text_model_prefix(plain) == []  # once is enough
    with safe_open(str(plain / "model.safetensors"), "pt") as f:
        assert f.metadata() == metadata and set(f.keys()) == set(shipped)
        assert all(torch.equal(f.get_tensor(key), tensor) for key, tensor in shipped.items())
    before = (tiny_sdxl / "text_encoder_2" / "model.safetensors").read_bytes()
    shutil.copytree(tiny_sdxl / "text_encoder_2", tmp_path / "text_encoder_2")
    assert add_text_model_prefix(tmp_path / "text_encoder_2") == []  # CLIPTextModelWithProjection: left alone
    assert (tmp_path / "text_encoder_2" / "model.safetensors").read_bytes() == before
