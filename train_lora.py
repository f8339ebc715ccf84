#!/usr/bin/env python
"""Fine-tune a text-to-image diffusion model with LoRA (peft) on captioned images, the accelerate way.

SD 1.x/2.x and XL (a UNet on DDPM noise), SD 3, Flux.1, FLUX.2, Qwen-Image, Z-Image, Wan (video clips: --num_frames;
A14B's experts: --wan_expert) (transformers trained by flow matching): the base's model_index.json names its family,
whose module (common/families/) loads it, embeds prompts (SDXL: two CLIPs, pooled embedding, each image's size "time
ids"; SD3: two CLIPs and T5; Flux.1: CLIP pooled, T5, packed latents, guidance input; the newer bases: an LLM's hidden
states) and calls its denoiser. The denoiser frozen, LoRA (init_lora_weights="gaussian") on its attention projections
(optionally on the CLIP text encoders too), trained on the family's objective (common/objectives.py; the other
objective's flags are refused); frozen weights in fp16/bf16, LoRA in fp32; latents (--cache_latents) and prompt
embeddings computed once, then the text encoders leave the accelerator; caption dropout, an EMA of the LoRA weights
(--use_ema: what gets exported), validation images, a held-out loss, resumable checkpoints. Also DreamBooth with prior
preservation (common/dreambooth.py: class images the base draws once), a loss mask per image (--masked_loss,
common/loss_masks.py), edit LoRAs from reference images paired by name (--control_data_dir: FLUX.1 Kontext, FLUX.2;
common/references.py, `make train-edit-lora`), and LyCORIS's LoHa and LoKr instead of LoRA (--adapter, peft). Writes
pytorch_lora_weights.safetensors (`pipe.load_lora_weights(output_dir)`; LoHa/LoKr: peft_adapter_weights.safetensors,
which sample.py loads through peft), beside it pytorch_lora_weights_ui.safetensors for ComfyUI, Forge and A1111, a model
card, and lora_info.json, from which sample.py finds the base model.

Defaults suit a real base: --resolution is the base's native size (its VAE's sample_size, 512 for SD 1.5),
--learning_rate 1e-4, --train_batch_size 16, as in diffusers' LoRA example.

Built-in demo (CPU, about a minute): a style LoRA, "red ink on paper", on a tiny digits base shipped in assets/
(white-on-black digits only: tiny-flux-digits, Flux.1's architecture, or BASE=assets/tiny-sd-digits), then its
measured effect and a side-by-side picture (demo/style_report.py); the Makefile passes the demo's data and settings:
    make train-lora                              # (the script's own default base is assets/tiny-sd-digits)
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
Flux.1-dev (bf16 base, gradient checkpointing; on a smaller GPU --quantize_base nf4 or fp8, --blocks_to_swap N):
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_lora.py \
        --pretrained_model_name_or_path black-forest-labs/FLUX.1-dev <the same data flags> --resolution 1024 \
        --train_batch_size 1 --gradient_accumulation_steps 4 --mixed_precision bf16 --cache_latents \
        --gradient_checkpointing --rank 16 --learning_rate 1e-4 --output_dir outputs/lora-flux
DreamBooth with prior preservation (diffusers' flags; the base draws the missing class images once):
    <the launch above> --instance_data_dir dog --instance_prompt "a photo of sks dog" --with_prior_preservation \
        --class_data_dir dog-class --class_prompt "a photo of a dog" --num_class_images 200   (make train-dreambooth)
Then:  python sample.py --model outputs/lora-naruto --prompt "a girl with pink hair"

A copy also needs the module of its base's family, one of common/families/*.py (sd.py for Stable Diffusion 1.x/2.x;
FLUX.2 dev: flux2.py with flux2_klein.py).
Copy with: common/__init__.py, common/args.py, common/base_models.py, common/block_swap.py, common/buckets.py, common/caption_files.py, common/checkpoints.py, common/cli.py, common/deepspeed_engine.py, common/diffusion.py, common/distributed.py, common/drawing.py, common/dreambooth.py, common/families/__init__.py, common/float8_base.py, common/fsdp.py, common/image_data.py, common/lora_adapters.py, common/lora_files.py, common/lora_metadata.py, common/loss_masks.py, common/objectives.py, common/optimizers.py, common/preemption.py, common/prompts.py, common/references.py, common/reporting.py, common/sampling_defaults.py, common/sgm_names.py, common/training.py, common/ui_lora.py, common/vae.py, common/validation_images.py, common/validation_loss.py, common/video.py
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
    add_mask_args,
    add_training_args,
    check_bucket_args,
    check_common_args,
    make_parser,
    positive_float,
    positive_int,
    probability,
)
from common.base_models import SHIPPED_BASE, add_base_model_args, check_base_args, lora_dtypes, size_factor
from common.block_swap import add_block_swap_args, check_block_swap
from common.buckets import batching, bucket_images, check_bucket_resolution, validation_sizes
from common.caption_files import caption_folder_reader, check_caption_args
from common.checkpoints import agreed_checkpoint, detect_shared_output_dir, read_checkpoint_info, resolve_resume
from common.cli import quiet_loading_bars, run
from common.dreambooth import add_dreambooth_args, check_dreambooth_args
from common.fsdp import full_models, uniform_dtype
from common.lora_adapters import add_adapter_args, check_lora_args, check_resumed_lora, comma_list, is_adapter_weight
from common.lora_files import LORA_EMA_STATE, lora_info
from common.loss_masks import base_prediction, check_mask_args, latent_mask, masked_prior_losses
from common.objectives import add_objective_args
from common.optimizers import OPTIMIZERS, add_optimizer_args, check_optimizer_args
from common.references import add_reference_args, check_reference_args, paired_references
from common.training import add_ema_args, check_resumed_ema, ema_weights, set_cuda_backends
from common.validation_images import add_validation_image_args, check_validation_image_args, validation_images
from common.video import add_video_args


def parse_args(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    g = add_data_args(parser, resolution=None)
    add_caption_args(g, caption_dropout_prob=0.0)
    add_latent_cache_args(g)
    add_bucket_args(g)
    add_video_args(g, experts=True)  # --num_frames, --frame_stride, --wan_expert (video bases: common/video.py)
    add_mask_args(g)
    add_reference_args(parser)  # edit LoRAs: --control_data_dir (common/references.py)
    add_dreambooth_args(parser)
    g = parser.add_argument_group("model")
    add_base_model_args(g, SHIPPED_BASE)
    g.add_argument("--quantize_base", default=None, choices=["nf4", "fp8"],
                   help="nf4 (QLoRA): the frozen denoiser in 4-bit NF4 (bitsandbytes through diffusers' "
                        "BitsAndBytesConfig; CUDA only, `make install-extras`); fp8: its transformer blocks' Linear "
                        "weights in float8_e4m3fn with a scale per row, cast up layer by layer (any device).")
    add_block_swap_args(g)  # --blocks_to_swap
    add_objective_args(g)
    g = parser.add_argument_group("LoRA")
    g.add_argument("--rank", type=positive_int, default=8,
                   help="LoRA rank r (LoHa: of each of its two products; LoKr: of its large factor's product).")
    g.add_argument("--lora_alpha", type=positive_float, default=None,
                   help="The update's scale is alpha/r, LoRA's, LoHa's and LoKr's alike; default alpha = r.")
    g.add_argument("--lora_dropout", type=probability, default=0.0)
    g.add_argument("--target_modules", type=comma_list, default=None,
                   help="Denoiser modules that get LoRA (names, name suffixes or wildcard patterns); default: the "
                        "family's attention projections (SD: to_k,to_q,to_v,to_out.0; SD3 and Flux.1 also the text "
                        "stream's add_*_proj and to_add_out; FLUX.2 diffusers' set, single_transformer_blocks.*...).")
    g.add_argument("--use_dora", action="store_true",
                   help="DoRA: weight-decomposed LoRA (exact in diffusers; ComfyUI and Forge apply it approximately, "
                        "A1111 not at all: docs/train_lora.md).")
    add_adapter_args(g)  # --adapter lora|loha|lokr, --lokr_factor
    g.add_argument("--train_text_encoder", action="store_true",
                   help="Also LoRA on the CLIP text encoders' attention projections (SDXL and SD3: both CLIPs; "
                        "Flux.1: its CLIP; never T5, nor the LLMs of FLUX.2, Qwen-Image and Z-Image).")
    g.add_argument("--text_encoder_lr", type=positive_float, default=None, help="Default: --learning_rate (why: docs).")
    g = parser.add_argument_group("EMA of the LoRA weights")
    add_ema_args(g)
    g.add_argument("--offload_ema", action="store_true",
                   help="Keep the EMA on the CPU, moving it to the device only for its update (same results, less "
                        "device memory).")
    add_validation_image_args(parser.add_argument_group("validation"), validation_steps=100)
    add_training_args(parser, output_dir="outputs/lora", learning_rate=1e-4, train_batch_size=16, num_train_epochs=5,
                      lr_scheduler="constant", lr_warmup_steps=0)
    add_optimizer_args(parser)
    add_checkpoint_args(parser, checkpointing_steps=500)
    add_logging_args(parser, project_name="train_lora")
    args = parser.parse_args(argv)
    check_dreambooth_args(args)  # (--instance_data_dir: the training images)
    if args.instance_data_dir is None:
        check_caption_args(args)
    check_common_args(args)
    check_optimizer_args(args)
    family = check_base_args(args, "train_lora.py trains")  # None for a hub base: checked once it is fetched
    args.lora_alpha = args.lora_alpha or args.rank
    check_bucket_args(args)
    check_mask_args(args)  # --masked_loss: each image's mask file (or alpha channel)
    check_reference_args(args, family)  # each training image's reference images, by name
    if args.buckets == "auto" and family:  # a hub base: once loaded
        check_bucket_resolution(args.resolution, size_factor(args.pretrained_model_name_or_path, family))
    check_lora_args(args, family)  # (a hub base: its family's defaults in main)
    resume_path = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume_path:  # a checkpoint of another LoRA shape would fail (or worse, half-load) deep inside load_state
        check_resumed_lora(resume_path, read_checkpoint_info(resume_path), lora_info(args))
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
    set_cuda_backends(args.allow_tf32, args.allow_cudnn_attention)
    # <domain: weight dtypes>
    # Read the accelerator's precision, not the flag: an accelerate yaml may ask for fp16 too.
    weight_dtype, lora_dtype = lora_dtypes(accelerator.mixed_precision)
    # </domain>

    # 2. Data: images decoded once; each image's captions as indices into the distinct prompts ("" for dropout).
    # <domain: data>
    from common.base_models import base_resolution, check_family_args
    from common.dreambooth import PriorLoss, class_images, instance_reader, prior_batching, with_class_images
    from common.families import load_family, read_model_index
    from common.image_data import CachedLatents, Captions, collate_batch, image_datasets, require_columns
    from common.validation_loss import HeldOutLoss, load_with_validation

    path, flag = args.pretrained_model_name_or_path, "--pretrained_model_name_or_path"
    family = load_family(path, flag, args.revision, args.cache_dir, expert=args.wan_expert)  # model_index.json
    check_family_args(args, family)  # (a hub base's: now that its family is known)
    check_lora_args(args, family)
    check_block_swap(args, family, accelerator)  # (swap, fp8: not under DeepSpeed or FSDP; swap: at most the blocks)
    check_validation_image_args(args, family)
    # The training size: the base's native one unless given. Far below it, what the LoRA learns shows little in
    # images at the size the base samples at.
    args.resolution, native = base_resolution(path, args.resolution, family, args.revision, args.cache_dir)
    if native and args.resolution * 2 < native:
        logger.warning(f"--resolution {args.resolution} is less than half the base's native {native} px: what the "
                       f"LoRA learns will show little at the base's own size (leave --resolution out to train at "
                       f"{native})")
    # held out: --validation_split's images, for val/loss; a folder without metadata: .txt captions
    read_folder = instance_reader(args) if args.instance_data_dir else caption_folder_reader(args)
    train_ds, held_out_ds = load_with_validation(args, read_folder=read_folder)
    require_columns(train_ds, image_column=args.image_column, caption_column=args.caption_column)
    refs, held_out_ds = paired_references(args, family, train_ds, held_out_ds)  # (edit LoRAs) held out: with theirs
    n_instance = len(train_ds)
    if args.with_prior_preservation:  # DreamBooth: class images (the base draws the missing ones) after the instances
        class_paths = class_images(args, accelerator, family, weight_dtype, logger)
        train_ds, n_instance = with_class_images(train_ds, class_paths, args)
    # each image's captions as indices into the distinct prompts; the validation prompts are embedded with them
    captions = Captions(args, train_ds, held_out_ds, extra=args.validation_prompt, prefixed=n_instance)

    sizes = held_out_sizes = None  # --buckets auto: each image's (height, width)
    if args.buckets == "auto":
        sizes, held_out_sizes, table = bucket_images(args, train_ds, held_out_ds, size_factor(
            path, family, args.revision, args.cache_dir))
        logger.info(f"aspect-ratio buckets at {args.resolution} px:\n{table}")
    with accelerator.main_process_first():  # (SDXL: each image's original size too, for its time ids)
        train_data, held_out = image_datasets(args, train_ds, held_out_ds, sizes, held_out_sizes, family.TIME_IDS,
                                              masked_rows=n_instance, references=refs.rows)  # (class images: no mask)
    # </domain>

    # 3. Model: the base frozen in the weight dtype (the VAE in fp32: fp16 decodes overflow), LoRA adapters in fp32.
    # <domain: model>
    from diffusers.training_utils import EMAModel, cast_training_params

    from common.base_models import lazy_latent_cache, load_parts, offload_idle_models, unused_parts
    from common.lora_adapters import add_lora, place_frozen_denoiser, quantization_config
    from common.objectives import make_objective
    from common.prompts import Conditioning
    from common.vae import encode_params, sample_latents

    quiet_loading_bars()
    quantization = quantization_config(args, weight_dtype, accelerator.device)  # --quantize_base nf4 (QLoRA)
    parts = load_parts(family, path, dtype=weight_dtype, revision=args.revision, variant=args.variant,
                       cache_dir=args.cache_dir, skip=unused_parts(family, args),
                       quantization_config=quantization)
    noise_scheduler, vae, denoiser = parts["scheduler"], parts["vae"], parts[family.DENOISER]
    args.max_sequence_length = family.text_length(parts, args.max_sequence_length, training=True)  # T5's, if any
    if args.prediction_type:
        noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    objective = make_objective(family, noise_scheduler, args)  # what the denoiser learns (common/objectives.py)
    text_encoders = {name: parts[name] for name in family.TEXT_ENCODERS if parts[name] is not None}
    for model in (vae, *text_encoders.values()):
        model.requires_grad_(False).to(accelerator.device)
    denoiser.requires_grad_(False)
    if quantization is None and not (args.quantize_base or args.blocks_to_swap):  # (else: place_frozen_denoiser)
        denoiser.to(accelerator.device)
    # a guidance-distilled base (Flux.1-dev) takes the guidance as an input; --guidance_scale sets it
    guidance = args.guidance_scale if denoiser.config.get("guidance_embeds") else None
    trained = add_lora(family, denoiser, text_encoders, args)  # what trains, by checkpoint subfolder
    place_frozen_denoiser(family, denoiser, args, weight_dtype, accelerator.device)  # fp8, block swap, device
    cast_training_params(list(trained.values()), dtype=lora_dtype)
    uniform_dtype(accelerator, trained.values(), lora_dtype)  # (FSDP: the frozen weights too)
    trainable = {f"{name}.{n}": p for name, m in trained.items() for n, p in m.named_parameters() if p.requires_grad}
    assert all(is_adapter_weight(name, args.adapter) for name in trainable), "only adapter weights may train"
    num_trainable = sum(p.numel() for p in trainable.values())
    ema, ema_params = None, list(trainable.values())  # the EMA averages the trainable LoRA weights only, in fp32
    if args.use_ema:
        ema = EMAModel(ema_params, decay=args.ema_max_decay, use_ema_warmup=True, inv_gamma=args.ema_inv_gamma,
                       power=args.ema_power, foreach=True)
        ema.to("cpu" if args.offload_ema else accelerator.device, torch.float32)
    if args.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
        for name in trained if args.train_text_encoder else ():
            if name != family.DENOISER:
                trained[name].gradient_checkpointing_enable()

    # Speed: what is frozen is computed once. Text: every distinct prompt embedded once (kept on the CPU), unless the
    # text encoders train; the pipeline samples the unconditional branch of some families (SDXL) with zeros, and
    # caption dropout trains on them.
    condition = Conditioning(family, parts, captions.prompts, args.max_sequence_length, accelerator.device,
                             family.empty_prompt_zeros(read_model_index(path, flag, args.revision, args.cache_dir)),
                             cache=not args.train_text_encoder)

    latent_config = family.latent_config(vae)  # the VAE's latents -> the denoiser's (common/vae.py)

    def encode(pixel_values):  # -> parameters (mean, log-variance) of the VAE's latent distribution, in fp32
        return encode_params(vae, pixel_values)

    held_out_loss = None if held_out is None else HeldOutLoss(  # keyed by image: SDXL's time ids are the image's
        held_out, encode, latent_config, list(range(len(held_out))), objective, accelerator, args.seed,
        args.train_batch_size)
    if held_out is not None and len(held_out):  # their references' latents (Wan I2V: condition), on the VAE's device
        refs.held_out(torch.arange(len(held_out)), held_out, encode, latent_config)
    loader_batches = batching(refs.batch_keys(sizes), args.train_batch_size, args.seed, train_data)  # by bucket
    prior = None  # DreamBooth: each batch instance images, then as many class images; the loss in two parts
    if args.with_prior_preservation:
        loader_batches = prior_batching(n_instance, len(train_ds) - n_instance, args.train_batch_size, args.seed,
                                        train_data)
        prior = PriorLoss(n_instance, args.prior_loss_weight, accelerator.device)
        logger.info(f"prior preservation: each batch {args.train_batch_size} of the {n_instance} instance images, then "
                    f"as many of the {len(train_ds) - n_instance} class images")
    if args.cache_latents:
        lazy = lazy_latent_cache(args, accelerator.device)  # (each image when a batch first needs it)
        logger.info(f"caching the latents of {len(train_data)} images{' and their mirror images' * args.random_flip}"
                    f"{' as the batches first need them' * lazy}")
        train_data = CachedLatents(train_data, encode, args.vae_encode_batch_size, lazy,
                                   refs.cached_condition(encode, latent_config, accelerator.device))  # (Wan I2V)
    offload_idle_models(logger, args, vae, list(text_encoders.values()), text_cached=condition.cache is not None,
                        family=family)  # (Wan 2.1 I2V: its image encoder with the VAE)
    train_dataloader = torch.utils.data.DataLoader(train_data, num_workers=args.dataloader_num_workers,
                                                   collate_fn=collate_batch, **loader_batches)
    check_same_data(accelerator, training_images=len(train_data), batches=len(train_dataloader),  # (machines' copies)
                    held_out_images=0 if held_out is None else len(held_out))
    # </domain>

    # 4. Optimizer on the LoRA weights (the text encoder's at its own LR); schedule counted in optimizer steps.
    # <domain: parameter groups>
    lr_groups = {name: args.text_encoder_lr or args.learning_rate for name in trained if name != family.DENOISER}
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
    from common.lora_files import load_lora_ema, load_lora_state, save_lora_ema, save_lora_state, save_lora_weights
    from common.lora_metadata import lora_card, lora_metadata

    denoiser = models[0]
    condition.use_encoders(zip(list(trained)[1:], models[1:]))  # the text encoders that train: the prepared ones
    info = lora_info(args)
    checkpoint_info = info  # in checkpoint_info.json too: a resume checks its LoRA settings against them
    base_version = family.base_metadata(unwrapped[family.DENOISER].config,
                                        noise_scheduler.config.get("prediction_type"))

    def file_metadata(step):  # the LoRA files' header (max_train_steps: its value when they are written)
        return lora_metadata(args, info, base_version, step, max_train_steps, len(train_data),
                             accelerator.mixed_precision, family.TEXT_LORA_TARGETS, OPTIMIZERS[args.optimizer][0])

    def save_extra(folder, models):  # the checkpoint's pytorch_lora_weights: what would be exported now (EMA)
        with ema_weights(ema, ema_params):
            save_lora_weights(folder, family, models, info, metadata=file_metadata(global_step))
        if ema is not None:  # lora_ema.safetensors + lora_ema.json (unet/ etc.: the raw adapters)
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
    total_batch_size *= 2 if prior else 1  # (DreamBooth: as many class images as instance images)
    logger.info(f"{len(train_data)} training images at {args.resolution} px, {captions.distinct} distinct captions, "
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

    # 7. The loop: latents noised by the family's objective -> the denoiser (with LoRA) predicts its target.
    progress = tqdm(total=max_train_steps, initial=global_step, desc="steps",
                    disable=not accelerator.is_local_main_process)
    start_time, start_step = time.time(), global_step
    loss_sum, last_loss, metrics = torch.zeros((), device=accelerator.device), None, {}
    skipped_steps = 0
    group_names = [group["name"] for group in optimizer.param_groups]
    # <domain: validation>
    def validate(step, images=True):  # the held-out loss and images of the current LoRA (its EMA with --use_ema)
        full = full_models(accelerator, dict(zip(trained, models)))  # (under FSDP: gathered on every process)
        model = full[family.DENOISER]
        with ema_weights(ema, ema_params):
            if held_out_loss is not None:
                held_out_loss.log(step, model, lambda x, t, cond: family.denoise(model, x, t, cond, guidance),
                                  lambda ids: {**condition(captions.held_out_ids[ids], ids, held_out),
                                               **refs.held_out(ids, held_out, encode, latent_config)})
            if not (images and args.validation_prompt):
                return []
            pipe_parts = {**{k: v for k, v in parts.items() if k != "scheduler"}, **full}
            return validation_images(args, accelerator, family, pipe_parts, noise_scheduler, step,
                                     sizes=validation_sizes(sizes, args.resolution), embeddings=condition.cached(),
                                     references=refs.validation)  # (edit LoRAs: reference | base | LoRA)

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
                    noised = objective(sample_latents(params, latent_config, args.vae_encode_mode))  # input, target
                    cond = condition(captions.pick(batch["index"], epoch), batch["index"], train_data)
                    cond.update(refs(batch, encode, latent_config))  # edit LoRAs: the reference images' latents
                    model_pred = family.denoise(denoiser, noised.noisy, noised.timesteps, cond, guidance)
                    mask = latent_mask(batch.get("mask"), model_pred)  # --masked_loss: on the latent grid
                    losses = objective.losses(model_pred, noised, mask)  # per image
                    if args.masked_prior_preservation_weight:  # outside the masks: the base's own prediction
                        base_pred = base_prediction(unwrapped[family.DENOISER], lambda: family.denoise(
                            denoiser, noised.noisy, noised.timesteps, cond, guidance))
                        losses = losses + args.masked_prior_preservation_weight * masked_prior_losses(
                            objective, model_pred, base_pred, noised, mask)
                    loss = prior(losses, batch["index"], accelerator) if prior else losses.mean()  # DreamBooth: 2 parts
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
                    logs.update(prior.logs(accelerator) if prior else {})
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

        # 9. Save: the LoRA in diffusers' format and the UIs', final images, a model card and the run summary.
        accelerator.wait_for_everyone()
        # <domain: the final validation, the LoRA and its model card>
        images = validate(global_step) if validating else []
        final = full_models(accelerator, dict(zip(trained, models)), main_only=True)
        if accelerator.is_main_process:
            if ema is not None:  # the trained weights themselves, beside the EMA: pipe.load_lora_weights(".../raw")
                save_lora_weights(os.path.join(args.output_dir, "raw"), family, final, {**info, "ema_weights": False},
                                  metadata=file_metadata(global_step))
            with ema_weights(ema, ema_params):
                save_lora_weights(args.output_dir, family, final, info, metadata=file_metadata(global_step))
            write_model_card(args.output_dir, *lora_card(args, info, family, global_step, last_loss, ema is not None,
                                                         (args.validation_prompt or [captions.prompts[-1]])[0]),
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


if __name__ == "__main__":
    run(main, parse_args)
