"""Images (and a video family's clips: video files, folders of frames, common/video.py) with same-name .txt captions
beside them (the kohya sd-scripts, ai-toolkit and SimpleTuner layout), read as a datasets.DatasetDict.

`cat/01.png` is captioned by `cat/01.txt` (`cat/01.caption` with --caption_extension .caption): UTF-8 text, its
first non-empty line the caption, as kohya's sd-scripts read it; with --enable_wildcard (kohya's flag) every non-empty
line is a caption, one picked per step. Subfolders are searched at any depth; names starting with "." are skipped, as
datasets' imagefolder skips them. A tree with a datasets metadata file
(metadata.jsonl, .csv or .parquet) anywhere in it is an imagefolder instead, and datasets reads it.
"""
import os
import re

from .args import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from .cli import UserError

METADATA_FILES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")
SHOWN = 3  # file names quoted in an error about several files
CAPTION_EXTENSION = ".txt"  # kohya's sd-scripts default to .caption; most folders use .txt
OTHER_EXTENSIONS = (".txt", ".caption")  # what an error suggests when the files use the other one
# kohya's wildcard notation, "{a|b}" (one variant per step; "{{" and "}}" stand for the braces themselves)
WILDCARD = re.compile(r"\{[^{}]+\}")


def caption_extension(text):
    """--caption_extension: ".txt", "txt" -> ".txt"; an image extension or an empty one is an error."""
    name = text.strip().lstrip(".").lower()
    if not name or "/" in name or os.sep in name:
        raise UserError(f"--caption_extension '{text}' is not a file extension; give one such as .txt or .caption")
    extension = "." + name
    if extension in IMAGE_EXTENSIONS:
        raise UserError(f"--caption_extension '{text}' is an image extension; captions are text files (.txt, "
                        ".caption)")
    return extension


def tree_files(root):
    """The files under `root` as sorted "/"-separated relative paths, hidden files and folders left out."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        relative = os.path.relpath(folder, root)
        for name in files:
            if not name.startswith("."):
                found.append(os.path.normpath(os.path.join(relative, name)).replace(os.sep, "/"))
    return sorted(found)


def metadata_file(root):
    """The first datasets metadata file in the tree under `root` (a relative path), else None."""
    return next((path for path in tree_files(root) if path.rsplit("/", 1)[-1] in METADATA_FILES), None)


def read_caption_file(path, every_line=False):
    """A caption file -> [its first non-empty line], stripped; `every_line` (--enable_wildcard): all of them."""
    try:
        with open(path, encoding="utf-8-sig") as file:  # -sig: a byte-order mark (Windows editors) is not text
            text = file.read()
    except UnicodeDecodeError as err:
        raise UserError(f"caption file '{path}' is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except OSError as err:
        raise UserError(f"cannot read caption file '{path}': {err.strerror or err}") from None
    captions = [line.strip() for line in text.splitlines() if line.strip()]
    if not captions:
        raise UserError(f"caption file '{path}' is empty; write the image's caption in it, or delete it to caption "
                        "the image with --default_caption")
    if not every_line:
        return captions[:1]
    for caption in captions:
        wildcard = WILDCARD.search(caption.replace("{{", "").replace("}}", ""))
        if wildcard:  # kohya would expand it; trained as written it would teach the braces
            raise UserError(f"caption file '{path}' holds kohya's {{a|b}} wildcard notation ('{wildcard.group()}'), "
                            "which is not expanded here: write each variant as a caption line of its own "
                            "(--enable_wildcard picks one line per step)")
    return captions


def listed(paths):
    return ", ".join(paths[:SHOWN]) + (f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else "")


def frame_folders(files, extension=CAPTION_EXTENSION):
    """The folders of frames among `files` (relative paths): a folder holding image files with a caption file of its
    own name beside it (`jump/000.png`..., `jump.txt`) is one clip."""
    captions = {os.path.splitext(path)[0] for path in files if os.path.splitext(path)[1].lower() == extension}
    return sorted({path.rpartition("/")[0] for path in files if path.rpartition("/")[0] in captions
                   and os.path.splitext(path)[1].lower() in IMAGE_EXTENSIONS})


def read_caption_folder(root, default_caption=None, extension=CAPTION_EXTENSION, every_line=False):
    """-> (image paths, caption lists), in sorted path order (every process sees the same). An image without a caption
    file (<name><extension>) takes [default_caption], or is an error naming the first few; so is a caption file
    without its image. `every_line`: read_caption_file's."""
    files = tree_files(root)
    clips = frame_folders(files, extension)  # (video families: common/video.py)
    media = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS
    images = sorted([path for path in files if os.path.splitext(path)[1].lower() in media
                     and not path.startswith(tuple(folder + "/" for folder in clips))] + clips)
    if not images:
        raise UserError(f"--train_data_dir '{root}' holds no image files; put images in it, each with its caption "
                        f"in a {extension} file of the same name beside it (photo.png, photo{extension})")
    texts = {}
    for path in files:
        if path.startswith(tuple(folder + "/" for folder in clips)):
            continue
        stem, ext = os.path.splitext(path)
        if ext.lower() == extension:
            if stem in texts:
                raise UserError(f"two caption files for one image in '{root}': {texts[stem]} and {path}; keep one")
            texts[stem] = path
    stems = {os.path.splitext(path)[0] for path in images}
    orphans = [path for stem, path in texts.items() if stem not in stems]
    if orphans:
        raise UserError(f"caption file(s) without an image of the same name in '{root}': {listed(orphans)}; add the "
                        "image or delete the caption file")
    missing = [path for path in images if os.path.splitext(path)[0] not in texts]
    if missing and default_caption is None:
        stems = {os.path.splitext(path)[0] for path in missing}
        other = next((ext.lower() for stem, ext in map(os.path.splitext, files)
                      if stem in stems and ext.lower() in OTHER_EXTENSIONS and ext.lower() != extension), None)
        if other:  # e.g. kohya's .caption files read as .txt
            raise UserError(f"images without a {extension} caption file in '{root}' ({len(missing)} of {len(images)}):"
                            f" {listed(missing)}; their captions are {other} files: give --caption_extension {other}")
        raise UserError(f"images without a caption file in '{root}' ({len(missing)} of {len(images)}): "
                        f"{listed(missing)}; write a {extension} caption of the same name beside each, or give "
                        "--default_caption for them")
    captions = []
    for path in images:
        text = texts.get(os.path.splitext(path)[0])
        captions.append(read_caption_file(os.path.join(root, text), every_line) if text else [default_caption])
    return [os.path.abspath(os.path.join(root, path)) for path in images], captions


def load_caption_folder(path, image_column, caption_column, default_caption=None, extension=CAPTION_EXTENSION,
                        every_line=False):
    """-> datasets.DatasetDict with a "train" split: `image_column` a datasets.Image() of the files, `caption_column`
    each image's list of captions."""
    import datasets

    if image_column == caption_column:
        raise UserError(f"--image_column and --caption_column are both '{image_column}'; give two names")
    images, captions = read_caption_folder(path, default_caption, extension, every_line)
    features = datasets.Features({image_column: datasets.Image(),
                                  caption_column: datasets.Sequence(datasets.Value("string"))})
    train = datasets.Dataset.from_dict({image_column: images, caption_column: captions}, features=features)
    return datasets.DatasetDict({"train": train})


def caption_folder_reader(args):
    """load_image_dataset's `read_folder`: a --train_data_dir without a datasets metadata file is a caption folder."""
    def read(path):
        if metadata_file(path) is not None:
            return None
        return load_caption_folder(path, args.image_column, args.caption_column, args.default_caption,
                                   args.caption_extension, args.enable_wildcard)
    return read


def check_caption_args(args):
    """Before torch loads: a --train_data_dir without a metadata file is a caption folder, read once here so that its
    mistakes are reported at once; --default_caption, --caption_extension and --enable_wildcard only apply to one."""
    args.caption_extension = caption_extension(args.caption_extension)
    folder_only = [flag for flag, given in (("--default_caption", args.default_caption is not None),
                                            ("--enable_wildcard", args.enable_wildcard)) if given]
    if args.dataset_name is not None:
        if folder_only:
            raise UserError(f"{folder_only[0]} is for a --train_data_dir of images with .txt captions; a "
                            "--dataset_name has its captions in --caption_column (a list: one picked per step): drop "
                            f"{folder_only[0]}")
        return
    if not os.path.isdir(args.train_data_dir):
        return  # check_common_args says so
    metadata = metadata_file(args.train_data_dir)
    if metadata is None:
        read_caption_folder(args.train_data_dir, args.default_caption, args.caption_extension, args.enable_wildcard)
    elif folder_only:
        raise UserError(f"{folder_only[0]} is for a folder of images with .txt captions; '{args.train_data_dir}' is "
                        f"an imagefolder ({metadata}) whose --caption_column has the captions: drop {folder_only[0]}")
