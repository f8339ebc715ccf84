#!/usr/bin/env python
"""Train an image (optionally image+text) classifier the accelerate way.

A complete accelerate script, after accelerate's examples/complete_cv_example.py: mixed precision, accumulation,
TensorBoard/wandb, per-module learning rates, linear warm-up then cosine, gradient clipping, evaluation with
gather_for_metrics on a validation split carved from train, best-model saving, test-split metrics at the end,
resumable checkpoints, and `save_pretrained` (so `pipeline("image-classification")` loads the result).

Built-in demo (scikit-learn's handwritten digits, a small ResNet from scratch, CPU):
    make train-classifier
One GPU:
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_classifier.py --mixed_precision bf16
Several GPUs (or `make train-classifier CONFIG=accelerate_configs/multi_gpu.yaml`):
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml train_classifier.py
A hub model and dataset:
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_classifier.py \
        --model_name_or_path microsoft/resnet-18 --dataset_name uoft-cs/cifar10 --image_column img \
        --resolution 224 --learning_rate 1e-4 --lr_groups resnet=2e-5 --mixed_precision fp16
Image + text (the modules image_model, text_model and head take their own learning rates):
    ... --text_column text --text_model_name_or_path google-bert/bert-base-uncased \
        --lr_groups image_model=2e-5,text_model=4e-5

Copy with: common/__init__.py, common/args.py, common/caption_files.py, common/checkpoints.py, common/classifier_metrics.py, common/cli.py, common/deepspeed_engine.py, common/distributed.py, common/fsdp.py, common/image_data.py, common/image_text_model.py, common/loss_masks.py, common/optimizers.py, common/preemption.py, common/reporting.py, common/training.py, common/video.py
"""  # noqa: E501 (the copy list stays one line, for grep)
import argparse
import math
import os
import time

from common.args import (
    add_checkpoint_args,
    add_data_args,
    add_logging_args,
    add_training_args,
    check_common_args,
    check_model_folder,
    make_parser,
    positive_int,
)
from common.checkpoints import agreed_checkpoint, detect_shared_output_dir, read_checkpoint_info, resolve_resume
from common.cli import UserError, first_line, quiet_loading_bars, run
from common.optimizers import add_optimizer_args, check_optimizer_args
from common.training import parse_lr_groups, set_cuda_backends


def parse_args(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    data = add_data_args(parser, resolution=32)
    data.add_argument("--train_val_split", type=float, default=0.1,
                      help="Share of the train split held out (fixed seed) as the validation split: the per-epoch "
                           "evaluation and the choice of best_model/. --eval_split is the test split, reported at the "
                           "end for the final model and best_model/ (nothing when the dataset has no such split).")
    g = parser.add_argument_group("model")
    g.add_argument("--label_column", default="label", help="Column that holds the class of each image.")
    g.add_argument("--model_name_or_path", default=None,
                   help="Pretrained image classifier (hub id or folder); default: a small ResNet from scratch.")
    g.add_argument("--text_column", default=None, help="Add a text branch fed with this column.")
    g.add_argument("--text_model_name_or_path", default=None, help="Text encoder for --text_column.")
    g.add_argument("--max_text_length", type=positive_int, default=32)
    g.add_argument("--lr_groups", type=parse_lr_groups, default={},
                   help="Per-module learning rates, MODULE_PREFIX=LR,...; the rest use --learning_rate.")
    g.add_argument("--metric_for_best_model", default="accuracy", choices=["accuracy", "f1"])
    g.add_argument("--eval_batch_size", type=positive_int, default=256)
    g.add_argument("--channels_last", action=argparse.BooleanOptionalAction, default=True,
                   help="Convolution weights in channels-last memory format (the usual layout for convnets under mixed "
                        "precision on GPUs; faster in the CPU demo too). --no-channels_last: PyTorch's default layout.")
    add_training_args(parser, output_dir="outputs/classifier", learning_rate=3e-3, train_batch_size=64,
                      num_train_epochs=15, lr_scheduler="warmup_cosine", lr_warmup_steps=30, adam_weight_decay=0.05)
    add_optimizer_args(parser)
    add_checkpoint_args(parser, checkpointing_steps=500)
    add_logging_args(parser, project_name="train_classifier")
    args = parser.parse_args(argv)
    check_common_args(args)
    check_optimizer_args(args)
    resolve_resume(args.resume_from_checkpoint, args.output_dir)  # a wrong checkpoint path: before torch loads
    if not 0 < args.train_val_split < 1:
        parser.error(f"--train_val_split must be between 0 and 1 (exclusive), not {args.train_val_split}")
    if (args.text_column is None) != (args.text_model_name_or_path is None):
        parser.error("--text_column and --text_model_name_or_path go together")
    if args.model_name_or_path:
        check_model_folder(args.model_name_or_path, "--model_name_or_path", "config.json", "an image classifier")
    if args.text_model_name_or_path:
        check_model_folder(args.text_model_name_or_path, "--text_model_name_or_path", "config.json", "a text model")
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

    # 2. Data: labels -> ids, images decoded once; text tokenized once. eval: the validation split carved from train
    #    (per-epoch metrics, best_model/); test: --eval_split, evaluated only at the end (None if the dataset lacks it).
    # <domain: data>
    from common.image_data import (
        ImageDataset,
        collate_batch,
        label_ids,
        label_names,
        load_image_dataset,
        require_columns,
    )

    train_ds, eval_ds, test_ds = load_image_dataset(args, validation_split=args.train_val_split)
    text_columns = {"text_column": args.text_column} if args.text_column else {}
    for ds in [ds for ds in (train_ds, eval_ds, test_ds) if ds is not None]:
        require_columns(ds, image_column=args.image_column, label_column=args.label_column, **text_columns)
    labels = label_names(train_ds, args.label_column)

    tokenizer = None
    if args.text_column:
        from transformers import AutoModel, AutoTokenizer

        from common.image_text_model import ImageTextClassifier

        tokenizer = AutoTokenizer.from_pretrained(args.text_model_name_or_path)

    def columns(ds, split):
        cols = {"labels": label_ids(ds, args.label_column, labels, split)}
        if tokenizer is not None:
            tokens = tokenizer(list(ds[args.text_column]), padding="max_length", truncation=True,
                               max_length=args.max_text_length, return_tensors="pt")
            cols.update(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        return cols

    # </domain>

    # 3. Model: a pretrained classifier with a new head, or a small ResNet from scratch; optional text branch.
    # <domain: model>
    from transformers import AutoImageProcessor, AutoModelForImageClassification, ResNetConfig, ResNetModel
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    from common.fsdp import is_fsdp

    quiet_loading_bars(["transformers"])

    id2label = dict(enumerate(labels))
    mean = std = [0.5, 0.5, 0.5]
    if args.model_name_or_path:
        try:
            pretrained_processor = AutoImageProcessor.from_pretrained(args.model_name_or_path)
            mean, std = pretrained_processor.image_mean, pretrained_processor.image_std
        except OSError:
            pass
    if args.text_column:
        image_model = (AutoModel.from_pretrained(args.model_name_or_path) if args.model_name_or_path
                       else ResNetModel(small_resnet_config(ResNetConfig, len(labels))))
        text_model = AutoModel.from_pretrained(args.text_model_name_or_path)
        model = ImageTextClassifier(image_model, text_model, id2label)
    elif args.model_name_or_path:
        try:
            model = AutoModelForImageClassification.from_pretrained(
                args.model_name_or_path, num_labels=len(labels), id2label=id2label,
                label2id={v: k for k, v in id2label.items()}, ignore_mismatched_sizes=True)
        except (OSError, ValueError) as err:
            raise UserError(f"--model_name_or_path: cannot load an image classifier from "
                            f"'{args.model_name_or_path}': {first_line(err)}") from None
    else:
        model = AutoModelForImageClassification.from_config(small_resnet_config(ResNetConfig, len(labels), id2label))
    if args.channels_last and is_fsdp(accelerator):  # FSDP's sharded checkpoints take contiguous weights only
        logger.info("FSDP: the weights stay in PyTorch's default layout (--channels_last left out)")
    elif args.channels_last:  # 4-D weights only: a ViT or a text model is left as it is
        model.to(memory_format=torch.channels_last)
    processor = ViTImageProcessorPil(size={"height": args.resolution, "width": args.resolution},
                                     image_mean=list(mean), image_std=list(std))

    def forward(batch):
        if tokenizer is not None:
            return model(batch["pixel_values"], batch["input_ids"], batch["attention_mask"])
        return model(pixel_values=batch["pixel_values"]).logits

    with accelerator.main_process_first():
        train_data = ImageDataset(train_ds, args.image_column, args.resolution, center_crop=args.center_crop,
                                  random_flip=args.random_flip, mean=mean, std=std,
                                  columns=columns(train_ds, "training"), seed=args.seed)
        eval_data = ImageDataset(eval_ds, args.image_column, args.resolution, center_crop=True, mean=mean, std=std,
                                 columns=columns(eval_ds, "validation"))
        test_data = None if test_ds is None else ImageDataset(
            test_ds, args.image_column, args.resolution, center_crop=True, mean=mean, std=std,
            columns=columns(test_ds, "test"))
    train_dataloader = torch.utils.data.DataLoader(
        train_data, batch_size=args.train_batch_size, shuffle=True, num_workers=args.dataloader_num_workers,
        collate_fn=collate_batch, generator=torch.Generator().manual_seed(args.seed))  # own RNG: the global one stays
    eval_dataloader, test_dataloader = [
        None if data is None else torch.utils.data.DataLoader(
            data, batch_size=args.eval_batch_size, num_workers=args.dataloader_num_workers, collate_fn=collate_batch)
        for data in (eval_data, test_data)]
    trained = {"model": model}  # what trains, by checkpoint subfolder
    check_same_data(accelerator, training_images=len(train_data), batches=len(train_dataloader),  # (machines' copies)
                    validation_images=len(eval_data), test_images=0 if test_data is None else len(test_data))
    # </domain>

    # 4. Optimizer on per-module parameter groups; warm-up -> cosine counted in optimizer steps.
    # <domain: parameter groups>
    param_groups = build_param_groups(model, args.learning_rate, args.adam_weight_decay, args.lr_groups)
    # </domain>
    optimizer = build_optimizer(args, param_groups, accelerator.device)  # --optimizer (default: fused AdamW)
    steps_per_epoch, max_train_steps, num_train_epochs = plan_steps(
        math.ceil(len(train_dataloader) / accelerator.num_processes), args.gradient_accumulation_steps,
        args.num_train_epochs, args.max_train_steps)
    lr_scheduler = build_lr_scheduler(args.lr_scheduler, optimizer, args.lr_warmup_steps, max_train_steps,
                                      accelerator.num_processes, args.lr_warmup_start_factor, args.lr_min)

    # 5. prepare, hooks (checkpoints hold the model in from_pretrained form), then the exact step counts.
    *models, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(*trained.values(), optimizer,
                                                                             train_dataloader, lr_scheduler)
    unwrapped = {name: accelerator.unwrap_model(m, keep_torch_compile=False) for name, m in zip(trained, models)}
    trained_params = [p for model in models for p in model.parameters() if p.requires_grad]  # what gets clipped
    # <domain: the prepared models; what a checkpoint holds>
    model = models[0]
    eval_dataloader = accelerator.prepare(eval_dataloader)
    if test_dataloader is not None:
        test_dataloader = accelerator.prepare(test_dataloader)
    register_state_hooks(accelerator, unwrapped)
    best_key = f"best_eval_{args.metric_for_best_model}"
    checkpoint_info = {best_key: None}  # the best validation metric so far: best_model/ is replaced by a better one
    # </domain>
    steps_per_epoch, max_train_steps, num_train_epochs = plan_steps(
        len(train_dataloader), args.gradient_accumulation_steps, args.num_train_epochs, args.max_train_steps)

    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    init_trackers(accelerator, args)
    total_batch_size = args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    # <domain: what this run trains>
    logger.info(f"{len(train_data)} training images, {len(labels)} classes, {accelerator.num_processes} process(es), "
                f"batch {total_batch_size}, {max_train_steps} optimizer steps over {num_train_epochs} epochs")
    # </domain>

    # From here on each process draws its own noise, timesteps and dropout (the models above were initialised alike
    # on every process); resuming restores every process's generators.
    set_seed(args.seed, device_specific=True)

    # 6. Resume: state, the best validation metric so far, then the position in the epoch (the batches already seen
    #    are skipped, not replayed).
    global_step, first_epoch, skip_batches = 0, 0, 0
    resume_path = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume_path:
        load_checkpoint(accelerator, resume_path)
        global_step = checkpoint_step(resume_path)
        # <domain: the best metric so far>
        checkpoint_info[best_key] = read_checkpoint_info(resume_path).get(best_key)
        # </domain>
        first_epoch, skip_batches = resume_position(global_step, steps_per_epoch, args.gradient_accumulation_steps,
                                                    max_train_steps)
        logger.info(f"resumed from {resume_path} at step {global_step}")

    # 7. The loop.
    progress = tqdm(total=max_train_steps, initial=global_step, desc="steps",
                    disable=not accelerator.is_local_main_process)
    start_time, start_step = time.time(), global_step
    loss_sum, last_loss, metrics = torch.zeros((), device=accelerator.device), None, {}
    skipped_steps = 0
    group_names = [group["name"] for group in optimizer.param_groups]
    # <domain: validation>
    def validate(epoch):
        """Validation metrics (gather_for_metrics drops the padding duplicates); best_model/ when they are the best."""
        nonlocal metrics
        metrics = evaluate(model, eval_dataloader, forward, accelerator)
        accelerator.log({f"eval/{k[5:]}": v for k, v in metrics.items()}, step=global_step)
        logger.info(f"epoch {epoch}: validation accuracy {metrics['eval_accuracy']:.4f}, "
                    f"macro-F1 {metrics['eval_f1']:.4f}")
        current, best = metrics[f"eval_{args.metric_for_best_model}"], checkpoint_info[best_key]
        if best is None or current > best:
            checkpoint_info[best_key] = current
            save_model(accelerator, model, processor, tokenizer, os.path.join(args.output_dir, "best_model"))
    # </domain>
    try:
        # <domain: the validation a resumed run owes>
        if resume_path and not skip_batches:  # a checkpoint of an epoch's last step was saved before its evaluation
            validate(first_epoch - 1)
        # </domain>
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
                    logits = forward(batch)
                    loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
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
                global_step += 1
                skipped_steps += not update
                progress.update(1)
                if global_step % args.logging_steps == 0 or global_step == max_train_steps:
                    last_loss = accelerator.reduce(loss_sum, "mean").item()  # mean over processes, on logging steps
                    logs = {"train/loss": last_loss, "epoch": epoch}
                    logs.update({f"lr/{name}": group["lr"] for name, group in zip(group_names, optimizer.param_groups)})
                    # <domain: more to log>
                    logs["train/batch_accuracy"] = (logits.argmax(-1) == batch["labels"]).float().mean().item()
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
                # 8. Validate: at each epoch's last step (and the run's), on the validation split; keep the best model.
                # <domain: validation>
                if global_step % steps_per_epoch == 0 or global_step >= max_train_steps:
                    validate(epoch)
                # </domain>
                if global_step >= max_train_steps:
                    break
            if global_step >= max_train_steps:
                break

        # 9. Save: the final model in from_pretrained form, test-split metrics, a model card and the run summary.
        accelerator.wait_for_everyone()
        # <domain: the final model, its test-split metrics and its model card>
        from common.distributed import from_main_process
        from common.fsdp import load_full_weights

        save_model(accelerator, model, processor, tokenizer, args.output_dir)
        best_dir = os.path.join(args.output_dir, "best_model")
        test_metrics = {}
        if test_dataloader is not None:  # the final model, then best_model/ (its weights loaded into the model)
            test_metrics = evaluate(model, test_dataloader, forward, accelerator, prefix="test")

            def read_best():  # on the main process, which wrote it: the other machines' disks may not hold it
                if os.path.isdir(best_dir):
                    return type(unwrapped["model"]).from_pretrained(best_dir).state_dict()

            best = from_main_process(accelerator, read_best)  # (sent to every process)
            if best is not None:
                load_full_weights(accelerator, model, best)
                test_metrics.update(evaluate(model, test_dataloader, forward, accelerator, prefix="best_model_test"))
        if accelerator.is_main_process:
            write_model_card(
                args.output_dir, "Image classifier trained with train_classifier.py",
                f"Trained on `{args.dataset_name or args.train_data_dir}` for {global_step} optimizer steps.",
                {"base model": args.model_name_or_path or "ResNet from scratch", "labels": ", ".join(labels),
                 "validation accuracy": f"{metrics['eval_accuracy']:.4f}",
                 "validation macro-F1": f"{metrics['eval_f1']:.4f}",
                 **({"test accuracy": f"{test_metrics['test_accuracy']:.4f}",
                     "test macro-F1": f"{test_metrics['test_f1']:.4f}"} if test_metrics else {}),
                 "best model": f"best_model/ (by validation {args.metric_for_best_model})" + (
                     f", test accuracy {test_metrics['best_model_test_accuracy']:.4f}"
                     if "best_model_test_accuracy" in test_metrics else "")},
                usage_snippet(args))
        metrics = {**metrics, best_key: checkpoint_info[best_key], **test_metrics}
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


def small_resnet_config(config_class, num_labels, id2label=None):
    """A ~0.3 M-parameter ResNet for 32 px images: trains on CPU in a minute or two."""
    extra = {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}} if id2label else {}
    return config_class(num_channels=3, embedding_size=32, hidden_sizes=[32, 64, 128], depths=[1, 1, 1],
                        layer_type="basic", downsample_in_first_stage=False, num_labels=num_labels, **extra)


def evaluate(model, dataloader, forward, accelerator, prefix="eval"):
    import torch

    from common.classifier_metrics import macro_f1

    model.eval()
    predictions, references = [], []
    with torch.no_grad():
        for batch in dataloader:
            preds, refs = accelerator.gather_for_metrics((forward(batch).argmax(-1), batch["labels"]))
            predictions.append(preds.cpu())
            references.append(refs.cpu())
    model.train()
    predictions, references = torch.cat(predictions), torch.cat(references)
    return {f"{prefix}_accuracy": (predictions == references).float().mean().item(),
            f"{prefix}_f1": macro_f1(predictions, references),
            f"{prefix}_samples": len(references)}


def usage_snippet(args):
    """The model card's code: transformers' pipeline for an image model; the image+text model is our own class (the
    pipeline cannot load it), fed with the image processor and the tokenizer saved beside it."""
    path = args.output_dir
    if not args.text_column:
        return ('from transformers import pipeline\n'
                f'classify = pipeline("image-classification", model="{path}")\n'
                'print(classify("digit.png"))')
    return ('import torch\n'
            'from PIL import Image\n'
            'from transformers import AutoImageProcessor, AutoTokenizer\n'
            '\n'
            'from common.image_text_model import ImageTextClassifier  # common/ of the recipes, on the Python path\n'
            '\n'
            f'model = ImageTextClassifier.from_pretrained("{path}").eval()\n'
            f'processor = AutoImageProcessor.from_pretrained("{path}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{os.path.join(path, "text_model")}")\n'
            'image = processor(Image.open("digit.png").convert("RGB"), return_tensors="pt")\n'
            f'text = tokenizer(["what the image\'s {args.text_column} column holds"], padding="max_length",\n'
            f'                 truncation=True, max_length={args.max_text_length}, return_tensors="pt")\n'
            'with torch.no_grad():\n'
            '    logits = model(image["pixel_values"], text["input_ids"], text["attention_mask"])\n'
            'print(model.id2label[logits.argmax(-1).item()])')


def save_model(accelerator, model, processor, tokenizer, path):
    """save_pretrained (safetensors) + image processor (+ tokenizer), by the main process (every process calls it:
    under FSDP they gather the weights together)."""
    from common.fsdp import full_models

    accelerator.wait_for_everyone()
    full = full_models(accelerator, {"model": model}, main_only=True)["model"]
    if accelerator.is_main_process:
        full.save_pretrained(path)
        processor.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(path, "text_model"))


if __name__ == "__main__":
    run(main, parse_args)
