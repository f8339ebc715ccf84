"""Images with same-name .txt captions (common/caption_files.py), as the Stable Diffusion trainers read them: the
reader on real files, the layout rule (a metadata file anywhere: an imagefolder), --default_caption, --caption_prefix,
--enable_wildcard, the bad-input lines, and one real train_lora.py run on a caption folder."""
import json
from argparse import Namespace

import pytest
from conftest import assert_one_line_error, launch, read_results, run_script
from PIL import Image

from common.caption_files import (
    caption_extension,
    caption_folder_reader,
    load_caption_folder,
    read_caption_file,
    read_caption_folder,
)
from common.cli import UserError
from common.image_data import caption_lists, load_image_dataset

NON_ASCII = "ein Hund, 犬, café"


def image(path, size=(40, 36), color=(200, 30, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path, format="PNG" if path.suffix.lower() == ".png" else None)
    return path


def relative(paths, root):
    return [str(p)[len(str(root)) + 1:] for p in paths]


@pytest.fixture
def captioned(tmp_path):
    """Nested folders, an upper-case extension, a two-line caption, a non-ASCII one saved with a byte-order mark,
    and files the reader skips (a hidden folder, a json)."""
    root = tmp_path / "style"
    image(root / "a.png")
    (root / "a.txt").write_text("a red square\n", encoding="utf-8")
    image(root / "sub" / "b.JPG", color=(10, 200, 10))
    (root / "sub" / "b.txt").write_text("first\n\n   second  \n", encoding="utf-8")
    image(root / "sub" / "deeper" / "c.webp", size=(36, 48))
    (root / "sub" / "deeper" / "c.txt").write_text(NON_ASCII, encoding="utf-8-sig")
    image(root / ".thumbnails" / "a.png")
    (root / "notes.json").write_text("{}")
    return root


def sd_args(**kw):
    return Namespace(**{"dataset_name": None, "dataset_config_name": None, "train_data_dir": None, "cache_dir": None,
                        "eval_split": "test", "seed": 0, "max_train_samples": None, "image_column": "image",
                        "caption_column": "text", "default_caption": None, "caption_extension": ".txt",
                        "enable_wildcard": False, **kw})


def test_nested_folders_in_sorted_order_the_first_line_the_caption_or_every_line_with_enable_wildcard(captioned):
    paths, captions = read_caption_folder(str(captioned))
    assert relative(paths, captioned) == ["a.png", "sub/b.JPG", "sub/deeper/c.webp"]
    assert captions == [["a red square"], ["first"], [NON_ASCII]]  # the byte-order mark is not text
    paths, captions = read_caption_folder(str(captioned), every_line=True)
    assert captions == [["a red square"], ["first", "second"], [NON_ASCII]]


def test_enable_wildcard_refuses_kohyas_brace_notation_rather_than_train_the_braces(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("\n  a {cat|dog} on a mat\nlast\n", encoding="utf-8")
    assert read_caption_file(path) == ["a {cat|dog} on a mat"]  # as kohya reads it without the flag: as written
    with pytest.raises(UserError, match=r"a.txt' holds kohya's \{a\|b\} wildcard notation \('\{cat\|dog\}'\), "
                                        r"which is not expanded here: write each variant as a caption line"):
        read_caption_file(path, every_line=True)
    path.write_text("a {{literal}} brace\nand }{ these\n", encoding="utf-8")  # kohya's escapes, and no group
    assert read_caption_file(path, every_line=True) == ["a {{literal}} brace", "and }{ these"]


def test_caption_folder_dataset_has_an_image_column_and_caption_lists(captioned):
    import datasets

    loaded = load_caption_folder(str(captioned), "picture", "caption")
    assert list(loaded) == ["train"]
    train = loaded["train"]
    assert isinstance(train.features["picture"], datasets.Image) and train.column_names == ["picture", "caption"]
    assert train[2]["picture"].size == (36, 48) and train["caption"][2] == [NON_ASCII]
    # What the trainers do with it: load_image_dataset(read_folder=caption_folder_reader(args)), then caption_lists.
    args = sd_args(train_data_dir=str(captioned))
    train, _ = load_image_dataset(args, carve_eval=False, read_folder=caption_folder_reader(args))
    assert caption_lists(train["text"], "text") == [["a red square"], ["first"], [NON_ASCII]]
    args = sd_args(train_data_dir=str(captioned), enable_wildcard=True)
    train, _ = load_image_dataset(args, carve_eval=False, read_folder=caption_folder_reader(args))
    assert caption_lists(train["text"], "text") == [["a red square"], ["first", "second"], [NON_ASCII]]


def test_images_without_captions_are_named_unless_default_caption(captioned):
    for name in ("x1", "x2", "x3", "x4"):
        image(captioned / "sub" / f"{name}.png")
    with pytest.raises(UserError) as err:
        read_caption_folder(str(captioned))
    assert "(4 of 7): sub/x1.png, sub/x2.png, sub/x3.png and 1 more" in str(err.value)
    assert "--default_caption" in str(err.value)
    _, captions = read_caption_folder(str(captioned), default_caption="a photo")
    assert captions == [["a red square"], ["first"], [NON_ASCII], *[["a photo"]] * 4]


def test_caption_extension_reads_kohya_caption_files(captioned):
    """--caption_extension .caption (kohya's sd-scripts): the same folder with .caption files; the .txt ones are then
    neither captions nor orphans, as any other file."""
    for path in sorted(captioned.rglob("*.txt")):
        path.rename(path.with_suffix(".caption"))
    (captioned / "README.txt").write_text("notes")
    assert [caption_extension(text) for text in ("caption", ".caption", ".CAPTION", " txt ")] == [
        ".caption", ".caption", ".caption", ".txt"]
    paths, captions = read_caption_folder(str(captioned), extension=".caption")
    assert relative(paths, captioned) == ["a.png", "sub/b.JPG", "sub/deeper/c.webp"]
    assert captions == [["a red square"], ["first"], [NON_ASCII]]
    args = sd_args(train_data_dir=str(captioned), caption_extension=".caption")
    train, _ = load_image_dataset(args, carve_eval=False, read_folder=caption_folder_reader(args))
    assert caption_lists(train["text"], "text") == captions


def test_caption_prefix_goes_before_every_caption_and_not_the_dropout_prompt():
    prefixed = caption_lists(["a cat", ["a dog", "a dog, sitting"]], "text", prefix="sks style, ")
    assert prefixed == [["sks style, a cat"], ["sks style, a dog", "sks style, a dog, sitting"]]
    # The trainers add the dropout prompt "" to the captions' prompts themselves, after the prefix.
    prompts = sorted({c for options in prefixed for c in options} | {""})
    assert prompts[0] == "" and all(p.startswith("sks style, ") for p in prompts[1:])


def test_a_tree_with_metadata_jsonl_is_still_an_imagefolder(tmp_path):
    root = tmp_path / "data"
    for i in range(3):
        image(root / "train" / f"{i}.png")
    (root / "train" / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": f"{i}.png", "text": f"caption {i}"}) + "\n" for i in range(3)))
    (root / "README.txt").write_text("not a caption")  # would be a caption file without its image in the other layout
    args = sd_args(train_data_dir=str(root))
    train, _ = load_image_dataset(args, carve_eval=False, read_folder=caption_folder_reader(args))
    assert sorted(train["text"]) == ["caption 0", "caption 1", "caption 2"]
    assert sorted(caption_lists(train["text"], "text", prefix="sks, ")) == [["sks, caption 0"], ["sks, caption 1"],
                                                                           ["sks, caption 2"]]


def test_without_captions_a_caption_folder_is_read_as_an_imagefolder(captioned):
    """train_classifier.py and train_ddpm.py: image files only, the .txt files ignored as before."""
    train, _ = load_image_dataset(sd_args(train_data_dir=str(captioned)), carve_eval=False)
    assert len(train) == 3 and "text" not in train.column_names


def test_make_data_writes_the_train_digits_with_their_captions(tmp_path):
    from demo.digits import write_digits

    n_train, _ = write_digits(str(tmp_path / "digits"), captions_dir=str(tmp_path / "captions"))
    rows = {row["file_name"]: row for row in map(json.loads, (tmp_path / "digits/train/metadata.jsonl").open())}
    paths, captions = read_caption_folder(str(tmp_path / "captions"), every_line=True)
    assert len(paths) == n_train == len(rows)
    for path, options in zip(relative(paths, tmp_path / "captions"), captions):
        digit, name = path.split("/")
        assert int(digit) == rows[name]["label"] and options == rows[name]["captions"]
    assert read_caption_folder(str(tmp_path / "captions"))[1] == [options[:1] for options in captions]


# --------------------------------------------------------------------------------------- bad input, in the scripts
def folder_with(root, files):
    """files: {relative path: caption bytes, or None for an image}."""
    for name, content in files.items():
        path = root / name
        if content is None:
            image(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
    return root


GOOD = {"a.png": None, "a.txt": b"a red square", "sub/b.png": None, "sub/b.txt": b"a green square"}
METADATA = {"train/0.png": None, "train/metadata.jsonl": b'{"file_name": "0.png", "text": "a square"}\n'}
BAD = [
    ("not-utf8", {**GOOD, "sub/b.txt": "café".encode("latin-1")}, [], ("b.txt", "not UTF-8", "save it as UTF-8")),
    ("empty-caption-file", {**GOOD, "sub/b.txt": b" \n\t\n"}, [], ("b.txt", "is empty", "--default_caption")),
    ("caption-without-image", {**GOOD, "sub/c.txt": b"a lost caption"}, [], ("sub/c.txt", "without an image")),
    ("image-without-caption", {**GOOD, "sub/c.png": None}, [],
     ("without a caption file", "(1 of 3): sub/c.png", "--default_caption")),
    ("no-images", {"a.txt": b"a caption", "b.txt": b"another"}, [], ("holds no image files", ".txt")),
    ("default-caption-with-metadata", METADATA, ["--default_caption", "a photo"],
     ("--default_caption", "train/metadata.jsonl", "drop --default_caption")),
    ("default-caption-with-dataset-name", GOOD, ["--dataset_name", "someone/captions", "--default_caption", "a photo"],
     ("--default_caption", "--dataset_name")),
    ("enable-wildcard-with-metadata", METADATA, ["--enable_wildcard"],
     ("--enable_wildcard is for a folder", "train/metadata.jsonl", "drop --enable_wildcard")),
    ("enable-wildcard-with-dataset-name", GOOD, ["--dataset_name", "someone/captions", "--enable_wildcard"],
     ("--enable_wildcard", "--dataset_name", "drop --enable_wildcard")),
    ("kohya-caption-files-read-as-txt", {"a.png": None, "a.caption": b"a red square", "b.png": None,
                                         "b.caption": b"a square"}, [],
     ("without a .txt caption file", "a.png, b.png", "give --caption_extension .caption")),
    ("caption-extension-an-image-one", GOOD, ["--caption_extension", ".PNG"],
     ("--caption_extension", "image extension")),
]


def assert_refused(script, tmp_path, files, extra, needles):
    """One error line, and nothing written to --output_dir."""
    root = folder_with(tmp_path / "data", files)
    out = tmp_path / "out"
    proc = run_script(script, "--train_data_dir", root, "--output_dir", out, "--report_to", "none", *extra)
    assert_one_line_error(proc, *needles)
    assert not out.exists()


@pytest.mark.parametrize("files, extra, needles", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_caption_input_is_one_line(files, extra, needles, tmp_path):
    assert_refused("train_lora.py", tmp_path, files, extra, needles)


def test_text_to_image_checks_caption_folders_too(tmp_path):
    assert_refused("train_text_to_image.py", tmp_path, {**GOOD, "sub/c.png": None}, [],
                   ("without a caption file", "sub/c.png", "--default_caption"))


def test_both_trainers_document_enable_wildcard_in_help():
    for script in ("train_lora.py", "train_text_to_image.py"):
        text = " ".join(run_script(script, "--help").stdout.split())
        assert "--enable_wildcard Caption files: every non-empty line a caption, one picked at random per step" in text
        assert "Without it: the first line, as kohya reads them." in text


def test_text_to_image_takes_enable_wildcard_and_refuses_the_brace_notation(tmp_path):
    assert_refused("train_text_to_image.py", tmp_path, {**GOOD, "sub/b.txt": b"a {green|blue} square\nsecond"},
                   ["--enable_wildcard"], ("sub/b.txt", "wildcard notation ('{green|blue}')", "a caption line"))


# ----------------------------------------------------------------------------------------------- one real run
def test_lora_trains_on_a_caption_folder(captioned, tiny_sd, tmp_path):
    image(captioned / "sub" / "uncaptioned.png", color=(0, 0, 200))
    out = tmp_path / "lora"
    proc = launch("train_lora.py", "--train_data_dir", captioned, "--pretrained_model_name_or_path", tiny_sd,
                  "--output_dir", out, "--resolution", "32", "--max_train_steps", "2", "--train_batch_size", "2",
                  "--default_caption", "a blue square", "--caption_prefix", "sks style, ", "--enable_wildcard",
                  "--caption_dropout_prob", "0.5", "--report_to", "none")
    # a red square, first, second (--enable_wildcard: both lines), the non-ASCII one, the default caption
    assert "4 training images at 32 px, 5 distinct captions" in proc.stderr
    assert read_results(out)["global_step"] == 2 and (out / "pytorch_lora_weights.safetensors").is_file()
    # the trigger word is recorded where users of the LoRA look: lora_info.json and the model card
    assert json.loads((out / "lora_info.json").read_text())["trigger"] == "sks style"
    assert "`sks style, `" in (out / "README.md").read_text()
