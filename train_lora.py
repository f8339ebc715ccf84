#!/usr/bin/env python
"""Fine-tune Stable Diffusion (1.x/2.x or XL) with LoRA (peft) on captioned images, the accelerate way.

The UNet frozen, LoRA adapters (LoraConfig, init_lora_weights="gaussian") on its attention projections, trained on
the denoising loss; optionally the CLIP text encoder(s) too. The base's model_index.json says which pipeline it is:
an SDXL base is conditioned on both its text encoders, the pooled embedding and each image's size "time ids"
(original size, crop, target size; right with --buckets too). Frozen weights in fp16/bf16, LoRA weights in fp32; latents
(--cache_latents) and text embeddings computed once; min-SNR weighting, noise offset, caption dropout, an EMA of
the LoRA weights (--use_ema: what gets exported), validation images, resumable checkpoints that hold only the LoRA.
Writes pytorch_lora_weights.safetensors (`pipe.load_lora_weights(output_dir)`), optionally the kohya/A1111/ComfyUI
format, a model card, and lora_info.json, from which sample.py finds the base model.

Defaults suit a real base: --resolution is the base's native size (its VAE's sample_size, 512 for SD 1.5),
--learning_rate 1e-4, --train_batch_size 16, as in diffusers' LoRA example.

Built-in demo (CPU, a few minutes): a style LoRA, "red ink on paper", on the tiny digits base shipped in
assets/tiny-sd-digits (white-on-black digits only), then its measured effect and a side-by-side picture
(demo/style_report.py); the Makefile passes the demo's data, --learning_rate 3e-3, --train_batch_size 16,
--max_train_steps 400, --caption_dropout_prob 0.1 and LoRA on the convolutions and feed-forward layers too:
    make train-lora
One GPU, Stable Diffusion 1.5 from the hub (at 512 px, its native size):
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_lora.py \
        --pretrained_model_name_or_path stable-diffusion-v1-5/stable-diffusion-v1-5 \
        --dataset_name lambdalabs/naruto-blip-captions --center_crop --random_flip \
        --train_batch_size 4 --max_train_steps 3000 --learning_rate 1e-4 --rank 8 --mixed_precision fp16 \
        --cache_latents --checkpointing_steps 500 --validation_prompt "a man with blue hair" \
        --validation_steps 500 --output_dir outputs/lora-naruto
Several GPUs (or `make train-lora CONFIG=accelerate_configs/multi_gpu.yaml ARGS="..."`):
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml train_lora.py <the same flags>
SDXL (1024 px; the VAE always runs in fp32, so SDXL's fp16 VAE overflow cannot blacken anything):
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_lora.py \
        --pretrained_model_name_or_path stabilityai/stable-diffusion-xl-base-1.0 <the same data flags> \
        --train_batch_size 1 --gradient_accumulation_steps 4 --mixed_precision bf16 --cache_latents \
        --gradient_checkpointing --output_dir outputs/lora-sdxl
Then:  python sample.py --model outputs/lora-naruto --prompt "a girl with pink hair"

Copy with: common/__init__.py, common/args.py, common/buckets.py, common/caption_files.py, common/checkpoints.py, common/cli.py, common/diffusion.py, common/distributed.py, common/fsdp.py, common/image_data.py, common/lora_metadata.py, common/optimizers.py, common/preemption.py, common/reporting.py, common/sdxl.py, common/stable_diffusion.py, common/training.py, common/validation_loss.py
"""  # noqa: E501 (the copy list stays one line, for grep)
import math
import os
import random
import time

from common.args import (
    add_bucket_args,
    add_caption_args,
    add_checkpoint_args,
    add_data_args,
    add_latent_cache_args,
    add_logging_args,
    add_training_args,
    check_bucket_args,
    check_common_args,
    make_parser,
    positive_float,
    positive_int,
    probability,
)
from common.buckets import check_bucket_resolution
from common.caption_files import caption_folder_reader, check_caption_args
from common.checkpoints import agreed_checkpoint, detect_shared_output_dir, read_checkpoint_info, resolve_resume
from common.cli import UserError, first_line, quiet_loading_bars, run
from common.diffusion import SCHEDULER_CLASSES, SD_SCHEDULER, diffusion_loss, diffusion_target
from common.lora_metadata import base_model_metadata, lora_card, lora_metadata
from common.optimizers import OPTIMIZERS, add_optimizer_args, check_optimizer_args
from common.sdxl import TEXT_ENCODERS, embed_prompts, pipeline_kind, text_encoder_targets
from common.stable_diffusion import (
    LORA_EMA_STATE,
    SHIPPED_BASE,
    base_resolution,
    check_local_resolution,
    check_sd_pipeline,
    load_error,
    load_lora_ema,
    load_lora_state,
    lora_dtypes,
    offload_idle_models,
    save_lora_ema,
    save_lora_state,
    save_lora_weights,
    size_factor,
    validation_images,
)
from common.training import add_ema_args, check_resumed_ema, ema_weights

UNET_TARGETS = "to_k,to_q,to_v,to_out.0"
TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
SAME_LORA = ("rank", "lora_alpha", "target_modules", "use_dora", "train_text_encoder")  # needed to resume


def comma_list(text):
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    g = add_data_args(parser, resolution=None)
    add_caption_args(g, caption_dropout_prob=0.0)
    add_latent_cache_args(g)
    add_bucket_args(g)
    g = parser.add_argument_group("model")
    g.add_argument("--pretrained_model_name_or_path", default=SHIPPED_BASE,
                   help="A StableDiffusionPipeline or StableDiffusionXLPipeline: hub id or folder (default: the "
                        "shipped tiny digits base).")
    g.add_argument("--revision", default=None, help="Hub revision of the base model.")
    g.add_argument("--variant", default=None, help="Weights variant of the base model, e.g. fp16.")
    g.add_argument("--prediction_type", default=None, choices=["epsilon", "v_prediction", "sample"],
                   help="Training target; default: the base scheduler's.")
    g.add_argument("--snr_gamma", type=positive_float, default=None, help="Min-SNR loss weighting (5.0 is usual).")
    g.add_argument("--noise_offset", type=float, default=0.0, help="Offset noise scale (0.05-0.1 is usual).")
    g.add_argument("--gradient_checkpointing", action="store_true",
                   help="Less memory, slower steps (the backward recomputes the forward).")
    g = parser.add_argument_group("LoRA")
    g.add_argument("--rank", type=positive_int, default=8, help="LoRA rank r.")
    g.add_argument("--lora_alpha", type=positive_float, default=None, help="LoRA scale alpha/r; default alpha = r.")
    g.add_argument("--lora_dropout", type=probability, default=0.0)
    g.add_argument("--target_modules", type=comma_list, default=comma_list(UNET_TARGETS),
                   help=f"UNet modules that get LoRA (names or name suffixes), default {UNET_TARGETS}.")
    g.add_argument("--use_dora", action="store_true", help="DoRA: weight-decomposed LoRA.")
    g.add_argument("--train_text_encoder", action="store_true",
                   help="Also LoRA on the CLIP text encoder's attention projections (SDXL: both encoders').")
    g.add_argument("--text_encoder_lr", type=positive_float, default=None, help="Default: --learning_rate.")
    g.add_argument("--export_kohya", action="store_true",
                   help="Also write pytorch_lora_weights_kohya.safetensors (A1111/ComfyUI key names).")
    g = parser.add_argument_group("EMA of the LoRA weights")
    add_ema_args(g)
    g.add_argument("--offload_ema", action="store_true",
                   help="Keep the EMA on the CPU, moving it to the device only for its update (same results, less "
                        "device memory).")
    g = parser.add_argument_group("validation")
    g.add_argument("--validation_prompt", action="append", default=[], help="Repeatable.")
    g.add_argument("--num_validation_images", type=positive_int, default=2, help="Images per prompt.")
    g.add_argument("--validation_steps", type=positive_int, default=100,
                   help="Every N optimizer steps, and at the end.")
    g.add_argument("--validation_scheduler", default=SD_SCHEDULER, choices=sorted(SCHEDULER_CLASSES),
                   help="Sampler of the validation images (sample.py's default too).")
    g.add_argument("--validation_inference_steps", type=positive_int, default=20)
    g.add_argument("--validation_guidance_scale", type=float, default=7.5)
    add_training_args(parser, output_dir="outputs/lora", learning_rate=1e-4, train_batch_size=16, num_train_epochs=5,
                      lr_scheduler="constant", lr_warmup_steps=0)
    add_optimizer_args(parser)
    add_checkpoint_args(parser, checkpointing_steps=500)
    add_logging_args(parser, project_name="train_lora")
    args = parser.parse_args(argv)
    check_caption_args(args)
    check_common_args(args)
    check_optimizer_args(args)
    check_sd_pipeline(args.pretrained_model_name_or_path, "--pretrained_model_name_or_path")
    if os.path.isdir(args.pretrained_model_name_or_path):  # a hub base's class: once its model_index.json is fetched
        pipeline_kind(args.pretrained_model_name_or_path, "--pretrained_model_name_or_path")
    args.resolution = check_local_resolution(args.pretrained_model_name_or_path, args.resolution)
    args.lora_alpha = args.lora_alpha or args.rank
    check_bucket_args(args)
    if args.buckets == "auto" and os.path.isdir(args.pretrained_model_name_or_path):  # a hub base: once loaded
        check_bucket_resolution(args.resolution, size_factor(args.pretrained_model_name_or_path))
    if args.export_kohya and args.use_dora:
        parser.error("--export_kohya: the kohya format has no DoRA weights; drop --use_dora or --export_kohya")
    if not args.target_modules:
        parser.error("--target_modules: give at least one module name")
    if args.offload_ema and not args.use_ema:
        parser.error("--offload_ema: there is no EMA to offload without --use_ema")
    resume_path = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume_path:  # a checkpoint of another LoRA shape would fail (or worse, half-load) deep inside load_state
        saved, now = read_checkpoint_info(resume_path), lora_info(args)
        diffs = [f"{key}={saved[key]} (now {now[key]})" for key in SAME_LORA if key in saved and saved[key] != now[key]]
        if diffs:
            raise UserError(f"--resume_from_checkpoint: {resume_path} holds a LoRA with {', '.join(diffs)}; "
                            "resume with the same LoRA settings or train into a new --output_dir")
        check_resumed_ema(args, resume_path, LORA_EMA_STATE)
    return args


def main(args):
    import torch
    from accelerate import Accelerator
    from accelerate.logging import get_logger
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, ProjectConfiguration, set_seed
    from tqdm.auto import tqdm

    from common.checkpoints import checkpoint_step, load_checkpoint, register_state_hooks, save_checkpoint
    from common.distributed import check_same_data, match_deepspeed_config, process_group_kwargs
    from common.fsdp import check_fsdp_run, clip_grad_norm
    from common.optimizers import build_optimizer
    from common.preemption import PreemptionGuard
    from common.reporting import init_trackers, log_with, write_all_results, write_model_card
    from common.training import build_lr_scheduler, build_param_groups, finite_step, plan_steps, resume_position

    # 1. Accelerator: mixed precision from --mixed_precision, else from the accelerate config.
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=log_with(args.report_to),
        project_config=ProjectConfiguration(project_dir=args.output_dir,
                                            logging_dir=os.path.join(args.output_dir, args.logging_dir)),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # same order on resume
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=args.find_unused_parameters),
                         process_group_kwargs(args.ddp_timeout)],  # how long the others wait for the main process
    )
    match_deepspeed_config(accelerator, args.gradient_accumulation_steps, args.max_grad_norm)
    detect_shared_output_dir(accelerator, args.output_dir)  # or each machine's own: then a checkpoint copy on each
    args.resume_from_checkpoint = agreed_checkpoint(accelerator, args.resume_from_checkpoint, args.output_dir)
    check_fsdp_run(accelerator, args)  # FSDP where accelerate does not apply it, or flags it cannot run
    logger = get_logger(__name__, log_level="INFO")
    set_seed(args.seed)
    # SIGTERM/SIGINT from here on (start-up included) stop the run after a complete, saved optimizer step.
    preemption = PreemptionGuard(accelerator, check_every=args.logging_steps)
    if args.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    # <domain: weight dtypes>
    # Read the accelerator's precision, not the flag: an accelerate yaml may ask for fp16 too.
    weight_dtype, lora_dtype = lora_dtypes(accelerator.mixed_precision)
    # </domain>

    # 2. Data: images decoded once; each image's captions as indices into the distinct prompts ("" for dropout).
    # <domain: data>
    from common.buckets import batching, bucket_images, validation_sizes
    from common.image_data import (
        CachedLatents,
        ImageDataset,
        caption_lists,
        collate_batch,
        image_sizes,
        require_columns,
    )
    from common.validation_loss import HeldOutLoss, load_with_validation

    # The training size: the base's native one (its VAE's sample_size) unless given. Far below it, what the LoRA
    # learns shows little in images at the size the base samples at.
    args.resolution, native = base_resolution(args.pretrained_model_name_or_path, args.resolution, args.revision,
                                              args.cache_dir)
    if native and args.resolution * 2 < native:
        logger.warning(f"--resolution {args.resolution} is less than half the base's native {native} px: what the "
                       f"LoRA learns will show little at the base's own size (leave --resolution out to train at "
                       f"{native})")
    # held out: --validation_split's images, for val/loss; a folder without metadata: .txt captions
    train_ds, held_out_ds = load_with_validation(args, read_folder=caption_folder_reader(args))
    require_columns(train_ds, image_column=args.image_column, caption_column=args.caption_column)
    captions = caption_lists(train_ds[args.caption_column], args.caption_column, prefix=args.caption_prefix)
    held_out_captions = (caption_lists(held_out_ds[args.caption_column], args.caption_column,
                                       prefix=args.caption_prefix) if held_out_ds else [])
    prompts = sorted({c for options in captions + held_out_captions for c in options} | {""})
    prompt_id = {p: i for i, p in enumerate(prompts)}
    caption_ids = [[prompt_id[c] for c in options] for options in captions]

    def pick_prompts(indices, epoch):
        """One caption per image, or "" with --caption_dropout_prob: a function of (seed, epoch, index)."""
        picked = []
        for index in indices.tolist():
            rng = random.Random(hash((args.seed, epoch, index)))
            picked.append(prompt_id[""] if rng.random() < args.caption_dropout_prob else rng.choice(caption_ids[index]))
        return torch.tensor(picked)

    kind = pipeline_kind(args.pretrained_model_name_or_path, "--pretrained_model_name_or_path", args.revision,
                         args.cache_dir)  # "sd" (1.x/2.x) or "sdxl"
    originals = held_out_originals = None  # SDXL: every image's original (height, width), for its time ids
    if kind == "sdxl":
        originals = image_sizes(train_ds, args.image_column)[0]
        held_out_originals = image_sizes(held_out_ds, args.image_column)[0] if held_out_ds else None
    sizes = held_out_sizes = None  # --buckets auto: each image's (height, width)
    if args.buckets == "auto":
        sizes, held_out_sizes, table = bucket_images(args, train_ds, held_out_ds, size_factor(
            args.pretrained_model_name_or_path, args.revision, args.cache_dir))
        logger.info(f"aspect-ratio buckets at {args.resolution} px:\n{table}")
    with accelerator.main_process_first():
        train_data = ImageDataset(train_ds, args.image_column, args.resolution, center_crop=args.center_crop,
                                  random_flip=args.random_flip, columns={"index": torch.arange(len(train_ds))},
                                  seed=args.seed, sizes=sizes, original_sizes=originals)
        held_out = None if held_out_ds is None else ImageDataset(
            held_out_ds, args.image_column, args.resolution, center_crop=True, seed=args.seed, sizes=held_out_sizes,
            original_sizes=held_out_originals)
    # </domain>

    # 3. Model: the base frozen in the weight dtype (the VAE in fp32: fp16 decodes overflow), LoRA adapters in fp32.
    # <domain: model>
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from diffusers.training_utils import EMAModel, cast_training_params
    from peft import LoraConfig
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from common.fsdp import uniform_dtype

    quiet_loading_bars()
    path, load = args.pretrained_model_name_or_path, {"revision": args.revision, "cache_dir": args.cache_dir}
    try:  # SDXL: a second tokenizer and text encoder (with the projection whose output is the pooled embedding)
        noise_scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler", **load)
        tokenizers = {name.replace("text_encoder", "tokenizer"): CLIPTokenizer.from_pretrained(
            path, subfolder=name.replace("text_encoder", "tokenizer"), **load) for name in TEXT_ENCODERS[kind]}
        text_encoders = {name: (CLIPTextModel if name == "text_encoder" else CLIPTextModelWithProjection)
                         .from_pretrained(path, subfolder=name, variant=args.variant, dtype=weight_dtype, **load)
                         for name in TEXT_ENCODERS[kind]}
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", variant=args.variant, dtype=torch.float32,
                                            **load)
        unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", variant=args.variant,
                                                    dtype=weight_dtype, **load)
    except (OSError, ValueError) as err:
        raise load_error("--pretrained_model_name_or_path", path, err) from None
    if args.prediction_type:
        noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    for model in (unet, vae, *text_encoders.values()):
        model.requires_grad_(False).to(accelerator.device)
    unet.set_attn_processor(AttnProcessor2_0())  # PyTorch SDPA (flash / memory-efficient kernels where available)
    check_target_modules(unet, args.target_modules, "--target_modules", "UNet")
    try:
        unet.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                    init_lora_weights="gaussian", target_modules=args.target_modules,
                                    use_dora=args.use_dora))
    except ValueError as err:  # e.g. a target that is not a Linear/Conv layer
        raise UserError(f"--target_modules: {first_line(err)}") from None
    trained = {"unet": unet}  # what trains, by checkpoint subfolder
    for name, text_encoder in text_encoders.items() if args.train_text_encoder else ():
        targets = text_encoder_targets(name, text_encoder, kind, TEXT_ENCODER_TARGETS)  # SDXL: not all layers
        text_encoder.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                            init_lora_weights="gaussian", target_modules=targets,
                                            use_dora=args.use_dora))
        trained[name] = text_encoder
    cast_training_params(list(trained.values()), dtype=lora_dtype)
    uniform_dtype(accelerator, trained.values(), lora_dtype)  # (FSDP: the frozen weights too)
    trainable = {f"{name}.{n}": p for name, m in trained.items() for n, p in m.named_parameters() if p.requires_grad}
    assert all("lora_" in name for name in trainable), "only LoRA weights may train"
    num_trainable = sum(p.numel() for p in trainable.values())
    ema, ema_params = None, list(trainable.values())  # the EMA averages the trainable LoRA weights only, in fp32
    if args.use_ema:
        ema = EMAModel(ema_params, decay=args.ema_max_decay, use_ema_warmup=True, inv_gamma=args.ema_inv_gamma,
                       power=args.ema_power, foreach=True)
        ema.to("cpu" if args.offload_ema else accelerator.device, torch.float32)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        for text_encoder in text_encoders.values() if args.train_text_encoder else ():
            text_encoder.gradient_checkpointing_enable()

    # Speed: what is frozen is computed once. Text: every distinct prompt embedded once (kept on the CPU).
    input_ids = [tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                           return_tensors="pt").input_ids for tokenizer in tokenizers.values()]
    prompt_embeds = pooled_embeds = None
    if not args.train_text_encoder:
        with torch.no_grad():
            chunks = [embed_prompts(list(text_encoders.values()), [ids[i:i + 64].to(accelerator.device)
                                                                    for ids in input_ids])
                      for i in range(0, len(prompts), 64)]
        prompt_embeds = torch.cat([hidden.cpu() for hidden, _ in chunks])
        pooled_embeds = torch.cat([pooled.cpu() for _, pooled in chunks]) if kind == "sdxl" else None

    def encode(pixel_values):  # -> parameters (mean, log-variance) of the VAE's latent distribution
        with torch.no_grad(), accelerator.autocast():
            return vae.encode(pixel_values.to(accelerator.device, torch.float32)).latent_dist.parameters

    def sample_latents(params):  # drawn afresh each step; contiguous, or randn_like draws differ for channels-last
        latents = DiagonalGaussianDistribution(params.float().contiguous()).sample()
        return (latents - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor

    def condition(prompt_ids, image_ids, data):  # -> the UNet's encoder hidden states, SDXL's added conditioning
        if prompt_embeds is not None:
            hidden = prompt_embeds[prompt_ids].to(accelerator.device)
            pooled = None if pooled_embeds is None else pooled_embeds[prompt_ids].to(accelerator.device)
        else:  # the text encoders train (after prepare: the prepared ones)
            hidden, pooled = embed_prompts(list(text_encoders.values()),
                                           [ids[prompt_ids].to(accelerator.device) for ids in input_ids])
        if pooled is None:
            return hidden, None
        time_ids = data.time_ids(image_ids.tolist()).to(accelerator.device, hidden.dtype)
        return hidden, {"text_embeds": pooled, "time_ids": time_ids}

    held_out_prompts = torch.tensor([prompt_id[c[0]] for c in held_out_captions], dtype=torch.long)
    held_out_loss = None if held_out is None else HeldOutLoss(  # keyed by image: SDXL's time ids are the image's
        held_out, encode, vae.config, list(range(len(held_out))), noise_scheduler.config.num_train_timesteps,
        accelerator, args.seed, args.train_batch_size)
    loader_batches = batching(sizes, args.train_batch_size, args.seed, train_data)  # one bucket each with --buckets
    if args.cache_latents:
        logger.info(f"caching the latents of {len(train_data)} images{' and their mirror images' * args.random_flip}")
        train_data = CachedLatents(train_data, encode, args.vae_encode_batch_size)
    offload_idle_models(accelerator, logger, args, vae, list(text_encoders.values()),
                        text_cached=prompt_embeds is not None)
    train_dataloader = torch.utils.data.DataLoader(train_data, num_workers=args.dataloader_num_workers,
                                                   collate_fn=collate_batch, **loader_batches)
    check_same_data(accelerator, training_images=len(train_data), batches=len(train_dataloader),  # (machines' copies)
                    held_out_images=0 if held_out is None else len(held_out))
    # </domain>

    # 4. Optimizer on the LoRA weights (the text encoder's at its own LR); schedule counted in optimizer steps.
    # <domain: parameter groups>
    lr_groups = {name: args.text_encoder_lr or args.learning_rate for name in trained if name != "unet"}
    param_groups = build_param_groups(torch.nn.ModuleDict(trained), args.learning_rate, args.adam_weight_decay,
                                      lr_groups)
    # </domain>
    optimizer = build_optimizer(args, param_groups, accelerator.device)  # --optimizer (default: fused AdamW)
    steps_per_epoch, max_train_steps, num_train_epochs = plan_steps(
        math.ceil(len(train_dataloader) / accelerator.num_processes), args.gradient_accumulation_steps,
        args.num_train_epochs, args.max_train_steps)
    lr_scheduler = build_lr_scheduler(args.lr_scheduler, optimizer, args.lr_warmup_steps, max_train_steps,
                                      accelerator.num_processes, args.lr_warmup_start_factor, args.lr_min)

    # 5. prepare, hooks (checkpoints hold the LoRA weights only, plus sample.py's files), then the exact step counts.
    *models, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(*trained.values(), optimizer,
                                                                             train_dataloader, lr_scheduler)
    unwrapped = {name: accelerator.unwrap_model(m, keep_torch_compile=False) for name, m in zip(trained, models)}
    trained_params = [p for model in models for p in model.parameters() if p.requires_grad]  # what gets clipped
    # <domain: the prepared models; what a checkpoint holds>
    unet = models[0]
    text_encoders.update(zip(list(trained)[1:], models[1:]))  # the text encoders that train: the prepared ones
    info = lora_info(args)
    checkpoint_info = info  # in checkpoint_info.json too: a resume checks its LoRA settings against them
    base_version = base_model_metadata(unwrapped["unet"].config, noise_scheduler.config.prediction_type)

    def file_metadata(step):  # the LoRA files' header (max_train_steps: its value when they are written)
        return lora_metadata(args, info, base_version, step, max_train_steps, len(train_data),
                             accelerator.mixed_precision, TEXT_ENCODER_TARGETS, OPTIMIZERS[args.optimizer][0])

    def save_extra(folder, models):  # the checkpoint's pytorch_lora_weights: what would be exported now (EMA)
        with ema_weights(ema, ema_params):
            save_lora_weights(folder, models, info, metadata=file_metadata(global_step))
        if ema is not None:  # lora_ema.safetensors + lora_ema.json (unet/, text_encoder/: the raw adapters)
            save_lora_ema(ema, list(trainable), folder)

    def load_extra(folder):  # (parse_args checked that the checkpoint's EMA matches the flags)
        if ema is not None:
            load_lora_ema(ema, list(trainable), folder, "cpu" if args.offload_ema else accelerator.device)

    register_state_hooks(accelerator, unwrapped, save_fn=save_lora_state,
                         load_fn=lambda model, path: load_lora_state(model, path, lora_dtype),
                         extra_save=save_extra, extra_load=load_extra)
    # </domain>
    steps_per_epoch, max_train_steps, num_train_epochs = plan_steps(
        len(train_dataloader), args.gradient_accumulation_steps, args.num_train_epochs, args.max_train_steps)

    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    init_trackers(accelerator, args)
    total_batch_size = args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    # <domain: what this run trains>
    logger.info(f"{len(train_data)} training images at {args.resolution} px, {len(prompts) - 1} distinct captions, "
                f"{num_trainable} LoRA parameters ({accelerator.mixed_precision} mixed precision: base {weight_dtype}, "
                f"LoRA {lora_dtype}), {accelerator.num_processes} process(es), batch {total_batch_size}, "
                f"{max_train_steps} optimizer steps over {num_train_epochs} epochs")
    # </domain>

    # From here on each process draws its own noise, timesteps and dropout (the models above were initialised alike
    # on every process); resuming restores every process's generators.
    set_seed(args.seed, device_specific=True)

    # 6. Resume: state (the load hook sets the adapters), then the position in the epoch.
    global_step, first_epoch, skip_batches = 0, 0, 0
    resume_path = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume_path:
        load_checkpoint(accelerator, resume_path)
        global_step = checkpoint_step(resume_path)
        first_epoch, skip_batches = resume_position(global_step, steps_per_epoch, args.gradient_accumulation_steps,
                                                    max_train_steps)
        logger.info(f"resumed from {resume_path} at step {global_step}")

    # 7. The loop: latents + noise at a random timestep -> the UNet (with LoRA) predicts the noise (or v, or x0).
    progress = tqdm(total=max_train_steps, initial=global_step, desc="steps",
                    disable=not accelerator.is_local_main_process)
    start_time, start_step = time.time(), global_step
    loss_sum, last_loss, metrics = torch.zeros((), device=accelerator.device), None, {}
    skipped_steps = 0
    group_names = [group["name"] for group in optimizer.param_groups]
    # <domain: validation>
    from common.fsdp import full_models

    def validate(step, images=True):  # the held-out loss and images of the current LoRA (its EMA with --use_ema)
        full = full_models(accelerator, dict(zip(trained, models)))  # (under FSDP: gathered on every process)
        with ema_weights(ema, ema_params):
            if held_out_loss is not None:
                held_out_loss.log(step, full["unet"],
                                  lambda ids: condition(held_out_prompts[ids], ids, held_out), noise_scheduler)
            if not (images and args.validation_prompt):
                return []
            parts = {"vae": vae, "unet": full["unet"], **tokenizers,
                     **{name: full.get(name, model) for name, model in text_encoders.items()}}
            return validation_images(args, accelerator, parts, noise_scheduler, step,
                                     sizes=validation_sizes(sizes, args.resolution))

    validating = held_out_loss is not None or args.validation_prompt
    if held_out_loss is not None and global_step == 0:
        validate(0, images=False)  # the held-out loss of the base: where the curve starts
    # </domain>
    try:
        for epoch in range(first_epoch, num_train_epochs):
            for model in models:
                model.train()
            train_dataloader.set_epoch(epoch)  # shuffling order and augmentations: functions of (seed, epoch)
            train_data.set_epoch(epoch)
            loader = train_dataloader
            if epoch == first_epoch and skip_batches:
                loader = accelerator.skip_first_batches(train_dataloader, skip_batches)
            for batch in loader:
                with accelerator.accumulate(*models):
                    # <domain: the loss>
                    params = batch["latent_params"] if args.cache_latents else encode(batch["pixel_values"])
                    latents = sample_latents(params)
                    noise = torch.randn_like(latents)
                    if args.noise_offset:  # lets the model learn overall brightness (very dark / light images)
                        noise += args.noise_offset * torch.randn(*latents.shape[:2], 1, 1, device=latents.device)
                    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                              device=latents.device)
                    noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
                    prompt_index = pick_prompts(batch["index"], epoch)
                    encoder_hidden_states, added_cond = condition(prompt_index, batch["index"], train_data)
                    target = diffusion_target(noise_scheduler, latents, noise, timesteps)
                    model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, added_cond_kwargs=added_cond,
                                      return_dict=False)[0]
                    loss = diffusion_loss(model_pred, target, noise_scheduler, timesteps, args.snr_gamma)
                    # </domain>
                    accelerator.backward(loss)
                    loss_sum += loss.detach() / args.gradient_accumulation_steps
                    if accelerator.sync_gradients:  # NaN/inf: stop before the update, or skip it (a flag)
                        update = finite_step(accelerator, loss_sum, global_step + 1, args.skip_nonfinite_steps)
                        if update:
                            clip_grad_norm(accelerator, models, trained_params, args.max_grad_norm)
                            optimizer.step()  # (between syncs accelerate's step does nothing: no call needed)
                    lr_scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                if not accelerator.sync_gradients:
                    continue
                # <domain: the EMA>
                if ema is not None and update:  # real optimizer steps only
                    if args.offload_ema:  # updated on the device, as without the flag: the same numbers
                        ema.to(accelerator.device)
                    ema.step(ema_params)
                    if args.offload_ema:
                        ema.to("cpu")
                # </domain>
                global_step += 1
                skipped_steps += not update
                progress.update(1)
                if global_step % args.logging_steps == 0 or global_step == max_train_steps:
                    last_loss = accelerator.reduce(loss_sum, "mean").item()  # mean over processes, on logging steps
                    logs = {"train/loss": last_loss, "epoch": epoch}
                    logs.update({f"lr/{name}": group["lr"] for name, group in zip(group_names, optimizer.param_groups)})
                    # <domain: more to log>
                    if ema is not None and ema.cur_decay_value is not None:
                        logs["ema_decay"] = ema.cur_decay_value
                    # </domain>
                    accelerator.log(logs, step=global_step)
                    progress.set_postfix(loss=f"{last_loss:.4f}")
                loss_sum.zero_()
                stop = preemption.should_stop(global_step)  # SIGTERM/SIGINT: all processes agree
                if global_step % args.checkpointing_steps == 0 or stop:
                    checkpoint = save_checkpoint(accelerator, args.output_dir, global_step,
                                                 args.checkpoints_total_limit, info=checkpoint_info)
                    if stop:  # the step is complete and saved: stop here
                        preemption.exit(checkpoint)
                # 8. Validate: images from the current LoRA every --validation_steps (the final ones: below).
                # <domain: validation>
                if validating and global_step % args.validation_steps == 0 and global_step < max_train_steps:
                    validate(global_step)
                # </domain>
                if global_step >= max_train_steps:
                    break
            if global_step >= max_train_steps:
                break

        # 9. Save: the LoRA in diffusers' format (+ kohya), final images, a model card and the run summary.
        accelerator.wait_for_everyone()
        # <domain: the final validation, the LoRA and its model card>
        images = validate(global_step) if validating else []
        final = full_models(accelerator, dict(zip(trained, models)), main_only=True)
        if accelerator.is_main_process:
            if ema is not None:  # the trained weights themselves, beside the EMA: pipe.load_lora_weights(".../raw")
                save_lora_weights(os.path.join(args.output_dir, "raw"), final, {**info, "ema_weights": False},
                                  kohya=args.export_kohya, metadata=file_metadata(global_step))
            with ema_weights(ema, ema_params):
                save_lora_weights(args.output_dir, final, info, kohya=args.export_kohya,
                                  metadata=file_metadata(global_step))
            write_model_card(args.output_dir, *lora_card(args, info, kind, global_step, last_loss, ema is not None,
                                                         (args.validation_prompt or [prompts[-1]])[0]),
                             images=[os.path.relpath(p, args.output_dir) for p in images])
        metrics = {"trainable_parameters": num_trainable, "mixed_precision": accelerator.mixed_precision,
                   "resolution": args.resolution}
        if held_out_loss is not None:
            metrics.update(held_out_loss.results())
        # </domain>
        if accelerator.is_main_process:
            results = write_all_results(
                args.output_dir, global_step=global_step, start_time=start_time, steps_run=global_step - start_step,
                samples_per_step=total_batch_size, final_loss=last_loss, device=accelerator.device,
                num_processes=accelerator.num_processes, metrics={**metrics, "skipped_steps": skipped_steps})
            logger.info(f"saved to {args.output_dir}: {results}")
        accelerator.wait_for_everyone()
    finally:
        progress.close()
        accelerator.end_training()


def lora_info(args):
    """What sample.py and a resumed run need to know about this LoRA (lora_info.json, checkpoint_info.json)."""
    base = args.pretrained_model_name_or_path
    return {"base_model": os.path.abspath(base) if os.path.isdir(base) else base, "revision": args.revision,
            "variant": args.variant, "rank": args.rank, "lora_alpha": args.lora_alpha,
            "target_modules": args.target_modules, "use_dora": args.use_dora,
            "train_text_encoder": args.train_text_encoder, "prediction_type": args.prediction_type,
            "ema_weights": args.use_ema,  # the weights in pytorch_lora_weights.safetensors are the EMA ones
            "trigger": args.caption_prefix.strip(" ,") or None}  # --caption_prefix: what prompts need to show it


def check_target_modules(model, targets, flag, what):
    """peft matches a target by full name or name suffix; name the closest module names when one matches nothing."""
    import difflib

    names = [name for name, _ in model.named_modules() if name]
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in names):
            suffixes = {".".join(n.split(".")[-k:]) for n in names for k in (1, 2)}
            suffixes = sorted(suffixes - {str(i) for i in range(99)})
            close = difflib.get_close_matches(target, suffixes, n=4, cutoff=0.5)
            hint = f"closest module names: {', '.join(close)}" if close else f"module names look like {names[-1]}"
            raise UserError(f"{flag}: '{target}' matches no module of the {what}; {hint}")


if __name__ == "__main__":
    run(main, parse_args)
