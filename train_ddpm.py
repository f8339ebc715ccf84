#!/usr/bin/env python
"""Train a DDPM from scratch, unconditional or class-conditional with classifier-free guidance.

The whole DDPM recipe, after diffusers' train_unconditional.py example: `DDPMScheduler.add_noise` at random
timesteps, the UNet predicting the noise (or v, or the clean image), MSE with min-SNR-gamma weights, an EMA of the
weights, class dropout so that one model learns the conditional and the unconditional prediction (guidance:
uncond + w * (cond - uncond)), validation grids drawn with a fast sampler (DDIM/DPM-Solver) and scored by a
train_classifier.py classifier when given, resumable checkpoints, and an output that `DDPMPipeline.from_pretrained`
loads (sample.py draws from it).

Built-in demo (scikit-learn's digits at 16 px, a row per digit, a 0.7 M-parameter UNet from scratch, one CPU
thread, ~7.5 minutes; how well a classifier recognises its samples: docs/train_ddpm.md):
    make train-ddpm && make sample-ddpm
One GPU:
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_ddpm.py --class_column label --use_ema
Several GPUs (or `make train-ddpm CONFIG=accelerate_configs/multi_gpu.yaml`):
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml train_ddpm.py --class_column label --use_ema
A hub dataset (CIFAR-10, class-conditional, 32 px, a bigger UNet):
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_ddpm.py \
        --dataset_name uoft-cs/cifar10 --image_column img --class_column label --resolution 32 --random_flip \
        --block_out_channels 128,256,256,256 --layers_per_block 2 --train_batch_size 128 --num_train_epochs 300 \
        --learning_rate 2e-4 --lr_warmup_steps 1000 --use_ema --ema_max_decay 0.9999 --mixed_precision bf16

Copy with: common/__init__.py, common/args.py, common/caption_files.py, common/checkpoints.py, common/classifier_metrics.py, common/cli.py, common/deepspeed_engine.py, common/diffusion.py, common/distributed.py, common/fsdp.py, common/image_data.py, common/loss_masks.py, common/optimizers.py, common/preemption.py, common/reporting.py, common/training.py, common/unet_config.py, common/video.py
"""  # noqa: E501 (the copy list stays one line, for grep)
import json
import math
import os
import time

from common.args import (
    add_checkpoint_args,
    add_data_args,
    add_logging_args,
    add_training_args,
    check_common_args,
    make_parser,
    positive_float,
    positive_int,
    probability,
)
from common.checkpoints import agreed_checkpoint, detect_shared_output_dir, resolve_resume
from common.cli import UserError, first_line, quiet_loading_bars, run
from common.diffusion import (
    DEFAULT_GUIDANCE_SCALE,
    DEFAULT_INFERENCE_STEPS,
    DEFAULT_SCHEDULER,
    SCHEDULER_CLASSES,
    diffusion_loss,
    diffusion_target,
)
from common.optimizers import add_optimizer_args, check_optimizer_args
from common.training import add_ema_args, check_resumed_ema, ema_weights, set_cuda_backends
from common.unet_config import channel_list, check_unet_shape, pretrained_unet_config, unet_config_source


def parse_args(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    g = add_data_args(parser, resolution=16)
    g.add_argument("--class_column", default=None, help="Train class-conditional on this column (else unconditional).")
    g.add_argument("--class_dropout_prob", type=probability, default=0.1,
                   help="Share of labels replaced by the null class, so the model also learns the unconditional "
                        "prediction that classifier-free guidance needs.")
    g = parser.add_argument_group("model")
    g.add_argument("--model_config_name_or_path", default=None, help="UNet2DModel config (json file or folder).")
    g.add_argument("--pretrained_model_name_or_path", default=None,
                   help="Continue from a UNet2DModel or a DDPM pipeline (folder with unet/).")
    g.add_argument("--block_out_channels", type=channel_list, default=(16, 32, 64),
                   help="Default UNet: channels per level (each level but the last halves the resolution; "
                        "self-attention at the last level).")
    g.add_argument("--layers_per_block", type=positive_int, default=1, help="Default UNet: ResNet blocks per level.")
    g = parser.add_argument_group("diffusion")
    g.add_argument("--ddpm_num_steps", type=positive_int, default=1000, help="Training timesteps.")
    g.add_argument("--ddpm_beta_schedule", default="squaredcos_cap_v2",
                   choices=["linear", "scaled_linear", "squaredcos_cap_v2"],
                   help="Cosine wastes fewer steps on pure noise than linear (compared in docs/train_ddpm.md).")
    g.add_argument("--ddpm_beta_start", type=positive_float, default=1e-4, help="linear/scaled_linear schedules.")
    g.add_argument("--ddpm_beta_end", type=positive_float, default=0.02, help="linear/scaled_linear schedules.")
    g.add_argument("--prediction_type", default="epsilon", choices=["epsilon", "v_prediction", "sample"])
    g.add_argument("--snr_gamma", type=float, default=5.0,
                   help="Min-SNR-gamma loss weights (Hang et al., 2023); 0: plain MSE.")
    add_ema_args(g)
    g = parser.add_argument_group("validation")
    g.add_argument("--validation_steps", type=positive_int, default=1000,
                   help="Sample a grid every N optimizer steps, and at the end.")
    g.add_argument("--num_validation_images", type=positive_int, default=20,
                   help="Per class (a row each), or in all for an unconditional model.")
    g.add_argument("--validation_scheduler", default=DEFAULT_SCHEDULER, choices=sorted(SCHEDULER_CLASSES))
    g.add_argument("--validation_inference_steps", type=positive_int, default=DEFAULT_INFERENCE_STEPS)
    g.add_argument("--guidance_scale", type=float, default=DEFAULT_GUIDANCE_SCALE,
                   help="Classifier-free guidance for the validation samples (1: plain conditional).")
    g.add_argument("--eval_batch_size", type=positive_int, default=200, help="Images sampled per batch.")
    g.add_argument("--eval_classifier", default=None,
                   help="A train_classifier.py output: log sample accuracy and the Fréchet distance of its features.")
    add_training_args(parser, output_dir="outputs/ddpm", learning_rate=2e-3, train_batch_size=64,
                      num_train_epochs=55, lr_scheduler="warmup_cosine", lr_warmup_steps=100, adam_weight_decay=1e-6)
    add_optimizer_args(parser)
    add_checkpoint_args(parser, checkpointing_steps=500)
    add_logging_args(parser, project_name="train_ddpm")
    args = parser.parse_args(argv)
    check_common_args(args)
    check_optimizer_args(args)
    if args.model_config_name_or_path and args.pretrained_model_name_or_path:
        parser.error("give --model_config_name_or_path or --pretrained_model_name_or_path, not both")
    if args.snr_gamma < 0:
        parser.error("--snr_gamma must be >= 0 (0: plain MSE)")
    if args.ddpm_beta_end <= args.ddpm_beta_start:
        parser.error("--ddpm_beta_end must be larger than --ddpm_beta_start")
    # A local config or pretrained UNet is checked now, before torch loads (hub ids when they load).
    if args.pretrained_model_name_or_path:
        config, source = pretrained_unet_config(args.pretrained_model_name_or_path) or (None, None)
    else:
        config, source = unet_config_source(args)
    if config is not None:
        check_unet_shape(config, args.resolution, source)
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
    set_cuda_backends(args.allow_tf32, args.allow_cudnn_attention)

    # 2. Data: images decoded once, scaled to [-1, 1]; class names -> ids (the null class is the id after the last).
    # <domain: data>
    from common.image_data import (
        ImageDataset,
        collate_batch,
        label_ids,
        label_names,
        load_image_dataset,
        require_columns,
    )

    train_ds, eval_ds = load_image_dataset(args, carve_eval=args.eval_classifier is not None)  # eval: real images
    require_columns(train_ds, image_column=args.image_column,
                    **({"class_column": args.class_column} if args.class_column else {}))
    labels = label_names(train_ds, args.class_column) if args.class_column else []
    null_class = len(labels)
    columns = {}
    if labels:
        columns["class_labels"] = label_ids(train_ds, args.class_column, labels)
    with accelerator.main_process_first():
        train_data = ImageDataset(train_ds, args.image_column, args.resolution, center_crop=args.center_crop,
                                  random_flip=args.random_flip, columns=columns, seed=args.seed)
    train_dataloader = torch.utils.data.DataLoader(
        train_data, batch_size=args.train_batch_size, shuffle=True, num_workers=args.dataloader_num_workers,
        collate_fn=collate_batch, generator=torch.Generator().manual_seed(args.seed))  # own RNG: the global one stays
    check_same_data(accelerator, training_images=len(train_data), batches=len(train_dataloader))  # (machines' copies)
    # </domain>

    # 3. Model: a UNet2DModel from a config, from a pretrained UNet/pipeline, or the small default; the noise schedule.
    # <domain: model>
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel  # here: a data mistake is reported seconds sooner
    from diffusers.training_utils import EMAModel

    from common.classifier_metrics import ClassifierScorer

    quiet_loading_bars(["diffusers"])

    unet = build_unet(args, UNet2DModel, null_class + 1 if labels else None)
    noise_scheduler = DDPMScheduler(num_train_timesteps=args.ddpm_num_steps, beta_start=args.ddpm_beta_start,
                                    beta_end=args.ddpm_beta_end, beta_schedule=args.ddpm_beta_schedule,
                                    prediction_type=args.prediction_type)
    trained = {"unet": unet}  # what trains, by checkpoint subfolder
    ema = None
    if args.use_ema:
        ema = EMAModel(unet.parameters(), decay=args.ema_max_decay, use_ema_warmup=True, inv_gamma=args.ema_inv_gamma,
                       power=args.ema_power, model_cls=UNet2DModel, model_config=unet.config, foreach=True)
    scorer = scorer_ids = real_features = None
    if args.eval_classifier:  # loaded everywhere so that a bad path stops every process; used on the main one
        scorer = ClassifierScorer(args.eval_classifier, accelerator.device)
        scorer_ids = scorer.class_ids(labels) if labels else None
        require_columns(eval_ds, image_column=args.image_column)
        if accelerator.is_main_process:  # real images of the held-out split, at the training resolution
            real = ImageDataset(eval_ds.select(range(min(len(eval_ds), 2000))), args.image_column, args.resolution)
            real_features, _ = scorer(torch.stack([item["pixel_values"] for item in real]) / 2 + 0.5)
    # </domain>

    # 4. Optimizer; warm-up -> cosine counted in optimizer steps.
    # <domain: parameter groups>
    param_groups = build_param_groups(unet, args.learning_rate, args.adam_weight_decay)
    # </domain>
    optimizer = build_optimizer(args, param_groups, accelerator.device)  # --optimizer (default: fused AdamW)
    steps_per_epoch, max_train_steps, num_train_epochs = plan_steps(
        math.ceil(len(train_dataloader) / accelerator.num_processes), args.gradient_accumulation_steps,
        args.num_train_epochs, args.max_train_steps)
    lr_scheduler = build_lr_scheduler(args.lr_scheduler, optimizer, args.lr_warmup_steps, max_train_steps,
                                      accelerator.num_processes, args.lr_warmup_start_factor, args.lr_min)

    # 5. prepare, hooks (checkpoints hold unet/ and unet_ema/ in from_pretrained form, plus scheduler/ and
    #    labels.json so that sample.py reads a checkpoint directly), then the exact step counts.
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
        write_labels(folder, labels)

    def load_extra(folder):  # (parse_args checked that the checkpoint's EMA matches the flags)
        if ema is not None:
            ema.load_state_dict(EMAModel.from_pretrained(os.path.join(folder, "unet_ema"), UNet2DModel).state_dict())
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
    logger.info(f"{len(train_data)} training images, {len(labels) or 'no'} classes, "
                f"{sum(p.numel() for p in unet.parameters()) / 1e6:.2f} M parameters, "
                f"{accelerator.num_processes} process(es), batch {total_batch_size}, "
                f"{max_train_steps} optimizer steps over {num_train_epochs} epochs")
    # </domain>

    # From here on each process draws its own noise, timesteps and dropout (the models above were initialised alike
    # on every process); resuming restores every process's generators.
    set_seed(args.seed, device_specific=True)

    # 6. Resume: state (EMA included), then the position in the epoch (seen batches are skipped, not replayed).
    global_step, first_epoch, skip_batches = 0, 0, 0
    resume_path = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume_path:
        load_checkpoint(accelerator, resume_path)
        global_step = checkpoint_step(resume_path)
        first_epoch, skip_batches = resume_position(global_step, steps_per_epoch, args.gradient_accumulation_steps,
                                                    max_train_steps)
        logger.info(f"resumed from {resume_path} at step {global_step}")

    # 7. The loop: noise a clean batch at random timesteps, predict, MSE to the target.
    progress = tqdm(total=max_train_steps, initial=global_step, desc="steps",
                    disable=not accelerator.is_local_main_process)
    start_time, start_step = time.time(), global_step
    loss_sum, last_loss, metrics = torch.zeros((), device=accelerator.device), None, {}
    skipped_steps = 0
    group_names = [group["name"] for group in optimizer.param_groups]
    # <domain: validation>
    from common.fsdp import full_models

    def validate(step):  # a grid from the EMA weights; its scores with --eval_classifier
        full = full_models(accelerator, {"unet": unet}, main_only=True)  # (under FSDP: gathered, on every process)
        return validation_grid(accelerator, full["unet"], ema, noise_scheduler, args, labels, scorer, scorer_ids,
                               real_features, step)
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
                    clean = batch["pixel_values"]
                    noise = torch.randn_like(clean)
                    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (clean.shape[0],),
                                              device=clean.device)
                    noisy = noise_scheduler.add_noise(clean, noise, timesteps)
                    class_labels = (drop_class_labels(batch["class_labels"], null_class, args.class_dropout_prob)
                                    if labels else None)
                    prediction = unet(noisy, timesteps, class_labels=class_labels).sample
                    target = diffusion_target(noise_scheduler, clean, noise, timesteps)
                    loss = diffusion_loss(prediction, target, noise_scheduler, timesteps, args.snr_gamma)
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
                # 8. Validate: a grid (and its scores) every --validation_steps (the final one: below).
                # <domain: validation>
                if global_step % args.validation_steps == 0 and global_step < max_train_steps:
                    metrics = validate(global_step)
                # </domain>
                if global_step >= max_train_steps:
                    break
            if global_step >= max_train_steps:
                break

        # 9. Save: a DDPMPipeline folder (EMA weights when --use_ema), labels.json, a model card and the run summary.
        accelerator.wait_for_everyone()
        # <domain: the final validation (its metrics go into all_results.json), the pipeline and its model card>
        metrics = validate(global_step)
        final = full_models(accelerator, {"unet": unet}, main_only=True)
        if accelerator.is_main_process:
            with ema_weights(ema, final["unet"]):
                DDPMPipeline(unet=final["unet"], scheduler=noise_scheduler).save_pretrained(args.output_dir)
            write_labels(args.output_dir, labels)
            write_model_card(
                args.output_dir, "DDPM trained with train_ddpm.py",
                f"Trained from scratch on `{args.dataset_name or args.train_data_dir}` for {global_step} optimizer "
                f"steps at {args.resolution} px.",
                {"classes": ", ".join(labels) if labels else "unconditional", "EMA weights": ema is not None,
                 "prediction type": args.prediction_type, "beta schedule": args.ddpm_beta_schedule,
                 **{k: f"{v:.4f}" for k, v in metrics.items() if isinstance(v, float)}},
                f'from diffusers import DDPMPipeline\npipe = DDPMPipeline.from_pretrained("{args.output_dir}")\n'
                + (f"# class-conditional (names in labels.json): python sample.py --model {args.output_dir} "
                   "--class_label all" if labels else "image = pipe(num_inference_steps=1000).images[0]"),
                images=[f"samples/step-{global_step}.png"])
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


def build_unet(args, unet_class, num_class_embeds):
    """The UNet of --pretrained_model_name_or_path / --model_config_name_or_path / the small default, checked."""
    if args.pretrained_model_name_or_path:
        path = args.pretrained_model_name_or_path
        subfolder = "unet" if not os.path.isdir(path) or os.path.isdir(os.path.join(path, "unet")) else None
        try:
            unet = unet_class.from_pretrained(path, subfolder=subfolder, cache_dir=args.cache_dir)
        except (OSError, ValueError) as err:
            raise UserError(f"--pretrained_model_name_or_path: cannot load a UNet2DModel from '{path}': "
                            f"{first_line(err)}") from None
        source = f"the pretrained UNet '{path}'"
    else:
        config, source = unet_config_source(args)
        if config is None:  # a hub id
            try:
                config = unet_class.load_config(args.model_config_name_or_path, cache_dir=args.cache_dir)
            except (OSError, ValueError) as err:
                raise UserError(f"--model_config_name_or_path: cannot read a UNet2DModel config from "
                                f"'{args.model_config_name_or_path}': {first_line(err)}") from None
        if config.get("num_class_embeds") is None:  # a config without classes gets this run's
            config["num_class_embeds"] = num_class_embeds
        try:
            unet = unet_class.from_config({**config, "sample_size": args.resolution})
        except (TypeError, ValueError) as err:
            raise UserError(f"{source}: {first_line(err)}") from None
    config = unet.config
    check_unet_shape(config, args.resolution, source)
    if config.num_class_embeds != num_class_embeds:
        want = f"{num_class_embeds} (classes + 1 null class)" if num_class_embeds else "none (no --class_column)"
        raise UserError(f"{source} has num_class_embeds={config.num_class_embeds}; this run needs {want}")
    unet.register_to_config(sample_size=args.resolution)  # DDPMPipeline samples at this size
    return unet


def drop_class_labels(class_labels, null_class, prob):
    """Classifier-free guidance training: each label becomes the null class with probability `prob`."""
    import torch

    drop = torch.rand(class_labels.shape, device=class_labels.device) < prob
    return class_labels.masked_fill(drop, null_class)


def validation_grid(accelerator, unet, ema, noise_scheduler, args, labels, scorer, scorer_ids, real_features, step):
    """On the main process (the others wait): a grid, a row per class, drawn with the EMA weights, logged and saved
    as samples/step-N.png; with --eval_classifier, sample accuracy and Fréchet distance. Returns the metrics."""
    import torch

    from common.classifier_metrics import frechet_distance
    from common.diffusion import image_grid, sample_images, sampling_scheduler, to_pil
    from common.reporting import log_image

    metrics = {}
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(unet, keep_torch_compile=False)
        n = args.num_validation_images
        class_ids = torch.arange(len(labels)).repeat_interleave(n) if labels else None
        model.eval()
        with ema_weights(ema, model):
            images = sample_images(model, sampling_scheduler(args.validation_scheduler, noise_scheduler.config),
                                   n * max(len(labels), 1), class_labels=class_ids, null_class=len(labels),
                                   guidance_scale=args.guidance_scale, batch_size=args.eval_batch_size,
                                   num_inference_steps=args.validation_inference_steps,
                                   generator=torch.Generator().manual_seed(args.seed))  # own RNG: training's untouched
        model.train()
        grid = image_grid(to_pil(images), ncol=n if labels else math.ceil(math.sqrt(n)))
        os.makedirs(os.path.join(args.output_dir, "samples"), exist_ok=True)
        grid.save(os.path.join(args.output_dir, "samples", f"step-{step}.png"))
        log_image(accelerator, "validation", grid, step)
        if scorer is not None:
            features, predicted = scorer((images * 255).round() / 255)  # the pixels a PNG would hold
            if labels:
                metrics["sample_accuracy"] = (predicted == scorer_ids[class_ids]).float().mean().item()
            metrics["frechet_distance"] = frechet_distance(real_features, features)
            metrics["eval_guidance_scale"] = args.guidance_scale
            accelerator.log({f"validation/{k}": v for k, v in metrics.items()}, step=step)
            accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    accelerator.wait_for_everyone()
    return metrics


def write_labels(folder, labels):
    """labels.json: the class names in id order, where sample.py looks for them (nothing for unconditional)."""
    if labels:
        with open(os.path.join(folder, "labels.json"), "w") as f:
            json.dump(labels, f)


if __name__ == "__main__":
    run(main, parse_args)
