"""Argument groups with the diffusers examples' flag names, and their validation (one-line errors)."""
import argparse
import os
import re

from .cli import RecipeArgumentParser, UserError

MIXED_PRECISION = ["no", "fp16", "bf16"]
LR_SCHEDULERS = ["warmup_cosine", "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
                 "polynomial"]
REPORT_TO = ["tensorboard", "wandb", "all", "none"]


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise ValueError
    return value


positive_int.__name__ = "positive integer"


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise ValueError
    return value


non_negative_int.__name__ = "non-negative integer"


def positive_float(text):
    value = float(text)
    if not value > 0:
        raise ValueError
    return value


positive_float.__name__ = "positive number"


def non_negative_float(text):
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError
    return value


non_negative_float.__name__ = "non-negative number"


def probability(text):
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError
    return value


probability.__name__ = "probability in [0, 1]"


# --dtype's names (accelerate's mixed-precision names) -> torch's.
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def torch_dtype(name):
    """A --dtype or accelerate mixed-precision name -> the torch dtype; anything else ("no", "fp8") is fp32."""
    import torch

    return getattr(torch, DTYPES.get(name, "float32"))


def device_and_dtype(device=None, dtype=None):
    """--device and --dtype -> (torch.device, torch.dtype); by default cuda when available, else cpu, and fp16 on
    CUDA, fp32 elsewhere."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, torch_dtype(dtype or ("fp16" if device.type == "cuda" else "fp32"))


def make_parser(description):
    return RecipeArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_device_args(parser, dtype=None):
    """--device and --dtype of the scripts that load a model to run it; dtype: --dtype's default (None: by device)."""
    parser.add_argument("--device", default=None, help="Default: cuda when available, else cpu.")
    parser.add_argument("--dtype", default=dtype, choices=list(DTYPES),
                        help="The weights' dtype." if dtype else "Default: fp16 on CUDA, fp32 on CPU.")


def add_data_args(parser, resolution, image_column="image"):
    g = parser.add_argument_group("data")
    g.add_argument("--dataset_name", default=None, help="Hub dataset id or local dataset path (else --train_data_dir).")
    g.add_argument("--dataset_config_name", default=None, help="Config of the hub dataset, if it has several.")
    g.add_argument("--train_data_dir", default="data/digits", help="An imagefolder (metadata.jsonl optional).")
    g.add_argument("--cache_dir", default=None, help="Where datasets and models are cached.")
    g.add_argument("--image_column", default=image_column, help="Column that holds the images.")
    g.add_argument("--eval_split", default="test", help="Held-out split; carved from train if missing.")
    g.add_argument("--max_train_samples", type=positive_int, default=None, help="Truncate the training set.")
    native = "; default: the base model's native one (its VAE config's sample_size: 512 for SD 1.5)"
    g.add_argument("--resolution", type=positive_int, default=resolution,
                   help=f"Square training resolution{'' if resolution else native}.")
    g.add_argument("--center_crop", action="store_true", help="Center crop instead of random crop.")
    g.add_argument("--random_flip", action="store_true", help="Random horizontal flip.")
    g.add_argument("--dataloader_num_workers", type=non_negative_int, default=0, help="0: load in the main process.")
    return g


def add_caption_args(group, caption_dropout_prob):
    """The caption flags of the text-to-image trainers, added to their data group."""
    group.add_argument("--caption_column", default="text",
                       help="Column with each image's caption: a string, or a list (one picked at random per step).")
    group.add_argument("--caption_dropout_prob", type=probability, default=caption_dropout_prob,
                       help="Train on the empty prompt this often (what classifier-free guidance needs).")
    group.add_argument("--default_caption", default=None,
                       help="Caption of the images that have no .txt caption file, when --train_data_dir holds images "
                            "with same-name .txt captions (no metadata file); without it each image needs one.")
    group.add_argument("--caption_extension", default=".txt",
                       help="The caption files' extension in such a folder: .txt, or .caption (kohya's sd-scripts).")
    group.add_argument("--enable_wildcard", action="store_true",
                       help="Caption files: every non-empty line a caption, one picked at random per step (kohya's "
                            "flag; its {a|b} notation is refused). Without it: the first line, as kohya reads them.")
    group.add_argument("--caption_prefix", default="",
                       help="Put before every caption, e.g. a trigger word: 'sks style, ' (not before the empty "
                            "prompt of caption dropout).")
    return group


def add_training_args(parser, *, output_dir, learning_rate, train_batch_size, num_train_epochs, lr_scheduler,
                      lr_warmup_steps, max_grad_norm=1.0, adam_weight_decay=1e-2):
    g = parser.add_argument_group("training")
    g.add_argument("--output_dir", default=output_dir, help="Where the model, checkpoints and logs are written.")
    g.add_argument("--seed", type=int, default=42, help="Seed for a reproducible run.")
    g.add_argument("--train_batch_size", type=positive_int, default=train_batch_size, help="Batch size per device.")
    g.add_argument("--num_train_epochs", type=positive_int, default=num_train_epochs)
    g.add_argument("--max_train_steps", type=positive_int, default=None,
                   help="Total optimizer steps; overrides --num_train_epochs.")
    g.add_argument("--gradient_accumulation_steps", type=positive_int, default=1)
    g.add_argument("--learning_rate", type=positive_float, default=learning_rate,
                   help="Peak learning rate (after any warm-up).")
    g.add_argument("--lr_scheduler", default=lr_scheduler, choices=LR_SCHEDULERS,
                   help="warmup_cosine: linear warm-up from lr_warmup_start_factor*lr, then cosine to --lr_min.")
    g.add_argument("--lr_warmup_steps", type=non_negative_int, default=lr_warmup_steps, help="In optimizer steps.")
    g.add_argument("--lr_warmup_start_factor", type=probability, default=0.1, help="warmup_cosine: first LR / lr.")
    g.add_argument("--lr_min", type=float, default=0.0, help="warmup_cosine: LR at the last optimizer step.")
    g.add_argument("--adam_beta1", type=float, default=0.9)
    g.add_argument("--adam_beta2", type=float, default=0.999)
    g.add_argument("--adam_weight_decay", type=float, default=adam_weight_decay,
                   help="Not applied to biases and norm weights.")
    g.add_argument("--adam_epsilon", type=float, default=1e-8)
    g.add_argument("--max_grad_norm", type=positive_float, default=max_grad_norm, help="Gradient clipping.")
    g.add_argument("--mixed_precision", default=None, choices=MIXED_PRECISION,
                   help="Overrides the accelerate config's mixed precision.")
    g.add_argument("--allow_tf32", action="store_true", help="TF32 matmuls on Ampere+ GPUs.")
    g.add_argument("--allow_cudnn_attention", action="store_true",
                   help="Let scaled_dot_product_attention use cuDNN's fused kernel on GPUs. Off by default: its "
                        "backward crashed training on an H100 with torch 2.11 (docs/reliability.md); the flash and "
                        "memory-efficient kernels train the same.")
    g.add_argument("--ddp_timeout", type=positive_int, default=1800,
                   help="Seconds a process waits for the others before the run fails: the main process validates, "
                        "samples and saves while the others wait. With several machines, also how long the launcher "
                        "(make, python -m common.launch) waits for the other machines to join.")
    g.add_argument("--find_unused_parameters", action="store_true",
                   help="DDP: for models with parameters that get no gradient in a step (unused branches).")
    g.add_argument("--skip_nonfinite_steps", action="store_true",
                   help="Skip an optimizer step whose loss is NaN/inf (logged) instead of stopping the run there "
                        "(its forward pass still ran: BatchNorm running statistics saw the batch).")
    return g


def add_checkpoint_args(parser, checkpointing_steps=500):
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--checkpointing_steps", type=positive_int, default=checkpointing_steps,
                   help="Save a resumable checkpoint-N every N optimizer steps.")
    g.add_argument("--checkpoints_total_limit", type=positive_int, default=None, help="Keep the newest N checkpoints.")
    g.add_argument("--resume_from_checkpoint", default=None, help='"latest" or a checkpoint-N folder.')
    return g


def add_logging_args(parser, project_name):
    g = parser.add_argument_group("logging")
    g.add_argument("--report_to", default="tensorboard", choices=REPORT_TO, help="Tracker(s) to log to.")
    g.add_argument("--logging_dir", default="logs", help="Tracker folder, relative to --output_dir.")
    g.add_argument("--tracker_project_name", default=project_name, help="Project name for the trackers.")
    g.add_argument("--run_name", default=None, help="Run name for the trackers (default: a timestamp).")
    g.add_argument("--logging_steps", type=positive_int, default=10, help="Log the loss every N optimizer steps.")
    return g


def check_common_args(args):
    """Checks that need no heavy import, so a mistake is reported before torch loads."""
    import os

    if args.dataset_name is None:
        root = args.train_data_dir
        if not os.path.isdir(root):
            raise UserError(f"--train_data_dir '{root}' does not exist (run `make data` for the built-in digits)")
        if not any(has_image_file(files) or any(os.path.splitext(name)[1].lower() in VIDEO_EXTENSIONS for name in files)
                   for _, _, files in os.walk(root)):
            raise UserError(f"--train_data_dir '{root}' holds no image files; put images in it (an imagefolder: "
                            "images with a metadata.jsonl, or one subfolder per class)")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UserError(f"--output_dir '{args.output_dir}' is a file; give a folder")
    check_writable(args.output_dir, "--output_dir")
    # The tracker folder is <output_dir>/<logging_dir>/<tracker_project_name>: it must stay inside the output folder.
    logs = os.path.join(args.output_dir, args.logging_dir, args.tracker_project_name)
    if os.path.relpath(os.path.normpath(logs), os.path.normpath(args.output_dir)).split(os.sep)[0] == os.pardir:
        raise UserError(f"--logging_dir '{args.logging_dir}' / --tracker_project_name '{args.tracker_project_name}' "
                        f"lead outside --output_dir; give names inside it")


# What datasets' imagefolder reads (its IMAGE_EXTENSIONS), here without importing datasets or PIL's plugins.
IMAGE_EXTENSIONS = frozenset(
    ".blp .bmp .dib .bufr .cur .pcx .dcx .dds .ps .eps .fit .fits .fli .flc .ftc .ftu .gbr .gif .grib .png .apng .jp2 "
    ".j2k .jpc .jpf .jpx .j2c .icns .ico .im .iim .tif .tiff .jfif .jpe .jpg .jpeg .mpg .mpeg .msp .pcd .pxr .pbm .pgm "
    ".ppm .pnm .psd .bw .rgb .rgba .sgi .ras .tga .icb .vda .vst .webp .wmf .emf .xbm .xpm".split())


# The video families' clips (common/video.py): PyAV reads these; an animated GIF or WebP is read as an image file.
VIDEO_EXTENSIONS = frozenset((".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v"))


def has_image_file(names):
    return any(os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS for name in names)


def check_writable(path, flag, value=None):
    """The folder `path` can be written (or created): its nearest existing ancestor is a folder this user may write.

    Checked before anything heavy loads, so that a read-only location is reported before the run, not at its end.
    `value`: the flag's value for the message, when `path` is derived from it (a file's folder).
    """
    value = path if value is None else value
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"{flag} '{value}': '{existing}' is a file, not a folder; choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} '{value}': cannot write in '{existing}' (no write permission, or a read-only file "
                        f"system); choose another {flag} or make that folder writable")


# The hub's rule for repo ids (huggingface_hub's validate_repo_id): `name` or `owner/name` of letters, digits, "_",
# "-" and ".", each part starting and ending with a letter or digit, no "--" or "..", at most 96 characters.
_HUB_NAME = r"\w(?:[\w.-]{0,94}\w)?"
HUB_ID = re.compile(rf"(?:{_HUB_NAME}/)?{_HUB_NAME}")
# Names that read like a local file, not a repo: a missing file is reported as missing, not looked up on the hub.
FILE_SUFFIXES = (".safetensors", ".ckpt", ".bin", ".pt", ".pth", ".json", ".yaml", ".yml")


def is_hub_id(path):
    """`path` does not exist here and reads like a hub id (name or owner/name): to be checked when it loads."""
    return (not os.path.exists(path) and HUB_ID.fullmatch(path) is not None and "--" not in path
            and ".." not in path and not path.lower().endswith(FILE_SUFFIXES))


def check_model_folder(path, flag, required, what):
    """A local model path holds `required` (a file name relative to it); a path that cannot be a hub id must exist."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, required)):
            raise UserError(f"{flag} '{path}' is not {what} (no {required} in it)")
    elif os.path.exists(path):
        raise UserError(f"{flag} '{path}' is a file; give {what} folder or a hub id")
    elif not is_hub_id(path):
        raise UserError(f"{flag} '{path}' does not exist (and is not a hub id owner/name)")


def share_or_split(text):
    """--validation_split: a share of the training images (0 < x < 1), or the name of one of the dataset's splits."""
    try:
        share = float(text)
    except ValueError:
        return text
    if not 0 < share < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share between 0 and 1 (or a split name such as 'test')")
    return share


def add_bucket_args(group):
    """--buckets, --bucket_max_upscale and --validation_split of the Stable Diffusion trainers' data group."""
    group.add_argument("--buckets", default="off", choices=["auto", "off"],
                       help="auto: aspect-ratio buckets of about --resolution squared pixels instead of square crops; "
                            "each image resized to the bucket nearest its shape, every batch from one bucket.")
    group.add_argument("--bucket_max_upscale", type=positive_float, default=2.0,
                       help="--buckets auto: an image its bucket would upscale by more than this is an error.")
    group.add_argument("--validation_split", type=share_or_split, default=None,
                       help="Hold out this share of the training images (e.g. 0.05), or name a split of the "
                            "dataset: their denoising loss at fixed timesteps and noise is logged as val/loss every "
                            "--validation_steps.")


def add_mask_args(group):
    """--masked_loss and --mask_data_dir of train_lora.py's data group (common/loss_masks.py)."""
    group.add_argument("--masked_loss", action="store_true",
                       help="Weight each image's per-pixel loss by a mask (white: trained, black: ignored, grey: in "
                            "between; kohya's flag): the image's file in --mask_data_dir, else its alpha channel.")
    group.add_argument("--mask_data_dir", default=None,
                       help="--masked_loss: a folder of masks, each named as its image in --train_data_dir (same "
                            "relative path, any image extension) and of its size; a folder of its own, so the masks "
                            "are never read as training images (kohya's conditioning_data_dir). Without it each "
                            "image's alpha channel is its mask.")
    group.add_argument("--masked_prior_preservation_weight", type=non_negative_float, default=0.0,
                       help="--masked_loss: outside each mask, train the LoRA towards the base's own prediction, at "
                            "this weight (OneTrainer's setting; one more forward pass of the base a step): what is "
                            "masked out stays as the base draws it instead of drifting.")


def add_latent_cache_args(group):
    """--cache_latents of the Stable Diffusion trainers, and the batch its VAE encoding runs at (diffusers' name)."""
    group.add_argument("--cache_latents", action="store_true",
                       help="VAE-encode every image once (implies --center_crop; with --random_flip both "
                            "orientations): before training, or, where the VAE is not to leave the device (the CPU, "
                            "--validation_prompt) and without dataloader workers, when a batch first needs it.")
    group.add_argument("--vae_encode_batch_size", type=positive_int, default=None,
                       help="--cache_latents: images per VAE encode while the cache is made, before training "
                            "(default: a quarter of --train_batch_size, at least 1: at full resolution an image's "
                            "encode can take more memory than a training sample's step, e.g. with "
                            "--gradient_checkpointing).")
    group.add_argument("--vae_encode_mode", default="sample", choices=["sample", "mode"],
                       help="The training latent: drawn from the VAE's distribution at every step, or its mode (its "
                            "mean: what diffusers' Kontext and FLUX.2 img2img scripts train on).")


def check_bucket_args(args):
    """--buckets auto crops each image to its bucket's shape, centered: --center_crop has nothing to do there. Without
    buckets --cache_latents implies --center_crop (one cached crop per image). Also --vae_encode_batch_size's
    default."""
    if args.buckets == "auto" and args.center_crop:
        raise UserError("--center_crop: with --buckets auto images are not cropped square but to their bucket's "
                        "shape (centered); drop --center_crop")
    args.center_crop = args.center_crop or (args.cache_latents and args.buckets == "off")
    if args.vae_encode_batch_size is None:
        args.vae_encode_batch_size = max(1, args.train_batch_size // 4)  # (docs/performance.md: the latent cache)
