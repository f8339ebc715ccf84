"""Clips for the video families (Wan): training clips read from video files, animated images or folders of frames,
and drawn clips written as video files and animated previews.

A training folder holds clips beside images, each with its same-name caption: `walk.mp4` + `walk.txt`, `wave.gif` +
`wave.txt`, or a folder of frames `jump/` (its image files in name order) + `jump.txt`. With --num_frames N, a clip
trains on N frames, `--frame_stride` S apart, from its first (N must suit the VAE: Wan's takes 4k + 1); an image is a
clip of one frame. Video files are decoded with PyAV (`pip install av`, requirements-extras.txt: FFmpeg's decoders
in one wheel, maintained, and imageio's own video plugin is PyAV too); animated GIF and WebP and folders of frames
need only Pillow. Every file that cannot be read, or has too few frames, is one line naming it (clips are never
skipped).
"""
import os

from .cli import UserError, one_line

VIDEO_EXTENSIONS = frozenset((".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v"))
FPS = 16  # Wan 2.1's frame rate: what drawn clips are written at
MISSING_AV = ("reading and writing video files needs PyAV: `pip install av` (requirements-extras.txt); animated GIF "
              "and WebP and folders of frames need nothing more")


def add_video_args(group):
    """--num_frames and --frame_stride (the video families' training clips)."""
    from .args import positive_int

    group.add_argument("--num_frames", type=positive_int, default=None,
                       help="Video bases (Wan): train on clips of this many frames (4k + 1 for Wan: 1, 5, 9, ... "
                            "81), each video's first; images train as one frame. Default: one frame of each file.")
    group.add_argument("--frame_stride", type=positive_int, default=1,
                       help="With --num_frames: take every S-th frame of each video (2 halves its frame rate).")


def check_video_args(args, family, vae_config):
    """One line for --num_frames on a family that draws images, or a frame count its VAE cannot take; sets
    args.clip_frames, (frames, stride) of each training clip for a video family (None: images)."""
    args.clip_frames = (args.num_frames or 1, args.frame_stride) if getattr(family, "VIDEO", False) else None
    if args.num_frames is None:
        if args.frame_stride != 1:
            raise UserError("--frame_stride picks frames for --num_frames: give --num_frames too")
        return
    if not getattr(family, "VIDEO", False):
        raise UserError(f"--num_frames {args.num_frames}: a {family.NAME} base draws images, not clips; leave "
                        "--num_frames out (video bases: Wan)")
    family.check_frames(args.num_frames, vae_config())


def frame_kwargs(family, num_frames):
    """The pipeline call's frame count for a video family (one frame: a still), nothing for the others."""
    return {"num_frames": num_frames or 1} if getattr(family, "VIDEO", False) else {}


def is_clip(path):
    """A video file or a folder of frames (anything else is read by Pillow: an image, or an animated GIF/WebP)."""
    return bool(path) and (os.path.isdir(path) or os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS)


def _video_frames(path, needed):
    """The first `needed` frames of a video file, as PIL images (PyAV)."""
    try:
        import av
    except ImportError:
        raise UserError(f"cannot read '{path}': {MISSING_AV}") from None
    frames = []
    try:
        with av.open(path) as container:
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
    from PIL import Image, ImageSequence

    from .image_data import _open, readable, to_rgb

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
    from .args import IMAGE_EXTENSIONS
    from .image_data import _open, readable, to_rgb

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
    needed = 1 if not num_frames else (num_frames - 1) * stride + 1
    if path and os.path.isdir(path):
        frames = _folder_frames(path, needed)
    elif path and os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS:
        if os.path.getsize(path) == 0:
            raise UserError(f"cannot read video '{path}': the file is empty; delete or replace it")
        frames = _video_frames(path, needed)
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


def clip_size(value):
    """(height, width) of a clip's or image's first frame."""
    return read_frames(value)[0].size[::-1]


def decode_clip(value, resolution, num_frames, stride=1, resize=None):
    """A clip (or image) -> uint8 tensor [F, 3, H, W], each frame resized as `resize(frame, resolution)` does it
    (common/image_data.py's resize_shorter_side or resize_to_bucket)."""
    import torch

    return torch.stack([resize(frame, resolution) for frame in read_frames(value, num_frames, stride)])


def save_clip(frames, path, fps=FPS):
    """PIL frames -> a video file at `path` (.mp4: H.264 through PyAV; .gif, .webp: animated, through Pillow).
    -> the path written."""
    extension = os.path.splitext(path)[1].lower()
    if extension in (".gif", ".webp"):
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0,
                       **({"lossless": True} if extension == ".webp" else {}))
        return path
    try:
        import av
    except ImportError:
        raise UserError(f"cannot write '{path}': {MISSING_AV}") from None
    import numpy as np

    width, height = frames[0].size
    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = width + width % 2, height + height % 2
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            array = np.asarray(frame.convert("RGB").resize((stream.width, stream.height)))
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def video_extension():
    """.mp4 where PyAV is installed, else animated .webp (lossless)."""
    try:
        import av  # noqa: F401
    except ImportError:
        return ".webp"
    return ".mp4"
