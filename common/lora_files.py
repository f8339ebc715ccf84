"""LoRA files of the latent diffusion recipes, whatever the family: lora_info.json (which ties a LoRA to its base, so
sample.py finds the base from the LoRA alone), the checkpoint hooks (the peft adapter state, and the EMA of the LoRA
weights), the LoRA files users load (the family names the pipeline that saves them and the kohya names the UIs read),
their headers read without torch, and a summary of a file's training metadata for people."""
import json
import os

from .cli import UserError
from .families import family_module, lora_family

LORA_INFO = "lora_info.json"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' name: pipe.load_lora_weights(folder) finds it
ADAPTER_FILE = "adapter_model.safetensors"
UI_WEIGHTS = "pytorch_lora_weights_ui.safetensors"  # the UIs' file (ComfyUI, Forge, A1111): the names they read
# A LoHa's or LoKr's file for sample.py, which diffusers' load_lora_weights cannot read (it reads LoKr for Z-Image and
# Flux.2 only): every component's peft adapter state under `<component>.` and, in its header, their peft configs.
PEFT_WEIGHTS = "peft_adapter_weights.safetensors"
PEFT_CONFIGS = "peft_adapter_configs"  # the header entry: {component: peft config as a dict}
ADAPTER_NAMES = {"LOHA": "LoHa", "LOKR": "LoKr"}


def safetensors_header(path, flag):
    """The JSON header of a .safetensors file (an 8-byte length, then a table of tensors and `__metadata__`), read
    without torch so that a wrong or damaged file is reported at once."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100 * 2**20:
                raise ValueError("no safetensors header")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("no safetensors header")
    except (OSError, ValueError) as err:
        raise UserError(f"{flag} '{path}' is not a readable .safetensors file ({err}); give a LoRA saved as "
                        "safetensors (diffusers, peft or kohya format)") from None
    return header


def check_safetensors(path, flag):
    """A .safetensors file whose header reads. -> the tensor names it holds."""
    return [name for name in safetensors_header(path, flag) if name != "__metadata__"]


def lora_info(args):
    """What sample.py and a resumed run need to know about train_lora.py's LoRA, from its flags (lora_info.json,
    checkpoint_info.json)."""
    base = args.pretrained_model_name_or_path
    return {"base_model": os.path.abspath(base) if os.path.isdir(base) else base, "revision": args.revision,
            "variant": args.variant, "rank": args.rank, "lora_alpha": args.lora_alpha,
            "adapter": args.adapter, "lokr_factor": args.lokr_factor,  # lora, loha, lokr (common/lora_adapters.py)
            "target_modules": args.target_modules, "use_dora": args.use_dora,
            "train_text_encoder": args.train_text_encoder, "prediction_type": args.prediction_type,
            "max_sequence_length": args.max_sequence_length,  # T5's prompt length: sample.py's default too
            "drop_t5": args.drop_t5,  # trained without T5 (SD3): sample.py draws without it too
            "resolution": args.resolution,  # the training size: sample.py's default size
            "num_frames": (getattr(args, "clip_frames", None) or [None])[0],  # a video LoRA's: sample.py's default
            "ema_weights": args.use_ema,  # the weights in pytorch_lora_weights.safetensors are the EMA ones
            "references": len(args.control_data_dir or args.control_image_column),  # an edit LoRA's reference images
            "wan_expert": getattr(args, "wan_expert", None),  # Wan 2.2 A14B: the expert the LoRA is of
            "trigger": args.instance_prompt or args.caption_prefix.strip(" ,") or None}  # what prompts need to show it


def write_lora_info(folder, info):
    """info: base_model, revision, variant, rank, lora_alpha, target_modules, ... (JSON-able)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LORA_INFO)
    with open(path + ".tmp", "w") as f:
        json.dump(info, f, indent=2)
    os.replace(path + ".tmp", path)


def read_lora_info(folder):
    """The lora_info.json of a train_lora.py output or checkpoint folder, or None."""
    path = os.path.join(folder, LORA_INFO)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def save_lora_state(model, path):
    """Checkpoint save hook (`register_state_hooks(save_fn=...)`): the adapter's weights only, peft names."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(state, os.path.join(path, ADAPTER_FILE))


def load_lora_state(model, path, dtype):
    """Checkpoint load hook: really set the adapter (a silent no-op would resume from the initial LoRA), then
    upcast it again to the trainable dtype."""
    from diffusers.training_utils import cast_training_params
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(os.path.join(path, ADAPTER_FILE)), adapter_name="default")
    problems = list(result.unexpected_keys) + [k for k in result.missing_keys if ".default" in k]  # the adapter's
    if problems:
        raise UserError(f"--resume_from_checkpoint: {path} does not fit this LoRA ({problems[0]} ...)")
    cast_training_params(model, dtype=dtype)


LORA_EMA_WEIGHTS = "lora_ema.safetensors"  # in a checkpoint of a --use_ema run: the EMA of the LoRA weights
LORA_EMA_STATE = "lora_ema.json"  # beside it: EMAModel's scalar state (optimization_step, decay, ...)


def save_lora_ema(ema, names, folder):
    """Checkpoint `extra_save`: an EMAModel of the LoRA weights as safetensors, each shadow under its parameter's
    name (`names`, in the order given to EMAModel), and its scalar state as JSON; no pickle."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    state = ema.state_dict()
    shadows = state.pop("shadow_params")
    save_file({name: p.detach().cpu().contiguous() for name, p in zip(names, shadows, strict=True)},
              os.path.join(folder, LORA_EMA_WEIGHTS))
    with open(os.path.join(folder, LORA_EMA_STATE), "w") as f:
        json.dump({**state, "cur_decay_value": ema.cur_decay_value}, f, indent=2)


def load_lora_ema(ema, names, folder, device):
    """Checkpoint `extra_load`: the EMAModel back as save_lora_ema wrote it, its shadows in fp32 on `device`."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(os.path.join(folder, LORA_EMA_WEIGHTS))
    with open(os.path.join(folder, LORA_EMA_STATE)) as f:
        state = json.load(f)
    if sorted(weights) != sorted(names) or any(weights[n].shape != p.shape for n, p in zip(names, ema.shadow_params)):
        odd = sorted(set(weights) ^ set(names)) or [n for n, p in zip(names, ema.shadow_params)
                                                       if weights[n].shape != p.shape]
        raise UserError(f"--resume_from_checkpoint: {folder}/{LORA_EMA_WEIGHTS} does not fit this LoRA ({odd[0]} ...)")
    cur_decay_value = state.pop("cur_decay_value", None)
    ema.load_state_dict({**state, "shadow_params": [weights[n].to(device, torch.float32) for n in names]})
    ema.cur_decay_value = cur_decay_value


def save_lora_weights(folder, family, lora_models, info, metadata=None):
    """lora_models: {"unet" or "transformer": ..., "text_encoder": ..., ...} (peft-adapted, unwrapped), of a base of
    `family`. Writes pytorch_lora_weights.safetensors with the family's pipeline's `save_lora_weights` (the adapter
    configs ride along as diffusers' metadata, so alpha and DoRA load back), beside it the file for the UIs
    (ComfyUI, Forge, A1111: the family's ui_lora names with alphas and DoRA magnitudes, common/ui_lora.py) and
    lora_info.json. `metadata` ({str: str}, common/lora_metadata.py's lora_metadata) goes into the header of both
    files. Main process only."""
    import diffusers
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    if getattr(family, "split_experts", None):  # Wan 2.2 A14B, both experts: the high one's here, the low one's below
        for subfolder, expert_family, models in family.split_experts(lora_models):
            expert_info = {**info, "wan_expert": expert_family.EXPERT} if subfolder else info
            save_lora_weights(os.path.join(folder, subfolder), expert_family, models, expert_info, metadata)
        return write_lora_info(folder, info)
    states = {name: get_peft_model_state_dict(model) for name, model in lora_models.items()}
    configs = {name: model.peft_config["default"].to_dict() for name, model in lora_models.items()}
    if info.get("adapter", "lora") != "lora":
        return save_lycoris_weights(folder, family, lora_models, states, configs, info, metadata)
    # the UI file first: a LoRA it cannot hold is one line before anything is written
    ui_weights = family.ui_lora(states, configs[family.DENOISER]["lora_alpha"], lora_models[family.DENOISER].config)
    text_layers = {f"{name}_lora_layers": {text_encoder_key(key): value for key, value in
                                           convert_state_dict_to_diffusers(state).items()}
                   for name, state in states.items() if name != family.DENOISER}
    header = {"format": "pt", **(metadata or {})}
    # diffusers writes its adapter metadata only with its own save function: the same entry, written here beside ours
    # (a Wan A14B expert's file names its denoiser `transformer`, whichever expert: LORA_FILE_DENOISER)
    named = {family.DENOISER: getattr(family, "LORA_FILE_DENOISER", family.DENOISER)}
    adapter_configs = {f"{named.get(name, name)}.{key}": value for name, config in configs.items()
                       for key, value in config.items()}
    header[LORA_ADAPTER_METADATA_KEY] = json.dumps(adapter_configs, indent=2, sort_keys=True, default=sorted)
    getattr(diffusers, family.PIPELINE).save_lora_weights(
        # The denoiser's keys stay in peft's format (lora_A/lora_B): converted, a UNet's attention layers get
        # diffusers' old names (lora.down/lora.up) while convolutions keep peft's, and the loader then drops the
        # attention ones without an error (a LoRA on attention and convolutions would load half applied).
        folder, weight_name=LORA_WEIGHTS, **{f"{named[family.DENOISER]}_lora_layers": states[family.DENOISER]},
        **text_layers, save_function=lambda weights, path: save_file(weights, path, metadata=header))
    ui_header = {"format": "pt", **(metadata or {})}  # (no adapter configs: diffusers refuses them beside alphas)
    if "modelspec.implementation" in ui_header:  # whose module names the file uses, as kohya's files say
        ui_header["modelspec.implementation"] = family.UI_IMPLEMENTATION
    save_file(ui_weights, os.path.join(folder, UI_WEIGHTS), metadata=ui_header)
    write_lora_info(folder, info)


def save_lycoris_weights(folder, family, models, states, configs, info, metadata=None):
    """save_lora_weights for a LoHa or LoKr (diffusers' loaders read neither): peft_adapter_weights.safetensors (each
    component's peft state under `<component>.`, the peft configs in the header: sample.py loads it through peft),
    the UI file in LyCORIS's names (common/ui_lora.py; LoKr's scale baked where the UIs apply none) and
    lora_info.json. Main process only."""
    from safetensors.torch import save_file

    from .ui_lora import bake_lokr_scale

    config = configs[family.DENOISER]
    alpha, scale = config["alpha"], config["alpha"] / config["r"]
    ui_weights = family.ui_lora({name: bake_lokr_scale(state, scale) for name, state in states.items()}, alpha,
                                models[family.DENOISER].config)
    header = {"format": "pt", **(metadata or {}),
              PEFT_CONFIGS: json.dumps(configs, sort_keys=True, default=lambda v: sorted(v) if isinstance(v, set)
                                       else str(v))}
    weights = {f"{name}.{key}": value.detach().contiguous() for name, state in states.items()
               for key, value in state.items()}
    os.makedirs(folder, exist_ok=True)
    save_file(weights, os.path.join(folder, PEFT_WEIGHTS), metadata=header)
    ui_header = {"format": "pt", **(metadata or {})}
    if "modelspec.implementation" in ui_header:
        ui_header["modelspec.implementation"] = family.UI_IMPLEMENTATION
    save_file(ui_weights, os.path.join(folder, UI_WEIGHTS), metadata=ui_header)
    write_lora_info(folder, info)


def lora_weights_file(path):
    """The weights sample.py loads from a LoRA path: a folder's pytorch_lora_weights.safetensors, else its
    peft_adapter_weights.safetensors (a LoHa's or LoKr's), else None; a file as it is."""
    if not os.path.isdir(path):
        return path
    return next((os.path.join(path, name) for name in (LORA_WEIGHTS, PEFT_WEIGHTS)
                 if os.path.isfile(os.path.join(path, name))), None)


def peft_adapter_configs(path):
    """{component: peft config dict} of a peft_adapter_weights.safetensors file (or of a folder holding one), None
    for any other LoRA file or folder."""
    file = lora_weights_file(path)
    if not file or not os.path.isfile(file) or not file.endswith(".safetensors"):
        return None
    configs = (safetensors_header(file, "--lora").get("__metadata__") or {}).get(PEFT_CONFIGS)
    return json.loads(configs) if configs else None


def check_lora_format(path, keys, flag, peft_loader=None):
    """One line for a LoHa or LoKr given where only diffusers' load_lora_weights reads it: its UI file (LyCORIS's
    names) anywhere, its peft file or folder where `peft_loader` (the script that loads those) is None."""
    configs = peft_adapter_configs(path)
    if configs is not None:
        if peft_loader is None:
            kinds = sorted({ADAPTER_NAMES.get(c.get("peft_type"), c.get("peft_type")) for c in configs.values()})
            raise UserError(f"{flag} '{path}' is a {'/'.join(kinds)} (LyCORIS), which diffusers' load_lora_weights "
                            "cannot read: draw it with `python sample.py --model <that folder>`, which loads it "
                            "through peft")
        return
    lycoris = next((key for key in keys if ".hada_" in key or ".lokr_" in key), None)
    if lycoris:
        kind = "LoHa" if ".hada_" in lycoris else "LoKr"
        where = (f"give {peft_loader} the train_lora.py output folder (its {PEFT_WEIGHTS} loads through peft)"
                 if peft_loader else "load it in ComfyUI, or draw its train_lora.py output folder with sample.py")
        raise UserError(f"{flag} '{path}' holds {kind} weights in LyCORIS's names (a UI file), which diffusers' "
                        f"load_lora_weights cannot read: {where}")


def load_peft_adapters(pipe, path, adapter_name):
    """A LoHa or LoKr of train_lora.py (peft_adapter_weights.safetensors, or a folder holding it) into the pipeline's
    denoiser and text encoders as peft adapter `adapter_name`, each set to the saved state; diffusers' set_adapters
    then scales it as it scales LoRAs. One line when it does not fit the pipeline's models."""
    from peft import PeftConfig
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = lora_weights_file(path)
    weights = load_file(file)
    for component, config in peft_adapter_configs(path).items():
        model = getattr(pipe, component, None)
        if model is None:
            raise UserError(f"--lora '{path}' adapts a {component}, which this pipeline lacks (a LoRA for another "
                            "model?)")
        state = {key.removeprefix(f"{component}."): value for key, value in weights.items()
                 if key.startswith(f"{component}.")}
        try:
            model.add_adapter(PeftConfig.from_peft_type(**config), adapter_name=adapter_name)
            result = set_peft_model_state_dict(model, state, adapter_name=adapter_name)
        except (ValueError, RuntimeError, TypeError) as err:
            raise UserError(f"--lora '{path}' does not fit the {component} of this base (a LoRA for another "
                            f"model?): {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        missing = [key for key in result.missing_keys if f".{adapter_name}" in key]
        if result.unexpected_keys or missing:
            raise UserError(f"--lora '{path}' does not fit the {component} of this base (a LoRA for another "
                            f"model?): {(list(result.unexpected_keys) + missing)[0]} ...")


def lora_file_metadata(path):
    """The `__metadata__` of a LoRA .safetensors file (or of a folder's pytorch_lora_weights.safetensors or
    peft_adapter_weights.safetensors), without torch; {} for a hub id or a file without any."""
    file = lora_weights_file(path) or ""
    if not os.path.isfile(file):
        return {}
    metadata = safetensors_header(file, "--lora").get("__metadata__")
    return {str(key): str(value) for key, value in metadata.items()} if isinstance(metadata, dict) else {}


def describe_lora(metadata):
    """A few lines for people from a LoRA file's metadata: train_lora.py's keys, else kohya's ss_* and ModelSpec's
    (LoRAs from kohya's sd-scripts and the tools that follow it). [] when it holds none of them."""
    get = metadata.get
    lines = []
    base, version = get("base_model") or get("ss_sd_model_name"), get("ss_base_model_version")
    resolution = get("modelspec.resolution") or get("ss_resolution")
    if base or version or resolution:
        lines.append(f"base model: {base or 'unknown'}" + (f" ({version})" if version else "")
                     + (f", trained at {resolution}" if resolution else ""))
    rank, alpha = get("rank") or get("ss_network_dim"), get("lora_alpha") or get("ss_network_alpha")
    if rank:
        targets = get("target_modules")
        kind = {"loha": "LoHa, ", "lokr": "LoKr, "}.get(get("adapter"), "")
        lines.append(f"{kind}rank {rank}, alpha {alpha or rank}"
                     + (f", on {targets.replace(',', ', ')}" if targets else "")
                     + ((" and both CLIP text encoders" if two_clips(lora_family(metadata, [])[0])
                         else " and the text encoder")
                        if get("text_encoder_target_modules") else ""))
    steps, total = get("ss_steps"), get("ss_max_train_steps")
    if steps or total:
        dataset = get("dataset") or ", ".join(json_keys(get("ss_dataset_dirs")))
        images = get("ss_num_train_images")
        lines.append(f"trained {steps or '?'}" + (f" of {total}" if total and total != steps else "") + " steps"
                     + (f" on {dataset}" if dataset else "") + (f" ({images} images)" if images else "")
                     + (f", learning rate {get('ss_learning_rate')}" if get("ss_learning_rate") else "")
                     + (f", {get('ss_optimizer')}" if get("ss_optimizer") else ""))
    trigger = get("modelspec.trigger_phrase") or get("trigger")
    if trigger:
        lines.append(f"trigger: {trigger} (put it in the prompt)")
    return lines


def json_keys(text):
    """The keys of a JSON object in a metadata string (kohya's ss_dataset_dirs); [] for anything else."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return []
    return list(value) if isinstance(value, dict) else []


def text_encoder_key(key):
    """A text-encoder key as diffusers' training scripts write it for CLIP, under `text_model.`: transformers 4's
    CLIPTextModel has that level, transformers 5's does not (diffusers' loader strips it for such a model). A DoRA
    magnitude as `...lora_magnitude_vector.weight`, the name transformers' load_adapter (where `load_lora_weights`
    sends the text encoder's keys) matches: peft's own name lacks the `.weight`, and load_adapter drops it."""
    key = key if key.startswith("text_model.") else "text_model." + key
    return key + ".weight" if key.endswith(".lora_magnitude_vector") else key


def two_clips(family):
    """Whether --train_text_encoder puts LoRA on two CLIP text encoders in `family` (SDXL, SD3)."""
    try:
        return family is not None and len(family_module(family).LORA_TEXT_ENCODERS) == 2
    except UserError:
        return False
