"""Image datasets: a hub id, a local dataset or an imagefolder, checked columns, and torch/PIL transforms.

Images are decoded and resized once (kept as uint8 tensors when the set fits in `cache_limit_gb`), so the hot path
only crops, flips and normalizes tensors; larger sets are decoded per item, in dataloader workers if asked.
Any PIL mode is accepted (converted to RGB). A file that cannot be decoded stops the run with one line naming it,
never skipped silently (a skipped image would change the data and its labels without a word): with the decode-once
cache, before training starts. CachedLatents (--cache_latents of the Stable Diffusion trainers) holds each image's
VAE latent distribution instead of its pixels. A loss mask (common/loss_masks.py) is decoded with its image as a
fourth channel, so every resize, crop and flip of the image is the mask's too. A video family's items are clips
(common/video.py), uint8 [F, 3, H, W], each frame resized, cropped and flipped alike.
"""
import contextlib
import io
import logging
import os

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .args import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from .cli import UserError, first_line, one_line
from .loss_masks import dataset_masks
from .video import MISSING_AV

logger = logging.getLogger(__name__)


def load_image_dataset(args, carve_eval=True, validation_split=None, read_folder=None):
    """-> (train, eval) `datasets.Dataset`s. eval is `args.eval_split`, else 10% carved from train (fixed seed),
    else None when `carve_eval` is False (training that evaluates nothing keeps all its data).

    With `validation_split` (a share of train) -> (train, validation, test): the validation split is always carved
    from train (fixed seed), and test is `args.eval_split`, or None when the dataset has no such split.
    `--max_train_samples` truncates train after the carving: the held-out images do not depend on it.
    read_folder(path) -> a DatasetDict, or None: another layout of --train_data_dir, tried before datasets'
    imagefolder (the text-to-image trainers: images with same-name .txt captions, common/caption_files.py).
    """
    import datasets

    try:
        if args.dataset_name is not None:
            loaded = datasets.load_dataset(args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir)
        else:
            loaded = read_folder(args.train_data_dir) if read_folder else None
            if loaded is None:
                with folders_listed_once():
                    loaded = datasets.load_dataset("imagefolder", data_dir=args.train_data_dir,
                                                   cache_dir=args.cache_dir)
    except UserError:
        raise
    except Exception as err:  # datasets raises many types for a missing/invalid dataset
        source = args.dataset_name or args.train_data_dir
        raise UserError(f"cannot load dataset '{source}': {first_line(err)}") from None
    if "train" not in loaded:
        raise UserError(f"dataset has no 'train' split (it has: {', '.join(loaded)})")
    train = loaded["train"]
    if len(train) == 0:
        raise UserError("the dataset's train split is empty")
    evaluation = loaded[args.eval_split] if args.eval_split in loaded else None
    carved = None
    if validation_split is not None or (evaluation is None and carve_eval):
        share = validation_split if validation_split is not None else 0.1
        try:
            parts = train.train_test_split(test_size=share, seed=args.seed)
        except ValueError:  # no image would be left on one side
            raise UserError(f"the train split has {len(train)} image(s): too few to hold out {share:g} of them for "
                            "evaluation") from None
        train, carved = parts["train"], parts["test"]
    if args.max_train_samples is not None:
        train = train.select(range(min(args.max_train_samples, len(train))))
    if validation_split is not None:
        return train, carved, evaluation
    return train, evaluation if evaluation is not None else carved


@contextlib.contextmanager
def folders_listed_once():
    """Within it fsspec's local file system lists each folder once: datasets finds an imagefolder's files by trying
    two dozen split patterns, each a glob that lists (and stats every file of) the whole tree again."""
    from fsspec.implementations.local import LocalFileSystem

    ls, listings = LocalFileSystem.ls, {}

    def listed(self, path, detail=False, **kwargs):
        key = (path, detail, tuple(sorted(kwargs.items())))
        if key not in listings:
            listings[key] = ls(self, path, detail=detail, **kwargs)
        return list(listings[key])

    LocalFileSystem.ls = listed
    try:
        yield
    finally:
        LocalFileSystem.ls = ls


def require_columns(dataset, **columns):
    """require_columns(ds, image_column="image", ...): one-line error naming the columns that exist."""
    for flag, name in columns.items():
        if name not in dataset.column_names:
            raise UserError(f"--{flag} '{name}' is not a column of the dataset; "
                            f"columns are: {', '.join(dataset.column_names)}")


def label_names(dataset, column):
    """Class names: a ClassLabel's names, else the sorted distinct values as strings (ids are their positions)."""
    feature = dataset.features[column]
    if hasattr(feature, "names"):
        return list(feature.names)
    return [str(value) for value in sorted(set(dataset[column]))]


def label_ids(dataset, column, names, split="training"):
    """The class id of every row (a tensor): the position of its name in `names` (label_names of the training split).

    A ClassLabel stores ints that index its own names: they are read as names, so every split maps by name alike.
    A label that `names` lacks is a one-line error naming `split`.
    """
    feature = dataset.features[column]
    values = dataset[column]
    if hasattr(feature, "names"):
        missing = sorted({v for v in values if not 0 <= v < len(feature.names)})
        if missing:  # -1 is how datasets marks a row without a label
            raise UserError(f"the {split} split has rows without a class in '{column}' (values {missing[:5]})")
        values = [feature.names[v] for v in values]
    position = {name: i for i, name in enumerate(names)}
    values = [str(v) for v in values]
    unknown = set(values) - set(position)
    if unknown:
        raise UserError(f"{split} labels {sorted(unknown)[:5]} do not occur in the training split")
    return torch.tensor([position[v] for v in values])


def to_rgb(image):
    """Any PIL mode -> RGB; transparency composited on white, 16-bit scaled to 8-bit."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        array = np.asarray(image, dtype=np.float32)
        peak = array.max() if array.max() > 255 else 255.0
        image = Image.fromarray((array * (255.0 / peak)).clip(0, 255).astype(np.uint8), "L")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return image.convert("RGB")


def _open(value):
    """A datasets Image value (undecoded dict or PIL) -> PIL image."""
    if isinstance(value, Image.Image):
        return value
    path, data = value.get("path"), value.get("bytes")
    image = Image.open(io.BytesIO(data) if data is not None else path)
    image.load()
    return image


def decode_image(value, resolution, index=None, mask=None, references=()):
    """A datasets Image value -> uint8 tensor [3, H, W]: with an int `resolution` min(H, W) == resolution; with a
    (height, width) bucket, resized to cover it and center-cropped to it. A file that PIL cannot decode
    (corrupt, truncated, not an image, an unconvertible mode) is a one-line error naming it and what to do.
    mask: the image's loss mask ("alpha", "ones" or a mask file: mask_image), resized and cropped alike as a fourth
    channel: [4, H, W]. references: its reference images' values (common/references.py; None: missing, zeros),
    each stretched to the image's size and resized alike, three channels each after those."""
    with readable(value, index):
        image = _open(value)
        resize = resize_shorter_side if isinstance(resolution, int) else resize_to_bucket
        channels = [resize(image, resolution)]
        if mask is not None:
            channels.append(resize(mask_image(image, mask, image_name(value, index)), resolution)[:1])
    for reference in references:
        if reference is None:
            channels.append(torch.zeros_like(channels[0]))
            continue
        with readable(reference):
            control = to_rgb(_open(reference))
        channels.append(resize(control if control.size == image.size else control.resize(image.size, Image.BILINEAR),
                               resolution))
    return torch.cat(channels) if len(channels) > 1 else channels[0]


def has_alpha(image):
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (image.mode == "P" and "transparency" in image.info)


def mask_image(image, source, name):
    """The PIL mask ("L") of PIL `image` (named `name` in errors): its alpha channel (source "alpha"), all ones
    ("ones"), or the grey value of the mask file `source`. A mask that is all black trains nothing: one line."""
    from PIL import Image

    if source == "ones":
        return Image.new("L", image.size, 255)
    if source == "alpha":
        if not has_alpha(image):
            raise UserError(f"image {name} has no alpha channel to mask its loss with; give --mask_data_dir (a mask "
                            "per image) or save the images with transparency")
        mask = image.convert("RGBA").getchannel("A")
    else:
        with readable({"path": source}):
            mask = Image.open(source)
            mask.load()
            if has_alpha(mask):  # the mask is its grey value: its own transparency means nothing here
                mask = mask.convert("RGBA").convert("RGB")
            mask = to_rgb(mask).convert("L")
        if mask.size != image.size:
            raise UserError(f"mask '{source}' is {mask.size[0]}x{mask.size[1]} px but its image {name} is "
                            f"{image.size[0]}x{image.size[1]}; a mask must have its image's size")
    if mask.getextrema()[1] == 0:
        what = f"the alpha channel of image {name}" if source == "alpha" else f"mask '{source}'"
        raise UserError(f"{what} is black everywhere: the image would train nothing; fix the mask or leave the image "
                        "out")
    return mask


def image_name(value, index=None):
    """How an error names an image: its path, else its row."""
    name = value.get("path") if isinstance(value, dict) else None
    return f"'{name}'" if name else f"at row {index} of the dataset" if index is not None else "(in memory)"


@contextlib.contextmanager
def readable(value, index=None):
    """PIL's errors while reading image `value` -> one line naming it (images are never skipped)."""
    try:
        yield
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as err:
        raise UserError(f"cannot read image {image_name(value, index)}: {one_line(err, 200)}; delete or replace that "
                        "file (images are never skipped)") from None


def image_sizes(dataset, image_column):
    """(height, width) of every image of a `datasets.Dataset`, from the file headers (nothing decoded; a clip's first
    frame)."""
    values = undecoded(dataset, image_column)
    sizes = []
    for index, value in enumerate(values):
        with readable(value, index):
            if isinstance(value, Image.Image):
                sizes.append(value.size[::-1])
                continue
            path, data = value.get("path"), value.get("bytes")
            if is_clip(path):  # a video file, a folder of frames: its first frame's
                sizes.append(clip_size(value))
                continue
            with Image.open(io.BytesIO(data) if data is not None else path) as image:
                sizes.append(image.size[::-1])
    return sizes, [image_name(value, index) for index, value in enumerate(values)]


def resize_shorter_side(image, resolution):
    """PIL image -> uint8 tensor [3, H, W] with min(H, W) == resolution."""
    image = to_rgb(image)
    w, h = image.size
    scale = resolution / min(w, h)
    size = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
    if size != image.size:
        image = image.resize(size, Image.BILINEAR)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


def cover_size(size, bucket):
    """(height, width) an image of `size` is resized to so that it covers `bucket` with its own aspect ratio."""
    (h, w), (bh, bw) = size, bucket
    scale = max(bh / h, bw / w)
    return max(bh, round(h * scale)), max(bw, round(w * scale))


def resize_to_bucket(image, bucket):
    """PIL image -> uint8 tensor [3, h, w] of `bucket` (h, w): resized to cover it, the excess cropped evenly."""
    image = to_rgb(image)
    (bh, bw), (h, w) = bucket, cover_size(image.size[::-1], bucket)
    if (w, h) != image.size:
        image = image.resize((w, h), Image.BILINEAR)
    top, left = (h - bh) // 2, (w - bw) // 2
    image = image.crop((left, top, left + bw, top + bh))
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


# Clips (video families, common/video.py): video files (PyAV), animated GIF and WebP (Pillow), folders of frames.

def is_clip(path):
    """A video file or a folder of frames (anything else is read by Pillow: an image, or an animated GIF/WebP)."""
    return bool(path) and (os.path.isdir(path) or os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS)


def undecoded(dataset, column):
    """A dataset column's values undecoded, {"path", "bytes"} each: a Video column's (a hub dataset's clips) as
    videos, any other as images."""
    import datasets

    video = isinstance(dataset.features.get(column), getattr(datasets, "Video", ()))
    return dataset.cast_column(column, (datasets.Video if video else datasets.Image)(decode=False))[column]


def _video_frames(path, needed, data=None):
    """The first `needed` frames of a video file (or its bytes, `data`), as PIL images (PyAV)."""
    try:
        import av
    except ImportError:
        raise UserError(f"cannot read '{path}': {MISSING_AV}") from None
    frames = []
    try:
        with av.open(io.BytesIO(data) if data else path) as container:
            for frame in container.decode(video=0):
                frames.append(frame.to_image())
                if len(frames) >= needed:
                    break
    except (av.FFmpegError, OSError, ValueError, IndexError) as err:
        raise UserError(f"cannot read video '{path}': {one_line(err, 200)}; delete or replace that file (clips are "
                        "never skipped)") from None
    return frames


def _pillow_frames(value, needed):
    """The first `needed` frames of an image file (one, or an animated GIF/WebP's), as PIL images."""
    from PIL import ImageSequence

    with readable(value):
        image = _open(value)
        frames = []
        for frame in ImageSequence.Iterator(image):
            frames.append(to_rgb(frame.copy()))
            if len(frames) >= needed:
                break
    return frames if frames else [Image.new("RGB", image.size)]


def _folder_frames(path, needed):
    """A folder of frames: its image files in name order, as PIL images."""
    names = sorted(n for n in os.listdir(path) if os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS
                   and not n.startswith("."))
    if not names:
        raise UserError(f"the folder of frames '{path}' holds no image files; put its frames in it (000.png, "
                        "001.png, ...) or delete it")
    frames = []
    for name in names[:needed]:
        value = {"path": os.path.join(path, name), "bytes": None}
        with readable(value):
            frames.append(to_rgb(_open(value)))
    return frames


def read_frames(value, num_frames=None, stride=1):
    """A datasets Image value (a path or bytes) -> PIL frames: with num_frames, that many, `stride` apart, from the
    first (an image: its one frame); else the first frame alone. One line for an unreadable, empty or short one."""
    path = value.get("path") if isinstance(value, dict) else None
    data = value.get("bytes") if isinstance(value, dict) else None
    needed = 1 if not num_frames else (num_frames - 1) * stride + 1
    if path and os.path.isdir(path):
        frames = _folder_frames(path, needed)
    elif path and os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS:  # (a file, or a hub dataset's bytes)
        if not data and not os.path.isfile(path):
            raise UserError(f"cannot read video '{path}': no such file; put it back or delete its caption")
        if not data and os.path.getsize(path) == 0:
            raise UserError(f"cannot read video '{path}': the file is empty; delete or replace it")
        frames = _video_frames(path, needed, data)
        if not frames:
            raise UserError(f"cannot read video '{path}': it holds no frames; delete or replace it")
    else:
        frames = _pillow_frames(value, needed)
    if len(frames) == 1 or not num_frames:
        return frames[:1]  # an image: a clip of one frame
    if len(frames) < needed:
        fits = (len(frames) - 1) // (num_frames - 1) if num_frames > 1 else 0
        offer = f"--frame_stride {fits}" if fits >= 1 else "fewer --num_frames"
        raise UserError(f"'{path or 'a clip'}' has {len(frames)} frames, fewer than --num_frames {num_frames} at "
                        f"--frame_stride {stride} need ({needed}); give {offer}, or a longer clip")
    return frames[:needed:stride]


def clip_length(value, num_frames):
    """How many frames read_frames(value, num_frames) gives, from the file's kind (and an image's header) alone:
    num_frames for a video file, a folder of frames or an animated image, 1 for a still."""
    path = value.get("path") if isinstance(value, dict) else None
    if not num_frames or num_frames == 1 or is_clip(path):
        return num_frames or 1
    with readable(value):
        return num_frames if getattr(_open(value), "n_frames", 1) > 1 else 1


def clip_size(value):
    """(height, width) of a clip's or image's first frame."""
    return read_frames(value)[0].size[::-1]


def decode_clip(value, resolution, num_frames, stride=1, resize=None):
    """A clip (or image) -> uint8 tensor [F, 3, H, W], each frame resized as `resize(frame, resolution)` does it
    (common/image_data.py's resize_shorter_side or resize_to_bucket)."""
    import torch

    return torch.stack([resize(frame, resolution) for frame in read_frames(value, num_frames, stride)])


def splitmix64(x):
    """A 64-bit integer -> 64 well-mixed bits (the SplitMix64 generator's output function)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return x ^ (x >> 31)


class ImageDataset(torch.utils.data.Dataset):
    """Items: {"pixel_values": float [3, R, R] normalized, plus `name: values[index]` for each of `columns`}.

    columns: {name: a list or tensor with one entry per image} (labels, token ids, captions...).
    sizes: aspect-ratio buckets, the (height, width) of every image (common/buckets.py), instead of R x R crops; each
    image is resized to cover its bucket and center-cropped to it once, when decoded.
    Random crops and flips are drawn from (seed, epoch, index), not from the global RNG: the dataloader fetches
    ahead of the step, so global draws made here would differ between an uninterrupted and a resumed run.
    Call `set_epoch` at the start of every epoch.
    masks (--masked_loss): items get "mask", float [1, R, R] in [0, 1], cropped and flipped with the pixels: None (no
    masks), "alpha" (each image's alpha channel), "ones" (all ones: a dataset that has no masks, e.g. DreamBooth's
    class images, beside one that has), or a list of mask files, one per image (common/loss_masks.py).
    references (edit LoRAs): each image's reference images' values (common/references.py): items get
    "reference_values", float [k, 3, R, R] normalized, cropped and flipped with the pixels.
    """

    def __init__(self, dataset, image_column, resolution, center_crop=True, random_flip=False,
                 mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), columns=None, seed=0, cache_limit_gb=4.0, sizes=None,
                 original_sizes=None, masks=None, references=None, frames=None):

        self.images = undecoded(dataset, image_column)
        self.columns = columns or {}
        self.resolution, self.center_crop, self.random_flip = resolution, center_crop, random_flip
        self.sizes, self.original_sizes = sizes, original_sizes  # original_sizes: (height, width)s, for time_ids
        # uint8 -> float: x * scale + shift, i.e. (x / 255 - mean) / std (a multiply is cheaper than a divide)
        self.scale = 1 / (torch.tensor(std, dtype=torch.float32).view(3, 1, 1) * 255)
        self.shift = -torch.tensor(mean, dtype=torch.float32).view(3, 1, 1) / torch.tensor(std).view(3, 1, 1)
        self.seed, self.epoch = seed, 0
        self.masks, self.references = masks, references
        self.frames = frames  # (num_frames, frame_stride): clips, [F, 3, H, W] (common/video.py); None: images
        self.cache = None
        channels = (3 + (masks is not None) + 3 * len(references[0] if references else ())) * (frames or [1])[0]
        if len(self.images) * channels * resolution * resolution <= cache_limit_gb * 2**30:
            values = self.images[:]  # the whole column in one read (row by row is far slower)
            self.cache = stack_if_uniform([self._decode(i, value) for i, value in enumerate(values)])

    def target(self, index):
        """Item `index`'s training size: its bucket, else the resolution (an int: square crops)."""
        return tuple(self.sizes[index]) if self.sizes is not None else self.resolution

    def crop_size(self, index):
        """(height, width) of item `index` as trained: its bucket, else R x R."""
        return tuple(self.sizes[index]) if self.sizes is not None else (self.resolution, self.resolution)

    def mask_source(self, index):
        return self.masks[index] if isinstance(self.masks, list) else self.masks

    def _decode(self, index, value=None):
        value = self.images[index] if value is None else value
        if self.frames:  # a clip (an image: one frame) [F, 3, H, W]


            resize = resize_shorter_side if isinstance(self.target(index), int) else resize_to_bucket
            return decode_clip(value, self.target(index), *self.frames, resize=resize)
        return decode_image(value, self.target(index), index, self.mask_source(index),
                            self.references[index] if self.references else ())

    def set_epoch(self, epoch):
        self.epoch = epoch

    def frame_counts(self):
        """Each item's frame count (clips: common/video.py), for batches of one length; None for images."""
        if not self.frames:
            return None
        if isinstance(self.cache, torch.Tensor):
            return [self.cache.shape[1]] * len(self)
        if self.cache is not None:
            return [len(clip) for clip in self.cache]
        return [clip_length(value, self.frames[0]) for value in self.images]

    def augmentation(self, index, h, w):
        """(top, left, flip) of item `index` (an h x w image) in the current epoch: 64 random bits hashed from
        (seed, epoch, index): cheaper than a torch.Generator per item (timings: docs/performance.md)."""
        rh, rw = self.crop_size(index)
        bits = splitmix64(splitmix64(splitmix64(self.seed) ^ self.epoch) ^ index)
        if self.center_crop:
            top, left = (h - rh) // 2, (w - rw) // 2
        else:
            top, left = bits % (h - rh + 1), (bits >> 24) % (w - rw + 1)
        return top, left, bool(self.random_flip and bits >> 63)

    def fixed_crop(self, h, w, rh, rw):
        """(top, left) of every h x w image cropped to rh x rw when nothing is drawn (no flips; the center crop, or
        all of the image), else None: then each item's crop and flip come from `augmentation`."""
        if self.random_flip or not (self.center_crop or (h, w) == (rh, rw)):
            return None
        return (h - rh) // 2, (w - rw) // 2

    def __len__(self):
        return len(self.images)

    def placement(self, index, h, w):
        """(top, left, flip) of item `index`, decoded as an h x w image, in the current epoch."""
        fixed = self.fixed_crop(h, w, *self.crop_size(index))
        return (*fixed, False) if fixed else self.augmentation(index, h, w)

    def crop(self, index):
        """Item `index` as uint8 [3, R, R] (or its bucket's size; 4 channels with masks), cropped and flipped for the
        current epoch."""
        pixels = self.cache[index] if self.cache is not None else self._decode(index)
        rh, rw = self.crop_size(index)
        h, w = pixels.shape[-2:]
        top, left, flip = self.placement(index, h, w)
        pixels = pixels[..., top:top + rh, left:left + rw]
        return pixels.flip(-1) if flip else pixels

    def time_ids(self, indices):
        """SDXL's size conditioning of items `indices` in the current epoch, float [B, 6]: the original (height,
        width), the crop's (top, left) in the resized image, the trained (height, width). Computed from the original
        sizes (ImageDataset(original_sizes=...)), nothing decoded; a flipped item's crop is measured from the
        mirrored image's left edge, where that crop lies in it."""
        rows = []
        for index in indices:
            (oh, ow), (rh, rw) = self.original_sizes[index], self.crop_size(index)
            if self.sizes is not None:  # resized to cover the bucket and center-cropped to it when decoded
                h, w = cover_size((oh, ow), (rh, rw))
                top, left, flip = (h - rh) // 2, (w - rw) // 2, self.placement(index, rh, rw)[2]
            else:  # resized (shorter side R) when decoded, cropped per epoch
                scale = self.resolution / min(oh, ow)
                h, w = max(self.resolution, round(oh * scale)), max(self.resolution, round(ow * scale))
                top, left, flip = self.placement(index, h, w)
            rows.append((oh, ow, top, w - left - rw if flip else left, rh, rw))
        return torch.tensor(rows, dtype=torch.float32)

    def item(self, index, pixels):
        item = self.pixels_and_mask(pixels)
        for name, values in self.columns.items():
            item[name] = values[index]
        return item

    def normalize(self, pixels):
        """uint8 [..., 3, H, W] -> float32 normalized with mean and std."""
        return pixels.float().mul_(self.scale).add_(self.shift)

    def pixels_and_mask(self, pixels):
        """uint8 [..., 3 or 4, H, W] -> {"pixel_values": normalized} and, with masks, "mask": [..., 1, H, W] in
        [0, 1]; with references, "reference_values": [..., k, 3, H, W] normalized (the channels after those)."""
        out = {"pixel_values": self.normalize(pixels[..., :3, :, :])}
        if self.masks is not None:
            out["mask"] = pixels[..., 3:4, :, :].float().div_(255)
        if self.references is not None:
            references = pixels[..., 3 + (self.masks is not None):, :, :]
            out["reference_values"] = self.normalize(references.unflatten(-3, (-1, 3)))
        return out

    def __getitem__(self, index):
        return self.item(index, self.crop(index))

    def __getitems__(self, indices):
        """The DataLoader's whole batch at once (give it collate_fn=collate_batch): what default_collate makes of
        the __getitem__ items, bit for bit, with one normalization and one gather per column instead of a dict per
        image. When nothing is drawn (no flips; center crops, or images already R x R) and the decoded images share
        one size, the pixels are one index_select of the cache too (timings: docs/performance.md)."""
        index = torch.as_tensor(indices)
        rh, rw = self.crop_size(indices[0])  # a batch is one size (one bucket)
        fixed = self.fixed_crop(*self.cache.shape[-2:], rh, rw) if isinstance(self.cache, torch.Tensor) else None
        if fixed:
            top, left = fixed
            pixels = self.cache.index_select(0, index)[..., top:top + rh, left:left + rw]
        else:
            pixels = torch.stack([self.crop(i) for i in indices])
        return {**self.pixels_and_mask(pixels),
                **{name: gather(values, index) for name, values in self.columns.items()}}


def stack_if_uniform(images):
    """Decoded images -> one uint8 tensor [N, 3, H, W] when they share one size (a batch is then one index_select),
    else the list as it is. Copied image by image, so the peak stays near one copy of the set."""
    if not images or any(x.shape != images[0].shape for x in images):
        return images
    stacked = torch.empty((len(images), *images[0].shape), dtype=torch.uint8)
    for i in range(len(images)):
        stacked[i] = images[i]
        images[i] = None
    return stacked


def gather(values, index):
    """values[index] (index: a 1-D tensor) as default_collate stacks them: a tensor column in one index_select
    (torch's advanced indexing is much slower on small batches)."""
    if isinstance(values, torch.Tensor):
        return values.index_select(0, index)
    return torch.utils.data.default_collate([values[i] for i in index.tolist()])


def collate_batch(batch):
    """collate_fn for ImageDataset and CachedLatents, whose __getitems__ returns the batch itself."""
    return batch if isinstance(batch, dict) else torch.utils.data.default_collate(batch)


class CachedLatents:
    """A dataset over an ImageDataset (center crop, or buckets): each image's latent-distribution parameters (mean,
    log-variance; latents are still sampled every step), and its mirror image's with random_flip.

    Items {"latent_params", "index"}; the flip of each item is drawn exactly as ImageDataset draws it (same seed,
    epoch and index), so a cached run sees the same data as an uncached one. encode(pixels) -> parameters; images
    are encoded `batch_size` at a time, a bucket at a time. With masks, "mask" too: each view's mask averaged down to
    its latent grid (common/loss_masks.py: latent_mask), cached with its latent. With references (edit LoRAs),
    "reference_latents" too: each view's reference images' latent means [k, C, h, w] (common/references.py). With
    `condition` (an image-to-video base: condition(pixels) -> {name: tensor}, each clip's own, e.g. Wan I2V's first
    frame latents and CLIP embeddings), "condition" too: that dict of each item's view, cached with its latent.

    lazy: a chunk's view (its `batch_size` images as they are, or mirrored) is encoded when a batch first asks for one
    of its images, in the process that reads the batches (so not with dataloader workers), so that a short run
    encodes only what it trains on; else all of them now. Either way each chunk's view is encoded in the same call,
    so the values do not depend on which batches came first (a resumed run gets the same latents). Once every view
    is cached the decoded images are dropped.
    """

    def __init__(self, images, encode, batch_size, lazy=False, condition=None):
        groups = {}
        frames = images.frame_counts() or [1] * len(images)  # (clips of one length a group)
        for i in range(len(images)):
            groups.setdefault((images.crop_size(i), frames[i]), []).append(i)
        self.images, self.encode, self.uniform = images, encode, len(groups) == 1
        self.chunks = [members[start:start + batch_size] for members in groups.values()
                       for start in range(0, len(members), batch_size)]
        self.chunk_of = [0] * len(images)
        for c, chunk in enumerate(self.chunks):
            for i in chunk:
                self.chunk_of[i] = c
        self.num_views = 2 if images.random_flip else 1
        self.todo = {(c, v) for c in range(len(self.chunks)) for v in range(self.num_views)}
        # [N, views, 2 * latent channels, h, w] when every image has one size, else a list of [views, ...] (buckets);
        # masks and references alike (None without them)
        self.params = [None] * len(images)
        self.masks = None if images.masks is None else [None] * len(images)
        self.references = None if images.references is None else [None] * len(images)
        self.condition, self.conditions = condition, {}  # name -> as params
        if not lazy:
            self.fill((i, v) for i in range(len(images)) for v in range(self.num_views))

    def fill(self, pairs):
        """Encode the chunk views that hold these (image, view) pairs, where not cached yet."""
        missing = sorted({(self.chunk_of[i], v) for i, v in pairs} & self.todo)
        for c, v in missing:
            self._encode_view(self.chunks[c], v)
            self.todo.discard((c, v))
        if missing and not self.todo:
            self.images.cache = None  # the decoded images are not needed any more

    def _encode_view(self, chunk, view):
        import torch

        from .loss_masks import latent_mask

        items = [self.images[i] for i in chunk]
        flips = [self.flipped(i) for i in chunk]

        def oriented(name):  # the items' images (or masks) as they are, or mirrored (view 1): [B, C, H, W]
            values = torch.stack([item[name].flip(-1) if f else item[name] for item, f in zip(items, flips)])
            return values.flip(-1) if view else values

        latents = self.encode(oriented("pixel_values")).cpu()
        self._store("params", chunk, view, latents)
        if self.masks is not None:  # the view's mask on its latent grid
            self._store("masks", chunk, view, latent_mask(oriented("mask"), latents).cpu())
        if self.references is not None:  # the view's references' latent means
            self._store("references", chunk, view, reference_means(self.encode, oriented("reference_values")).cpu())
        if self.condition is not None:  # (image-to-video: each clip's own condition)
            for name, values in self.condition(oriented("pixel_values")).items():
                self._store(name, chunk, view, values.cpu(), self.conditions)

    def _store(self, name, chunk, view, values, holder=None):
        import torch

        holder = self.__dict__ if holder is None else holder
        cached = holder.get(name)
        if cached is None:  # (a condition's first chunk)
            cached = [None] * len(self.images)
        if self.uniform and not isinstance(cached, torch.Tensor):  # one tensor for all, made on the first chunk
            cached = torch.empty((len(self.images), self.num_views, *values.shape[1:]), dtype=values.dtype)
        holder[name] = cached
        for n, i in enumerate(chunk):
            if self.uniform:
                cached[i, view] = values[n]
            else:
                if cached[i] is None:
                    cached[i] = values.new_empty((self.num_views, *values.shape[1:]))
                cached[i][view] = values[n]

    def set_epoch(self, epoch):
        self.images.set_epoch(epoch)

    def __len__(self):
        return len(self.images)

    def flipped(self, index):
        return self.images.augmentation(index, *self.images.crop_size(index))[2]

    def time_ids(self, indices):
        """SDXL's size conditioning of items `indices` (ImageDataset.time_ids: the same view as the latents)."""
        return self.images.time_ids(indices)

    def views(self, indices):
        """Which view (0: as is, 1: mirrored) each item shows in the current epoch."""
        import torch

        if not self.images.random_flip:
            return torch.zeros(len(indices), dtype=torch.long)
        return torch.tensor([int(self.flipped(i)) for i in indices])

    def __getitem__(self, index):
        view = self.views([index])[0]
        self.fill([(index, int(view))])
        item = {"latent_params": self.params[index][view], "index": index}
        if self.masks is not None:
            item["mask"] = self.masks[index][view]
        if self.references is not None:
            item["reference_latents"] = self.references[index][view]
        if self.conditions:
            item["condition"] = {name: cached[index][view] for name, cached in self.conditions.items()}
        return item

    def __getitems__(self, indices):
        """The DataLoader's whole batch (collate_fn=common.image_data.collate_batch): one gather, no dict per item."""
        import torch

        index, views = torch.as_tensor(indices), self.views(indices)
        if self.todo:
            self.fill(zip(indices, views.tolist()))
        batch = {"index": index}

        def gather(cached):
            if isinstance(cached, torch.Tensor):
                return cached[index, views]
            return torch.stack([cached[i][v] for i, v in zip(indices, views.tolist())])

        for name, cached in (("latent_params", self.params), ("mask", self.masks),
                             ("reference_latents", self.references)):
            if cached is not None:
                batch[name] = gather(cached)
        if self.conditions:
            batch["condition"] = {name: gather(cached) for name, cached in self.conditions.items()}
        return batch


def reference_means(encode, pixels):
    """Reference pixels [B, k, 3, H, W] -> the means of their latent distributions [B, k, C, h, w] (encode(pixels) ->
    the parameters, mean and log-variance)."""
    return torch.stack([encode(pixels[:, j]).chunk(2, dim=1)[0] for j in range(pixels.shape[1])], dim=1)


def caption_lists(values, column, prefix=""):
    """Each row's caption(s) as a non-empty list of strings, each after `prefix` (--caption_prefix, a trigger word)."""
    lists = []
    for row, value in enumerate(values):
        options = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else []
        if not options or not all(isinstance(c, str) for c in options):
            raise UserError(f"--caption_column '{column}': row {row} holds {str(value)[:60]!r}, "
                            "not a caption or a list of captions")
        lists.append([prefix + caption for caption in options])
    return lists


def image_datasets(args, train_ds, held_out_ds, sizes=None, held_out_sizes=None, time_ids=False, masked_rows=None,
                   references=(None, None)):
    """The ImageDatasets of a text-to-image run: the training images (--center_crop or random crops, --random_flip,
    each image's index as a column), the held-out ones (center crops, no flips) or None; `sizes`/`held_out_sizes`:
    each image's bucket (--buckets auto); `time_ids`: each image's original size kept, for SDXL's time ids; with
    --masked_loss each image's mask (common/loss_masks.py), the held-out images' too; `masked_rows`: only the first
    training rows have masks (DreamBooth's class images after them train everywhere); `references`: each training
    and held-out image's reference images (edit LoRAs: common/references.py's References.rows). A video family's
    items are clips (args.clip_frames)."""
    def originals(dataset):
        return image_sizes(dataset, args.image_column)[0] if time_ids else None

    clips = getattr(args, "clip_frames", None)  # a video family's (common/video.py: check_video_args)

    train = ImageDataset(train_ds, args.image_column, args.resolution, center_crop=args.center_crop,
                         random_flip=args.random_flip, columns={"index": torch.arange(len(train_ds))}, seed=args.seed,
                         sizes=sizes, original_sizes=originals(train_ds),
                         masks=dataset_masks(args, train_ds, masked_rows), references=references[0], frames=clips)
    held_out = None if held_out_ds is None else ImageDataset(
        held_out_ds, args.image_column, args.resolution, center_crop=True, seed=args.seed, sizes=held_out_sizes,
        original_sizes=originals(held_out_ds), masks=dataset_masks(args, held_out_ds), references=references[1],
        frames=clips)
    return train, held_out


class Captions:
    """The captions of a text-to-image run as indices into its distinct prompts (each embedded once): `prompts`
    (sorted, "" among them for caption dropout, `extra` too: the validation prompts), `index` (prompt -> id),
    `held_out_ids` (each held-out image's first caption), and `pick`, each training image's caption for an epoch."""

    def __init__(self, args, train_ds, held_out_ds, extra=(), prefixed=None):
        import torch

        values = train_ds[args.caption_column]  # --caption_prefix before the first `prefixed` rows' (default: all)
        prefixed = len(values) if prefixed is None else prefixed
        train = (caption_lists(values[:prefixed], args.caption_column, prefix=args.caption_prefix)
                 + caption_lists(values[prefixed:], args.caption_column))
        held_out = (caption_lists(held_out_ds[args.caption_column], args.caption_column, prefix=args.caption_prefix)
                    if held_out_ds is not None else [])
        distinct = {c for options in train + held_out for c in options}
        self.distinct = len(distinct - {""})  # the distinct captions
        self.prompts = sorted(distinct | {""} | set(extra))
        self.index = {p: i for i, p in enumerate(self.prompts)}
        self.train_ids = [[self.index[c] for c in options] for options in train]
        self.held_out_ids = torch.tensor([self.index[c[0]] for c in held_out], dtype=torch.long)
        self.seed, self.dropout = args.seed, args.caption_dropout_prob

    def pick(self, indices, epoch):
        """One caption per image, or "" with --caption_dropout_prob: a function of (seed, epoch, index)."""
        import random

        import torch

        picked = []
        for index in indices.tolist():
            rng = random.Random(hash((self.seed, epoch, index)))
            picked.append(self.index[""] if rng.random() < self.dropout else rng.choice(self.train_ids[index]))
        return torch.tensor(picked)
