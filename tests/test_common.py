"""Unit tests of the common/ helpers (no subprocess, no accelerate launch)."""
import glob
import itertools
import json
import os
from argparse import Namespace

import numpy as np
import pytest
import torch
from conftest import CONFIGS
from PIL import Image

from common.checkpoints import choose_resume_step, folder_sharing, list_checkpoints, resolve_resume, save_checkpoint
from common.cli import UserError, first_line, one_line
from common.image_data import (
    ImageDataset,
    collate_batch,
    label_ids,
    label_names,
    load_image_dataset,
    require_columns,
    resize_shorter_side,
    to_rgb,
)
from common.launch import check_accelerate_config
from common.reporting import sanitize_config
from common.training import build_param_groups, parse_lr_groups, plan_steps, resume_position


def test_digits_imagefolder(digits):
    for split, count in (("train", 1437), ("test", 360)):
        rows = [json.loads(line) for line in (digits / split / "metadata.jsonl").read_text().splitlines()]
        assert len(rows) == count
        assert set(rows[0]) == {"file_name", "label", "text", "captions"}
        assert all(len(r["captions"]) == 6 and all(c.startswith(r["text"]) for c in r["captions"]) for r in rows)
        assert {r["label"] for r in rows} == set(range(10))
        image = Image.open(digits / split / rows[0]["file_name"])
        assert image.mode == "RGB" and image.size == (32, 32)
    counts = [sum(json.loads(line)["label"] == c for line in (digits / "test/metadata.jsonl").read_text().splitlines())
              for c in range(10)]
    assert max(counts) - min(counts) <= 2  # stratified
    assert rows[0]["text"].startswith("a handwritten digit ")


def test_red_ink_copy_is_the_same_digits_restyled(tmp_path):
    from demo.digit_eval import in_style
    from demo.digits import write_digits

    write_digits(str(tmp_path / "plain"), styled_dir=str(tmp_path / "red"), blot_dir=str(tmp_path / "blot"))
    plain = [json.loads(line) for line in (tmp_path / "plain/train/metadata.jsonl").read_text().splitlines()]
    red = [json.loads(line) for line in (tmp_path / "red/train/metadata.jsonl").read_text().splitlines()]
    assert [r["file_name"] for r in red] == [r["file_name"] for r in plain]
    assert all(r["text"] == p["text"] + ", red ink on paper" for r, p in zip(red, plain))

    def load(folder, rows):
        return torch.stack([torch.from_numpy(np.array(Image.open(tmp_path / folder / "train" / r["file_name"])))
                            for r in rows[:50]]).permute(0, 3, 1, 2).float() / 255

    assert in_style(load("red", red)).all() and not in_style(load("plain", plain)).any()
    # the masked-loss demo's copy: the red-ink digits and a blot (has_blot finds it in all; in a few of the red-ink
    # digits whose strokes reach that corner, in none of the white ones),
    # its masks leaving out the corner block that holds the blot, and nothing else
    from demo.digit_eval import has_blot
    from demo.digits import blot_box

    blot = load("blot", red)
    assert has_blot(blot).all() and has_blot(load("red", red)).float().mean() < 0.05
    assert not has_blot(load("plain", plain)).any()
    top, bottom, left, right = blot_box(32)
    outside = torch.ones(32, 32, dtype=torch.bool)
    outside[top:bottom, left:right] = False
    assert torch.equal(blot[:, :, outside], load("red", red)[:, :, outside])
    mask = torch.from_numpy(np.array(Image.open(tmp_path / "blot-masks" / "train" / red[0]["file_name"]))) > 0
    assert not mask[:8, 24:].any() and mask.sum() == 32 * 32 - 64 and not (mask & ~outside).any()


def _data_args(**kw):
    return Namespace(**{"dataset_name": None, "dataset_config_name": None, "train_data_dir": None, "cache_dir": None,
                        "eval_split": "test", "seed": 0, "max_train_samples": None, **kw})


def test_loader_reads_imagefolder_and_checks_columns(digits):
    train, evaluation = load_image_dataset(_data_args(train_data_dir=str(digits), max_train_samples=50))
    assert len(train) == 50 and len(evaluation) == 360
    assert label_names(evaluation, "label") == [str(i) for i in range(10)]
    require_columns(train, image_column="image", label_column="label")
    with pytest.raises(UserError, match="'caption' is not a column.*columns are: image, label, text"):
        require_columns(train, caption_column="caption")


def test_loader_carves_a_validation_split_from_train(digits):
    import datasets

    def files(ds):
        return [value["path"] for value in ds.cast_column("image", datasets.Image(decode=False))["image"]]

    train, validation, test = load_image_dataset(_data_args(train_data_dir=str(digits)), validation_split=0.1)
    assert (len(train), len(validation), len(test)) == (1293, 144, 360)
    assert not set(files(validation)) & set(files(train)) and not set(files(validation)) & set(files(test))
    small, same_validation, _ = load_image_dataset(_data_args(train_data_dir=str(digits), max_train_samples=50),
                                                   validation_split=0.1)
    assert len(small) == 50 and files(same_validation) == files(validation)  # held out before the truncation
    no_test, validation, test = load_image_dataset(_data_args(train_data_dir=str(digits), eval_split="nothing"),
                                                   validation_split=0.1)
    assert (len(no_test), len(validation), test) == (1293, 144, None)


def test_an_imagefolder_read_over_folders_listed_once_is_the_same_dataset(tmp_path):
    """load_image_dataset lists each folder once while datasets resolves an imagefolder's split patterns: the same
    splits, rows and order as without, far fewer listings, and fsspec as it was afterwards."""
    import datasets
    from fsspec.implementations.local import LocalFileSystem

    from common.image_data import folders_listed_once

    root = tmp_path / "folder"
    for split, count in (("train", 3), ("test", 2)):
        (root / split / "sub").mkdir(parents=True)
        with open(root / split / "metadata.jsonl", "w") as f:
            for i in range(count):
                name = f"{'sub/' * (i % 2)}{i}.png"
                Image.new("RGB", (8, 8), (i, 0, 0)).save(root / split / name)
                f.write(json.dumps({"file_name": name, "text": f"{split} {i}"}) + "\n")
    Image.new("RGB", (8, 8)).save(root / "train" / ".hidden.png")
    ls, calls = LocalFileSystem.ls, []

    def counted(self, path, *args, **kwargs):
        calls.append(path)
        return ls(self, path, *args, **kwargs)

    def load(cache):
        loaded = datasets.load_dataset("imagefolder", data_dir=str(root), cache_dir=str(tmp_path / cache))
        return {split: (ds.cast_column("image", datasets.Image(decode=False))["image"], ds["text"])
                for split, ds in loaded.items()}

    LocalFileSystem.ls = counted
    try:
        plain, listed = load("a"), len(calls)
        with folders_listed_once():
            once = load("b")
    finally:
        LocalFileSystem.ls = ls
    assert once == plain and set(plain) == {"train", "test"} and len(plain["train"][1]) == 3
    assert len(calls) - listed < listed / 4  # (each folder listed once, not once a pattern)
    assert LocalFileSystem.ls is ls


def test_label_ids_map_names_of_classlabel_and_plain_columns():
    # The bug this pins: a ClassLabel column's ints were looked up as names. Its ints index the ClassLabel's names.
    import datasets

    classlabel = datasets.Features({"label": datasets.ClassLabel(names=["cat", "dog", "ant"])})
    train = datasets.Dataset.from_dict({"label": [2, 0, 1, 0]}, features=classlabel)
    names = label_names(train, "label")
    assert names == ["cat", "dog", "ant"] and label_ids(train, "label", names).tolist() == [2, 0, 1, 0]
    reordered = datasets.Dataset.from_dict(  # another split whose ClassLabel lists the names in another order
        {"label": [0, 1]}, features=datasets.Features({"label": datasets.ClassLabel(names=["dog", "ant", "cat"])}))
    assert label_ids(reordered, "label", names, "evaluation").tolist() == [1, 2]
    unlabeled = datasets.Dataset.from_dict({"label": [0, -1]}, features=classlabel)
    with pytest.raises(UserError, match=r"the test split has rows without a class in 'label' \(values \[-1\]\)"):
        label_ids(unlabeled, "label", names, "test")

    plain = datasets.Dataset.from_dict({"label": [10, 9, 2, 9]})
    names = label_names(plain, "label")
    assert names == ["2", "9", "10"] and label_ids(plain, "label", names).tolist() == [2, 1, 0, 1]
    other = datasets.Dataset.from_dict({"label": [2, 7]})
    with pytest.raises(UserError, match=r"evaluation labels \['7'\] do not occur in the training split"):
        label_ids(other, "label", names, "evaluation")


def test_images_of_every_mode_become_rgb():
    for mode in ("L", "LA", "RGBA", "P", "I;16", "RGB", "CMYK"):
        image = Image.new(mode, (5, 7))
        assert to_rgb(image).mode == "RGB"
    transparent = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    assert to_rgb(transparent).getpixel((0, 0)) == (255, 255, 255)  # composited on white
    sixteen = Image.new("I;16", (2, 2), 65535)
    assert to_rgb(sixteen).getpixel((0, 0)) == (255, 255, 255)


def test_dataset_transforms_are_reproducible_per_epoch(tmp_path):
    import datasets

    paths = []
    for i, mode in enumerate(("L", "RGBA", "P", "RGB")):
        path = tmp_path / f"{i}.png"
        noise = np.random.default_rng(i).integers(0, 256, (30, 40, 3), dtype=np.uint8)
        Image.fromarray(noise).convert(mode).save(path)
        paths.append(str(path))
    ds = datasets.Dataset.from_dict({"image": paths}).cast_column("image", datasets.Image())
    data = ImageDataset(ds, "image", 16, center_crop=False, random_flip=True, columns={"i": list(range(4))})
    assert data[0]["pixel_values"].shape == (3, 16, 16) and data[0]["pixel_values"].dtype == torch.float32
    first = [data[i]["pixel_values"] for i in range(4)]
    assert all(torch.equal(a, data[i]["pixel_values"]) for i, a in enumerate(first))  # same epoch: same crops
    torch.manual_seed(123)  # the global RNG plays no part
    assert all(torch.equal(a, data[i]["pixel_values"]) for i, a in enumerate(first))
    assert data[2]["i"] == 2
    batch = data.__getitems__([3, 1, 2])  # what the DataLoader calls: the collated items, bit for bit
    assert batch["i"].tolist() == [3, 1, 2]
    assert torch.equal(batch["pixel_values"], torch.stack([first[i] for i in (3, 1, 2)]))
    loader = torch.utils.data.DataLoader(data, batch_size=3, collate_fn=collate_batch)
    assert torch.equal(next(iter(loader))["pixel_values"], torch.stack(first[:3]))
    data.set_epoch(1)
    assert any(not torch.equal(a, data[i]["pixel_values"]) for i, a in enumerate(first))  # a new epoch: new crops


def test_batches_equal_the_collated_items(tmp_path):
    """__getitems__ (ImageDataset, CachedLatents) gives what default_collate makes of __getitem__'s items, bit for bit:
    images of the training size and larger, random crops and flips, tensor and list columns, across epochs."""
    import datasets

    from common.image_data import CachedLatents

    rng = np.random.default_rng(0)
    # (height, width): square, larger (resized to 16 x 16), one size wider than high (crops of a 16 x 24), and sizes
    # that differ (the per-image path of __getitems__)
    for size, flip in itertools.product(((16, 16), (24, 24), (20, 30), "mixed"), (False, True)):
        paths = [str(tmp_path / f"{size}-{flip}-{i}.png") for i in range(6)]
        for i, path in enumerate(paths):
            h, w = size if size != "mixed" else (16 + 8 * (i % 2), 16 + 4 * (i % 3))
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        ds = datasets.Dataset.from_dict({"image": paths}).cast_column("image", datasets.Image())
        columns = {"label": torch.arange(6) * 10, "caption": [f"c{i}" for i in range(6)]}
        data = ImageDataset(ds, "image", 16, center_crop=False, random_flip=flip, columns=columns, seed=3)
        center = ImageDataset(ds, "image", 16, center_crop=True, random_flip=flip, seed=3)  # what --cache_latents uses
        cached = CachedLatents(ImageDataset(ds, "image", 16, random_flip=flip, seed=3), lambda x: x[:, :2] * 2, 4)
        indices = [5, 0, 3, 3]
        for epoch in (0, 1):
            for dataset in (data, cached, center):
                dataset.set_epoch(epoch)
            for dataset in (data, cached, center):
                expected = torch.utils.data.default_collate([dataset[i] for i in indices])
                batch = collate_batch(dataset.__getitems__(indices))
                assert batch.keys() == expected.keys()
                for key, value in expected.items():
                    assert value == batch[key] if isinstance(value, list) else torch.equal(value, batch[key]), key
            encoded = torch.stack([center[i]["pixel_values"][:2] * 2 for i in indices])  # this epoch's flips
            assert torch.equal(cached.__getitems__(indices)["latent_params"], encoded)
            # the center crop, worked out here from the file
            for i, got in zip(indices, center.__getitems__(indices)["pixel_values"]):
                image = resize_shorter_side(Image.open(paths[i]), 16)
                top, left = (image.shape[1] - 16) // 2, (image.shape[2] - 16) // 2
                crop = image[:, top:top + 16, left:left + 16].float() / 127.5 - 1
                assert torch.allclose(got, crop, atol=1e-6) or (flip and torch.allclose(got, crop.flip(-1), atol=1e-6))
        if size == (20, 30) and not flip:  # random crops of 16 x 24 images: not all of them the center one
            assert any(not torch.equal(data[i]["pixel_values"], center[i]["pixel_values"]) for i in range(6))


def test_macro_f1_matches_sklearn():
    from sklearn.metrics import f1_score

    from common.classifier_metrics import macro_f1

    g = torch.Generator().manual_seed(0)
    for n, classes in ((50, 3), (200, 10), (7, 10)):  # (7, 10): classes that appear in neither are left out
        refs, preds = torch.randint(0, classes, (n,), generator=g), torch.randint(0, classes, (n,), generator=g)
        preds[: n // 2] = refs[: n // 2]
        assert abs(macro_f1(preds, refs) - f1_score(refs.numpy(), preds.numpy(), average="macro")) < 1e-12
    assert macro_f1(torch.tensor([1, 1]), torch.tensor([1, 1])) == 1.0
    assert macro_f1(torch.tensor([0, 0]), torch.tensor([1, 1])) == 0.0


def test_param_groups_prefixes_and_no_decay():
    model = torch.nn.Sequential()
    model.add_module("image_model", torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))
    model.add_module("text_model", torch.nn.Linear(4, 4))
    model.add_module("head", torch.nn.Linear(8, 2))
    lr_groups = parse_lr_groups("image_model=2e-5,text_model=4e-5")
    groups = {g["name"]: g for g in build_param_groups(model, 1e-3, 0.1, lr_groups)}
    assert groups["image_model"]["lr"] == 2e-5 and groups["image_model"]["weight_decay"] == 0.1
    assert groups["image_model/no_decay"]["weight_decay"] == 0.0
    assert len(groups["image_model/no_decay"]["params"]) == 3  # linear bias, norm weight, norm bias
    assert groups["text_model"]["lr"] == 4e-5 and groups["default"]["lr"] == 1e-3
    assert sum(len(g["params"]) for g in groups.values()) == len(list(model.parameters()))
    with pytest.raises(UserError, match="no module named 'vision'.*image_model, text_model, head"):
        build_param_groups(model, 1e-3, 0.1, {"vision": 1e-4})
    for bad in ("image_model", "image_model=abc", "=1e-3", "x=-1"):
        with pytest.raises(UserError, match="--lr_groups"):
            parse_lr_groups(bad)


def test_tracker_config_is_tensorboard_safe():
    clean = sanitize_config({"a": None, "b": [1, 2], "c": 1.5, "d": True, "e": {"x": 1}, "f": "s"})
    assert clean == {"a": "none", "b": "1,2", "c": 1.5, "d": True, "e": "{'x': 1}", "f": "s"}


def test_step_accounting():
    assert plan_steps(23, 1, 15) == (23, 345, 15)
    assert plan_steps(23, 4, 2) == (6, 12, 2)  # the short last cycle still steps
    assert plan_steps(23, 4, 2, max_train_steps=7) == (6, 7, 2)
    assert resume_position(8, 6, 4, 12) == (1, 8)
    assert resume_position(7, 6, 4, 7) == (2, 0)  # at the last step: no epoch left to run


class _FakeAccelerator:
    """Stands in for one process: save_state writes a file, like accelerate's does."""
    is_main_process = is_local_main_process = True
    project_configuration = Namespace(save_on_each_node=False)

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "state.bin"), "w") as f:
            f.write("x")


def test_checkpoint_rotation_and_atomic_names(tmp_path):
    out = str(tmp_path)
    for step in (10, 20, 30):
        save_checkpoint(_FakeAccelerator(), out, step, total_limit=2)
    assert [os.path.basename(p) for p in list_checkpoints(out)] == ["checkpoint-20", "checkpoint-30"]
    assert json.loads((tmp_path / "checkpoint-30/checkpoint_info.json").read_text())["global_step"] == 30
    (tmp_path / "checkpoint-40.tmp").mkdir()  # a save that was interrupted
    assert resolve_resume("latest", out).endswith("checkpoint-30")
    assert resolve_resume("checkpoint-20", out).endswith("checkpoint-20")
    assert resolve_resume("latest", str(tmp_path / "empty")) is None
    with pytest.raises(UserError, match="no checkpoint at 'checkpoint-99'"):
        resolve_resume("checkpoint-99", out)
    save_checkpoint(_FakeAccelerator(), out, 40, total_limit=2)  # the stale .tmp is replaced, not kept
    assert not (tmp_path / "checkpoint-40.tmp").exists() and (tmp_path / "checkpoint-40/state.bin").exists()


def test_every_accelerate_config_loads_with_accelerate():
    from accelerate.commands.config.config_args import load_config_from_file

    files = sorted(glob.glob(str(CONFIGS / "*.yaml")))
    assert len(files) >= 9
    for path in files:
        assert check_accelerate_config(path) is None
        config = load_config_from_file(path)
        assert config.num_processes >= 1
    assert load_config_from_file(str(CONFIGS / "cpu_2proc.yaml")).num_processes == 2


def test_no_accelerate_config_contradicts_the_scripts_flags():
    """Mixed precision: a value --mixed_precision also takes (the flag wins over the yaml). DeepSpeed's accumulation
    and clipping: left to the scripts' --gradient_accumulation_steps and --max_grad_norm (absent, or `auto`)."""
    from accelerate.commands.config.config_args import load_config_from_file

    from common.args import MIXED_PRECISION

    for path in sorted(glob.glob(str(CONFIGS / "*.yaml"))):
        config = load_config_from_file(path)
        assert config.mixed_precision in MIXED_PRECISION, path
        for key in ("gradient_accumulation_steps", "gradient_clipping"):
            assert (config.deepspeed_config or {}).get(key, "auto") == "auto", (path, key)
            assert key not in (config.fsdp_config or {}), (path, key)


def test_deepspeed_accumulation_and_clipping_come_from_the_flags():
    """What accelerate builds from deepspeed_zero2.yaml (no deepspeed needed to build it): `auto` values, filled from
    the flags by the scripts; a value the yaml sets otherwise is one line."""
    from types import SimpleNamespace

    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin

    from common.distributed import match_deepspeed_config

    yaml = load_config_from_file(str(CONFIGS / "deepspeed_zero2.yaml")).deepspeed_config
    plugin = DeepSpeedPlugin(zero_stage=yaml["zero_stage"], gradient_accumulation_steps=yaml.get(
        "gradient_accumulation_steps"), gradient_clipping=yaml.get("gradient_clipping"))
    match_deepspeed_config(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)), 4, 0.5)
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 4
    assert plugin.deepspeed_config["gradient_clipping"] == 0.5
    fixed = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1, gradient_clipping=1.0)
    with pytest.raises(UserError, match="gradient_accumulation_steps: 1 where --gradient_accumulation_steps is 4"):
        match_deepspeed_config(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=fixed)), 4, 1.0)
    match_deepspeed_config(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None)), 4, 0.5)  # not DeepSpeed


def test_unreadable_accelerate_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: [oops\n  : :")
    assert "cannot be read" in check_accelerate_config(str(bad))
    bad.write_text("- a list\n")
    assert "not an accelerate config" in check_accelerate_config(str(bad))
    assert "does not exist" in check_accelerate_config(str(tmp_path / "missing.yaml"))


def test_machines_find_out_whether_they_share_the_output_folder():
    # (process, its machine's first process, the processes whose files it sees, its folder): 2 machines x 2 processes
    shared = [(r, r - r % 2, [0, 1, 2, 3], "/shared/out") for r in range(4)]
    assert folder_sharing(shared) == "shared"
    own = [(r, r - r % 2, [r - r % 2, r - r % 2 + 1], f"/local{r // 2}/out") for r in range(4)]
    assert folder_sharing(own) == "per machine"
    mixed = [(0, 0, [0, 1, 2], "/a"), (1, 0, [0, 1, 2], "/a"), (2, 2, [0, 1, 2], "/a"), (3, 2, [3], "/b")]
    with pytest.raises(UserError, match=r"process 0 sees the files of processes 0, 1, 2 in '/a', but the processes "
                                        r"of its machine are 0, 1: give every machine one folder"):
        folder_sharing(mixed)


def test_every_process_resumes_from_the_same_step():
    views = [(0, [2, 4], "/a"), (1, [2, 4, 6], "/b")]  # (process, steps of the checkpoints it finds, its folder)
    assert choose_resume_step("latest", views) == 4  # the newest that every machine holds
    assert choose_resume_step("latest", [(0, [], "/a"), (1, [], "/b")]) is None  # a fresh start everywhere
    with pytest.raises(UserError, match=r"latest: no checkpoint is in every machine's --output_dir \(process 1 finds "
                                        r"none in '/b', process 0 finds checkpoint-4\): copy checkpoint-4 into"):
        choose_resume_step("latest", [(0, [2, 4], "/a"), (1, [], "/b")])  # never step 0 beside a resumed machine
    with pytest.raises(UserError, match="process 0 finds checkpoint-2 in '/a', process 1 finds checkpoint-4"):
        choose_resume_step("latest", [(0, [2], "/a"), (1, [4], "/b")])
    assert choose_resume_step("checkpoint-2", [(0, [2], "/a"), (1, [2], "/b")]) == 2
    with pytest.raises(UserError, match="process 1 finds no checkpoint at 'checkpoint-2' \\(nor in its --output_dir "
                                        "'/b'\\), other processes do"):
        choose_resume_step("checkpoint-2", [(0, [2], "/a"), (1, [], "/b")])
    with pytest.raises(UserError, match="no checkpoint at 'checkpoint-9'"):
        choose_resume_step("checkpoint-9", [(0, [], "/a"), (1, [], "/b")])
    with pytest.raises(UserError, match="is checkpoint-2 on some processes and checkpoint-4 on others"):
        choose_resume_step("/ckpt", [(0, [2], "/a"), (1, [4], "/b")])


def test_state_hooks_write_from_pretrained_folders_and_restore(tmp_path):
    from accelerate import Accelerator
    from transformers import ResNetConfig, ResNetForImageClassification

    from common.checkpoints import register_state_hooks

    accelerator = Accelerator(cpu=True)
    pretrained = ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1]))
    plain = torch.nn.Linear(3, 2)
    extra = {}
    pretrained, plain = accelerator.prepare(pretrained, plain)
    register_state_hooks(accelerator, {"classifier": pretrained, "head": plain},
                         extra_save=lambda d, models: extra.setdefault("saved", (d, models)),
                         extra_load=lambda d: extra.setdefault("loaded", d))
    saved = {k: v.clone() for k, v in {**pretrained.state_dict(), **plain.state_dict()}.items()}
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt/classifier/config.json").exists()
    assert (tmp_path / "ckpt/classifier/model.safetensors").exists()
    assert (tmp_path / "ckpt/head/model.safetensors").exists()
    assert not (tmp_path / "ckpt/model.safetensors").exists()  # popped: not written twice
    with torch.no_grad():
        for p in list(pretrained.parameters()) + list(plain.parameters()):
            p.add_(1.0)
    accelerator.load_state(str(tmp_path / "ckpt"))
    restored = {**pretrained.state_dict(), **plain.state_dict()}
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    assert extra == {"saved": (str(tmp_path / "ckpt"), {"classifier": pretrained, "head": plain}),
                     "loaded": str(tmp_path / "ckpt")}


def test_preemption_guard_ignores_a_copy_of_the_signal_and_stops_at_a_real_second_one():
    import signal
    import time

    from accelerate import Accelerator

    from common.preemption import REPEAT_AFTER_S, PreemptionGuard

    guard = PreemptionGuard(Accelerator(cpu=True))
    try:
        assert not guard.should_stop(1)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's / the scheduler's copy, at once: the same event
        assert guard.should_stop(2) and guard.signum == signal.SIGTERM
        time.sleep(REPEAT_AFTER_S + 0.1)
        with pytest.raises(SystemExit) as stopped:  # a second signal later: stop now, no checkpoint
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        assert stopped.value.code == 128 + signal.SIGINT
    finally:
        guard.restore()


def test_first_line_and_one_line_of_an_error():
    hub = OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your connection or see the docs at ...")
    assert first_line(hub) == "We couldn't connect to 'https://huggingface.co'."
    assert first_line(ValueError("")) == "ValueError" and one_line(KeyError()) == "KeyError"
    assert first_line(ValueError("x" * 400)) == "x" * 297 + "..." and len(first_line(ValueError("x" * 400), 200)) == 200
    assert one_line(ValueError("while parsing a block\n  in line 3")) == "while parsing a block in line 3"


def test_is_hub_id_follows_the_hubs_naming_rule(tmp_path):
    from common.args import is_hub_id

    for name in ("gpt2", "stable-diffusion-v1-5/stable-diffusion-v1-5", "google/ddpm-cifar10-32", "a.b_c/d.e"):
        assert is_hub_id(name), name
    (tmp_path / "here").mkdir()
    for name in (str(tmp_path / "here"), str(tmp_path / "missing"), "./models/tiny-sd", "~/model", "a/b/c",
                 "owner/-name", "owner/name.", "a--b/c", "a../b", "lora.safetensors", "owner/unet.json", ""):
        assert not is_hub_id(name), name


def test_dtype_and_device_from_their_flags():
    from common.args import device_and_dtype, torch_dtype
    from common.base_models import lora_dtypes

    assert [torch_dtype(n) for n in ("fp32", "fp16", "bf16", "no", None)] == [
        torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.float32]
    assert device_and_dtype("cpu") == (torch.device("cpu"), torch.float32)
    assert device_and_dtype("cpu", "bf16") == (torch.device("cpu"), torch.bfloat16)
    assert device_and_dtype("cuda")[1] == torch.float16  # a device is only named here, nothing is allocated on it
    assert lora_dtypes("fp16") == (torch.float16, torch.float32) and lora_dtypes("no") == (torch.float32,) * 2


def test_the_launcher_waits_for_other_machines_as_long_as_ddp_timeout():
    from common.launch import with_rdzv_timeout

    assert with_rdzv_timeout("", ["--ddp_timeout", "60"]) == "timeout=60"
    assert with_rdzv_timeout("read_timeout=5", ["--ddp_timeout=60"]) == "read_timeout=5,timeout=60"
    assert with_rdzv_timeout("timeout=10", ["--ddp_timeout", "60"]) == "timeout=10"  # the launcher's own flag wins
    assert with_rdzv_timeout("", ["--seed", "1"]) == ""  # torchrun's 900 s


def test_idle_frozen_models_are_what_the_caches_leave_unused():
    from common.base_models import idle_frozen_models

    assert idle_frozen_models(cache_latents=True, text_cached=True, validation_prompts=[]) == ["vae", "text_encoders"]
    assert idle_frozen_models(cache_latents=False, text_cached=True, validation_prompts=[]) == ["text_encoders"]
    assert idle_frozen_models(cache_latents=True, text_cached=False, validation_prompts=[]) == ["vae"]  # trained TE
    # validation images decode through the VAE; their prompts are cached with the others
    assert idle_frozen_models(cache_latents=True, text_cached=True, validation_prompts=["a cat"]) == ["text_encoders"]


def test_an_image_to_video_bases_image_encoder_leaves_the_device_with_the_vae():
    """Wan 2.1 I2V's CLIP image encoder (its family's PIPELINE_EXTRAS) is idle once the latent cache holds its
    embeddings: offload_idle_models moves it with the VAE, and keeps both where validation clips are drawn."""
    import argparse
    import logging
    import types

    from common.base_models import offload_idle_models

    moved = []

    class Model(torch.nn.Linear):  # records where it is sent
        def to(self, device, *args, **kwargs):
            moved.append((self.name, device))
            return self

    vae, encoder, text = Model(1, 1), Model(1, 1), Model(1, 1)
    vae.name, encoder.name, text.name = "vae", "image_encoder", "text_encoder"
    family = types.SimpleNamespace(PIPELINE_EXTRAS={"image_encoder": encoder})
    for prompts, expected in ((None, ["vae", "image_encoder", "text_encoder"]), (["a cat"], ["text_encoder"])):
        moved.clear()
        args = argparse.Namespace(cache_latents=True, validation_prompt=prompts)
        offload_idle_models(logging.getLogger("test"), args, vae, [text], text_cached=True, family=family)
        assert moved == [(name, "cpu") for name in expected], prompts


def test_a_lazy_latent_cache_encodes_only_what_batches_ask_for_and_equals_the_eager_one(tmp_path):
    """CachedLatents(lazy=True): a chunk's view is encoded (in the same call as the eager cache encodes it, so bit for
    bit the same, whatever the batches' order) when a batch first asks for one of its images; once all are, the
    decoded images go. On the CPU, and where the VAE stays on the device anyway, --cache_latents is lazy. An
    image-to-video base's condition of each clip (Wan I2V: `condition`) is cached with its latents, each view's the
    condition of that view's own pixels."""
    import datasets

    from common.base_models import lazy_latent_cache
    from common.image_data import CachedLatents

    rng = np.random.default_rng(0)
    paths, sizes = [], []
    for i in range(6):
        h, w = (16, 24) if i % 3 else (16, 16)
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
        sizes.append((h, w))
    ds = datasets.Dataset.from_dict({"image": paths}).cast_column("image", datasets.Image())
    calls = []

    def encode(x):  # each output depends on the whole call: another chunking would show
        calls.append(len(x))
        return torch.cat([x[:, :, ::4, ::4], x[:, :, ::4, ::4]], dim=1) + x.mean()

    def condition(x):  # per image, as a clip's first-frame condition is
        return {"image_condition": x[:, :1, ::2, ::2] * 3, "image_embeds": x.flatten(1)[:, :5]}

    for buckets, flip in itertools.product((None, sizes), (False, True)):
        def data():
            return ImageDataset(ds, "image", 16, center_crop=True, random_flip=flip, seed=3, sizes=buckets,
                                masks="ones", references=[[{"path": p, "bytes": None}] for p in paths])

        eager, lazy = CachedLatents(data(), encode, 2, condition=condition), \
            CachedLatents(data(), encode, 2, lazy=True, condition=condition)
        plain = data()
        views = 2 if flip else 1
        calls.clear()
        for epoch, indices in enumerate(([4], [5, 1], [2, 4, 1], [0, 3], [3, 0], [5, 4, 2, 1])):  # (one size each)
            for cache in (eager, lazy, plain):
                cache.set_epoch(epoch)
            got, expected = lazy.__getitems__(indices), eager.__getitems__(indices)
            if epoch == 0:
                assert len(calls) == 2 and lazy.images.cache is not None  # one view of one chunk: image and reference
            assert got.keys() == expected.keys() == {"index", "latent_params", "mask", "reference_latents", "condition"}
            for key in got:
                if key != "condition":
                    assert torch.equal(got[key], expected[key]), key
            pixels = plain.__getitems__(indices)["pixel_values"]  # this epoch's views, uncached
            for name, value in condition(pixels).items():
                assert torch.equal(got["condition"][name], value) and torch.equal(expected["condition"][name], value)
                assert all(torch.equal(lazy[i]["condition"][name], value[n]) for n, i in enumerate(indices))
            assert all(torch.equal(lazy[i][key], eager[i][key]) for i in indices for key in ("latent_params", "mask"))
        assert len(calls) == 2 * (len(eager.chunks) * views - len(lazy.todo))
        assert (lazy.images.cache is None) == (not lazy.todo)
        lazy.fill((i, v) for i in range(6) for v in range(views))  # the rest: then all of it equals the eager cache
        assert not lazy.todo and lazy.images.cache is None and len(calls) == 2 * len(eager.chunks) * views
        for name in ("params", "masks", "references"):
            assert all(torch.equal(a, b) for a, b in zip(getattr(lazy, name), getattr(eager, name))), name
    args = Namespace(dataloader_num_workers=0, cache_latents=True, validation_prompt=None)
    assert lazy_latent_cache(args, torch.device("cpu"))
    assert not lazy_latent_cache(args, torch.device("cuda"))  # the VAE leaves the GPU once the cache is made
    assert lazy_latent_cache(Namespace(**{**vars(args), "validation_prompt": ["a cat"]}), torch.device("cuda"))
    assert not lazy_latent_cache(Namespace(**{**vars(args), "dataloader_num_workers": 2}), torch.device("cpu"))


def test_cudnn_attention_stays_off_unless_asked_for():
    from common.training import set_cuda_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        set_cuda_backends(allow_tf32=False, allow_cudnn_attention=True)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        set_cuda_backends(allow_tf32=False, allow_cudnn_attention=False)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
