"""Clips for the video families (Wan): training clips read from video files, animated images or folders of frames,
and drawn clips written as video files and animated previews.

A training folder holds clips beside images, each with its same-name caption: `walk.mp4` + `walk.txt`, `wave.gif` +
`wave.txt`, or a folder of frames `jump/` (its image files in name order) + `jump.txt`. With --num_frames N, a clip
trains on N frames, `--frame_stride` S apart, from its first (N must suit the VAE: Wan's takes 4k + 1); an image is a
clip of one frame. Video files are decoded with PyAV (`pip install av`, in requirements.txt: FFmpeg's decoders
in one wheel, maintained, and imageio's own video plugin is PyAV too); animated GIF and WebP and folders of frames
need only Pillow (common/image_data.py reads them all). Every file that cannot be read, or has too few frames, is one
line naming it (clips are never skipped).
"""
import os

from .cli import UserError

FPS = 16  # Wan 2.1's frame rate: what drawn clips are written at
MISSING_AV = ("reading and writing video files needs PyAV: `pip install av` (in requirements.txt); animated GIF "
              "and WebP and folders of frames need nothing more")


def add_video_args(group, experts=False):
    """--num_frames and --frame_stride (the video families' training clips); `experts`: --wan_expert too (Wan 2.2
    A14B's LoRAs)."""
    from .args import positive_int

    group.add_argument("--num_frames", type=positive_int, default=None,
                       help="Video bases (Wan): train on clips of this many frames (4k + 1 for Wan: 1, 5, 9, ... "
                            "81), from the start of each clip; images train as one frame. Default: one frame of each "
                            "file.")
    group.add_argument("--frame_stride", type=positive_int, default=1,
                       help="With --num_frames: take every S-th frame of each video (2 halves its frame rate).")
    if experts:
        group.add_argument("--wan_expert", choices=["high", "low", "both"], default=None,
                           help="Wan 2.2 A14B only (two experts): the LoRA of `high`, the `transformer` WanPipeline "
                                "samples timesteps >= boundary_ratio x 1000 with, or of `low`, its `transformer_2` "
                                "(below the boundary), trained on that expert's side of the boundary only; `both`: a "
                                "LoRA on each, every sample through the expert of its timestep (the low one's saved "
                                "in <output_dir>/low). Default: high, the expert diffusers' load_lora_weights loads a "
                                "LoRA into (`low` loads with load_into_transformer_2=True), which lays out the clip's "
                                "composition and motion.")


def check_video_args(args, family, vae_config):
    """One line for --num_frames on a family that draws images, or a frame count its VAE cannot take; sets
    args.clip_frames, (frames, stride) of each training clip for a video family (None: images). vae_config() -> the
    base VAE's config (read only for --num_frames)."""
    args.clip_frames = (args.num_frames or 1, args.frame_stride) if getattr(family, "VIDEO", False) else None
    if getattr(family, "VIDEO", False):  # (an A14B base's expert: args.wan_expert; None for one transformer)
        expert = family.check_base(args.pretrained_model_name_or_path, getattr(args, "revision", None),
                                   getattr(args, "cache_dir", None), getattr(args, "wan_expert", False))
        if hasattr(args, "wan_expert"):
            args.wan_expert = expert
        if expert == "both":
            for flag in ("blocks_to_swap", "quantize_base"):
                if getattr(args, flag, None):
                    raise UserError(f"--{flag} runs on one transformer: with --wan_expert both, train each expert "
                                    "alone (--wan_expert high, then low)")
    elif getattr(args, "wan_expert", None):
        raise UserError(f"--wan_expert {args.wan_expert}: a {family.NAME} base has no experts (Wan 2.2 A14B has "
                        "two); leave --wan_expert out")
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
