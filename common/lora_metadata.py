"""What train_lora.py's LoRAs say about themselves: the safetensors metadata of the LoRA files (its own keys, kohya's
ss_* keys as kohya's train_network.py writes them, and ModelSpec's modelspec.* keys: what A1111, ComfyUI and the
model sites show; sample.py reads them back with common.lora_files.describe_lora), and the model card. What they say
of the base comes from its family (common/families/: base_metadata)."""
import json
import os

from .lora_files import UI_WEIGHTS


def lora_metadata(args, info, base_version, step, max_train_steps, num_images, mixed_precision, text_encoder_targets,
                  optimizer):
    """The safetensors metadata of the LoRA files (strings): this recipe's own keys (the base as given, the target
    modules, the trigger word: what sample.py prints), kohya's ss_* keys as its train_network.py writes them and
    ModelSpec's modelspec.* (what A1111, ComfyUI and the model sites show). base_version: the family's base_metadata;
    optimizer: the optimizer class's name."""
    base, dataset, size = info["base_model"], args.dataset_name or args.train_data_dir, args.resolution
    name = os.path.basename(os.path.abspath(args.output_dir))
    trigger = info["trigger"] or ""
    text_encoder_lr = str(args.text_encoder_lr or args.learning_rate) if args.train_text_encoder else "None"
    adapter = getattr(args, "adapter", "lora")
    # a LoHa or LoKr as kohya's scripts write LyCORIS's: its network module and its algorithm in the network args
    lycoris = {} if adapter == "lora" else {"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps(
        {"algo": adapter, **({"factor": str(args.lokr_factor)} if adapter == "lokr" else {})})}
    metadata = {
        "base_model": base, "dataset": dataset, "resolution": str(size), "rank": str(args.rank),
        "lora_alpha": f"{args.lora_alpha:g}", "target_modules": ",".join(args.target_modules),
        "text_encoder_target_modules": ",".join(text_encoder_targets) if args.train_text_encoder else "",
        "steps": str(step), "trigger": trigger,
        "ss_sd_model_name": os.path.basename(base) if os.path.isdir(base) else base, "ss_output_name": name,
        "ss_network_module": "networks.lora", "ss_network_dim": str(args.rank),
        "ss_network_alpha": str(float(args.lora_alpha)), "ss_network_dropout": str(args.lora_dropout),
        "ss_resolution": f"({size}, {size})", "ss_enable_bucket": str(args.buckets == "auto"),
        "ss_steps": str(step), "ss_max_train_steps": str(max_train_steps), "ss_learning_rate": str(args.learning_rate),
        "ss_unet_lr": str(args.learning_rate), "ss_text_encoder_lr": text_encoder_lr,
        "ss_lr_scheduler": args.lr_scheduler, "ss_lr_warmup_steps": str(args.lr_warmup_steps),
        "ss_optimizer": optimizer, "ss_max_grad_norm": str(args.max_grad_norm),
        "ss_batch_size_per_device": str(args.train_batch_size),
        "ss_gradient_accumulation_steps": str(args.gradient_accumulation_steps),
        "ss_gradient_checkpointing": str(args.gradient_checkpointing), "ss_mixed_precision": mixed_precision,
        "ss_seed": str(args.seed), "ss_cache_latents": str(args.cache_latents), "ss_flip_aug": str(args.random_flip),
        "ss_noise_offset": str(args.noise_offset), "ss_min_snr_gamma": str(args.snr_gamma),
        "ss_caption_dropout_rate": str(args.caption_dropout_prob), "ss_num_train_images": str(num_images),
        "ss_dataset_dirs": json.dumps({os.path.basename(os.path.normpath(dataset)): {"n_repeats": 1,
                                                                                      "img_count": num_images}}),
        "ss_training_comment": "train_lora.py" + (f"; trigger: {trigger}" if trigger else ""),
        "modelspec.sai_model_spec": "1.0.0", "modelspec.implementation": "diffusers", "modelspec.title": name,
        "modelspec.resolution": f"{size}x{size}", "modelspec.trigger_phrase": trigger, **base_version,
        "adapter": adapter, **lycoris}
    return {key: value for key, value in metadata.items() if value}  # no empty trigger or text encoder targets


def lora_card(args, info, family, steps, last_loss, ema, prompt):
    """The model card's (title, summary, facts, usage) for common/reporting.py's write_model_card: what was trained on
    what, and how to load it (family: the base's family module; ema: the exported weights are the EMA ones; prompt:
    the usage example's)."""
    from .sampling_defaults import model_snippet

    base = args.pretrained_model_name_or_path
    references = getattr(args, "reference_paths", None) or ()  # (an edit LoRA's validation references)
    images = "".join(f" --image {path}" for path in references)
    summary = (f"Trained with train_lora.py on `{args.dataset_name or args.train_data_dir}` for {steps} optimizer "
               f"steps. Sample: `python sample.py --model {args.output_dir}{images} --prompt \"...\"`.")
    facts = {"base model": f"`{base}`" + (" (tiny, random-init: a smoke test, not a picture model)"
                                          if "tiny-sd" in base else ""),
             "resolution": f"{args.resolution} px", "rank / alpha": f"{args.rank} / {args.lora_alpha:g}",
             "target modules": ", ".join(args.target_modules), "text encoder LoRA": args.train_text_encoder,
             "steps": steps,
             "weights": (f"the EMA of the trained ones (decay up to {args.ema_max_decay:g}); the trained ones are "
                         "in raw/") if ema else "the trained ones",
             "trigger (caption prefix)": f"`{args.caption_prefix}`" if args.caption_prefix else "none",
             "final loss": f"{last_loss:.4f}" if last_loss is not None else "n/a",
             "validation prompts": "; ".join(args.validation_prompt) or "none",
             "ComfyUI, Forge, A1111": f"`{UI_WEIGHTS}`, in their LoRA folder"
                                      + ("; DoRA: ComfyUI and Forge apply it approximately, A1111 not at all"
                                         if args.use_dora else "")}
    adapter = getattr(args, "adapter", "lora")
    if adapter != "lora":  # diffusers' loaders cannot read it: sample.py loads it through peft
        facts["adapter"] = {"loha": "LoHa", "lokr": "LoKr"}[adapter] + " (LyCORIS, through peft)"
        return f"{facts['adapter'].split()[0]} for {base}", summary, facts, (
            "# diffusers' load_lora_weights cannot read it; sample.py loads it through peft:\n"
            f'# python sample.py --model {args.output_dir} --prompt "{prompt}"')
    # the settings sample.py draws this LoRA with: its size and T5 length, the base's steps and guidance
    usage = model_snippet(family, info["base_model"], prompt, info, lora=args.output_dir, cache_dir=args.cache_dir,
                          references=references)
    return f"LoRA for {base}", summary, facts, usage
