"""`python -m demo.digits`: scikit-learn's bundled handwritten digits as an imagefolder.

data/digits/{train,test}/ (stratified 80/20, fixed seed): RGB PNGs upscaled from 8x8 to 32x32, and a
metadata.jsonl per split with file_name, label (int) and text ("a handwritten digit seven").
"""
import argparse
import json
import os
import shutil

import numpy as np
from PIL import Image

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def write_digits(output_dir, size=32, test_fraction=0.2, seed=0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)  # values 0..16 -> 0..255
    index = np.arange(len(images))
    train_idx, test_idx = train_test_split(index, test_size=test_fraction, stratify=digits.target, random_state=seed)
    tmp = output_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for split, indices in (("train", train_idx), ("test", test_idx)):
        folder = os.path.join(tmp, split)
        os.makedirs(folder)
        with open(os.path.join(folder, "metadata.jsonl"), "w") as meta:
            for i in sorted(indices):
                label = int(digits.target[i])
                name = f"{i:04d}.png"
                image = Image.fromarray(images[i], "L").resize((size, size), Image.BICUBIC).convert("RGB")
                image.save(os.path.join(folder, name))
                meta.write(json.dumps({"file_name": name, "label": label,
                                       "text": f"a handwritten digit {NAMES[label]}"}) + "\n")
    shutil.rmtree(output_dir, ignore_errors=True)
    os.replace(tmp, output_dir)  # a half-written folder is never left under the final name
    return len(train_idx), len(test_idx)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="data/digits")
    parser.add_argument("--resolution", type=int, default=32)
    args = parser.parse_args()
    n_train, n_test = write_digits(args.output_dir, size=args.resolution)
    print(f"wrote {n_train} train and {n_test} test images to {args.output_dir}")
