"""DreamBooth in train_lora.py (common/dreambooth.py): prior-preservation batches and the loss in two parts against a
hand computation, class images drawn once by the base (equal on one and two processes, reused, topped up, refused
when drawn for another prompt), on the shipped Flux and SD bases and the tiny SDXL and SD3 ones, and the one-line
errors of the DreamBooth flags."""
import argparse
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import ROOT, assert_one_line_error, launch, logged_losses, read_results, run_script
from PIL import Image

from common.dreambooth import MANIFEST, PriorLoss, PriorPreservationBatches

FLUX, SD = ROOT / "assets" / "tiny-flux-digits", ROOT / "assets" / "tiny-sd-digits"
INSTANCE, CLASS = "a handwritten digit seven, sks", "a handwritten digit seven"
TINY = ["--train_batch_size", "2", "--max_train_steps", "3", "--learning_rate", "1e-3", "--logging_steps", "1",
        "--checkpointing_steps", "100", "--seed", "7"]


@pytest.fixture(scope="module")
def instances(digits, tmp_path_factory):
    """Three digits as instance images: a folder of images and nothing else."""
    folder = tmp_path_factory.mktemp("dreambooth") / "instance"
    folder.mkdir()
    rows = [json.loads(line) for line in (digits / "train" / "metadata.jsonl").read_text().splitlines()]
    for row in [r for r in rows if r["label"] == 7][:3]:
        shutil.copy(digits / "train" / row["file_name"], folder / row["file_name"])
    return folder


def dreambooth(instances, class_dir, base=FLUX, *extra):
    return ["--pretrained_model_name_or_path", base, "--instance_data_dir", instances, "--instance_prompt", INSTANCE,
            "--with_prior_preservation", "--class_data_dir", class_dir, "--class_prompt", CLASS, "--num_class_images",
            "4", "--sample_batch_size", "2", *TINY, *extra]


def test_batches_pair_instance_and_class_images():
    """Each batch: instance rows then as many class rows, pair i = (instance i mod n, class i mod m); an epoch is
    max(n, m) pairs in a shuffled order that depends on (seed, epoch) only."""
    data = argparse.Namespace(epoch=0)
    sampler = PriorPreservationBatches(3, 5, 2, seed=1, data=data)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 3
    pairs = []
    for batch in batches:
        half = len(batch) // 2
        instance, klass = batch[:half], batch[half:]
        assert all(0 <= i < 3 for i in instance) and all(3 <= c < 8 for c in klass)
        pairs += list(zip(instance, klass))
    assert sorted(c - 3 for _, c in pairs) == list(range(5))  # every class image once per epoch
    assert all(i == (c - 3) % 3 for i, c in pairs)
    data.epoch = 1
    assert list(sampler) != batches and list(sampler) == PriorPreservationBatches(3, 5, 2, 1, data).batches(1)


def test_prior_loss_is_instance_plus_weighted_class_mean():
    """One fixed batch: the objective's per-image losses split by row (instance rows first), against the mean
    squared errors computed by hand."""
    from accelerate import Accelerator

    g = torch.Generator().manual_seed(0)
    prediction, target = torch.randn(6, 4, 4, 4, generator=g), torch.randn(6, 4, 4, 4, generator=g)
    per_image = ((prediction - target) ** 2).mean(dim=(1, 2, 3))
    index = torch.tensor([0, 2, 1, 3, 4, 3])  # rows 3 and 4: class images (n_instance = 3)
    accelerator = Accelerator(cpu=True)
    prior = PriorLoss(3, 0.5, "cpu")
    loss = prior(per_image, index, accelerator)
    by_hand = ((prediction[:3] - target[:3]) ** 2).mean() + 0.5 * ((prediction[3:] - target[3:]) ** 2).mean()
    assert torch.allclose(loss, by_hand, atol=1e-6)
    logs = prior.logs(accelerator)
    assert logs["train/instance_loss"] == pytest.approx(((prediction[:3] - target[:3]) ** 2).mean().item(), rel=1e-6)
    assert logs["train/prior_loss"] == pytest.approx(((prediction[3:] - target[3:]) ** 2).mean().item(), rel=1e-6)


def test_class_images_drawn_once_equal_on_two_processes_and_reused(instances, tmp_path):
    """The base draws the missing class images (on two processes: each draws a share), writes them with
    class_images.json, and the run logs the loss in its two parts; a next run reuses them, a larger
    --num_class_images draws only the missing ones, another --class_prompt is refused."""
    one, two = tmp_path / "class-one", tmp_path / "class-two"
    first = launch("train_lora.py", *dreambooth(instances, one), "--output_dir", tmp_path / "out-one")
    launch("train_lora.py", *dreambooth(instances, two), "--output_dir", tmp_path / "out-two", config="cpu_2proc.yaml")
    assert "drawing 4 class images" in first.stderr
    names = sorted(p.name for p in one.glob("*.png"))
    assert names == [f"class-{i:05d}.png" for i in range(4)]
    for name in names:  # the same images whatever the process count
        assert (np.asarray(Image.open(one / name)) == np.asarray(Image.open(two / name))).all(), name
    assert read_results(tmp_path / "out-two")["num_processes"] == 2
    total, instance, prior = (logged_losses(tmp_path / "out-one", tag) for tag in
                              ("train/loss", "train/instance_loss", "train/prior_loss"))
    assert sorted(total) == [1, 2, 3]
    for step in total:  # --prior_loss_weight 1
        assert total[step] == pytest.approx(instance[step] + prior[step], rel=1e-5)
    info = json.loads((tmp_path / "out-one" / "lora_info.json").read_text())
    assert info["trigger"] == INSTANCE

    stamps = {p.name: p.stat().st_mtime_ns for p in one.glob("*.png")}
    again = launch("train_lora.py", *dreambooth(instances, one, FLUX, "--num_class_images", "5", "--max_train_steps",
                                                "1"), "--output_dir", tmp_path / "out-again")
    assert "drawing 1 class images" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in one.glob("*.png") if p.name in stamps} == stamps
    assert json.loads((one / MANIFEST).read_text())["images"] == [f"class-{i:05d}.png" for i in range(5)]
    other = run_script("train_lora.py", *dreambooth(instances, one, FLUX, "--class_prompt", "a handwritten digit two"),
                       "--output_dir", tmp_path / "out-other")
    assert_one_line_error(other, "--class_data_dir", "class_prompt='a handwritten digit seven'")
    assert not (tmp_path / "out-other").exists()


def test_shipped_sd_base_trains_with_class_images_of_its_own_masked_and_resumes_exactly(instances, tmp_path):
    """A UNet base: class images drawn by SD's pipeline at the training size; user images in --class_data_dir (no
    class_images.json) are used as they are and only the missing ones drawn. With --masked_loss the instance images
    take their masks and the class images none. A resume from mid-epoch (step 3 of 2 batches an epoch) ends with the
    uninterrupted run's losses and LoRA weights."""
    from safetensors.torch import load_file

    classes, masks = tmp_path / "class", tmp_path / "masks"
    classes.mkdir()
    masks.mkdir()
    Image.new("RGB", (32, 32), (0, 0, 0)).save(classes / "mine.png")
    for image in instances.iterdir():  # the strokes
        Image.open(image).convert("L").save(masks / image.name)
    args = dreambooth(instances, classes, SD, "--num_class_images", "3", "--max_train_steps", "4",
                      "--checkpointing_steps", "3", "--random_flip", "--masked_loss", "--mask_data_dir", masks)
    proc = launch("train_lora.py", *args, "--output_dir", tmp_path / "out")
    assert "drawing 2 class images" in proc.stderr
    assert sorted(p.name for p in classes.glob("*.png")) == ["class-00000.png", "class-00001.png", "mine.png"]
    assert Image.open(classes / "class-00000.png").size == (32, 32)
    shutil.copytree(tmp_path / "out" / "checkpoint-3", tmp_path / "resumed" / "checkpoint-3")
    launch("train_lora.py", *args, "--output_dir", tmp_path / "resumed", "--resume_from_checkpoint", "latest")
    assert logged_losses(tmp_path / "resumed")[4] == logged_losses(tmp_path / "out")[4]
    a, b = (load_file(tmp_path / run / "pytorch_lora_weights.safetensors") for run in ("out", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_class_images_train_everywhere_beside_masked_instances(instances, tmp_path):
    """--masked_loss with prior preservation: the instance rows' masks come from their files, the class rows' are
    all ones (they have none)."""
    from common.dreambooth import instance_reader, with_class_images
    from common.image_data import image_datasets
    from common.loss_masks import check_mask_args

    (tmp_path / "masks").mkdir()
    for image in instances.iterdir():
        Image.open(image).convert("L").save(tmp_path / "masks" / image.name)
    shutil.copytree(instances, tmp_path / "class")
    args = argparse.Namespace(masked_loss=True, mask_data_dir=str(tmp_path / "masks"), dataset_name=None,
                              masked_prior_preservation_weight=0.0, train_text_encoder=False,
                              train_data_dir=str(instances), image_column="image", caption_column="text",
                              resolution=32, center_crop=True, random_flip=False, seed=0)
    check_mask_args(args)
    args.instance_prompt, args.class_prompt = INSTANCE, CLASS
    train = instance_reader(args)(str(instances))["train"]
    train, n = with_class_images(train, sorted(str(p) for p in (tmp_path / "class").iterdir()), args)
    data, _ = image_datasets(args, train, None, masked_rows=n)
    masks = data.__getitems__(list(range(len(train))))["mask"]
    assert n == 3 and masks.shape == (6, 1, 32, 32)
    assert (masks[3:] == 1).all() and not (masks[:3] == 1).all() and (masks[:3] > 0).any()


@pytest.mark.parametrize("name", ["tiny_sdxl", "tiny_sd3", "sd3 without T5"])
def test_other_families_draw_class_images(name, request, tmp_path):
    """SDXL's and SD3's pipelines draw class images through the same code (in process: the drawing is all that
    differs between families; their training is tested in test_lora_sdxl.py and test_lora_flow.py); SD3 with
    --drop_t5 from a folder that has no T5, as the run trains."""
    import logging

    from accelerate import Accelerator

    from common.dreambooth import class_images, read_manifest
    from common.families import load_family

    base = request.getfixturevalue("tiny_sd3" if name == "sd3 without T5" else name)
    if name == "sd3 without T5":
        shutil.copytree(base, tmp_path / "no-t5", ignore=shutil.ignore_patterns("text_encoder_3", "tokenizer_3"))
        base = tmp_path / "no-t5"
    args = argparse.Namespace(pretrained_model_name_or_path=str(base), revision=None, variant=None, cache_dir=None,
                              class_data_dir=str(tmp_path / "class"), class_prompt=CLASS, num_class_images=2,
                              sample_batch_size=2, resolution=32, seed=0, max_sequence_length=16,
                              drop_t5=name == "sd3 without T5")
    family = load_family(str(base), "--pretrained_model_name_or_path")
    paths = class_images(args, Accelerator(cpu=True), family, torch.float32, logging.getLogger("test"))
    assert [Image.open(p).size for p in paths] == [(32, 32)] * 2
    assert read_manifest(str(tmp_path / "class"))["drawn_by"].get("drop_t5") == (True if args.drop_t5 else None)


@pytest.mark.parametrize("flags, needles", [
    (["--with_prior_preservation", "--class_data_dir", "x"], ["--with_prior_preservation needs --class_prompt"]),
    (["--class_prompt", "a digit"], ["--class_prompt is for prior preservation"]),
    (["--instance_prompt", "sks"], ["--instance_data_dir and --instance_prompt go together"]),
    (["--with_prior_preservation", "--class_data_dir", "x", "--class_prompt", "a", "--buckets", "auto"],
     ["leave out --buckets auto"]),
])
def test_dreambooth_flags_that_do_not_go_together(flags, needles, tmp_path):
    proc = run_script("train_lora.py", *flags, "--output_dir", tmp_path / "out")
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "out").exists()


def test_instance_folder_without_images(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_script("train_lora.py", "--instance_data_dir", tmp_path / "empty", "--instance_prompt", "sks",
                      "--output_dir", tmp_path / "out")
    assert_one_line_error(proc, "--instance_data_dir", "is not a folder of images")
