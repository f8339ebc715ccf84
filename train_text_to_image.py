#!/usr/bin/env python
"""Train the denoiser of a text-to-image diffusion model on captioned images (full fine-tuning, or from scratch).

The counterpart of diffusers' train_text_to_image.py, for every family of common/families/ (the base's model_index.json
says which): Stable Diffusion 1.x/2.x and XL (a UNet on DDPM noise: epsilon, v or x0, min-SNR weighting, noise offset),
Stable Diffusion 3, Flux.1 and Qwen-Image (a transformer trained by flow matching). The VAE and the text encoders
frozen, every denoiser weight trained, the denoiser from the base pipeline or, with --unet_config /
--transformer_config, a fresh one from a config (training from scratch). Latents (--cache_latents) and every prompt's
embeddings computed once; caption dropout so that classifier-free guidance works, an EMA of the weights (what gets
exported), validation images, a held-out loss, resumable checkpoints. Writes a complete pipeline folder of the base's
class (`DiffusionPipeline.from_pretrained(output_dir)`, sample.py, and a base for train_lora.py) and a model card.

Built-in demo (CPU): a full fine-tune of the shipped tiny base on the red-ink digits that `make data` writes (the
LoRA recipe's data, for comparison):
    make train-text-to-image
`make tiny-sd-base` and `make tiny-flux-base` train the shipped bases with this script (from --unet_config or
--transformer_config, on the digits).
One GPU, Stable Diffusion 1.5 from the hub (full fine-tuning wants a large GPU; bf16 and 8-bit Adam help):
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_text_to_image.py \
        --pretrained_model_name_or_path stable-diffusion-v1-5/stable-diffusion-v1-5 \
        --dataset_name lambdalabs/naruto-blip-captions --center_crop --random_flip --use_ema \
        --train_batch_size 4 --gradient_accumulation_steps 4 --gradient_checkpointing --mixed_precision bf16 \
        --max_train_steps 15000 --learning_rate 1e-5 --validation_prompt "a man with blue hair" \
        --output_dir outputs/sd-naruto
Then:  python sample.py --model outputs/sd-naruto --prompt "a girl with pink hair"

A copy also needs the module of its base's family, one of common/families/*.py (sd.py for Stable Diffusion 1.x/2.x;
FLUX.2 dev: flux2.py with flux2_klein.py).
Copy with: common/__init__.py, common/args.py, common/base_models.py, common/buckets.py, common/caption_files.py, common/checkpoints.py, common/cli.py, common/deepspeed_engine.py, common/diffusion.py, common/distributed.py, common/families/__init__.py, common/fsdp.py, common/image_data.py, common/lora_files.py, common/loss_masks.py, common/objectives.py, common/optimizers.py, common/preemption.py, common/prompts.py, common/references.py, common/reporting.py, common/sampling_defaults.py, common/sgm_names.py, common/single_file_checkpoint.py, common/text_encoder_keys.py, common/training.py, common/ui_lora.py, common/unet_config.py, common/vae.py, common/validation_images.py, common/validation_loss.py, common/video.py
"""  # noqa: E501 (the copy list stays one line, for grep)
import math
import os
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
)
from common.base_models import SHIPPED_BASE, add_base_model_args, check_base_args, size_factor
from common.buckets import check_bucket_resolution
from common.caption_files import caption_folder_reader, check_caption_args
from common.checkpoints import agreed_checkpoint, detect_shared_output_dir, resolve_resume
from common.cli import UserError, quiet_loading_bars, run
from common.objectives import add_objective_args
from common.optimizers import add_optimizer_args, check_optimizer_args
from common.single_file_checkpoint import check_single_file_base, save_single_file, single_file_path
from common.text_encoder_keys import add_text_model_prefix
from common.training import add_ema_args, check_resumed_ema, ema_weights, set_cuda_backends
from common.unet_config import read_json_config
from common.validation_images import add_validation_image_args
from common.video import add_video_args


def parse_args(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    g = add_data_args(parser, resolution=None)
    add_caption_args(g, caption_dropout_prob=0.1)
    add_latent_cache_args(g)
    add_bucket_args(g)
    add_video_args(g)  # --num_frames, --frame_stride (video bases: common/video.py)
    g = parser.add_argument_group("model")
    add_base_model_args(g, SHIPPED_BASE)
    g.add_argument("--unet_config", default=None,
                   help="A UNet2DConditionModel config (json file, or folder with config.json): train a fresh UNet "
                        "from scratch instead of the base's (SD 1.x/2.x, SDXL).")
    g.add_argument("--transformer_config", default=None,
                   help="The same for a transformer base (SD3Transformer2DModel, FluxTransformer2DModel, "
                        "QwenImageTransformer2DModel config).")
    add_objective_args(g)
    add_ema_args(g)
    g.add_argument("--save_model_as", default="diffusers", choices=["diffusers", "safetensors"],
                   help="kohya's flag. safetensors: also OUTPUT_DIR/<its name>.safetensors, the single-file "
                        "checkpoint (original SD layout) that ComfyUI's and A1111/Forge's checkpoint loaders and "
                        "diffusers' from_single_file read (SD 1.x/2.x and SDXL). The pipeline folder is always "
                        "written.")
    add_validation_image_args(parser.add_argument_group("validation"), validation_steps=500)
    add_training_args(parser, output_dir="outputs/text-to-image", learning_rate=1e-5, train_batch_size=16,
                      num_train_epochs=5, lr_scheduler="constant", lr_warmup_steps=0)
    add_optimizer_args(parser)
    add_checkpoint_args(parser, checkpointing_steps=500)
    add_logging_args(parser, project_name="train_text_to_image")
    args = parser.parse_args(argv)
    check_caption_args(args)
    check_common_args(args)
    check_optimizer_args(args)
    args.denoiser_config = read_denoiser_config(args)  # (a fresh denoiser's guidance embedding: check_base_args)
    family = check_base_args(args, "train_text_to_image.py trains")  # None for a hub base: checked once fetched
    if family:
        check_denoiser_flag(args, family)
    if args.denoiser_config and family:
        check_denoiser_fits(args.denoiser_config, args.pretrained_model_name_or_path, family)
    if args.save_model_as == "safetensors" and family:  # (a hub base: checked once its family is known)
        check_save_model_as(args, family)
    check_bucket_args(args)
    if args.buckets == "auto" and family:  # a hub base: once loaded
        check_bucket_resolution(args.resolution, size_factor(args.pretrained_model_name_or_path, family,
                                                             denoiser_config=args.denoiser_config))
    resume_path = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume_path:  # the EMA is kept as unet_ema/ or transformer_ema/, in from_pretrained form
        kind = "transformer" if os.path.isdir(os.path.join(resume_path, "transformer_ema")) else "unet"
        check_resumed_ema(args, resume_path, os.path.join(f"{kind}_ema", "config.json"))
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
    # <domain: weight dtype>
    # Read the accelerator's precision, not the flag: an accelerate yaml may ask for fp16 too. The denoiser trains in
    # fp32 (autocast computes in the low precision); the frozen text encoders are stored in it.
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    # </domain>

    # 2. Data: images decoded once; each image's captions as indices into the distinct prompts ("" for dropout).
    # <domain: data>
    from common.base_models import base_resolution, check_family_args
    from common.buckets import batching, bucket_images, validation_sizes
    from common.families import load_family, read_model_index
    from common.image_data import CachedLatents, Captions, collate_batch, image_datasets, require_columns
    from common.validation_images import check_validation_image_args
    from common.validation_loss import HeldOutLoss, load_with_validation

    path, flag = args.pretrained_model_name_or_path, "--pretrained_model_name_or_path"
    family = load_family(path, flag, args.revision, args.cache_dir, uses="train_text_to_image.py trains")
    check_family_args(args, family)  # (a hub base's: now that its family is known)
    check_denoiser_flag(args, family)
    check_validation_image_args(args, family, unconditional=args.caption_dropout_prob > 0)
    if args.save_model_as == "safetensors":
        check_save_model_as(args, family)
    args.resolution, _ = base_resolution(path, args.resolution, family, args.revision, args.cache_dir)
    # held out: --validation_split's images, for val/loss; a folder without metadata: .txt captions
    train_ds, held_out_ds = load_with_validation(args, read_folder=caption_folder_reader(args))
    require_columns(train_ds, image_column=args.image_column, caption_column=args.caption_column)
    # each image's captions as indices into the distinct prompts; the validation prompts are embedded with them
    captions = Captions(args, train_ds, held_out_ds, extra=args.validation_prompt)
    sizes = held_out_sizes = None  # --buckets auto: each image's (height, width)
    if args.buckets == "auto":
        sizes, held_out_sizes, table = bucket_images(args, train_ds, held_out_ds, size_factor(
            path, family, args.revision, args.cache_dir, args.denoiser_config))
        logger.info(f"aspect-ratio buckets at {args.resolution} px:\n{table}")
    with accelerator.main_process_first():  # (SDXL: each image's original size too, for its time ids)
        train_data, held_out = image_datasets(args, train_ds, held_out_ds, sizes, held_out_sizes, family.TIME_IDS)
    # </domain>

    # 3. Model: VAE (fp32: fp16 decodes overflow) and text encoders frozen; the denoiser trained in fp32; its EMA.
    # <domain: model>
    from diffusers.training_utils import EMAModel

    from common.base_models import lazy_latent_cache, load_parts, offload_idle_models
    from common.objectives import make_objective
    from common.prompts import Conditioning
    from common.vae import encode_params, sample_latents

    quiet_loading_bars()
    if args.denoiser_config:  # (a hub base: its configs are known only now)
        check_denoiser_fits(args.denoiser_config, path, family, args.revision, args.cache_dir)
    parts = load_parts(family, path, dtype=weight_dtype, denoiser_dtype=torch.float32, revision=args.revision,
                       variant=args.variant, cache_dir=args.cache_dir, denoiser_config=args.denoiser_config,
                       skip=family.OPTIONAL_COMPONENTS if args.drop_t5 else ())
    noise_scheduler, vae, denoiser = parts["scheduler"], parts["vae"], parts[family.DENOISER]
    args.max_sequence_length = family.text_length(parts, args.max_sequence_length, training=True)  # T5's, if any
    if args.prediction_type:
        noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    objective = make_objective(family, noise_scheduler, args)  # what the denoiser learns (common/objectives.py)
    text_encoders = [parts[name] for name in family.TEXT_ENCODERS if parts[name] is not None]
    for model in (vae, *text_encoders):
        model.requires_grad_(False).to(accelerator.device)
    denoiser.to(accelerator.device).train()
    guidance = args.guidance_scale if denoiser.config.get("guidance_embeds") else None  # (Flux.1-dev's input)
    if args.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    trained = {family.DENOISER: denoiser}  # what trains, by checkpoint subfolder
    ema = None
    if args.use_ema:
        ema = EMAModel(denoiser.parameters(), decay=args.ema_max_decay, use_ema_warmup=True,
                       inv_gamma=args.ema_inv_gamma, power=args.ema_power, model_cls=type(denoiser),
                       model_config=denoiser.config, foreach=True)
    num_trainable = sum(p.numel() for p in denoiser.parameters())

    # Speed: what is frozen is computed once. Text: every distinct prompt embedded once (kept on the CPU); the
    # pipeline samples the unconditional branch of some families (SDXL) with zeros, and caption dropout trains on them.
    condition = Conditioning(family, parts, captions.prompts, args.max_sequence_length, accelerator.device,
                             family.empty_prompt_zeros(read_model_index(path, flag, args.revision, args.cache_dir)))

    latent_config = family.latent_config(vae)  # the VAE's latents -> the denoiser's (common/vae.py)

    def encode(pixel_values):  # -> parameters (mean, log-variance) of the VAE's latent distribution, in fp32
        return encode_params(vae, pixel_values)

    held_out_loss = None if held_out is None else HeldOutLoss(
        held_out, encode, latent_config, list(range(len(held_out))), objective, accelerator, args.seed,
        args.train_batch_size)
    loader_batches = batching(sizes, args.train_batch_size, args.seed, train_data)  # one bucket each with --buckets
    if args.cache_latents:
        lazy = lazy_latent_cache(args, accelerator.device)  # (each image when a batch first needs it)
        logger.info(f"caching the latents of {len(train_data)} images{' and their mirror images' * args.random_flip}"
                    f"{' as the batches first need them' * lazy}")
        train_data = CachedLatents(train_data, encode, args.vae_encode_batch_size, lazy)
    offload_idle_models(logger, args, vae, text_encoders, text_cached=True)
    train_dataloader = torch.utils.data.DataLoader(train_data, num_workers=args.dataloader_num_workers,
                                                   collate_fn=collate_batch, **loader_batches)
    check_same_data(accelerator, training_images=len(train_data), batches=len(train_dataloader),  # (machines' copies)
                    held_out_images=0 if held_out is None else len(held_out))
    # </domain>

    # 4. Optimizer on the denoiser; schedule counted in optimizer steps.
    # <domain: parameter groups>
    param_groups = build_param_groups(denoiser, args.learning_rate, args.adam_weight_decay)
    # </domain>
    optimizer = build_optimizer(args, param_groups, accelerator.device)  # --optimizer (default: fused AdamW)
    steps_per_epoch, max_train_steps, num_train_epochs = plan_steps(
        math.ceil(len(train_dataloader) / accelerator.num_processes), args.gradient_accumulation_steps,
        args.num_train_epochs, args.max_train_steps)
    lr_scheduler = build_lr_scheduler(args.lr_scheduler, optimizer, args.lr_warmup_steps, max_train_steps,
                                      accelerator.num_processes, args.lr_warmup_start_factor, args.lr_min)

    # 5. prepare, hooks (checkpoints hold unet/ and unet_ema/, or transformer/ and transformer_ema/, in
    #    from_pretrained form, plus scheduler/), then the exact step counts.
    *models, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(*trained.values(), optimizer,
                                                                             train_dataloader, lr_scheduler)
    unwrapped = {name: accelerator.unwrap_model(m, keep_torch_compile=False) for name, m in zip(trained, models)}
    trained_params = [p for model in models for p in model.parameters() if p.requires_grad]  # what gets clipped
    # <domain: the prepared models; what a checkpoint holds>
    denoiser = models[0]
    ema_folder = f"{family.DENOISER}_ema"
    if ema is not None:
        ema.to(accelerator.device)

    def save_extra(folder, models):
        if ema is not None:
            ema.save_pretrained(os.path.join(folder, ema_folder))
        noise_scheduler.save_pretrained(os.path.join(folder, "scheduler"))

    def load_extra(folder):  # (parse_args checked that the checkpoint's EMA matches the flags)
        if ema is not None:
            ema.load_state_dict(EMAModel.from_pretrained(os.path.join(folder, ema_folder),
                                                         type(unwrapped[family.DENOISER])).state_dict())
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
    fresh = f" (fresh, from --{family.DENOISER}_config)" if args.denoiser_config else ""
    logger.info(f"{len(train_data)} training images at {args.resolution} px, {captions.distinct} distinct captions, "
                f"{num_trainable} {family.DENOISER} parameters{fresh} "
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

    # 7. The loop: latents noised by the family's objective -> the denoiser predicts its target.
    progress = tqdm(total=max_train_steps, initial=global_step, desc="steps",
                    disable=not accelerator.is_local_main_process)
    start_time, start_step = time.time(), global_step
    loss_sum, last_loss, metrics = torch.zeros((), device=accelerator.device), None, {}
    skipped_steps = 0
    group_names = [group["name"] for group in optimizer.param_groups]
    # <domain: validation>
    from common.fsdp import full_models
    from common.validation_images import validation_images

    def validate(step, images=True):  # the held-out loss and images of the EMA weights (what gets exported)
        full = full_models(accelerator, {family.DENOISER: denoiser})  # (under FSDP: gathered on every process)
        model = full[family.DENOISER]
        with ema_weights(ema, model):
            if held_out_loss is not None:
                held_out_loss.log(step, model, lambda x, t, cond: family.denoise(model, x, t, cond, guidance),
                                  lambda ids: condition(captions.held_out_ids[ids], ids, held_out))
            if not (images and args.validation_prompt):
                return []
            pipe_parts = {**{k: v for k, v in parts.items() if k != "scheduler"}, **full}
            return validation_images(args, accelerator, family, pipe_parts, noise_scheduler, step,
                                     sizes=validation_sizes(sizes, args.resolution), embeddings=condition.cached())

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
                    noised = objective(sample_latents(params, latent_config, args.vae_encode_mode))  # input, target
                    cond = condition(captions.pick(batch["index"], epoch), batch["index"], train_data)
                    model_pred = family.denoise(denoiser, noised.noisy, noised.timesteps, cond, guidance)
                    loss = objective.losses(model_pred, noised).mean()
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
                    ema.step(denoiser.parameters())
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
        final = full_models(accelerator, {family.DENOISER: denoiser}, main_only=True)
        if accelerator.is_main_process:
            import diffusers

            from common.sampling_defaults import model_snippet

            with ema_weights(ema, final[family.DENOISER]):
                saved = {**{name: part.to(torch.float32) if name.startswith("text_encoder") and part is not None
                            else part for name, part in parts.items()}, **final}  # text encoders in fp32, as loaded
                pipe = getattr(diffusers, family.PIPELINE)(**saved, **family.PIPELINE_EXTRAS)
                pipe.save_pretrained(args.output_dir)
                for name in family.TEXT_ENCODERS:  # CLIPs' keys under text_model. (ComfyUI's CLIP loader reads those)
                    add_text_model_prefix(os.path.join(args.output_dir, name))
                if args.save_model_as == "safetensors":
                    save_single_file(pipe, single_file_path(args.output_dir))
            base, name = args.pretrained_model_name_or_path, family.DENOISER
            write_model_card(
                args.output_dir, f"{family.NAME} {name} trained with train_text_to_image.py",
                f"The {name} of `{base}`{f' (fresh, from a {name} config)' * bool(args.denoiser_config)} trained on "
                f"`{args.dataset_name or args.train_data_dir}` for {global_step} optimizer steps; the other "
                f"components are the base's. Sample: `python sample.py --model {args.output_dir} --prompt \"...\"`.",
                {"base model": f"`{base}`", name: f"from --{name}_config" if args.denoiser_config else "the base's",
                 "resolution": f"{args.resolution} px", "objective": objective.describe(),
                 "EMA weights": ema is not None, "steps": global_step,
                 "final loss": f"{last_loss:.4f}" if last_loss is not None else "n/a",
                 "validation prompts": "; ".join(args.validation_prompt) or "none"},
                # what sample.py then draws: the training size and T5 length, the base's steps and guidance
                model_snippet(family, args.output_dir, (args.validation_prompt or [captions.prompts[-1]])[0],
                              {"resolution": args.resolution, "max_sequence_length": args.max_sequence_length,
                               "num_frames": (args.clip_frames or [None])[0]},  # (a video base's training clips)
                              base=base, unconditional=args.caption_dropout_prob > 0, cache_dir=args.cache_dir),
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


def read_denoiser_config(args):
    """--unet_config / --transformer_config: a json file or a folder holding config.json -> the config dict, or
    None."""
    if args.unet_config and args.transformer_config:
        raise UserError("--unet_config and --transformer_config: give one (the base's denoiser is one or the other)")
    flag = "--unet_config" if args.unet_config else "--transformer_config"
    path = args.unet_config or args.transformer_config
    if not path:
        return None
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    config = read_json_config(file, flag)
    if not isinstance(config.get("in_channels"), int) and "cross_attention_dim" not in config:
        raise UserError(f"{flag}: '{file}' is not a denoiser config (no in_channels or cross_attention_dim)")
    return config


def check_denoiser_flag(args, family):
    """The config flag must name the base's kind of denoiser."""
    for flag, kind in (("unet_config", "unet"), ("transformer_config", "transformer")):
        if getattr(args, flag) and family.DENOISER != kind:
            raise UserError(f"--{flag}: a {family.NAME} base has a {family.DENOISER}, not a {kind}: give "
                            f"--{family.DENOISER}_config")


def check_save_model_as(args, family):
    """The single-file layout holds SD 1.x/2.x and SDXL UNets; a local base's configs are checked against it before
    training (a hub base's when it is written)."""
    if not family.SINGLE_FILE:
        raise UserError(f"--save_model_as safetensors: the single-file checkpoint holds SD 1.x/2.x and SDXL bases, not "
                        f"{family.NAME}; leave it out (the pipeline folder loads in diffusers)")
    check_single_file_base(args.pretrained_model_name_or_path, "--save_model_as safetensors", args.denoiser_config)


def check_denoiser_fits(config, base, family, revision=None, cache_dir=None):
    """A fresh denoiser must take the base's latents and text embeddings (family.fit_problems); checked on the
    folder's configs before any weight loads (for a hub base, once its configs are fetched)."""
    from common.base_models import component_configs

    configs = component_configs(base, ("vae", *family.TEXT_ENCODERS), revision, cache_dir)
    for key, has, wants, what in family.fit_problems(config, configs):
        raise UserError(f"--{family.DENOISER}_config: {key} is {has}, but {what} of '{base}' is {wants}; set "
                        f"\"{key}\": {wants} in the config")


if __name__ == "__main__":
    run(main, parse_args)
