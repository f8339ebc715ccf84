"""`python -m demo.digits`: scikit-learn's bundled handwritten digits as an imagefolder, and a restyled copy.

data/digits/{train,test}/ (stratified 80/20, fixed seed): RGB PNGs upscaled from 8x8 to 32x32 (white on black),
and a metadata.jsonl per split with file_name, label (int), text ("a handwritten digit seven") and captions: the
text three times and three times with a suffix of neutral words (", thin scanned"), for the tiny base's training
(the base learns to read the digit word whatever follows it, so that a LoRA's style words do not drown it).
data/digits-red-ink/{train,test}/: the same digits in a style the base never sees, dark red ink on light paper,
captioned "a handwritten digit seven, red ink on paper": the style LoRA's data.
data/digits-red-ink-masks/{train,test}/: a loss mask per red-ink image, same name (train_lora.py --masked_loss
--mask_data_dir): white on the digit's strokes (ink at least a quarter strength), black on the bare paper.
data/digits-red-ink-blot/{train,test}/: the red-ink digits with a square blot of the ink near the top-right corner,
and in data/digits-red-ink-blot-masks/ their masks, white but for that corner's 8x8 px block: the masked-loss demo.
data/digits-captions/<digit>/: the train split's images again, each with a same-name .txt of its captions (the
metadata's `captions`, one per line): the caption-file layout that the Stable Diffusion trainers read too (every line
with --enable_wildcard, else the first).
"""
import argparse
import json
import os
import shutil

import numpy as np
from PIL import Image

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
PAPER, INK = (240, 235, 220), (170, 20, 20)  # the red-ink style (RGB)
STROKE = 64  # the masks' threshold on the stroke intensity (0-255)
STYLE = ", red ink on paper"
# Neutral words for the caption suffixes; none of the style's words (red, ink, paper) is among them.
SUFFIX_WORDS = ("thin bold small large scanned blurry sharp neat messy quick slow old new simple plain centered tall "
                "wide narrow dark bright soft hard round square clean rough light heavy tiny big pixel number sample "
                "image photo drawing sketch picture style pen pencil chalk marker crayon blue green yellow white black "
                "grey purple orange brown on with in of canvas board wall slate card page sheet").split()


def suffix_pool(rng, size=32, max_words=4):
    return [", " + " ".join(rng.choice(SUFFIX_WORDS, rng.integers(1, max_words + 1))) for _ in range(size)]


def red_ink(grey):
    """uint8 [H, W] stroke intensity -> uint8 [H, W, 3]: paper + (ink - paper) * intensity."""
    s = grey.astype(np.float32)[..., None] / 255.0
    paper, ink = np.array(PAPER, np.float32), np.array(INK, np.float32)
    return (paper + (ink - paper) * s).round().clip(0, 255).astype(np.uint8)


def stroke_mask(grey):
    """uint8 [H, W] stroke intensity -> uint8 [H, W] loss mask: 255 on the strokes, 0 on the paper."""
    return np.where(grey >= STROKE, 255, 0).astype(np.uint8)


def blot_box(size):
    """(top, bottom, left, right) of the ink blot of an image `size` px wide: near the top-right corner, inside the
    8x8 px block (of 32 px) that the blot masks leave out, one token of the tiny Flux base."""
    k = size / 32
    return round(1 * k), round(7 * k), round(25 * k), round(31 * k)


def ink_blot(rgb):
    """uint8 [H, W, 3] red-ink image -> a copy with a square blot of the ink near its top-right corner."""
    top, bottom, left, right = blot_box(rgb.shape[1])
    out = rgb.copy()
    out[top:bottom, left:right] = INK
    return out


def blot_mask(size):
    """uint8 [H, W] loss mask of a blotted image: 255 everywhere but the corner block that holds the blot."""
    mask = np.full((size, size), 255, np.uint8)
    mask[:size // 4, size - size // 4:] = 0
    return mask


def write_digits(output_dir, size=32, test_fraction=0.2, seed=0, styled_dir=None, captions_dir=None, masks_dir=None,
                 blot_dir=None):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)  # values 0..16 -> 0..255
    index = np.arange(len(images))
    train_idx, test_idx = train_test_split(index, test_size=test_fraction, stratify=digits.target, random_state=seed)
    rng = np.random.default_rng(seed)
    pools = [suffix_pool(rng) for _ in NAMES]
    masks_dir = masks_dir if styled_dir else None  # (masks of the red-ink images)
    blot_dir = blot_dir if styled_dir else None
    blot_masks = blot_dir.rstrip("/") + "-masks" if blot_dir else None
    imagefolders = [output_dir] + ([styled_dir] if styled_dir else []) + ([blot_dir] if blot_dir else [])
    outputs = imagefolders + [d for d in (captions_dir, masks_dir, blot_masks) if d]
    for out in outputs:
        shutil.rmtree(out.rstrip("/") + ".tmp", ignore_errors=True)
    for split, indices in (("train", train_idx), ("test", test_idx)):
        folders = [os.path.join(out.rstrip("/") + ".tmp", split) for out in imagefolders]
        for folder in folders:
            os.makedirs(folder)
        for folder in (masks_dir, blot_masks):
            if folder:
                os.makedirs(os.path.join(folder.rstrip("/") + ".tmp", split))
        metas = [open(os.path.join(folder, "metadata.jsonl"), "w") for folder in folders]
        for i in sorted(indices):
            label = int(digits.target[i])
            name, text = f"{i:04d}.png", f"a handwritten digit {NAMES[label]}"
            grey = np.asarray(Image.fromarray(images[i], "L").resize((size, size), Image.BICUBIC))
            Image.fromarray(grey, "L").convert("RGB").save(os.path.join(folders[0], name))
            captions = [text] * 3 + [text + pools[label][j] for j in rng.choice(len(pools[label]), 3)]
            metas[0].write(json.dumps({"file_name": name, "label": label, "text": text, "captions": captions}) + "\n")
            if styled_dir:
                Image.fromarray(red_ink(grey), "RGB").save(os.path.join(folders[1], name))
                metas[1].write(json.dumps({"file_name": name, "label": label, "text": text + STYLE}) + "\n")
            if masks_dir:
                Image.fromarray(stroke_mask(grey), "L").save(os.path.join(masks_dir.rstrip("/") + ".tmp", split, name))
            if blot_dir:
                Image.fromarray(ink_blot(red_ink(grey)), "RGB").save(os.path.join(folders[2], name))
                metas[2].write(json.dumps({"file_name": name, "label": label, "text": text + STYLE}) + "\n")
                Image.fromarray(blot_mask(size), "L").save(os.path.join(blot_masks + ".tmp", split, name))
            if captions_dir and split == "train":
                folder = os.path.join(captions_dir.rstrip("/") + ".tmp", str(label))
                os.makedirs(folder, exist_ok=True)
                shutil.copy(os.path.join(folders[0], name), os.path.join(folder, name))
                with open(os.path.join(folder, f"{i:04d}.txt"), "w", encoding="utf-8") as file:
                    file.write("\n".join(captions) + "\n")
        for meta in metas:
            meta.close()
    for out in outputs:
        shutil.rmtree(out, ignore_errors=True)
        os.replace(out.rstrip("/") + ".tmp", out)  # a half-written folder is never left under the final name
    return len(train_idx), len(test_idx)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="data/digits")
    parser.add_argument("--styled_dir", default="data/digits-red-ink", help="The red-ink copy ('' for none).")
    parser.add_argument("--captions_dir", default="data/digits-captions",
                        help="The train split with .txt captions ('' for none).")
    parser.add_argument("--masks_dir", default="data/digits-red-ink-masks",
                        help="A loss mask per red-ink image: its strokes ('' for none).")
    parser.add_argument("--blot_dir", default="data/digits-red-ink-blot",
                        help="The red-ink copy with an ink blot in a corner, its masks beside it in <dir>-masks "
                             "(the corner left out) ('' for none).")
    parser.add_argument("--resolution", type=int, default=32)
    args = parser.parse_args()
    n_train, n_test = write_digits(args.output_dir, size=args.resolution, styled_dir=args.styled_dir or None,
                                   captions_dir=args.captions_dir or None, masks_dir=args.masks_dir or None,
                                   blot_dir=args.blot_dir or None)
    print(f"wrote {n_train} train and {n_test} test images to {args.output_dir}"
          + (f", their red-ink copy to {args.styled_dir}" if args.styled_dir else "")
          + (f" with its stroke masks in {args.masks_dir}" if args.styled_dir and args.masks_dir else "")
          + (f", a copy with an ink blot in {args.blot_dir} (masks: {args.blot_dir}-masks)" if args.styled_dir
             and args.blot_dir else "")
          + (f", the train images with .txt captions to {args.captions_dir}" if args.captions_dir else ""))
