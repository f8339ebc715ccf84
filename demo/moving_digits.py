"""`python -m demo.moving_digits`: clips of a handwritten digit drifting across a black frame, with their captions
("a handwritten digit 3 moving left"), from scikit-learn's 1,797 real 8 x 8 digits (nothing downloaded).

Each clip: the digit scaled to half the frame, white on black, starting at a random height and moving `speed` pixels a
frame to the left (or right); written as a video file, an animated GIF or a folder of frames (common/video.py reads
all three), each with its same-name .txt caption.
"""
import argparse
import os


def digit_clip(image, frames=9, size=32, direction="left", speed=1, top=8):
    """An 8 x 8 digit (values 0-16) -> PIL frames of `size` px, the digit (size / 2 px) moving `speed` px a frame."""
    import numpy as np
    from PIL import Image

    side = size // 2
    digit = Image.fromarray((np.asarray(image) * 16).clip(0, 255).astype(np.uint8)).resize((side, side),
                                                                                             Image.BILINEAR)
    travel = (frames - 1) * speed
    start = (size - side + travel) // 2 if direction == "left" else (size - side - travel) // 2
    step = -speed if direction == "left" else speed
    clips = []
    for t in range(frames):
        frame = Image.new("L", (size, size))
        frame.paste(digit, (start + step * t, top))
        clips.append(frame.convert("RGB"))
    return clips


def write_moving_digits(output_dir, count=8, frames=9, size=32, direction="left", formats=("mp4",), seed=0, speed=1):
    """`count` clips under output_dir, the i-th written in formats[i % len(formats)] ("mp4", "gif" or "frames": a
    folder of PNGs), the digit moving `speed` px a frame; captions "a handwritten digit N moving <direction>". -> the
    clip paths."""
    import numpy as np
    from sklearn.datasets import load_digits

    from common.video import save_clip

    digits = load_digits()
    rng = np.random.default_rng(seed)
    os.makedirs(output_dir, exist_ok=True)
    paths = []
    for i, index in enumerate(rng.choice(len(digits.images), count, replace=False)):
        clip = digit_clip(digits.images[index], frames, size, direction, speed, top=int(rng.integers(2, size // 2 - 1)))
        kind, name = formats[i % len(formats)], os.path.join(output_dir, f"{i:04d}")
        if kind == "frames":
            os.makedirs(name, exist_ok=True)
            for t, frame in enumerate(clip):
                frame.save(os.path.join(name, f"{t:03d}.png"))
            paths.append(name)
        else:
            paths.append(save_clip(clip, f"{name}.{kind}"))
        with open(f"{name}.txt", "w") as f:
            f.write(f"a handwritten digit {digits.target[index]} moving {direction}\n")
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="data/moving-digits")
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--num_frames", type=int, default=9)
    parser.add_argument("--direction", choices=["left", "right"], default="left")
    parser.add_argument("--format", choices=["mp4", "gif", "frames"], default="mp4")
    parser.add_argument("--speed", type=int, default=1, help="Pixels a frame.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_moving_digits(args.output_dir, args.count, args.num_frames, direction=args.direction, formats=(args.format,),
                        seed=args.seed, speed=args.speed)
    print(f"wrote {args.count} clips of {args.num_frames} frames to {args.output_dir}")
