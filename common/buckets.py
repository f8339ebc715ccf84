"""Aspect-ratio buckets (--buckets auto): images trained at about resolution² pixels in the shape closest to their
own, instead of cropped square, and every batch drawn from one bucket (one tensor shape).

The buckets: sides that are multiples of the model's factor (the VAE's downsampling × the UNet's), from half to
twice the resolution, each the largest area not above resolution² for its width (the scheme of kohya's sd-scripts;
e.g. 512x512, 576x448, 640x384 ... for 512 and SD's factor 64). Each image goes to the bucket whose crop keeps the
most of it, the nearest aspect ratio on a log scale (kohya's sd-scripts take the plain difference of width/height
instead: docs/train_lora.md says what that changes); it is resized to cover the bucket and center-cropped to the
bucket's aspect only. A bucket with fewer images than a batch is merged into its nearest neighbour (said in the
table), never dropped.
BucketBatchSampler: per epoch, each bucket's images shuffled and cut into batches, and the batches shuffled, all as
functions of (seed, epoch), so a resumed run sees the batches an uninterrupted one would have.
"""
import math

import numpy as np

from .cli import UserError


def bucket_sizes(resolution, factor):
    """-> sorted [(height, width)] of the buckets for `resolution` (divisible by `factor`)."""
    area = resolution * resolution
    smallest, largest = max(factor, math.ceil(resolution / 2 / factor) * factor), 2 * resolution
    sizes = set()
    for width in range(smallest, largest + 1, factor):
        height = min(largest, area // width // factor * factor)
        if height >= smallest:
            sizes |= {(height, width), (width, height)}
    return sorted(sizes, key=lambda hw: (hw[1] / hw[0], hw))


def kept_share(size, bucket):
    """The share of an image of `size` (height, width) that is left after it is resized to cover `bucket` and
    center-cropped to it: the smaller aspect ratio over the larger. One division of two integers, so that an image
    and its transpose get the very same number for transposed buckets."""
    (h, w), (bh, bw) = size, bucket
    return min(w * bh, h * bw) / max(w * bh, h * bw)


def nearest_bucket(size, buckets):
    """size (height, width) -> the index of the bucket that crops the least of it (the nearest aspect ratio on a log
    scale: a tall image and its transpose take transposed buckets); ties: the larger bucket, then the first."""
    return min(range(len(buckets)), key=lambda i: (-kept_share(size, buckets[i]), -buckets[i][0] * buckets[i][1]))


def assign_buckets(sizes, resolution, factor, batch_size, max_upscale, names=None):
    """Image sizes [(height, width)] -> (buckets [(h, w)], bucket index of each image, merges {from: into}).

    Buckets with fewer than `batch_size` images are merged into the nearest bucket by aspect ratio, the smallest
    first, until every bucket left holds a batch (or one bucket is left). An image that its bucket would upscale by
    more than `max_upscale` is a one-line error naming it (`names`: its path or row, for the message).
    """
    buckets = bucket_sizes(resolution, factor)
    of = [nearest_bucket(size, buckets) for size in sizes]
    merges = {}
    while True:
        counts = np.bincount(of, minlength=len(buckets))
        used = [i for i in range(len(buckets)) if counts[i]]
        small = [i for i in used if counts[i] < batch_size]
        if not small or len(used) == 1:
            break
        source = min(small, key=lambda i: (counts[i], i))
        others = [i for i in used if i != source]
        target = others[nearest_bucket(buckets[source], [buckets[i] for i in others])]
        merges[buckets[source]] = buckets[target]
        of = [target if b == source else b for b in of]
    for i, (size, b) in enumerate(zip(sizes, of)):
        scale = max(buckets[b][0] / size[0], buckets[b][1] / size[1])
        if scale > max_upscale:
            name = names[i] if names is not None else f"row {i}"
            raise UserError(f"image {name} ({size[1]}x{size[0]}) is too small for its bucket ({buckets[b][1]}x"
                            f"{buckets[b][0]} at --resolution {resolution}): it would be upscaled {scale:.2f}x, more "
                            "than --bucket_max_upscale; remove it, lower --resolution or raise --bucket_max_upscale")
    final = {}
    for source, target in merges.items():
        while target in merges:  # merged into a bucket that was merged in turn
            target = merges[target]
        final[f"{source[1]}x{source[0]}"] = f"{target[1]}x{target[0]}"
    return buckets, of, final


def bucket_table(buckets, of, batch_size, merges):
    """The table printed at start: each used bucket (width x height), its aspect, images and batches per epoch."""
    counts = np.bincount(of, minlength=len(buckets))
    lines = [f"{'bucket (w x h)':>15} {'aspect':>7} {'images':>7} {'batches':>8}"]
    for i in np.flatnonzero(counts):
        h, w = buckets[i]
        lines.append(f"{f'{w}x{h}':>15} {w / h:7.2f} {counts[i]:7d} {math.ceil(counts[i] / batch_size):8d}")
    lines += [f"  bucket {s} had fewer images than a batch: merged into {t}" for s, t in merges.items()]
    return "\n".join(lines)


def check_bucket_resolution(resolution, factor):
    if resolution % factor:
        near = sorted({max(factor, resolution // factor * factor), (resolution // factor + 1) * factor})
        raise UserError(f"--buckets auto: --resolution {resolution} is not divisible by {factor} (the VAE's "
                        f"downsampling times the UNet's); use {' or '.join(map(str, near))}")


def bucket_images(args, train, held_out, factor):
    """--buckets auto for `datasets` train (and held-out) images -> (each training image's (height, width), each
    held-out image's, the table to print). Held-out images take the nearest of the training buckets."""
    from .image_data import image_sizes

    check_bucket_resolution(args.resolution, factor)
    sizes, names = image_sizes(train, args.image_column)
    buckets, of, merges = assign_buckets(sizes, args.resolution, factor, args.train_batch_size,
                                         args.bucket_max_upscale, names)
    train_sizes = [buckets[b] for b in of]
    held_out_sizes = None
    if held_out is not None:
        used = sorted(set(train_sizes))
        held_out_sizes = [used[nearest_bucket(size, used)] for size in image_sizes(held_out, args.image_column)[0]]
    return train_sizes, held_out_sizes, bucket_table(buckets, of, args.train_batch_size, merges)


def validation_sizes(sizes, resolution):
    """The (height, width)s of the validation images: None (the pipeline's default) without buckets; with them the
    square and the most used other bucket, so that the grid shows the LoRA at two aspects."""
    if sizes is None:
        return None
    others = sorted(((sizes.count(size), size) for size in set(sizes) if size[0] != size[1]), reverse=True)
    return [(resolution, resolution)] + [size for _, size in others[:1]]


class BucketBatchSampler:
    """Batches of image indices, each from one bucket (`sizes`: every image's bucket): per epoch (read from
    `data.epoch`, which the training loop sets), every bucket's images shuffled and cut into batches of `batch_size`
    (the last one of a bucket may be smaller), then the batches shuffled. `batch_size` is None on purpose: accelerate
    then shards whole batches between processes (and repeats whole batches to even them out) instead of mixing
    buckets in one batch."""

    batch_size = None
    drop_last = False

    def __init__(self, sizes, batch_size, seed, data):
        self.per_batch, self.seed, self.data = batch_size, seed, data
        self.members = [np.array([i for i, s in enumerate(sizes) if s == size]) for size in sorted(set(sizes))]

    def batches(self, epoch):
        rng = np.random.default_rng([self.seed, epoch])
        batches = []
        for members in self.members:
            shuffled = rng.permutation(members)
            batches += [shuffled[i:i + self.per_batch].tolist() for i in range(0, len(shuffled), self.per_batch)]
        return [batches[i] for i in rng.permutation(len(batches))]

    def __iter__(self):
        return iter(self.batches(self.data.epoch))

    def __len__(self):
        return sum(math.ceil(len(m) / self.per_batch) for m in self.members)


def batching(sizes, batch_size, seed, data):
    """The DataLoader's batching arguments: shuffled, or one bucket a batch (`sizes`: --buckets auto; `data`: the
    ImageDataset whose epoch the loop sets; clips of several lengths, a video family's, batch by length too). The
    loader has its own generator either way: it draws a seed from it at every epoch's start, and a draw from the global
    RNG would put a resumed run one draw off."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    frames = data.frame_counts() if hasattr(data, "frame_counts") else None  # (a video family's clips)
    if frames and len(set(frames)) > 1:  # frame-count buckets: clips of one length a batch (an image: 1 frame)
        sizes = [(tuple(key) if key else (), count) for key, count in zip(sizes or [None] * len(frames), frames)]
    if sizes is not None:
        return {"batch_sampler": BucketBatchSampler(sizes, batch_size, seed, data), "generator": generator}
    return {"batch_size": batch_size, "shuffle": True, "generator": generator}
