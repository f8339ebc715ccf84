"""Masked loss (--masked_loss, kohya's sd-scripts name): a mask per training image weights its per-pixel loss.

White (255) trains, black (0) is ignored, grey weights in between (value / 255). A mask is either a same-named file
in --mask_data_dir (kohya's `conditioning_data_dir`: `cat/01.png` in --train_data_dir is masked by `cat/01.<any image
extension>` there; the mask's grey value, any alpha of its own ignored) or, without that folder, the image's alpha
channel (kohya's `--alpha_mask`). The mask is decoded, resized and cropped with its image as one more channel
(common/image_data.py), flipped with it, cached with its latent, and averaged down to the latent grid (area
interpolation, as kohya's apply_masked_loss does) where the prediction meets its target.

The masked loss of a sample is the mean over all its latent elements of mask * squared error, as kohya's
apply_masked_loss then `loss.mean([1, 2, 3])`: not divided by the mask's sum, so an all-ones mask gives exactly the
plain loss, and a sample whose mask covers little weighs little (no few-pixel sample is blown up to a whole image's
weight). A dataset without masks (DreamBooth's class images) takes all-ones masks: ImageDataset(masks="ones").
"""
import os

from .args import IMAGE_EXTENSIONS
from .caption_files import listed, tree_files
from .cli import UserError


def image_files(root):
    """{relative path without extension: relative path} of the image files under `root` (hidden ones skipped), and
    the other files' relative paths."""
    images, others = {}, []
    for path in tree_files(root):
        stem, ext = os.path.splitext(path)
        if ext.lower() in IMAGE_EXTENSIONS:
            images.setdefault(stem, []).append(path)
        else:
            others.append(path)
    return images, others


def header_size(path, what):
    """(width, height) of an image file from its header; a file PIL cannot read is one line."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise UserError(f"cannot read {what} '{path}' as an image ({str(err).splitlines()[0][:120]}); replace or "
                        "delete it") from None


def mask_files(data_dir, mask_dir):
    """{image path relative to data_dir, "/"-separated: the absolute path of its mask} with every check of a mask
    folder: each image has exactly one mask of its own size, each mask an image, nothing else in the folder."""
    masks, others = image_files(mask_dir)
    if others:
        raise UserError(f"--mask_data_dir '{mask_dir}' holds files that are not images: {listed(others)}; masks are "
                        "images named as their training images (move the other files out)")
    doubles = [" and ".join(paths) for paths in masks.values() if len(paths) > 1]
    if doubles:
        raise UserError(f"two masks for one image in --mask_data_dir '{mask_dir}': {doubles[0]}; keep one")
    images, _ = image_files(data_dir)
    orphans = sorted(masks[stem][0] for stem in masks if stem not in images)
    if orphans:
        raise UserError(f"mask(s) without an image of the same name in --train_data_dir '{data_dir}': "
                        f"{listed(orphans)} (in --mask_data_dir '{mask_dir}'); add the image or delete the mask")
    missing = sorted(path for stem, paths in images.items() if stem not in masks for path in paths)
    if missing:
        raise UserError(f"images without a mask in --mask_data_dir '{mask_dir}' ({len(missing)} of "
                        f"{sum(map(len, images.values()))}): {listed(missing)}; --masked_loss needs a mask of the "
                        "same name for each (white: trained, black: ignored)")
    found = {}
    for stem, paths in images.items():
        mask = os.path.join(mask_dir, masks[stem][0])
        mask_size = header_size(mask, "mask")
        for path in paths:
            size = header_size(os.path.join(data_dir, path), "image")
            if size != mask_size:
                raise UserError(f"mask '{mask}' is {mask_size[0]}x{mask_size[1]} px but its image '{path}' is "
                                f"{size[0]}x{size[1]}; a mask must have its image's size")
            found[path] = os.path.abspath(mask)
    return found


def check_mask_args(args):
    """Before torch loads: --mask_data_dir's files against --train_data_dir's images (`args.mask_files` set: each
    image's mask); the flags' combinations."""
    args.mask_files = None
    if args.masked_prior_preservation_weight and not args.masked_loss:
        raise UserError("--masked_prior_preservation_weight keeps what the masks leave out: add --masked_loss")
    if args.masked_prior_preservation_weight and args.train_text_encoder:
        raise UserError("--masked_prior_preservation_weight compares with the base's prediction for the same prompt "
                        "embedding: leave out --train_text_encoder")
    if args.mask_data_dir is None:
        return
    if not args.masked_loss:
        raise UserError("--mask_data_dir is read only with --masked_loss; add --masked_loss (or drop the folder)")
    if args.dataset_name is not None:
        raise UserError("--mask_data_dir matches masks to the files of --train_data_dir; with --dataset_name give "
                        "images with an alpha channel instead (--masked_loss alone uses it as the mask)")
    if not os.path.isdir(args.mask_data_dir):
        raise UserError(f"--mask_data_dir '{args.mask_data_dir}' is not a folder; give the folder of masks")
    data, masks = os.path.realpath(args.train_data_dir), os.path.realpath(args.mask_data_dir)
    if os.path.commonpath([data, masks]) in (data, masks):
        raise UserError(f"--mask_data_dir '{args.mask_data_dir}' and --train_data_dir '{args.train_data_dir}' overlap "
                        "(the masks would be read as training images); keep the masks in a folder of their own")
    if os.path.isdir(args.train_data_dir):  # (else check_common_args says so)
        args.mask_files = mask_files(args.train_data_dir, args.mask_data_dir)


def dataset_masks(args, dataset, masked_rows=None):
    """What ImageDataset(masks=...) gets for a dataset of this run: None without --masked_loss, "alpha" without
    --mask_data_dir, else each row's mask file. masked_rows: only the first rows have masks, the others (DreamBooth's
    class images) all-ones ones."""
    if not getattr(args, "masked_loss", False):
        return None
    if masked_rows is not None and masked_rows < len(dataset):
        masks = dataset_masks(args, dataset.select(range(masked_rows)))
        return (masks if isinstance(masks, list) else [masks] * masked_rows) + ["ones"] * (len(dataset) - masked_rows)
    if not getattr(args, "mask_files", None):
        return "alpha"
    import datasets

    root, paths = os.path.realpath(args.train_data_dir), []
    values = dataset.cast_column(args.image_column, datasets.Image(decode=False))[args.image_column]
    for row, value in enumerate(values):
        path = value.get("path") if isinstance(value, dict) else None
        relative = os.path.relpath(os.path.realpath(path), root).replace(os.sep, "/") if path else None
        if relative not in args.mask_files:
            raise UserError(f"the image at row {row} ({path or 'no file'}) is not a file of --train_data_dir "
                            f"'{args.train_data_dir}' with a mask in --mask_data_dir")
        paths.append(args.mask_files[relative])
    return paths


def latent_mask(mask, like):
    """A batch's masks [B, 1, H, W] in [0, 1] (pixels, or the latent grid from the cache) -> on `like`'s latent grid
    [B, 1, h, w] (area interpolation: each latent cell gets its pixels' mean weight), on its device; None stays
    None."""
    if mask is None:
        return None
    import torch
    import torch.nn.functional as F

    mask = mask.to(like.device, torch.float32)  # (the loss is computed in fp32)
    if mask.shape[-2:] != like.shape[-2:]:
        mask = F.interpolate(mask, size=like.shape[-2:], mode="area")
    return mask


def base_prediction(model, predict):
    """predict() with the LoRA adapters of `model` (the unwrapped denoiser) off: the base's own prediction, without
    gradients."""
    import torch

    model.disable_adapters()
    try:
        with torch.no_grad():
            return predict()
    finally:
        model.enable_adapters()


def masked_prior_losses(objective, prediction, base, noised, mask):
    """--masked_prior_preservation_weight's term, per sample [B]: the squared distance to the base's prediction where
    the mask leaves the image out (1 - mask), averaged over all elements as the masked loss is, times the objective's
    per-sample weights; both predictions as the objective compares them with its target (common/objectives.py:
    under SD3's preconditioning, x0 estimates, so that the term weighs every noise level as the loss does)."""
    distance = (objective.estimate(prediction, noised).float() - objective.estimate(base, noised).float()) ** 2
    loss = (distance * (1 - mask)).mean(dim=tuple(range(1, prediction.ndim)))
    return loss if noised.weights is None else loss * noised.weights.float()
