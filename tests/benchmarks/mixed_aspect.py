"""The bucketed LoRA workloads of `make bench` (lora_buckets, lora_square): their data, and the cost of one batch
through the recipe's data path.

write_mixed_aspect: every digit of data/digits/train (32x32, white on black) pasted in the middle of a black canvas,
the canvases of workloads.toml's [mixed_aspect] in turn (wide, tall, square: equal shares), with the digit's label and
caption: an imagefolder, the same images for both workloads.
data_path_cost: common.image_data's ImageDataset.__getitems__ + collate_batch timed batch by batch in this process
(no training run), on the batches the recipe's loader draws: BucketBatchSampler's with --buckets auto, shuffled
batches otherwise. The dataset is built from the workload's own flags, parsed by train_lora.py's parser.
"""
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SPEC = "mixed_aspect.json"  # what the set was built from: other source metadata or canvases rebuild it


def write_mixed_aspect(source, output, canvases):
    """Image i of the imagefolder split `source` (metadata.jsonl with file_name, label, text) pasted centered on a
    black canvas of canvases[i % len(canvases)] (width, height), into `output`/train. -> True when written, False
    when `output` already holds this set. Written to a temporary folder first: never half a set."""
    from PIL import Image

    with open(os.path.join(source, "metadata.jsonl"), "rb") as f:
        metadata = f.read()
    rows = [json.loads(line) for line in metadata.splitlines()]
    spec = {"source_metadata_sha256": hashlib.sha256(metadata).hexdigest(), "images": len(rows),
            "canvases": [list(c) for c in canvases]}
    with contextlib.suppress(OSError, ValueError), open(os.path.join(output, SPEC)) as f:
        if json.load(f) == spec:
            return False
    tmp = output.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "train"))
    with open(os.path.join(tmp, "train", "metadata.jsonl"), "w") as meta:
        for i, row in enumerate(rows):
            width, height = canvases[i % len(canvases)]
            with Image.open(os.path.join(source, row["file_name"])) as digit:
                digit = digit.convert("RGB")
            canvas = Image.new("RGB", (width, height))
            canvas.paste(digit, ((width - digit.width) // 2, (height - digit.height) // 2))
            name = f"{i:04d}.png"
            canvas.save(os.path.join(tmp, "train", name))
            meta.write(json.dumps({"file_name": name, "label": row["label"], "text": row["text"]}) + "\n")
    with open(os.path.join(tmp, SPEC), "w") as f:
        json.dump(spec, f)
    shutil.rmtree(output, ignore_errors=True)
    os.rename(tmp, output)
    return True


def workload_data(workload_args):
    """A train_lora.py workload's flags -> (its parsed args, its training images as a `datasets.Dataset`, each
    image's bucket (height, width), or None without --buckets auto), as the recipe computes them."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import datasets

    from common.base_models import base_resolution, size_factor
    from common.buckets import bucket_images
    from common.caption_files import caption_folder_reader
    from common.families import load_family
    from common.validation_loss import load_with_validation
    from train_lora import parse_args

    datasets.disable_progress_bars()  # the data files' bars
    with contextlib.chdir(ROOT):  # the workloads' paths are relative to the repository, as the recipe runs
        args = parse_args(list(workload_args))
        family = load_family(args.pretrained_model_name_or_path, "--pretrained_model_name_or_path")
        args.resolution, _ = base_resolution(args.pretrained_model_name_or_path, args.resolution, family,
                                             args.revision, args.cache_dir)
        train, _ = load_with_validation(args, read_folder=caption_folder_reader(args))
        sizes = None
        if args.buckets == "auto":
            factor = size_factor(args.pretrained_model_name_or_path, family, args.revision, args.cache_dir)
            sizes = bucket_images(args, train, None, factor)[0]
    return args, train, sizes


def pixels_per_sample(args, sizes):
    """Mean pixels of a training sample over an epoch: the buckets' (height x width), else resolution²."""
    if sizes is None:
        return float(args.resolution * args.resolution)
    return sum(h * w for h, w in sizes) / len(sizes)


def epoch_batches(args, sizes, data, epoch):
    """The batches of image indices of one epoch: BucketBatchSampler's (one bucket each), else a shuffle cut into
    --train_batch_size batches (the last one smaller), as the recipe's DataLoader draws them."""
    import torch

    from common.buckets import BucketBatchSampler

    if sizes is not None:
        return BucketBatchSampler(sizes, args.train_batch_size, args.seed, data).batches(epoch)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
    return [order[i:i + args.train_batch_size] for i in range(0, len(order), args.train_batch_size)]


def time_batches(args, train, sizes, random_flip, batches):
    """-> the nanoseconds of `batches` batches (several epochs) through ImageDataset.__getitems__ + collate_batch."""
    import torch

    from common.image_data import ImageDataset, collate_batch

    data = ImageDataset(train, args.image_column, args.resolution, center_crop=args.center_crop,
                        random_flip=random_flip, columns={"index": torch.arange(len(train))}, seed=args.seed,
                        sizes=sizes)
    times, epoch = [], 0
    while len(times) < batches:
        data.set_epoch(epoch)
        for batch in epoch_batches(args, sizes, data, epoch)[:batches - len(times)]:
            start = time.perf_counter_ns()
            collate_batch(data.__getitems__(batch))
            times.append(time.perf_counter_ns() - start)
        epoch += 1
    return times


def data_path_cost(workload_args, batches):
    """A train_lora.py workload's flags -> its pixels per sample, and the median (and quartiles) microseconds of
    one batch through its data path with --random_flip off and on, over `batches` batches (none: the pixels only),
    on one thread (as the recipe's --num_cpu_threads_per_process 1)."""
    import torch

    args, train, sizes = workload_data(workload_args)
    result = {"batch_size": args.train_batch_size, "images": len(train),
              "pixels_per_sample": pixels_per_sample(args, sizes)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for flip in (False, True) if batches else ():
            us = [t / 1000 for t in time_batches(args, train, sizes, flip, batches)]
            q1, _, q3 = statistics.quantiles(us, n=4)
            result[f"random_flip_{'on' if flip else 'off'}"] = {"median_us": statistics.median(us), "q1_us": q1,
                                                                 "q3_us": q3, "batches": len(us)}
    finally:
        torch.set_num_threads(threads)
    return result
