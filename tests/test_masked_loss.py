"""Masked loss (train_lora.py --masked_loss, common/loss_masks.py): the objectives' masked loss is the plain loss under
an all-ones mask and ignores what a mask leaves out; a mask follows its image through resize, crops, flips, buckets and
the latent cache; end to end with a mask folder and with alpha channels (the same data both ways: the same losses);
a masked run's losses below the unmasked run's; the one-line errors of mask files that do not fit."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, assert_one_line_error, launch, logged_losses, read_results, run_script
from PIL import Image

from common.cli import UserError
from common.image_data import CachedLatents, ImageDataset
from common.objectives import DDPM, FlowMatching

BASE = ROOT / "assets" / "tiny-flux-digits"


def objectives():
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    ddpm = DDPMScheduler(num_train_timesteps=100, prediction_type="v_prediction")
    flow = FlowMatchEulerDiscreteScheduler(num_train_timesteps=100, shift=3.0)
    return {"ddpm min-SNR": DDPM(ddpm, snr_gamma=5.0), "flow sigma_sqrt": FlowMatching(flow, "sigma_sqrt"),
            "flow preconditioned": FlowMatching(flow, "logit_normal", precondition_outputs=True)}


@pytest.mark.parametrize("name", ["ddpm min-SNR", "flow sigma_sqrt", "flow preconditioned"])
def test_all_ones_mask_is_the_plain_loss_and_a_masked_out_region_is_ignored(name):
    objective = objectives()[name]
    torch.manual_seed(0)
    latents = torch.randn(3, 4, 8, 8)
    noised = objective(latents)
    prediction = torch.randn(3, 4, 8, 8)
    plain = objective.losses(prediction, noised)
    assert torch.equal(objective.losses(prediction, noised, torch.ones(3, 1, 8, 8)), plain)
    mask = torch.ones(3, 1, 8, 8)
    mask[:, :, :, :3] = 0  # the left three columns ignored
    masked = objective.losses(prediction, noised, mask)
    changed = prediction.clone()
    changed[:, :, :, :3] += 10
    assert torch.equal(objective.losses(changed, noised, mask), masked)
    assert (objective.losses(changed, noised) > plain).all()  # (the change is one the plain loss sees)
    changed[:, :, :, 3:] += 1  # inside the mask: seen
    assert not torch.equal(objective.losses(changed, noised, mask), masked)
    # not divided by the mask's sum (kohya's mean): a half-weight mask halves the loss
    assert torch.allclose(objective.losses(prediction, noised, torch.full((3, 1, 8, 8), 0.5)), plain / 2)


def write_images(folder, sizes, mask_folder=None, alpha=False):
    """Images of random colours (`sizes`: (height, width)s) and a mask for each that is its own red channel: in
    `mask_folder` (a grey PNG of the same name) or as its alpha channel. -> the datasets.Dataset of the images."""
    import datasets

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    paths = []
    for i, (h, w) in enumerate(sizes):
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        rgb[..., 0] = np.maximum(rgb[..., 0], 1)  # (no mask black everywhere)
        path = folder / f"{i:02d}.png"
        if alpha:
            Image.fromarray(np.dstack([rgb, rgb[..., 0]]), "RGBA").save(path)
        else:
            Image.fromarray(rgb, "RGB").save(path)
        if mask_folder is not None:
            mask_folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rgb[..., 0], "L").save(mask_folder / f"{i:02d}.png")
        paths.append(str(path))
    return datasets.Dataset.from_dict({"image": paths}).cast_column("image", datasets.Image())


def red_channel(item):
    """The red channel of an item's pixels (normalized with mean and std 0.5) back in [0, 1]: [..., 1, H, W]."""
    return item["pixel_values"][..., :1, :, :] * 0.5 + 0.5


def test_masks_follow_crops_flips_buckets_and_the_latent_cache(tmp_path):
    sizes = [(24, 40), (40, 24), (32, 32), (20, 36)]
    ds = write_images(tmp_path / "images", sizes, tmp_path / "masks")
    masks = [str(tmp_path / "masks" / f"{i:02d}.png") for i in range(len(sizes))]
    buckets = [(16, 24), (24, 16), (16, 16), (16, 24)]
    for kwargs in ({"center_crop": False}, {"center_crop": True}, {"sizes": buckets}):
        data = ImageDataset(ds, "image", 16, random_flip=True, seed=1, masks=masks, **kwargs)
        flips = set()
        for epoch in range(3):
            data.set_epoch(epoch)
            batch = data.__getitems__([0, 1, 2, 3]) if "sizes" not in kwargs else None
            for i in range(len(sizes)):
                item = data[i]
                assert item["mask"].shape == (1, *data.crop_size(i))
                assert torch.allclose(item["mask"], red_channel(item), atol=1e-6)  # the mask is where its pixels are
                if batch is not None:
                    assert torch.equal(batch["mask"][i], item["mask"])
                flips.add(data.placement(i, *data.cache[i].shape[-2:])[2])
        assert flips == {True, False}
    # the latent cache: each view's mask averaged down to its latent grid, with the latent
    encode = lambda x: torch.cat([F.avg_pool2d(x, 4)] * 2, dim=1)  # noqa: E731 (a "VAE" whose latent is the image)
    for kwargs in ({}, {"sizes": buckets}):
        cached = CachedLatents(ImageDataset(ds, "image", 16, random_flip=True, seed=1, masks=masks, **kwargs),
                               encode, 2)
        for epoch in range(3):
            cached.set_epoch(epoch)
            for i in range(len(sizes)):
                item = cached[i]
                assert item["mask"].shape == (1, *item["latent_params"].shape[-2:])
                assert torch.allclose(item["mask"], red_channel({"pixel_values": item["latent_params"][:3]}),
                                      atol=1e-6)
            if "sizes" not in kwargs:
                batch = cached.__getitems__([3, 1])
                assert torch.equal(batch["mask"][0], cached[3]["mask"])


def test_alpha_masks_and_all_ones_masks(tmp_path):
    ds = write_images(tmp_path / "rgba", [(24, 40), (32, 32)], tmp_path / "masks", alpha=True)
    alpha = ImageDataset(ds, "image", 16, center_crop=False, random_flip=True, masks="alpha")
    files = ImageDataset(ds, "image", 16, center_crop=False, random_flip=True,
                         masks=[str(tmp_path / "masks" / f"{i:02d}.png") for i in range(2)])
    ones = ImageDataset(ds, "image", 16, center_crop=False, random_flip=True, masks="ones")
    for i in range(2):
        assert torch.equal(alpha[i]["mask"], files[i]["mask"])
        assert torch.equal(alpha[i]["pixel_values"], files[i]["pixel_values"])
        assert torch.equal(ones[i]["mask"], torch.ones(1, 16, 16))
    plain = write_images(tmp_path / "rgb", [(16, 16)])
    with pytest.raises(UserError, match="has no alpha channel"):
        ImageDataset(plain, "image", 16, masks="alpha")
    Image.new("L", (16, 16), 0).save(tmp_path / "black.png")
    with pytest.raises(UserError, match="black everywhere"):
        ImageDataset(plain, "image", 16, masks=[str(tmp_path / "black.png")])
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(UserError, match="cannot read image"):
        ImageDataset(plain, "image", 16, masks=[str(tmp_path / "text.png")])


def ink_folder(digits, folder, alpha):
    """12 digits in red ink on white with their captions (an imagefolder); the masks, 255 wherever there is ink: in
    folder-masks/ or as the alpha channel. On white paper, compositing the alpha on white changes nothing: both
    layouts hold the same pixels and masks."""
    from demo.digits import red_ink

    rows = [json.loads(line) for line in (digits / "train" / "metadata.jsonl").read_text().splitlines()[:12]]
    (folder / "train").mkdir(parents=True)
    masks = folder.parent / (folder.name + "-masks") / "train"
    masks.mkdir(parents=True)
    with open(folder / "train" / "metadata.jsonl", "w") as meta:
        for row in rows:
            grey = np.asarray(Image.open(digits / "train" / row["file_name"]).convert("L"))
            rgb = np.where(grey[..., None] > 0, red_ink(grey), 255).astype(np.uint8)
            mask = np.where(grey > 0, 255, 0).astype(np.uint8)
            image = Image.fromarray(np.dstack([rgb, mask]), "RGBA") if alpha else Image.fromarray(rgb, "RGB")
            image.save(folder / "train" / row["file_name"])
            Image.fromarray(mask, "L").save(masks / row["file_name"])
            meta.write(json.dumps({"file_name": row["file_name"], "text": row["text"] + ", red ink"}) + "\n")
    return folder, masks.parent


def test_masked_runs_with_a_mask_folder_and_with_alpha_see_the_same_data(digits, tmp_path):
    args = ["--pretrained_model_name_or_path", BASE, "--masked_loss", "--max_train_steps", "3", "--train_batch_size",
            "4", "--rank", "2", "--learning_rate", "1e-2", "--random_flip", "--cache_latents", "--validation_split",
            "0.25", "--logging_steps", "1", "--checkpointing_steps", "100"]
    data, masks = ink_folder(digits, tmp_path / "files", alpha=False)
    launch("train_lora.py", "--train_data_dir", data, "--mask_data_dir", masks, "--output_dir", tmp_path / "a", *args)
    rgba, _ = ink_folder(digits, tmp_path / "rgba", alpha=True)
    launch("train_lora.py", "--train_data_dir", rgba, "--output_dir", tmp_path / "b", *args)
    losses = logged_losses(tmp_path / "a")
    assert sorted(losses) == [1, 2, 3] and losses == logged_losses(tmp_path / "b")
    validation = read_results(tmp_path / "a")["validation_losses"]
    assert validation == read_results(tmp_path / "b")["validation_losses"]
    assert (tmp_path / "a" / "pytorch_lora_weights.safetensors").is_file()
    # --masked_prior_preservation_weight: the LoRA starts as the base (its B matrices are zero), so step 1's loss is
    # the masked run's; then the term pulls the LoRA and the losses part
    launch("train_lora.py", "--train_data_dir", data, "--mask_data_dir", masks, "--output_dir", tmp_path / "kept",
           *args, "--masked_prior_preservation_weight", "1")
    kept = logged_losses(tmp_path / "kept")
    assert kept[1] == losses[1] and kept[3] != losses[3]
    # without the masks, the same draws: the base's losses (step 1's, the held-out one at step 0) are the full ones
    args.remove("--masked_loss")
    launch("train_lora.py", "--train_data_dir", data, "--output_dir", tmp_path / "c", *args, "--max_train_steps", "1")
    assert losses[1] < logged_losses(tmp_path / "c")[1]
    assert validation["0"] < read_results(tmp_path / "c")["validation_losses"]["0"]


def test_masked_prior_preservation_compares_with_the_base_outside_the_masks():
    """--masked_prior_preservation_weight: by hand, the squared distance to the base's prediction where the mask is
    0, none where it is 1; the base's prediction is the model's with its LoRA off (and the LoRA on again after). (End
    to end: in test_masked_runs_with_a_mask_folder_and_with_alpha_see_the_same_data.)"""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from common.loss_masks import base_prediction, masked_prior_losses
    from common.objectives import FlowMatching, Noised

    g = torch.Generator().manual_seed(0)
    prediction, base = torch.randn(2, 4, 4, 4, generator=g), torch.randn(2, 4, 4, 4, generator=g)
    mask = (torch.rand(2, 1, 4, 4, generator=g) > 0.5).float()
    by_hand = torch.stack([((prediction[i] - base[i]) ** 2 * (1 - mask[i])).mean() for i in range(2)])
    sigmas = torch.tensor([0.1, 0.9]).view(2, 1, 1, 1)
    noised = Noised(torch.randn(2, 4, 4, 4, generator=g), None, None, None, sigmas)
    flow = FlowMatching.__new__(FlowMatching)  # (its compare step only: no scheduler needed)
    for precondition, expected in ((False, by_hand), (True, by_hand * sigmas.flatten() ** 2)):
        flow.precondition_outputs = precondition  # SD3's: x0 estimates x_t - sigma * output are compared
        assert torch.allclose(masked_prior_losses(flow, prediction, base, noised, mask), expected)
        assert torch.equal(masked_prior_losses(flow, prediction, base, noised, torch.ones_like(mask)), torch.zeros(2))

    model = FluxTransformer2DModel.from_pretrained(BASE, subfolder="transformer")
    config = model.config
    inputs = {"hidden_states": torch.randn(1, 4, config.in_channels, generator=g),
              "encoder_hidden_states": torch.randn(1, 3, config.joint_attention_dim, generator=g),
              "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=g),
              "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(4, 3), "txt_ids": torch.zeros(3, 3),
              "return_dict": False}
    with torch.no_grad():
        plain = model(**inputs)[0]
    model.add_adapter(LoraConfig(r=2, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False))
    with torch.no_grad():
        adapted = model(**inputs)[0]
    assert not torch.allclose(adapted, plain)
    assert torch.equal(base_prediction(model, lambda: model(**inputs)[0]), plain)
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], adapted)  # the LoRA on again


@pytest.mark.parametrize("flags, needles", [
    (["--masked_prior_preservation_weight", "1"], ["add --masked_loss"]),
    (["--masked_loss", "--masked_prior_preservation_weight", "1", "--train_text_encoder"], ["--train_text_encoder"]),
])
def test_masked_prior_preservation_flags(tmp_path, flags, needles):
    proc = run_script("train_lora.py", *flags, "--output_dir", tmp_path / "out")
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "out").exists()


def mask_case(tmp_path, case):
    """A folder of two images and their masks, spoiled as `case` says."""
    images, masks = tmp_path / "images", tmp_path / "masks"
    write_images(images, [(16, 16), (16, 16)], masks)
    if case == "size":
        Image.new("L", (16, 12), 255).save(masks / "01.png")
    elif case == "orphan":
        Image.new("L", (16, 16), 255).save(masks / "07.png")
    elif case == "missing":
        (masks / "01.png").unlink()
    elif case == "not an image":
        (masks / "01.png").write_text("not an image")
    elif case == "two masks":
        Image.new("L", (16, 16), 255).save(masks / "01.jpg")
    elif case == "inside":
        masks = masks.rename(images / "masks")
    return images, masks


@pytest.mark.parametrize("case, needles", [
    ("size", ["mask", "16x12", "01.png", "its image's size"]),
    ("orphan", ["without an image", "07.png"]),
    ("missing", ["images without a mask", "01.png"]),
    ("not an image", ["cannot read mask", "01.png"]),
    ("two masks", ["two masks for one image", "01.jpg"]),
    ("inside", ["overlap"]),
    ("no --masked_loss", ["--mask_data_dir is read only with --masked_loss"]),
])
def test_bad_masks_are_one_line_errors_and_write_nothing(tmp_path, case, needles):
    images, masks = mask_case(tmp_path, case)
    out = tmp_path / "out"
    flags = [] if case == "no --masked_loss" else ["--masked_loss"]
    proc = run_script("train_lora.py", "--train_data_dir", images, "--mask_data_dir", masks, "--output_dir", out,
                      "--default_caption", "a digit", *flags)
    assert_one_line_error(proc, *needles)
    assert not out.exists()
