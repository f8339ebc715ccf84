"""common/pipelines.py: model_kind on a real folder of every kind (built here, tiny, random weights), and the class
label lookup that sample.py and inspect_pipeline.py share."""
import json
import shutil

import pytest

from common.cli import UserError
from common.pipelines import class_label_ids, model_kind, read_labels


def tiny_sdxl(path):
    """A StableDiffusionXLPipeline with random weights, in diffusers' own test sizes."""
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from demo.tiny_sd import byte_level_vocab

    torch.manual_seed(0)
    vocab = byte_level_vocab()
    text = CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=4, projection_dim=32, bos_token_id=vocab["<|startoftext|>"],
                          eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"])
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
        cross_attention_dim=64, norm_num_groups=16)
    vae = AutoencoderKL(block_out_channels=(32, 64), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        norm_num_groups=16, sample_size=16)
    StableDiffusionXLPipeline(
        vae=vae, text_encoder=CLIPTextModel(text), text_encoder_2=CLIPTextModelWithProjection(text),
        tokenizer=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77),
        tokenizer_2=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77),
        unet=unet, scheduler=EulerDiscreteScheduler()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_sd):
    """One folder of each kind, as the recipes (or diffusers) write it."""
    from diffusers import DDPMPipeline, DDPMScheduler, StableDiffusionPipeline, UNet2DModel
    from peft import LoraConfig

    from common.families import sd
    from common.lora_files import save_lora_weights

    root = tmp_path_factory.mktemp("kinds")
    paths = {"sd": tiny_sd, "sdxl": tiny_sdxl(root / "sdxl")}
    unet = UNet2DModel(sample_size=8, block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4, num_class_embeds=3)
    DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=100)).save_pretrained(root / "ddpm")
    (root / "ddpm" / "labels.json").write_text(json.dumps(["cat", "dog"]))  # train_ddpm.py's output layout
    paths["ddpm"] = root / "ddpm"
    checkpoint = paths["checkpoint"] = root / "run" / "checkpoint-4"  # train_ddpm.py --use_ema's layout
    for part in ("unet", "unet_ema", "scheduler"):
        shutil.copytree(root / "ddpm" / ("unet" if part == "unet_ema" else part), checkpoint / part)
    shutil.copy(root / "ddpm" / "labels.json", checkpoint)
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    pipe.unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]))
    paths["lora"] = root / "lora"
    save_lora_weights(str(paths["lora"]), sd, {"unet": pipe.unet}, {"base_model": str(tiny_sd), "rank": 2})
    return paths


@pytest.mark.parametrize("kind", ["sd", "sdxl", "lora", "ddpm", "checkpoint"])
def test_model_kind_of_each_folder(folders, kind):
    assert model_kind(str(folders[kind])) == kind


def test_model_kind_of_a_lora_checkpoint_and_a_hub_id(folders, tmp_path):
    checkpoint = tmp_path / "checkpoint-6"  # train_lora.py's checkpoints hold the same two files beside the state
    checkpoint.mkdir()
    for name in ("pytorch_lora_weights.safetensors", "lora_info.json"):
        shutil.copy(folders["lora"] / name, checkpoint)
    assert model_kind(str(checkpoint)) == "lora"
    assert model_kind("stable-diffusion-v1-5/stable-diffusion-v1-5") == "hub"


def test_model_kind_refuses_what_is_no_model(tmp_path):
    (tmp_path / "classifier").mkdir()
    (tmp_path / "classifier" / "config.json").write_text("{}")
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="--model '.*classifier' is not a diffusion pipeline .*model_index.json"):
        model_kind(str(tmp_path / "classifier"), "--model")
    for path in (tmp_path / "weights.safetensors", tmp_path / "missing"):
        with pytest.raises(UserError, match="is neither a folder nor a hub id"):
            model_kind(str(path))


def test_class_labels_by_name_id_or_all(folders):
    names = read_labels(str(folders["checkpoint"]))
    assert names == ["cat", "dog"] and read_labels(str(folders["sd"])) is None
    assert class_label_ids(["dog", "0"], names) == [1, 0]
    assert class_label_ids(["all"], names, allow_all=True) == [0, 1]
    with pytest.raises(UserError, match=r"--class_label 'all' is not a class of this model; its classes are: "
                                        r"cat, dog \(or ids 0-1\)$"):
        class_label_ids(["all"], names)
    with pytest.raises(UserError, match=r"'2' is not a class .*\(or ids 0-1, or 'all'\)$"):
        class_label_ids(["2"], names, allow_all=True)
