"""Aspect-ratio buckets (--buckets auto) and the held-out validation loss (--validation_split) of the Stable Diffusion
trainers: the bucket maths, the data path (no crop beyond a bucket, one shape a batch, cached == uncached latents),
and real train_lora.py / train_text_to_image.py runs: exact resume mid-epoch, two processes, non-square validation
images, and the bad input."""
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import ROOT, assert_one_line_error, launch, logged_losses, read_results, run_in_process, run_script
from PIL import Image
from safetensors.torch import load_file

from common.buckets import (
    BucketBatchSampler,
    assign_buckets,
    bucket_sizes,
    kept_share,
    nearest_bucket,
    validation_sizes,
)
from common.cli import UserError
from common.image_data import cover_size

# (width, height): wide, tall and square images at --resolution 32 (the tiny base's factor is 8)
SHAPES = [(48, 32), (32, 48), (40, 40)]


def write_mixed_folder(path, shapes=SHAPES, repeats=7):
    """An imagefolder of patterned images in several aspect ratios, with captions."""
    path.mkdir(parents=True)
    rows = []
    for i, (w, h) in enumerate(shapes * repeats):
        y, x = np.mgrid[0:h, 0:w]
        pixels = np.stack([(x * 255 // w), (y * 255 // h), np.full_like(x, 40 * (i % 6))], -1).astype(np.uint8)
        Image.fromarray(pixels).save(path / f"{i}.png")
        shape = "wide" if w > h else "tall" if h > w else "square"
        rows.append({"file_name": f"{i}.png", "text": f"a gradient, {shape}"})
    (path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return write_mixed_folder(tmp_path_factory.mktemp("data") / "mixed")


# --- the buckets themselves


def test_bucket_sizes_are_about_resolution_squared_with_sides_divisible_by_the_factor():
    sizes = bucket_sizes(512, 64)
    assert {(512, 512), (448, 576), (576, 448), (384, 640), (640, 384)} <= set(sizes)
    for h, w in sizes:
        assert h % 64 == 0 and w % 64 == 0 and 256 <= min(h, w) and max(h, w) <= 1024
        assert h * w <= 512 * 512 and h * w > 0.75 * 512 * 512
    assert all((w, h) in sizes for h, w in sizes)  # portrait and landscape alike
    assert bucket_sizes(32, 8) == [(64, 16), (56, 16), (48, 16), (40, 24), (32, 32), (24, 40), (16, 48), (16, 56),
                                   (16, 64)]


def test_images_go_to_the_nearest_aspect_and_small_buckets_are_merged_not_dropped():
    sizes = [(32, 48)] * 4 + [(48, 32)] * 4 + [(40, 40)] * 4  # (height, width)
    buckets, of, merges = assign_buckets(sizes, 32, 8, 2, 2.0)
    assert [buckets[b] for b in of] == [(24, 40)] * 4 + [(40, 24)] * 4 + [(32, 32)] * 4 and not merges
    # one tall image among squares: its bucket holds fewer than a batch of 2, so it joins the nearest one
    buckets, of, merges = assign_buckets([(40, 40)] * 4 + [(48, 32)], 32, 8, 2, 2.0)
    assert [buckets[b] for b in of] == [(32, 32)] * 5 and merges == {"24x40": "32x32"}
    assert len(of) == 5  # nothing dropped


def kohya_bucket(size, buckets):
    """kohya's sd-scripts' choice (BucketManager.select_bucket): the least plain difference of width / height."""
    return int(np.abs(np.array([w / h for h, w in buckets]) - size[1] / size[0]).argmin())


def test_each_image_takes_the_bucket_that_crops_least_and_its_transpose_the_transposed_one():
    buckets = bucket_sizes(512, 64)
    for h in range(90, 2200, 37):
        for w in range(90, 2200, 23):
            share = kept_share((h, w), buckets[nearest_bucket((h, w), buckets)])
            assert share == max(kept_share((h, w), b) for b in buckets), (w, h)
            assert buckets[nearest_bucket((w, h), buckets)] == buckets[nearest_bucket((h, w), buckets)][::-1], (w, h)
    # docs/train_lora.md's examples of where kohya's rule differs: computed here, quoted there
    docs = (ROOT / "docs" / "train_lora.md").read_text()
    for (w, h), ours, kohya in [((1000, 354), (256, 832), (320, 768)), ((360, 1000), (768, 320), (832, 256))]:
        assert buckets[nearest_bucket((h, w), buckets)] == ours and buckets[kohya_bucket((h, w), buckets)] == kohya
        quoted = (f"{w}x{h}: {kohya[1]}x{kohya[0]}, keeping {100 * kept_share((h, w), kohya):.1f} %",
                  f"{ours[1]}x{ours[0]}, keeping {100 * kept_share((h, w), ours):.1f} %")
        assert all(" ".join(q.split()) in " ".join(docs.split()) for q in quoted), quoted
        # turned on its side, kohya's choice is ours: its rule is not symmetric
        assert kohya_bucket((w, h), buckets) == nearest_bucket((w, h), buckets)


def test_an_image_too_small_for_its_bucket_is_one_line_naming_it():
    with pytest.raises(UserError, match=r"image 'tiny.png' \(8x8\) is too small for its bucket \(32x32.*4.00x"):
        assign_buckets([(40, 40), (8, 8)], 32, 8, 1, 2.0, names=["'big.png'", "'tiny.png'"])
    assign_buckets([(40, 40), (8, 8)], 32, 8, 1, 4.0)  # allowed with a larger --bucket_max_upscale


def test_validation_images_show_the_square_and_the_most_used_other_aspect():
    assert validation_sizes(None, 32) is None
    assert validation_sizes([(24, 40)] * 2 + [(40, 24)] * 3 + [(32, 32)], 32) == [(32, 32), (40, 24)]
    assert validation_sizes([(32, 32)] * 3, 32) == [(32, 32)]


class Epoch:
    epoch = 0


def test_every_batch_is_one_bucket_and_the_order_is_a_function_of_seed_and_epoch():
    from accelerate.data_loader import BatchSamplerShard

    sizes = [(24, 40)] * 7 + [(40, 24)] * 5 + [(32, 32)] * 6
    data = Epoch()
    sampler = BucketBatchSampler(sizes, 2, 42, data)
    first = list(sampler)
    assert len(first) == len(sampler) == 4 + 3 + 3
    assert sorted(i for batch in first for i in batch) == list(range(18))  # each image once an epoch
    assert all(len({sizes[i] for i in batch}) == 1 for batch in first)
    assert list(BucketBatchSampler(sizes, 2, 42, data)) == first  # same seed and epoch: same batches (resume)
    data.epoch = 1
    assert list(sampler) != first
    # accelerate shards whole batches between 2 processes (never a batch of mixed buckets), all images covered
    shards = [list(BatchSamplerShard(sampler, num_processes=2, process_index=p)) for p in range(2)]
    assert len(shards[0]) == len(shards[1]) == 5
    assert all(len({sizes[i] for i in batch}) == 1 for shard in shards for batch in shard)
    assert sorted({i for shard in shards for batch in shard for i in batch}) == list(range(18))


# --- the data path


def bucketed_dataset(folder, **kwargs):
    import datasets

    from common.image_data import ImageDataset, image_sizes

    ds = datasets.load_dataset("imagefolder", data_dir=str(folder))["train"]
    sizes, names = image_sizes(ds, "image")
    buckets, of, _ = assign_buckets(sizes, 32, 8, 2, 2.0, names)
    return ds, sizes, [buckets[b] for b in of], ImageDataset(ds, "image", 32, sizes=[buckets[b] for b in of],
                                                              **kwargs)


def test_no_image_is_cropped_beyond_its_bucket(mixed):
    ds, sizes, targets, data = bucketed_dataset(mixed, center_crop=True)
    for i, (size, target) in enumerate(zip(sizes, targets)):
        h, w = cover_size(size, target)
        assert (h == target[0] or w == target[1]) and h >= target[0] and w >= target[1]  # one side fits exactly
        assert abs(h / w - size[0] / size[1]) < 0.05  # resized with its own aspect ratio
        pixels = data.crop(i)
        assert tuple(pixels.shape[1:]) == target
        # the kept part is the center of the resized image
        resized = np.asarray(Image.open(mixed / f"{i}.png").convert("RGB").resize((w, h), Image.BILINEAR))
        top, left = (h - target[0]) // 2, (w - target[1]) // 2
        expected = resized[top:top + target[0], left:left + target[1]]
        assert np.array_equal(pixels.permute(1, 2, 0).numpy(), expected)


def test_cached_latents_equal_the_uncached_ones_per_bucket(mixed, tiny_sd):
    from diffusers import AutoencoderKL

    from common.image_data import CachedLatents, collate_batch

    vae = AutoencoderKL.from_pretrained(tiny_sd, subfolder="vae")

    def encode(pixels):
        with torch.no_grad():
            return vae.encode(pixels).latent_dist.parameters

    _, _, targets, data = bucketed_dataset(mixed, center_crop=True, random_flip=True, seed=3)
    sampler = BucketBatchSampler(targets, 2, 3, data)
    uncached = [collate_batch(data.__getitems__(batch)) for batch in sampler]
    _, _, _, cached_data = bucketed_dataset(mixed, center_crop=True, random_flip=True, seed=3)
    cached = CachedLatents(cached_data, encode, 4)
    for epoch in (0, 1):
        data.set_epoch(epoch)
        cached.set_epoch(epoch)
        for batch in BucketBatchSampler(targets, 2, 3, data):
            expected = encode(data.__getitems__(batch)["pixel_values"])
            got = cached.__getitems__(batch)["latent_params"]
            assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)
    assert {tuple(b["pixel_values"].shape[-2:]) for b in uncached} == {(24, 40), (40, 24), (32, 32)}


# --- the held-out loss


def test_held_out_loss_is_deterministic_for_fixed_weights_and_sees_a_change(mixed, tiny_sd):
    import datasets
    from accelerate import Accelerator
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

    from common.families import sd
    from common.image_data import ImageDataset
    from common.objectives import DDPM
    from common.validation_loss import HeldOutLoss

    path = str(tiny_sd)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet")
    scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler")
    ds = datasets.load_dataset("imagefolder", data_dir=str(mixed))["train"].select(range(5))
    held_out = ImageDataset(ds, "image", 32, center_crop=True)
    embeds = torch.randn(2, 77, 32, generator=torch.Generator().manual_seed(0))

    def encode(pixels):
        with torch.no_grad():
            return vae.encode(pixels).latent_dist.parameters

    objective = DDPM(scheduler)

    def predict(noisy, timesteps, cond):
        return sd.denoise(unet, noisy, timesteps, cond)

    def embed(ids):
        return {"prompt_embeds": embeds[ids]}

    loss = HeldOutLoss(held_out, encode, vae.config, [0, 1, 0, 1, 0], objective, Accelerator(cpu=True), 0, 3)
    first = loss(unet, predict, embed)
    assert loss(unet, predict, embed) == first
    again = HeldOutLoss(held_out, encode, vae.config, [0, 1, 0, 1, 0], objective, Accelerator(cpu=True), 0, 3)
    assert again(unet, predict, embed) == first  # fixed noise and timesteps
    with torch.no_grad():
        unet.conv_out.bias += 0.1
    assert loss(unet, predict, embed) != first


# --- real runs

RUN = ["--resolution", "32", "--buckets", "auto", "--validation_split", "0.2", "--train_batch_size", "2",
       "--max_train_steps", "8", "--checkpointing_steps", "3", "--validation_steps", "4", "--logging_steps", "1",
       "--random_flip", "--learning_rate", "1e-2", "--validation_prompt", "a gradient, wide",
       "--num_validation_images", "1", "--validation_inference_steps", "2"]


@pytest.fixture(scope="module")
def bucketed_run(mixed, tiny_sd, tmp_path_factory):
    out = tmp_path_factory.mktemp("buckets") / "run"
    proc = launch("train_lora.py", "--train_data_dir", mixed, "--pretrained_model_name_or_path", tiny_sd,
                  "--output_dir", out, *RUN)
    return out, proc.stderr


def test_a_bucketed_run_prints_its_buckets_and_draws_two_aspects(bucketed_run):
    out, stderr = bucketed_run
    assert "aspect-ratio buckets at 32 px" in stderr
    for bucket in ("40x24", "24x40", "32x32"):
        assert any(line.split()[:1] == [bucket] for line in stderr.splitlines()), stderr[-3000:]
    assert Image.open(out / "samples/step-8/0-0.png").size == (32, 32)
    other = [p for p in (out / "samples/step-8").glob("0-0-*.png")]
    assert len(other) == 1 and Image.open(other[0]).size in {(40, 24), (24, 40)}
    results = read_results(out)
    assert set(results["validation_losses"]) == {"0", "4", "8"}
    assert results["validation_loss"] == results["validation_losses"]["8"]
    logged = logged_losses(out, "val/loss")
    assert sorted(logged) == [0, 4, 8] and logged[8] == pytest.approx(results["validation_loss"], rel=1e-6)


def test_sample_py_draws_a_bucketed_lora_at_any_size_the_model_divides(bucketed_run, tmp_path):
    out, _ = bucketed_run
    run_in_process("sample.py", "--model", out, "--prompt", "a gradient, wide", "--height", "24", "--width", "40",
                   "--num_images", "1", "--num_inference_steps", "2", "--output_dir", tmp_path / "wide")
    assert Image.open(tmp_path / "wide" / "0000.png").size == (40, 24)
    # a size the VAE does not divide was rounded down by the pipeline without a word
    proc = run_script("sample.py", "--model", out, "--prompt", "x", "--height", "30", "--output_dir", tmp_path / "s")
    assert_one_line_error(proc, "--height 30 is not divisible by 4")
    assert not (tmp_path / "s").exists()


def test_a_bucketed_run_resumes_exactly_mid_epoch(bucketed_run, mixed, tiny_sd, tmp_path):
    reference, _ = bucketed_run
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(reference / "checkpoint-3", out / "checkpoint-3")  # 17 images in batches of 2: mid-epoch
    launch("train_lora.py", "--train_data_dir", mixed, "--pretrained_model_name_or_path", tiny_sd, "--output_dir",
           out, *RUN, "--resume_from_checkpoint", "latest")
    expected, resumed = logged_losses(reference), logged_losses(out)
    assert [resumed[s] for s in range(4, 9)] == [expected[s] for s in range(4, 9)]
    assert logged_losses(out, "val/loss") == {s: v for s, v in logged_losses(reference, "val/loss").items() if s > 3}
    a, b = (load_file(folder / "pytorch_lora_weights.safetensors") for folder in (reference, out))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_processes_with_cached_latents_and_text_to_image(bucketed_run, mixed, tiny_sd, tmp_path):
    # train_lora.py on 2 processes with cached latents: the held-out loss before training is the 1-process one
    reference, _ = bucketed_run
    out = tmp_path / "ddp"
    launch("train_lora.py", "--train_data_dir", mixed, "--pretrained_model_name_or_path", tiny_sd, "--output_dir",
           out, *RUN, "--cache_latents", "--max_train_steps", "4", "--report_to", "none", config="cpu_2proc.yaml")
    results = read_results(out)
    assert results["num_processes"] == 2 and results["global_step"] == 4
    assert results["validation_losses"]["0"] == pytest.approx(read_results(reference)["validation_losses"]["0"],
                                                              rel=1e-5)
    # train_text_to_image.py shares the data path: buckets, held-out loss, two aspects
    t2i = tmp_path / "t2i"
    launch("train_text_to_image.py", "--train_data_dir", mixed, "--pretrained_model_name_or_path", tiny_sd,
           "--output_dir", t2i, *RUN, "--max_train_steps", "4", "--learning_rate", "1e-4", "--use_ema",
           "--report_to", "none")
    assert set(read_results(t2i)["validation_losses"]) == {"0", "4"}
    assert len(list((t2i / "samples/step-4").glob("0-0*.png"))) == 2


@pytest.mark.parametrize("case", ["center_crop", "resolution", "too_small", "split_share", "split_name"])
def test_bad_input_is_one_line_and_writes_nothing(case, mixed, tiny_sd, tmp_path):
    data, extra = mixed, []
    if case == "too_small":
        data = tmp_path / "data"
        shutil.copytree(mixed, data)
        Image.new("RGB", (8, 12)).save(data / "0.png")
    extra = {"center_crop": ["--center_crop"], "resolution": ["--resolution", "36"], "too_small": [],
             "split_share": ["--validation_split", "1.5"], "split_name": ["--validation_split", "nosuch"]}[case]
    out = tmp_path / "out"
    args = ["--train_data_dir", data, "--pretrained_model_name_or_path", tiny_sd, "--output_dir", out,
            "--resolution", "32", "--buckets", "auto", "--max_train_steps", "2", *extra]
    line = assert_one_line_error(run_script("train_lora.py", *args))
    needle = {"center_crop": "--center_crop", "resolution": "is not divisible by 8 (the VAE's",
              "too_small": "0.png' (8x12) is too small for its bucket", "split_share": "1.5 is not a share",
              "split_name": "--validation_split 'nosuch' is not a split"}[case]
    assert needle in line
    assert not out.exists()


def test_help_lists_the_new_flags():
    for script in ("train_lora.py", "train_text_to_image.py"):
        proc = run_script(script, "--help")
        assert proc.returncode == 0
        assert all(flag in proc.stdout for flag in ("--buckets", "--bucket_max_upscale", "--validation_split"))
