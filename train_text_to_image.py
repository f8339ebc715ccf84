#!/usr/bin/env python
"""Train the UNet of Stable Diffusion on captioned images (full fine-tuning, or from scratch), the accelerate way.

The counterpart of diffusers' train_text_to_image.py: the VAE and the CLIP text encoder frozen, every UNet weight
trained on the denoising loss (epsilon, v or x0), the UNet from the base pipeline or, with --unet_config, a fresh
one from a config (training from scratch). Latents (--cache_latents) and text embeddings computed once; caption
dropout so that classifier-free guidance works, min-SNR weighting, noise offset, an EMA of the weights (what gets
exported), validation images, resumable checkpoints. Writes a complete StableDiffusionPipeline folder
(`StableDiffusionPipeline.from_pretrained(output_dir)`, sample.py, and a base for train_lora.py) and a model card.

Built-in demo (CPU): a full fine-tune of the shipped tiny base on the red-ink digits that `make data` writes (the
LoRA recipe's data, for comparison):
    make train-text-to-image
`make tiny-sd-base` trains the shipped base itself with this script (from --unet_config, on the digits).
One GPU, Stable Diffusion 1.5 from the hub (full fine-tuning wants a large GPU; bf16 and 8-bit Adam help):
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_text_to_image.py \
        --pretrained_model_name_or_path stable-diffusion-v1-5/stable-diffusion-v1-5 \
        --dataset_name lambdalabs/naruto-blip-captions --center_crop --random_flip --use_ema \
        --train_batch_size 4 --gradient_accumulation_steps 4 --gradient_checkpointing --mixed_precision bf16 \
        --max_train_steps 15000 --learning_rate 1e-5 --validation_prompt "a man with blue hair" \
        --output_dir outputs/sd-naruto
Then:  python sample.py --model outputs/sd-naruto --prompt "a girl with pink hair"

Copy with: common/__init__.py, common/args.py, common/buckets.py, common/caption_files.py, common/checkpoints.py, common/cli.py, common/diffusion.py, common/distributed.py, common/fsdp.py, common/image_data.py, common/optimizers.py, common/preemption.py, common/reporting.py, common/sdxl.py, common/stable_diffusion.py, common/training.py, common/unet_config.py, common/validation_loss.py
"""  # noqa: E501 (the copy list stays one line, for grep)
import json
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
)
from common.buckets import check_bucket_resolution
from common.caption_files import caption_folder_reader, check_caption_args
from common.checkpoints import agreed_checkpoint, detect_shared_output_dir, resolve_resume
from common.cli import UserError, quiet_loading_bars, run
from common.diffusion import SCHEDULER_CLASSES, SD_SCHEDULER, diffusion_loss, diffusion_target
from common.optimizers import add_optimizer_args, check_optimizer_args
from common.stable_diffusion import (
    SHIPPED_BASE,
    base_resolution,
    check_local_resolution,
    check_sd_pipeline,
    load_error,
    offload_idle_models,
    size_factor,
    validation_images,
)
from common.training import add_ema_args, check_resumed_ema, ema_weights
from common.unet_config import read_json_config


def parse_args(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    g = add_data_args(parser, resolution=None)
    add_caption_args(g, caption_dropout_prob=0.1)
    add_latent_cache_args(g)
    add_bucket_args(g)
    g = parser.add_argument_group("model")
    g.add_argument("--pretrained_model_name_or_path", default=SHIPPED_BASE,
                   help="A StableDiffusionPipeline: hub id or folder (default: the shipped tiny digits base).")
    g.add_argument("--revision", default=None, help="Hub revision of the base model.")
    g.add_argument("--variant", default=None, help="Weights variant of the base model, e.g. fp16.")
    g.add_argument("--unet_config", default=None,
                   help="A UNet2DConditionModel config (json file, or folder with config.json): train a fresh UNet "
                        "from scratch instead of the base's.")
    g.add_argument("--prediction_type", default=None, choices=["epsilon", "v_prediction", "sample"],
                   help="Training target; default: the base scheduler's. Saved in the output's scheduler.")
    g.add_argument("--snr_gamma", type=positive_float, default=None, help="Min-SNR loss weighting (5.0 is usual).")
    g.add_argument("--noise_offset", type=float, default=0.0, help="Offset noise scale (0.05-0.1 is usual).")
    g.add_argument("--gradient_checkpointing", action="store_true", help="Less memory, ~30%% slower.")
    add_ema_args(g)
    g = parser.add_argument_group("validation")
    g.add_argument("--validation_prompt", action="append", default=[], help="Repeatable.")
    g.add_argument("--num_validation_images", type=positive_int, default=2, help="Images per prompt.")
    g.add_argument("--validation_steps", type=positive_int, default=500,
                   help="Every N optimizer steps, and at the end.")
    g.add_argument("--validation_scheduler", default=SD_SCHEDULER, choices=sorted(SCHEDULER_CLASSES),
                   help="Sampler of the validation images (sample.py's default too).")
    g.add_argument("--validation_inference_steps", type=positive_int, default=20)
    g.add_argument("--validation_guidance_scale", type=float, default=7.5)
    add_training_args(parser, output_dir="outputs/text-to-image", learning_rate=1e-5, train_batch_size=16,
                      num_train_epochs=5, lr_scheduler="constant", lr_warmup_steps=0)
    add_optimizer_args(parser)
    add_checkpoint_args(parser, checkpointing_steps=500)
    add_logging_args(parser, project_name="train_text_to_image")
    args = parser.parse_args(argv)
    check_caption_args(args)
    check_common_args(args)
    check_optimizer_args(args)
    check_sd_pipeline(args.pretrained_model_name_or_path, "--pretrained_model_name_or_path")
    args.resolution = check_local_resolution(args.pretrained_model_name_or_path, args.resolution)
    if args.unet_config:
        args.unet_config = read_unet_config(args.unet_config)
        check_unet_fits(args.unet_config, args.pretrained_model_name_or_path)
    check_bucket_args(args)
    if args.buckets == "auto" and os.path.isdir(args.pretrained_model_name_or_path):  # a hub base: once loaded
        check_bucket_resolution(args.resolution, size_factor(args.pretrained_model_name_or_path,
                                                                unet_config=args.unet_config))
    resume_path = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume_path:
        check_resumed_ema(args, resume_path)
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
    # <domain: weight dtype>
    # Read the accelerator's precision, not the flag: an accelerate yaml may ask for fp16 too. The UNet trains in
    # fp32 (autocast computes in the low precision); the frozen text encoder is stored in it.
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    # </domain>

    # 2. Data: images decoded once; each image's captions as indices into the distinct prompts ("" for dropout).
    # <domain: data>
    from common.buckets import batching, bucket_images, validation_sizes
    from common.image_data import CachedLatents, ImageDataset, caption_lists, collate_batch, require_columns
    from common.validation_loss import HeldOutLoss, load_with_validation

    args.resolution, _ = base_resolution(args.pretrained_model_name_or_path, args.resolution, args.revision,
                                         args.cache_dir)
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

    sizes = held_out_sizes = None  # --buckets auto: each image's (height, width)
    if args.buckets == "auto":
        sizes, held_out_sizes, table = bucket_images(args, train_ds, held_out_ds, size_factor(
            args.pretrained_model_name_or_path, args.revision, args.cache_dir, args.unet_config))
        logger.info(f"aspect-ratio buckets at {args.resolution} px:\n{table}")
    with accelerator.main_process_first():
        train_data = ImageDataset(train_ds, args.image_column, args.resolution, center_crop=args.center_crop,
                                  random_flip=args.random_flip, columns={"index": torch.arange(len(train_ds))},
                                  seed=args.seed, sizes=sizes)
        held_out = None if held_out_ds is None else ImageDataset(
            held_out_ds, args.image_column, args.resolution, center_crop=True, seed=args.seed, sizes=held_out_sizes)
    # </domain>

    # 3. Model: VAE (fp32: fp16 decodes overflow) and text encoder frozen; the UNet trained in fp32; its EMA.
    # <domain: model>
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from diffusers.training_utils import EMAModel
    from transformers import CLIPTextModel, CLIPTokenizer

    quiet_loading_bars()
    path, load = args.pretrained_model_name_or_path, {"revision": args.revision, "cache_dir": args.cache_dir}
    try:
        noise_scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler", **load)
        tokenizer = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **load)
        text_encoder = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", variant=args.variant,
                                                     dtype=weight_dtype, **load)
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", variant=args.variant, dtype=torch.float32,
                                            **load)
        if args.unet_config:
            check_unet_fits(args.unet_config, path)  # a hub base: its configs are known only now
            unet = UNet2DConditionModel.from_config(args.unet_config)
        else:
            unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", variant=args.variant,
                                                        dtype=torch.float32, **load)
    except (OSError, ValueError) as err:
        raise load_error("--pretrained_model_name_or_path", path, err) from None
    if unet.config.cross_attention_dim != text_encoder.config.hidden_size:
        raise UserError(f"the UNet's cross_attention_dim {unet.config.cross_attention_dim} does not match the text "
                        f"encoder's hidden size {text_encoder.config.hidden_size}")
    if args.prediction_type:
        noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    for model in (vae, text_encoder):
        model.requires_grad_(False).to(accelerator.device)
    unet.to(accelerator.device).train()
    unet.set_attn_processor(AttnProcessor2_0())  # PyTorch SDPA (flash / memory-efficient kernels where available)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    trained = {"unet": unet}  # what trains, by checkpoint subfolder
    ema = None
    if args.use_ema:
        ema = EMAModel(unet.parameters(), decay=args.ema_max_decay, use_ema_warmup=True, inv_gamma=args.ema_inv_gamma,
                       power=args.ema_power, model_cls=UNet2DConditionModel, model_config=unet.config, foreach=True)
    num_trainable = sum(p.numel() for p in unet.parameters())

    # Speed: what is frozen is computed once. Text: every distinct prompt embedded once (kept on the CPU).
    input_ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                          return_tensors="pt").input_ids
    with torch.no_grad():
        prompt_embeds = torch.cat([text_encoder(ids.to(accelerator.device))[0].float().cpu()
                                   for ids in input_ids.split(64)])

    def encode(pixel_values):  # -> parameters (mean, log-variance) of the VAE's latent distribution
        with torch.no_grad(), accelerator.autocast():
            return vae.encode(pixel_values.to(accelerator.device, torch.float32)).latent_dist.parameters

    def sample_latents(params):  # drawn afresh each step; contiguous, or randn_like draws differ for channels-last
        latents = DiagonalGaussianDistribution(params.float().contiguous()).sample()
        return (latents - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor

    def embed(ids):  # prompt indices -> the text encoder's hidden states (computed once above)
        return prompt_embeds[ids].to(accelerator.device)

    held_out_loss = None if held_out is None else HeldOutLoss(
        held_out, encode, vae.config, [prompt_id[c[0]] for c in held_out_captions],
        noise_scheduler.config.num_train_timesteps, accelerator, args.seed, args.train_batch_size)
    loader_batches = batching(sizes, args.train_batch_size, args.seed, train_data)  # one bucket each with --buckets
    if args.cache_latents:
        logger.info(f"caching the latents of {len(train_data)} images{' and their mirror images' * args.random_flip}")
        train_data = CachedLatents(train_data, encode, args.vae_encode_batch_size)
    offload_idle_models(accelerator, logger, args, vae, text_encoder, text_cached=prompt_embeds is not None)
    train_dataloader = torch.utils.data.DataLoader(train_data, num_workers=args.dataloader_num_workers,
                                                   collate_fn=collate_batch, **loader_batches)
    check_same_data(accelerator, training_images=len(train_data), batches=len(train_dataloader),  # (machines' copies)
                    held_out_images=0 if held_out is None else len(held_out))
    # </domain>

    # 4. Optimizer on the UNet; schedule counted in optimizer steps.
    # <domain: parameter groups>
    param_groups = build_param_groups(unet, args.learning_rate, args.adam_weight_decay)
    # </domain>
    optimizer = build_optimizer(args, param_groups, accelerator.device)  # --optimizer (default: fused AdamW)
    steps_per_epoch, max_train_steps, num_train_epochs = plan_steps(
        math.ceil(len(train_dataloader) / accelerator.num_processes), args.gradient_accumulation_steps,
        args.num_train_epochs, args.max_train_steps)
    lr_scheduler = build_lr_scheduler(args.lr_scheduler, optimizer, args.lr_warmup_steps, max_train_steps,
                                      accelerator.num_processes, args.lr_warmup_start_factor, args.lr_min)

    # 5. prepare, hooks (checkpoints hold unet/ and unet_ema/ in from_pretrained form, plus scheduler/), then the
    #    exact step counts.
    *models, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(*trained.values(), optimizer,
                                                                             train_dataloader, lr_scheduler)
    unwrapped = {name: accelerator.unwrap_model(m, keep_torch_compile=False) for name, m in zip(trained, models)}
    trained_params = [p for model in models for p in model.parameters() if p.requires_grad]  # what gets clipped
    # <domain: the prepared models; what a checkpoint holds>
    unet = models[0]
    if ema is not None:
        ema.to(accelerator.device)

    def save_extra(folder, models):
        if ema is not None:
            ema.save_pretrained(os.path.join(folder, "unet_ema"))
        noise_scheduler.save_pretrained(os.path.join(folder, "scheduler"))

    def load_extra(folder):  # (parse_args checked that the checkpoint's EMA matches the flags)
        if ema is not None:
            ema.load_state_dict(EMAModel.from_pretrained(os.path.join(folder, "unet_ema"),
                                                         UNet2DConditionModel).state_dict())
            ema.to(accelerator.device)

    register_state_hooks(accelerator, unwrapped, extra_save=save_extra, extra_load=load_extra)
    checkpoint_info = {}  # checkpoint_info.json: the step only
    # </domain>
    steps_per_epoch, max_train_steps, num_train_epochs = plan_steps(
        len(train_dataloader), args.gradient_accumulation_steps, args.num_train_epochs, args.max_train_steps)

    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    init_trackers(accelerator, args)
    total_batch_size = args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    # <domain: what this run trains>
    logger.info(f"{len(train_data)} training images at {args.resolution} px, {len(prompts) - 1} distinct captions, "
                f"{num_trainable} UNet parameters{' (fresh, from --unet_config)' * bool(args.unet_config)} "
                f"({accelerator.mixed_precision} mixed precision), {accelerator.num_processes} process(es), batch "
                f"{total_batch_size}, {max_train_steps} optimizer steps over {num_train_epochs} epochs")
    # </domain>

    # From here on each process draws its own noise, timesteps and dropout (the models above were initialised alike
    # on every process); resuming restores every process's generators.
    set_seed(args.seed, device_specific=True)

    # 6. Resume: state (EMA included), then the position in the epoch.
    global_step, first_epoch, skip_batches = 0, 0, 0
    resume_path = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume_path:
        load_checkpoint(accelerator, resume_path)
        global_step = checkpoint_step(resume_path)
        first_epoch, skip_batches = resume_position(global_step, steps_per_epoch, args.gradient_accumulation_steps,
                                                    max_train_steps)
        logger.info(f"resumed from {resume_path} at step {global_step}")

    # 7. The loop: latents + noise at a random timestep -> the UNet predicts the noise (or v, or x0).
    progress = tqdm(total=max_train_steps, initial=global_step, desc="steps",
                    disable=not accelerator.is_local_main_process)
    start_time, start_step = time.time(), global_step
    loss_sum, last_loss, metrics = torch.zeros((), device=accelerator.device), None, {}
    skipped_steps = 0
    group_names = [group["name"] for group in optimizer.param_groups]
    # <domain: validation>
    from common.fsdp import full_models

    def validate(step, images=True):  # the held-out loss and images of the EMA weights (what gets exported)
        full = full_models(accelerator, {"unet": unet})  # (under FSDP: gathered on every process, for the loss)
        with ema_weights(ema, full["unet"]):
            if held_out_loss is not None:
                held_out_loss.log(step, full["unet"], embed, noise_scheduler)
            if not (images and args.validation_prompt):
                return []
            parts = {"vae": vae, "unet": full["unet"], "tokenizer": tokenizer, "text_encoder": text_encoder}
            return validation_images(args, accelerator, parts, noise_scheduler, step,
                                     sizes=validation_sizes(sizes, args.resolution))

    validating = held_out_loss is not None or args.validation_prompt
    if held_out_loss is not None and global_step == 0:
        validate(0, images=False)  # the held-out loss before training: where the curve starts
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
                    encoder_hidden_states = embed(prompt_index)
                    target = diffusion_target(noise_scheduler, latents, noise, timesteps)
                    model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
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
                    ema.step(unet.parameters())
                # </domain>
                global_step += 1
                skipped_steps += not update
                progress.update(1)
                if global_step % args.logging_steps == 0 or global_step == max_train_steps:
                    last_loss = accelerator.reduce(loss_sum, "mean").item()  # mean over processes, on logging steps
                    logs = {"train/loss": last_loss, "epoch": epoch}
                    logs.update({f"lr/{name}": group["lr"] for name, group in zip(group_names, optimizer.param_groups)})
                    # <domain: more to log>
                    if ema is not None:
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
                # 8. Validate: images from the (EMA) weights every --validation_steps (the final ones: below).
                # <domain: validation>
                if validating and global_step % args.validation_steps == 0 and global_step < max_train_steps:
                    validate(global_step)
                # </domain>
                if global_step >= max_train_steps:
                    break
            if global_step >= max_train_steps:
                break

        # 9. Save: the whole pipeline with the (EMA) UNet and the training scheduler, a model card, the run summary.
        accelerator.wait_for_everyone()
        # <domain: the final validation, the pipeline and its model card>
        images = validate(global_step) if validating else []
        final = full_models(accelerator, {"unet": unet}, main_only=True)
        if accelerator.is_main_process:
            with ema_weights(ema, final["unet"]):
                pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder.to(torch.float32),
                                               tokenizer=tokenizer, unet=final["unet"], scheduler=noise_scheduler,
                                               safety_checker=None, feature_extractor=None,
                                               requires_safety_checker=False)
                pipe.save_pretrained(args.output_dir)
            base = args.pretrained_model_name_or_path
            write_model_card(
                args.output_dir, "Stable Diffusion UNet trained with train_text_to_image.py",
                f"The UNet of `{base}`{' (fresh, from a UNet config)' * bool(args.unet_config)} trained on "
                f"`{args.dataset_name or args.train_data_dir}` for {global_step} optimizer steps; the other "
                f"components are the base's. Sample: `python sample.py --model {args.output_dir} --prompt \"...\"`.",
                {"base model": f"`{base}`", "UNet": "from --unet_config" if args.unet_config else "the base's",
                 "resolution": f"{args.resolution} px", "prediction type": noise_scheduler.config.prediction_type,
                 "EMA weights": ema is not None, "steps": global_step,
                 "final loss": f"{last_loss:.4f}" if last_loss is not None else "n/a",
                 "validation prompts": "; ".join(args.validation_prompt) or "none"},
                "from diffusers import StableDiffusionPipeline\n"
                f'pipe = StableDiffusionPipeline.from_pretrained("{args.output_dir}")\n'
                f'image = pipe("{(args.validation_prompt or [prompts[-1]])[0]}").images[0]',
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


def read_unet_config(path):
    """--unet_config: a json file or a folder holding config.json -> the config dict."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    config = read_json_config(file, "--unet_config")
    if "cross_attention_dim" not in config:
        raise UserError(f"--unet_config: '{file}' is not a UNet2DConditionModel config (no cross_attention_dim)")
    return config


def check_unet_fits(config, base):
    """A fresh UNet must take the base's latents and text embeddings; checked on the folder's configs before any
    weight loads (for a hub base, once loaded)."""
    checks = (("text_encoder", "hidden_size", "cross_attention_dim", "the text encoder's hidden size"),
              ("vae", "latent_channels", "in_channels", "the VAE's latent channels"))
    for part, key, unet_key, what in checks:
        file = os.path.join(base, part, "config.json")
        if not os.path.isfile(file):
            continue
        with open(file) as f:
            want = json.load(f).get(key)
        have = config.get(unet_key, 4 if unet_key == "in_channels" else None)
        if want is not None and have != want:
            raise UserError(f"--unet_config: {unet_key} is {have}, but {what} of '{base}' is {want}; "
                            f"set \"{unet_key}\": {want} in the config")


if __name__ == "__main__":
    run(main, parse_args)
