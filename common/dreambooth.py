"""DreamBooth for train_lora.py, with the flags of diffusers' train_dreambooth_lora*.py: instance images under one
prompt (a rare token in it), and prior preservation: class images of the same class, drawn by the base itself when
--class_data_dir holds fewer than --num_class_images, trained beside the instance images (each batch half instance,
half class) so that the class keeps what the base drew for it. The loss is instance + --prior_loss_weight x prior,
each the mean over its half, both logged.

Class images are drawn once, with sample.py's sampler, steps and guidance, image i from seed + i, in fixed batches
shared out between processes (so 1 or N processes draw the same images), written with class_images.json (what drew
them) by each machine's main process (machines without a shared disk each keep a copy), and reused by the next run.
Images of your own in --class_data_dir (no class_images.json) are used as they are.
"""
import json
import os

from .args import IMAGE_EXTENSIONS, check_writable
from .cli import UserError

MANIFEST = "class_images.json"


def add_dreambooth_args(parser):
    from .args import positive_float, positive_int

    g = parser.add_argument_group("DreamBooth (diffusers' train_dreambooth_lora flags)")
    g.add_argument("--instance_data_dir", default=None,
                   help="A folder of the subject's (or style's) images, all captioned --instance_prompt; replaces "
                        "--train_data_dir/--dataset_name.")
    g.add_argument("--instance_prompt", default=None,
                   help="The caption of every instance image, with a rare token: 'a photo of sks dog'.")
    g.add_argument("--with_prior_preservation", action="store_true",
                   help="Train on class images beside the instance images, against over-fitting and language drift.")
    g.add_argument("--class_data_dir", default=None,
                   help="Class images: yours, or drawn here by the base (and kept for the next run) up to "
                        "--num_class_images.")
    g.add_argument("--class_prompt", default=None, help="The class without the token: 'a photo of a dog'.")
    g.add_argument("--num_class_images", type=positive_int, default=100,
                   help="Class images to train with; the missing ones are drawn by the base.")
    g.add_argument("--prior_loss_weight", type=positive_float, default=1.0, help="Weight of the class images' loss.")
    g.add_argument("--sample_batch_size", type=positive_int, default=4, help="Batch size of the class-image draw.")


def folder_images(folder):
    """The image files directly in `folder` (sorted names), as diffusers' DreamBooth scripts list them."""
    return sorted(name for name in os.listdir(folder) if os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS
                  and os.path.isfile(os.path.join(folder, name)))


def read_manifest(folder):
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(f"--class_data_dir: cannot read {path} ({err}); delete it (the drawn images are drawn "
                        "again)") from None


def drawn_by(args):
    """What a drawn class image depends on (class_images.json): another value means other images."""
    base = args.pretrained_model_name_or_path
    return {"class_prompt": args.class_prompt, "base_model": os.path.abspath(base) if os.path.isdir(base) else base,
            "revision": args.revision, "resolution": args.resolution, "seed": args.seed,
            **({"drop_t5": True} if args.drop_t5 else {})}  # (T5's zeros draw other images)


def check_dreambooth_args(args):
    """Before torch loads: the DreamBooth flags go together, the folders hold what they should."""
    given = [flag for flag in ("class_data_dir", "class_prompt") if getattr(args, flag) is not None]
    if args.with_prior_preservation:
        for flag in ("class_prompt", "class_data_dir"):
            if getattr(args, flag) is None:
                raise UserError(f"--with_prior_preservation needs --{flag} (the class without the token, and where "
                                "its images are kept)")
        if args.buckets == "auto":
            raise UserError("--with_prior_preservation trains with square class images: leave out --buckets auto")
        folder = args.class_data_dir
        if not os.path.isdir(folder) or len(folder_images(folder)) < args.num_class_images:  # some will be drawn
            check_writable(folder, "--class_data_dir")
        if os.path.isdir(folder):
            read_manifest(folder)
    elif given:
        raise UserError(f"--{given[0]} is for prior preservation: add --with_prior_preservation, or leave it out")
    if (args.instance_data_dir is None) != (args.instance_prompt is None):
        raise UserError("--instance_data_dir and --instance_prompt go together: the images and their one caption")
    if args.instance_data_dir is None:
        return
    if args.dataset_name is not None:
        raise UserError("--instance_data_dir replaces --dataset_name: give one of them")
    if not os.path.isdir(args.instance_data_dir) or not folder_images(args.instance_data_dir):
        raise UserError(f"--instance_data_dir '{args.instance_data_dir}' is not a folder of images; give the "
                        "folder that holds the instance images")
    args.train_data_dir = args.instance_data_dir


def instance_reader(args):
    """load_image_dataset's `read_folder` for --instance_data_dir: its images, each captioned --instance_prompt."""
    def read(path):
        import datasets

        names = folder_images(path)
        return datasets.DatasetDict({"train": datasets.Dataset.from_dict(
            {args.image_column: [os.path.join(path, name) for name in names],
             args.caption_column: [args.instance_prompt] * len(names)}).cast_column(args.image_column,
                                                                                    datasets.Image())})
    return read


def class_images(args, accelerator, family, dtype, logger):
    """The paths of --num_class_images class images, drawing the missing ones (every process takes part) ->
    sorted paths."""
    import torch
    from accelerate.utils import broadcast_object_list

    folder, wanted = args.class_data_dir, drawn_by(args)
    manifest = read_manifest(folder) if os.path.isdir(folder) else None
    if manifest is not None and manifest.get("drawn_by") != wanted:
        differ = [f"{k}={manifest.get('drawn_by', {}).get(k)!r}" for k in wanted
                  if manifest.get("drawn_by", {}).get(k) != wanted[k]]
        raise UserError(f"--class_data_dir '{folder}' holds class images drawn with {', '.join(differ)}; give another "
                        "--class_data_dir (or empty this one to draw them again)")
    existing = folder_images(folder) if os.path.isdir(folder) else []
    # the main process's view decides what is drawn (a machine without a shared disk may see none)
    existing = broadcast_object_list([existing if accelerator.is_main_process else None])[0]
    missing = args.num_class_images - len(existing)
    if missing > 0:
        taken = set(existing)
        start = len((manifest or {}).get("images", []))
        names = []
        number = start
        while len(names) < missing:
            name = f"class-{number:05d}.png"
            if name not in taken:
                names.append((number, name))
            number += 1
        logger.info(f"drawing {missing} class images of '{args.class_prompt}' into {folder}")
        drawn = draw_class_images(args, accelerator, family, dtype, names)
        if accelerator.is_local_main_process:  # each machine's (the same bytes: a disk they share gets them twice)
            record = {"drawn_by": wanted, "images": sorted((manifest or {}).get("images", []) + [n for n, _ in drawn])}
            os.makedirs(folder, exist_ok=True)
            for name, data in [*drawn, (MANIFEST, json.dumps(record, indent=2).encode())]:
                temporary = os.path.join(folder, f"{name}.{os.getpid()}.tmp")
                with open(temporary, "wb") as f:
                    f.write(data)
                os.replace(temporary, os.path.join(folder, name))
        existing = sorted(existing + [n for n, _ in drawn])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    accelerator.wait_for_everyone()
    paths = [os.path.join(folder, name) for name in existing[:args.num_class_images]]
    absent = [p for p in paths if not os.path.isfile(p)]
    if absent:
        raise UserError(f"--class_data_dir '{folder}': {absent[0]} is not on this machine; put --class_data_dir on a "
                        "disk every machine shares, or copy it to each")
    return paths


def draw_class_images(args, accelerator, family, dtype, names):
    """[(number, file name)] -> [(file name, PNG bytes)] of every image (on every process): fixed batches of
    --sample_batch_size, batch k drawn by process k mod N, image `number` from seed + number."""
    import io

    from accelerate.utils import gather_object

    from .cli import quiet_loading_bars
    from .diffusion import sampling_scheduler
    from .drawing import draw_images, load_pipeline
    from .sampling_defaults import sampling_defaults

    quiet_loading_bars()
    base = args.pretrained_model_name_or_path
    pipe = load_pipeline(family, base, "--pretrained_model_name_or_path", dtype, revision=args.revision,
                         variant=args.variant, cache_dir=args.cache_dir,
                         drop=family.OPTIONAL_COMPONENTS if args.drop_t5 else ())  # (the run's T5, or none)
    pipe.scheduler = sampling_scheduler(family.SAMPLER, pipe.scheduler.config, family.SAMPLERS)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(accelerator.device)
    defaults = sampling_defaults(family, base, getattr(pipe, family.DENOISER).config)  # sample.py's: steps, guidance
    kwargs = {}
    if "max_sequence_length" in family.SAMPLE_FLAGS:
        kwargs["max_sequence_length"] = family.text_length(pipe.components, args.max_sequence_length)
    batches = [names[i:i + args.sample_batch_size] for i in range(0, len(names), args.sample_batch_size)]
    mine = []
    for batch in batches[accelerator.process_index::accelerator.num_processes]:
        images = draw_images(pipe, family, [args.class_prompt] * len(batch), [args.seed + n for n, _ in batch],
                             args.resolution, args.resolution, defaults["num_inference_steps"],
                             defaults["guidance_scale"], **kwargs)
        for (_, name), image in zip(batch, images):
            data = io.BytesIO()
            image.save(data, format="PNG")
            mine.append((name, data.getvalue()))
    del pipe
    return sorted(gather_object(mine) if accelerator.num_processes > 1 else mine)


def with_class_images(train_ds, paths, args):
    """The training rows followed by the class images' rows (captioned --class_prompt) -> (dataset, number of
    instance rows)."""
    import datasets

    rows = datasets.Dataset.from_dict({args.image_column: paths, args.caption_column: [args.class_prompt] * len(paths)})
    rows = rows.cast_column(args.image_column, datasets.Image())
    instance = train_ds.select_columns([args.image_column, args.caption_column])
    rows = rows.cast(instance.features) if rows.features != instance.features else rows
    return datasets.concatenate_datasets([instance, rows]), len(train_ds)


def prior_batching(n_instance, n_class, batch_size, seed, data):
    """The DataLoader's batching arguments with prior preservation (common/buckets.py's `batching` otherwise)."""
    import torch

    return {"batch_sampler": PriorPreservationBatches(n_instance, n_class, batch_size, seed, data),
            "generator": torch.Generator().manual_seed(seed)}


class PriorPreservationBatches:
    """Batches of `batch_size` instance rows [0, n_instance) then as many class rows [n_instance, n_instance +
    n_class): per epoch (read from `data.epoch`, which the loop sets) max(n_instance, n_class) pairs, pair i the
    instance i mod n_instance and class i mod n_class in a shuffled order, as diffusers' DreamBoothDataset pairs
    them. batch_size None: accelerate shards whole batches between processes."""

    batch_size = None
    drop_last = False

    def __init__(self, n_instance, n_class, batch_size, seed, data):
        self.n_instance, self.n_class, self.per_batch = n_instance, n_class, batch_size
        self.seed, self.data = seed, data
        self.pairs = max(n_instance, n_class)

    def batches(self, epoch):
        import numpy as np

        order = np.random.default_rng([self.seed, epoch]).permutation(self.pairs)
        return [[int(i % self.n_instance) for i in chunk] + [int(self.n_instance + i % self.n_class) for i in chunk]
                for chunk in (order[s:s + self.per_batch] for s in range(0, self.pairs, self.per_batch))]

    def __iter__(self):
        return iter(self.batches(self.data.epoch))

    def __len__(self):
        return -(-self.pairs // self.per_batch)


class PriorLoss:
    """loss = instance mean + weight x class mean over a batch's per-image losses; `logs` gives the two parts of the
    last optimizer step (mean over processes)."""

    def __init__(self, n_instance, weight, device):
        import torch

        self.n_instance, self.weight = n_instance, weight
        self.sums, self.step_done = torch.zeros(2, device=device), False

    def __call__(self, losses, index, accelerator):
        import torch

        if self.step_done:  # a new optimizer step
            self.sums.zero_()
        is_class = (index >= self.n_instance).to(losses.device)
        instance, prior = losses[~is_class].mean(), losses[is_class].mean()
        self.sums += torch.stack([instance.detach(), prior.detach()]) / accelerator.gradient_accumulation_steps
        self.step_done = accelerator.sync_gradients
        return instance + self.weight * prior

    def logs(self, accelerator):
        mean = accelerator.reduce(self.sums, "mean")
        return {"train/instance_loss": mean[0].item(), "train/prior_loss": mean[1].item()}
