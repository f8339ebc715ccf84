"""Edit LoRAs: each training image (the target) paired with one or more reference images (its controls), which the
base is given beside the noisy latents, as FLUX.1 Kontext is trained (diffusers' train_dreambooth_lora_flux_kontext.py
and FluxKontextPipeline) and FLUX.2 takes references (Flux2KleinPipeline, Flux2Pipeline).

Pairs: --control_data_dir, given once per reference, holds a file of the same name (any image extension) for each
training image (ai-toolkit's layout: `cat/01.png` of --train_data_dir is paired with `cat/01.<ext>` there; files that
are not images, such as metadata.jsonl or captions, are ignored); with a hub or imagefolder dataset,
--control_image_column names the column(s) that hold them. The caption (the instruction) comes from the usual caption
sources. A control image is decoded with its target as three more channels (common/image_data.py), stretched to the
target's size first (their aspect ratios must agree within 5 %), so it follows the target through every resize, crop,
flip and bucket; its latent is cached with the target's (--cache_latents). A sample without its control image(s) is an
error naming it, unless --allow_missing_control: then it trains as plain text-to-image (batched apart: a batch is all
with references or all without), and held-out images without theirs are left out of the held-out loss.

The reference latents are the mean of the VAE's latent distribution, normalized as the target's (the pipelines encode
the reference with sample_mode="argmax"); the family turns them into tokens appended to the image tokens, with their
own position ids (`family.denoise` reads `cond["reference_latents"]`: a list, one [B, C, h, w] tensor per reference),
and the loss is on the target tokens only. A family says how many references its base takes (REFERENCES, 0: none;
NO_REFERENCES, if set, why), which pipeline draws with them (EDIT_PIPELINE) and with which call arguments
(`family.reference_kwargs`), and where that pipeline takes larger references than one token, the smallest side
(REFERENCE_MIN_SIDE: FLUX.2's image processor's 64 px).
"""
import contextlib
import os

from .cli import UserError

ASPECT_TOLERANCE = 0.95  # the share of a control image a crop to its target's aspect ratio would keep, at least


def add_reference_args(parser):
    """The flags of edit LoRAs (diffusers' Kontext script's --cond_image_column is --control_image_column here)."""
    g = parser.add_argument_group("reference images (edit LoRAs: FLUX.1 Kontext, FLUX.2)")
    g.add_argument("--control_data_dir", action="append", default=[],
                   help="A folder with a reference image of the same name for each training image (repeatable: one "
                        "folder per reference). Makes the run an edit LoRA's: the base sees the reference beside the "
                        "noisy target (FLUX.1 Kontext's way), the caption is the instruction.")
    g.add_argument("--control_image_column", action="append", default=[],
                   help="The same from a column of the dataset (repeatable: one column per reference).")
    g.add_argument("--allow_missing_control", action="store_true",
                   help="A training image without its reference image trains as plain text-to-image, instead of "
                        "stopping the run with an error naming it.")
    g.add_argument("--validation_image", action="append", default=[],
                   help="The reference image(s) of the validation prompts (one per reference); default: the first "
                        "held-out image's, else the first training image's. Validation images then show the "
                        "reference, the base's output and the LoRA's side by side.")


def reference_count(args):
    """How many references each training image has (0: a text-to-image run)."""
    return len(getattr(args, "control_data_dir", None) or getattr(args, "control_image_column", None) or ())


def reference_flag(args):
    return "--control_data_dir" if args.control_data_dir else "--control_image_column"


def check_reference_args(args, family=None):
    """Before torch loads: the flags go together and each control folder pairs with the training images by name
    (`args.control_files` set: {image path: [its control file or None, one per folder]}); with the base's `family`
    (None for a hub base: checked again in main), that the base takes that many references."""
    count = reference_count(args)
    args.control_files = None
    if args.control_data_dir and args.control_image_column:
        raise UserError("--control_data_dir pairs the files of a folder, --control_image_column a dataset's columns: "
                        "give one of them")
    if not count:
        for flag in ("allow_missing_control", "validation_image"):
            if getattr(args, flag):
                raise UserError(f"--{flag} is for edit LoRAs: add --control_data_dir (or --control_image_column)")
        return
    if family is not None:
        check_family_references(family, count, reference_flag(args), args.pretrained_model_name_or_path)
    if args.with_prior_preservation:
        raise UserError("--with_prior_preservation trains on class images, which have no reference images: leave it "
                        "out of an edit LoRA's run (--instance_data_dir with --instance_prompt works)")
    if args.validation_image and len(args.validation_image) != count:
        raise UserError(f"--validation_image given {len(args.validation_image)} time(s) for {count} reference(s) per "
                        "image: give one per reference")
    if not args.control_data_dir:
        return
    if args.dataset_name is not None:
        raise UserError("--control_data_dir pairs files with those of --train_data_dir; a --dataset_name's reference "
                        "images are a column of it: give --control_image_column")
    from .base_models import size_factor

    smallest = smallest_reference(family, size_factor(args.pretrained_model_name_or_path, family)) if family else None
    if smallest and args.resolution:  # (the base's native size, or a hub base's: in main)
        check_resolution(args.resolution, family, smallest)
    files = {}
    for folder in args.control_data_dir:
        if not os.path.isdir(folder):
            raise UserError(f"--control_data_dir '{folder}' is not a folder; give the folder of reference images")
        if not os.path.isdir(args.train_data_dir):
            return  # (check_common_args says so)
        data, controls = os.path.realpath(args.train_data_dir), os.path.realpath(folder)
        if os.path.commonpath([data, controls]) in (data, controls):
            raise UserError(f"--control_data_dir '{folder}' and the training images' folder '{args.train_data_dir}' "
                            "overlap (the references would be read as training images); keep them apart")
        for path, control in control_files(args.train_data_dir, folder, args.allow_missing_control,
                                           smallest).items():
            files.setdefault(path, []).append(control)
    args.control_files = files


def smallest_reference(family, factor):
    """The smallest side of a reference image the base's edit pipeline takes: one token (`factor` px), or more where
    the pipeline says so (FLUX.2: REFERENCE_MIN_SIDE)."""
    return max(factor, getattr(family, "REFERENCE_MIN_SIDE", 0))


def check_resolution(resolution, family, smallest):
    """The references train at their training image's size: --resolution at least what the edit pipeline takes."""
    if resolution < smallest:
        raise UserError(f"--resolution {resolution}: {family.EDIT_PIPELINE} takes reference images of at least "
                        f"{smallest} px a side, and they train at their training image's size; give --resolution "
                        f"{smallest} or more")


def check_family_references(family, count, flag, base):
    """A base takes at most family.REFERENCES reference images: one line for more, or for any on a base that takes
    none."""
    if count and not family.REFERENCES:
        why = getattr(family, "NO_REFERENCES", None) or ("an edit LoRA needs a base whose family has an edit pipeline "
                                                         "(Flux.1: FLUX.1 Kontext; FLUX.2)")
        raise UserError(f"{flag}: the base model '{base}' ({family.NAME}) takes no reference images here; {why}")
    if count > family.REFERENCES:
        raise UserError(f"{flag}: {count} reference images, but {family.EDIT_PIPELINE} takes at most "
                        f"{family.REFERENCES}; give at most {family.REFERENCES}")


def control_files(data_dir, control_dir, allow_missing=False, smallest=None):
    """{training image path relative to data_dir, "/"-separated: the absolute path of its control image, or None
    (allow_missing)}: one control image per training image, by name, none left over, each readable (its header),
    with its image's aspect ratio, at least `smallest` px a side (None: not checked here)."""
    from .caption_files import listed
    from .loss_masks import header_size, image_files

    controls, _ = image_files(control_dir)  # (files that are not images: ignored)
    doubles = [" and ".join(paths) for paths in controls.values() if len(paths) > 1]
    if doubles:
        raise UserError(f"two reference images for one training image in --control_data_dir '{control_dir}': "
                        f"{doubles[0]}; keep one")
    images, _ = image_files(data_dir)
    extra = sorted(controls[stem][0] for stem in controls if stem not in images)
    if extra:
        raise UserError(f"--control_data_dir '{control_dir}' holds {len(extra)} image(s) with no training image of the "
                        f"same name in '{data_dir}': {listed(extra)}; add their training images or move them out")
    missing = sorted(path for stem, paths in images.items() if stem not in controls for path in paths)
    if missing and not allow_missing:
        raise UserError(f"{len(missing)} training image(s) of '{data_dir}' have no reference image of the same name in "
                        f"--control_data_dir '{control_dir}': {listed(missing)}; add them, or give "
                        "--allow_missing_control to train those as plain text-to-image")
    found = {}
    for stem, paths in images.items():
        control = os.path.join(control_dir, controls[stem][0]) if stem in controls else None
        size = header_size(control, "reference image")[::-1] if control else None
        for path in paths:
            if control:
                target = os.path.join(data_dir, path)
                check_size(size, header_size(target, "image")[::-1], f"'{control}'", f"'{target}'", smallest)
            found[path] = os.path.abspath(control) if control else None
    return found


def paired_references(args, family, train_ds, held_out_ds):
    """Each row's control images, checked: -> (References, the held-out dataset without the rows that lack theirs).
    One line for a control image that does not read, is smaller than the base takes, or has another aspect ratio
    than its target, and (without --allow_missing_control) for a training image without one."""
    count = reference_count(args)
    if not count and getattr(family, "FIRST_FRAME", False):  # (Wan image-to-video: validation's first frame)
        first = first_frame(args, train_ds, held_out_ds)
        return References(0, validation=[first] if first else None,
                          condition=family.image_condition if getattr(family, "IMAGE_CONDITION", False) else None
                          ), held_out_ds
    if not count:
        return References(0), held_out_ds
    from .base_models import size_factor

    flag, base = reference_flag(args), args.pretrained_model_name_or_path
    check_family_references(family, count, flag, base)  # (a hub base: now that its family is known)
    smallest = smallest_reference(family, size_factor(base, family, args.revision, args.cache_dir))
    check_resolution(args.resolution, family, smallest)
    train = dataset_controls(args, train_ds, smallest)
    held_out = None if held_out_ds is None else dataset_controls(args, held_out_ds, smallest)
    if held_out is not None and not all(all(row) for row in held_out):
        keep = [i for i, row in enumerate(held_out) if all(row)]
        held_out_ds, held_out = held_out_ds.select(keep), [held_out[i] for i in keep]
    if args.validation_image:
        validation = open_images(args.validation_image, "--validation_image")
        args.reference_paths = list(args.validation_image)  # (the model card's)
    else:  # the first held-out image's references, else the first training image's
        first = held_out[0] if held_out else next(row for row in train if all(row))
        validation = [open_value(value) for value in first]
        args.reference_paths = [(value.get("path") if isinstance(value, dict) else None) or "reference.png"
                                for value in first]
    return References(count, train, held_out, validation), held_out_ds


def first_frame(args, train_ds, held_out_ds):
    """An image-to-video run's validation first frame (PIL): the first held-out clip's, else the first training
    clip's; the model card's snippet reads it from <output_dir>/first_frame.png, which validation writes (without
    validation prompts: None, and the snippet names a first_frame.png of the user's)."""
    from .image_data import read_frames, undecoded

    args.reference_paths = [os.path.join(args.output_dir, FIRST_FRAME) if args.validation_prompt else FIRST_FRAME]
    if not args.validation_prompt:
        return None
    dataset = held_out_ds if held_out_ds is not None and len(held_out_ds) else train_ds
    return read_frames(undecoded(dataset.select([0]), args.image_column)[0])[0].convert("RGB")


FIRST_FRAME = "first_frame.png"


def dataset_controls(args, dataset, smallest):
    """[each row's control image values (datasets Image values: {"path", "bytes"}), or None where missing]: from
    --control_data_dir's files (by the row's path under --train_data_dir) or --control_image_column, each read from
    its header: readable, at least `smallest` px a side, with its target's aspect ratio."""
    import datasets

    from .image_data import image_name, image_sizes

    targets = dataset.cast_column(args.image_column, datasets.Image(decode=False))[args.image_column]
    if args.control_data_dir:
        root = os.path.realpath(args.train_data_dir)
        columns = [[] for _ in args.control_data_dir]
        for value in targets:
            path = value.get("path") if isinstance(value, dict) else None
            relative = os.path.relpath(os.path.realpath(path), root).replace(os.sep, "/") if path else None
            controls = (args.control_files or {}).get(relative) or [None] * len(columns)
            for column, control in zip(columns, controls):
                column.append(None if control is None else {"path": control, "bytes": None})
    else:
        columns = []
        for column in args.control_image_column:
            if column not in dataset.column_names:
                raise UserError(f"--control_image_column '{column}' is not a column of the dataset; columns are: "
                                f"{', '.join(dataset.column_names)}")
            try:
                columns.append(dataset.cast_column(column, datasets.Image(decode=False))[column])
            except (ValueError, TypeError) as err:
                raise UserError(f"--control_image_column '{column}' does not hold images ({err}); give the column "
                                "of the reference images") from None
    target_sizes, names = image_sizes(dataset, args.image_column)
    for column in columns:
        for row, (value, target_size) in enumerate(zip(column, target_sizes)):
            if value is None:
                if not args.allow_missing_control:
                    raise UserError(f"the training image {names[row]} has no reference image; add it, or give "
                                    "--allow_missing_control to train such images as plain text-to-image")
                continue
            check_size(header_size(value, row), target_size, image_name(value, row), names[row], smallest)
    return [list(controls) for controls in zip(*columns)]


def header_size(value, row):
    """(height, width) of a datasets Image value from its header; one line naming it when it does not read."""
    import io

    from PIL import Image

    from .image_data import readable

    with readable(value, row):
        if isinstance(value, Image.Image):
            return value.size[::-1]
        with Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") is not None else value["path"]) as image:
            return image.size[::-1]


def check_size(size, target_size, name, target_name, smallest=None):
    """A control image (height, width) must be at least `smallest` px a side (what the base packs into one token)
    and have its target's aspect ratio within 5 %: it is stretched to the target's size, then follows its resizes,
    crops and flips."""
    from .buckets import kept_share

    if smallest and min(size) < smallest:
        raise UserError(f"reference image {name} is {size[1]}x{size[0]} px; the base takes reference images of at "
                        f"least {smallest} px a side; give a larger one")
    if kept_share(size, target_size) < ASPECT_TOLERANCE:
        raise UserError(f"reference image {name} is {size[1]}x{size[0]} px but its training image {target_name} is "
                        f"{target_size[1]}x{target_size[0]}: their aspect ratios differ by more than 5 %, so no crop "
                        "or bucket pairs them; crop the reference as its training image is cropped")


class References:
    """The reference images of a run, for the training loop: `rows` (each training and held-out row's control image
    values, for image_datasets), `batch_keys` (batches all with or all without references), the conditioning of a
    batch (`refs(batch, encode, latent_config)`: {"reference_latents": [...]}, or {} for a batch without them or a
    text-to-image run), of held-out images (`held_out`), and `validation`, the validation prompts' references (PIL).
    `condition(encode, pixels, latent_config)`: an image-to-video family's condition of each clip, from its own pixels
    (Wan I2V: {"image_condition": ..., Wan 2.1's "image_embeds": ...}; no references then)."""

    def __init__(self, count, train=None, held_out=None, validation=None, condition=None):
        import torch

        self.count, self.rows, self.validation, self.condition = count, (train, held_out), validation, condition
        self.present = torch.tensor([all(row) for row in train or ()], dtype=torch.bool)
        self.all_present = bool(self.present.all()) if count else True
        self.held_out_cache = {}

    def batch_keys(self, sizes):
        """What the batches are drawn by: each image's bucket (`sizes`, or None without buckets), and with
        --allow_missing_control whether it has its references."""
        if self.all_present:
            return sizes
        return [(tuple(sizes[i]) if sizes else (), bool(p)) for i, p in enumerate(self.present.tolist())]

    def __call__(self, batch, encode, latent_config):
        """A training batch's reference latents (cached with --cache_latents, else encoded now); an image-to-video
        base's condition of each clip (the same)."""
        if self.condition is not None:
            if "condition" in batch:
                return batch["condition"]
            return self.condition(encode, batch["pixel_values"], latent_config)
        if not self.count or not (self.all_present or self.present[batch["index"].cpu()].all()):
            return {}
        from .image_data import reference_means

        if "reference_latents" in batch:
            means = batch["reference_latents"]
        else:
            means = reference_means(encode, batch["reference_values"])
        return {"reference_latents": normalized(means, latent_config)}

    def cached_condition(self, encode, latent_config, device):
        """For CachedLatents: an image-to-video base's condition(pixels) of a chunk of clips, computed on `device`
        (its encoders' place), or None."""
        if self.condition is None:
            return None
        return lambda pixels: self.condition(encode, pixels.to(device), latent_config)

    def held_out(self, ids, data, encode, latent_config):
        """The held-out images `ids`' reference latents (ImageDataset `data`; each encoded once)."""
        import torch

        from .image_data import reference_means

        if self.condition is not None:  # (each held-out clip's, encoded once)
            for i in ids.tolist():
                if i not in self.held_out_cache:
                    self.held_out_cache[i] = self.condition(encode, data[i]["pixel_values"][None], latent_config)
            return {key: torch.cat([self.held_out_cache[i][key] for i in ids.tolist()]) for key in
                    self.held_out_cache[ids[0].item()]}
        if not self.count:
            return {}
        for i in ids.tolist():
            if i not in self.held_out_cache:
                self.held_out_cache[i] = reference_means(encode, data[i]["reference_values"][None])[0]
        return {"reference_latents": normalized(torch.stack([self.held_out_cache[i] for i in ids.tolist()]),
                                                latent_config)}


def normalized(means, latent_config):
    """[B, k, C, h, w] VAE latents -> the denoiser's, one tensor per reference (what family.denoise takes)."""
    from .vae import normalize

    return [normalize(latent_config, means[:, j].float()) for j in range(means.shape[1])]


def open_value(value):
    """A datasets Image value -> an RGB PIL image."""
    from .image_data import _open, readable, to_rgb

    with readable(value):
        return to_rgb(_open(value))


def open_images(paths, flag):
    """Image files given by `flag` -> RGB PIL images; one line for one that does not read."""
    from PIL import Image, UnidentifiedImageError

    from .image_data import to_rgb

    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(to_rgb(image))
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
            raise UserError(f"{flag} '{path}': cannot read it as an image ({str(err).splitlines()[0][:120]}); give "
                            "an image file") from None
    return images


def check_references(images, paths, flag, family, factor):
    """sample.py's --image: each at least as large as the edit pipeline takes (smallest_reference)."""
    smallest = smallest_reference(family, factor)
    why = family.RESOLUTION_FACTOR if smallest == factor else "its image processor's smallest"
    for image, path in zip(images, paths):
        if min(image.size) < smallest:
            raise UserError(f"{flag} '{path}' is {image.size[0]}x{image.size[1]} px; {family.EDIT_PIPELINE} takes "
                            f"reference images of at least {smallest} px a side ({why}); give a larger one")


def check_drawing_size(family, height, width, factor):
    """sample.py draws from references resized to the drawing's size: at least what the edit pipeline takes (a side
    that is None: not checked)."""
    smallest = smallest_reference(family, factor)
    if min(height or smallest, width or smallest) < smallest:
        raise UserError(f"{width or '(default)'}x{height or '(default)'} px: {family.EDIT_PIPELINE} takes reference "
                        f"images of at least {smallest} px a side, and they are drawn from at the drawing's size; give "
                        f"--height and --width of at least {smallest}")


@contextlib.contextmanager
def adapters_off(models):
    """The base alone: the peft adapters of `models` disabled meanwhile."""
    adapted = [model for model in models if getattr(model, "_hf_peft_config_loaded", False)]
    for model in adapted:
        model.disable_adapters()
    try:
        yield
    finally:
        for model in adapted:
            model.enable_adapters()


def side_by_side(references, base, lora, height, width):
    """One row per validation image: its reference(s), the base's output, the LoRA's (PIL images)."""
    from .diffusion import image_grid

    shown = [image.resize((width, height)) for image in references]
    return image_grid([image for pair in zip(base, lora) for image in (*shown, *pair)], ncol=len(shown) + 2)
