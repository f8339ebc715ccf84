"""peft adapters on a base's denoiser and CLIP text encoders, for train_lora.py: LoRA (diffusers' LoraConfig
settings) or LyCORIS's LoHa and LoKr (peft's LoHaConfig, LoKrConfig; --adapter), the family's default targets, targets
that match no module named with the closest ones, the QLoRA base's quantization config, and where the frozen
denoiser goes once its adapters are added (--quantize_base fp8, --blocks_to_swap: common/float8_base.py,
common/block_swap.py)."""
from .block_swap import check_block_swap_flags, swap_lists
from .cli import UserError, first_line


def comma_list(text):
    """--target_modules' value: comma-separated names."""
    return [item.strip() for item in text.split(",") if item.strip()]


SAME_LORA = ("adapter", "rank", "lora_alpha", "lokr_factor", "target_modules", "use_dora",
             "train_text_encoder", "wan_expert")  # needed to resume (wan_expert: Wan 2.2 A14B's)
# Each adapter's weight names in peft (its layer's adapter_layer_names): what trains, what a checkpoint must set.
ADAPTER_WEIGHTS = {"lora": ("lora_",), "loha": ("hada_",), "lokr": ("lokr_",)}


def add_adapter_args(group):
    """--adapter and the one flag of LoKr's that LoRA and LoHa lack (train_lora.py's LoRA group holds --rank,
    --lora_alpha, --lora_dropout, --use_dora)."""
    group.add_argument("--adapter", default="lora", choices=sorted(ADAPTER_WEIGHTS),
                       help="lora; loha (LyCORIS LoHa: a Hadamard product of two rank-r products); lokr (LyCORIS "
                            "LoKr: a Kronecker product of a small matrix and a rank-r product), both through peft.")
    group.add_argument("--lokr_factor", type=int, default=-1,
                       help="LoKr: LyCORIS's `factor`, the size of the small Kronecker factor's sides (-1: as near "
                            "the square root of each layer's size as its divisors allow).")


def is_adapter_weight(name, adapter):
    """Whether a parameter name (peft's: `<module>.<weight>.<adapter name>`) is a weight of `adapter`."""
    return any(f".{prefix}" in name or name.startswith(prefix) for prefix in ADAPTER_WEIGHTS[adapter])


def check_lora_args(args, family):
    """One line for LoRA flags that do not go together; then what depends on the base's family (None: a hub base's,
    not fetched yet; main calls this again): the default targets, --quantize_base's package."""
    import importlib.util

    if args.target_modules == []:
        raise UserError("--target_modules: give at least one module name")
    if getattr(args, "wan_expert", None) == "both":  # (before the Accelerator, a hub base's too: DDP's setting)
        args.find_unused_parameters = True  # a step whose samples all fall on one side leaves an expert unused
    if args.offload_ema and not args.use_ema:
        raise UserError("--offload_ema: there is no EMA to offload without --use_ema")
    if args.adapter != "lora":  # peft's LoHa and LoKr have neither
        if args.use_dora:
            raise UserError(f"--use_dora is LoRA's (DoRA); leave it out with --adapter {args.adapter}")
        if args.lora_dropout:
            raise UserError(f"--lora_dropout is LoRA's; leave it out with --adapter {args.adapter}")
        if args.quantize_base == "nf4":  # peft's LoHa and LoKr layers wrap plain Linear and Conv layers only
            raise UserError(f"--quantize_base nf4: peft's {args.adapter} cannot wrap 4-bit layers; train it on an "
                            "unquantized base or an fp8 one (--quantize_base fp8), or use --adapter lora")
    if args.lokr_factor != -1 and (args.adapter != "lokr" or args.lokr_factor < 1):
        raise UserError(f"--lokr_factor {args.lokr_factor}: LoKr's factor (with --adapter lokr) is a positive "
                        "integer, or -1 for the default")
    check_block_swap_flags(args, family)
    if args.quantize_base == "fp8":
        if family is not None and not swap_lists(family):
            raise UserError(f"--quantize_base fp8 stores a transformer's blocks in fp8, and {family.NAME} bases have a "
                            "UNet: use --quantize_base nf4 (CUDA), or leave it out")
        from .float8_base import check_float8

        check_float8()
    if family is None:
        return
    text_flag = next((f for f in ("train_text_encoder", "text_encoder_lr") if getattr(args, f, None)), None)
    if text_flag and not family.LORA_TEXT_ENCODERS:
        raise UserError(f"--{text_flag}: LoRA on {family.NAME}'s text encoder (an LLM of billions of parameters; "
                        "diffusers' script trains none either) is not offered; leave it out (the transformer's LoRA "
                        "trains alone)")
    if args.target_modules is None:
        args.target_modules = comma_list(family.LORA_TARGETS)
    if args.quantize_base == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("--quantize_base nf4 needs bitsandbytes (`make install-extras`, on a CUDA machine)")


def check_resumed_lora(path, saved, now):
    """A checkpoint (its checkpoint_info.json: `saved`) must hold a LoRA of the shape the flags ask for (`now`)."""
    saved = {"adapter": "lora", **saved} if "rank" in saved else saved  # (a LoRA's, from before --adapter)
    diffs = [f"{key}={saved[key]} (now {now[key]})" for key in SAME_LORA
             if key in saved and now[key] is not None and saved[key] != now[key]]
    if diffs:
        raise UserError(f"--resume_from_checkpoint: {path} holds a LoRA with {', '.join(diffs)}; resume with the "
                        "same LoRA settings or train into a new --output_dir")


def quantization_config(args, weight_dtype, device):
    """diffusers' QLoRA recipe (--quantize_base nf4): the frozen denoiser in 4-bit NF4, computing in the weight
    dtype; None without it (--quantize_base fp8: once the adapters are added, place_frozen_denoiser). CUDA only."""
    if args.quantize_base == "fp8":
        from .float8_base import check_float8

        check_float8(device)  # (this device can cast float8)
    if args.quantize_base != "nf4":
        return None
    if device.type != "cuda":
        raise UserError("--quantize_base nf4 runs on CUDA GPUs only (bitsandbytes): leave it out on this machine")
    from diffusers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=weight_dtype)


def place_frozen_denoiser(family, denoiser, args, weight_dtype, device):
    """Once the adapters are added: with --quantize_base fp8 the frozen Linear layers of the denoiser's blocks in
    float8 (quantized on `device`); with --blocks_to_swap the frozen weights of that many blocks in host memory,
    copied in as they run; the rest of the denoiser on `device` (an nf4 one is there as it loads). -> the BlockSwap,
    or None."""
    from .block_swap import swap_blocks, swapped_blocks

    if args.quantize_base == "fp8":
        from .float8_base import quantize_blocks

        host = set(swapped_blocks(family, denoiser, args.blocks_to_swap)[1])
        quantize_blocks(denoiser, swap_lists(family), weight_dtype, device, host_blocks=host)
    swap = swap_blocks(family, denoiser, args.blocks_to_swap, device) if args.blocks_to_swap else None
    if args.quantize_base != "nf4":
        denoiser.to(device)
    return swap


def adapter_config(args, targets):
    """The peft config of --adapter: LoRA (init_lora_weights="gaussian", --rank, --lora_alpha, --lora_dropout,
    --use_dora), LoHa or LoKr (--rank, alpha --lora_alpha, --lokr_factor; peft's initialisation: a zero update)."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    if args.adapter == "loha":
        return LoHaConfig(r=args.rank, alpha=args.lora_alpha, target_modules=targets)
    if args.adapter == "lokr":
        return LoKrConfig(r=args.rank, alpha=args.lora_alpha, decompose_factor=args.lokr_factor,
                          target_modules=targets)
    return LoraConfig(r=args.rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      init_lora_weights="gaussian", target_modules=targets, use_dora=args.use_dora)


def add_lora(family, denoiser, text_encoders, args):
    """--adapter (LoRA, LoHa or LoKr: adapter_config) on the denoiser's --target_modules and, with
    --train_text_encoder, on the family's LoRA text encoders' attention projections.
    -> {checkpoint subfolder: model} of what trains."""
    def config(targets):
        return adapter_config(args, targets)

    check_target_modules(denoiser, args.target_modules, "--target_modules",
                         {"unet": "UNet"}.get(family.DENOISER, family.DENOISER))
    try:
        denoiser.add_adapter(config(expand_targets(denoiser, args.target_modules)))
    except (ValueError, TypeError) as err:  # e.g. a target that is not a Linear/Conv layer
        raise UserError(f"--target_modules: {first_line(err)}") from None
    trained = {family.DENOISER: denoiser}
    for name in family.LORA_TEXT_ENCODERS if args.train_text_encoder else ():
        text_encoders[name].add_adapter(config(family.text_encoder_targets(name, text_encoders[name],
                                                                           family.TEXT_LORA_TARGETS)))
        trained[name] = text_encoders[name]
    return trained


def is_pattern(target):
    """A target with a shell wildcard (`single_transformer_blocks.*.attn.to_out`): a pattern of module names."""
    return any(char in target for char in "*?[")


def target_matches(name, target):
    """peft's rule (the full name or a name suffix), with a wildcard pattern matched against either."""
    import fnmatch

    if is_pattern(target):
        return fnmatch.fnmatchcase(name, target) or fnmatch.fnmatchcase(name, "*." + target)
    return name == target or name.endswith("." + target)


def expand_targets(model, targets):
    """Targets as peft takes them: each wildcard pattern replaced by the full names of the modules it matches."""
    names = [name for name, _ in model.named_modules() if name]
    return [match for target in targets
            for match in ([n for n in names if target_matches(n, target)] if is_pattern(target) else [target])]


def check_target_modules(model, targets, flag, what):
    """peft matches a target by full name or name suffix (a wildcard pattern here: by the names it matches); name the
    closest module names when one matches nothing."""
    import difflib

    names = [name for name, _ in model.named_modules() if name]
    for target in targets:
        if not any(target_matches(name, target) for name in names):
            suffixes = {".".join(n.split(".")[-k:]) for n in names for k in (1, 2)}
            suffixes = sorted(suffixes - {str(i) for i in range(99)})
            close = difflib.get_close_matches(target, suffixes, n=4, cutoff=0.5)
            hint = f"closest module names: {', '.join(close)}" if close else f"module names look like {names[-1]}"
            raise UserError(f"{flag}: '{target}' matches no module of the {what}; {hint}")
