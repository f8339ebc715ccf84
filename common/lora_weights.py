"""LoRA weights on disk: checkpoint hooks (the peft adapter state), diffusers' pytorch_lora_weights.safetensors,
and the kohya key format that A1111, ComfyUI and diffusers' own loader read."""
import os

from .cli import UserError
from .sd_pipeline import LORA_WEIGHTS, write_lora_info

ADAPTER_FILE = "adapter_model.safetensors"
KOHYA_WEIGHTS = "pytorch_lora_weights_kohya.safetensors"


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
    problems = list(result.unexpected_keys) + [k for k in result.missing_keys if "lora_" in k]
    if problems:
        raise UserError(f"--resume_from_checkpoint: {path} does not fit this LoRA ({problems[0]} ...)")
    cast_training_params(model, dtype=dtype)


def save_lora_weights(folder, lora_models, info, kohya=False):
    """lora_models: {"unet": ..., "text_encoder": ...} (peft-adapted, unwrapped). Writes pytorch_lora_weights.safetensors
    with `StableDiffusionPipeline.save_lora_weights` (the adapter configs ride along as metadata, so alpha and DoRA
    load back), lora_info.json, and with `kohya` the kohya-format file. Main process only."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    states = {name: get_peft_model_state_dict(model) for name, model in lora_models.items()}
    configs = {name: model.peft_config["default"].to_dict() for name, model in lora_models.items()}
    text_encoder_layers = None
    if "text_encoder" in states:
        text_encoder_layers = {text_encoder_key(key): value
                               for key, value in convert_state_dict_to_diffusers(states["text_encoder"]).items()}
    StableDiffusionPipeline.save_lora_weights(
        folder, weight_name=LORA_WEIGHTS, unet_lora_layers=convert_state_dict_to_diffusers(states["unet"]),
        text_encoder_lora_layers=text_encoder_layers,
        unet_lora_adapter_metadata=configs["unet"], text_encoder_lora_adapter_metadata=configs.get("text_encoder"))
    if kohya:
        weights = peft_to_kohya(states["unet"], info["lora_alpha"], "lora_unet")
        if "text_encoder" in states:  # transformers 5 dropped CLIPTextModel's `text_model.` level; kohya keeps it
            weights.update(peft_to_kohya(states["text_encoder"], info["lora_alpha"], "lora_te", "text_model."))
        save_file(weights, os.path.join(folder, KOHYA_WEIGHTS), metadata={"format": "pt"})
    write_lora_info(folder, info)


def text_encoder_key(key):
    """A text-encoder key as diffusers' training scripts write it for CLIP, under `text_model.`: transformers 4's
    CLIPTextModel has that level, transformers 5's does not (diffusers' loader strips it for such a model). A DoRA
    magnitude as `...lora_magnitude_vector.weight`, the name transformers' load_adapter (where `load_lora_weights`
    sends the text encoder's keys) matches: peft's own name lacks the `.weight`, and load_adapter drops it."""
    key = key if key.startswith("text_model.") else "text_model." + key
    return key + ".weight" if key.endswith(".lora_magnitude_vector") else key


def peft_to_kohya(state_dict, alpha, prefix, module_prefix=""):
    """peft keys `<module>.lora_A.weight` / `.lora_B.weight` -> `<prefix>_<module, dots as underscores>` with
    `.lora_down.weight`, `.lora_up.weight` and `.alpha` (diffusers' own names give ComfyUI "lora key not loaded")."""
    import torch

    names = {"A.weight": "lora_down.weight", "B.weight": "lora_up.weight"}
    kohya = {}
    for key, value in state_dict.items():
        module, _, kind = key.rpartition(".lora_")
        if kind not in names:
            raise ValueError(f"kohya export: no kohya name for '{key}' (DoRA magnitudes and biases have none)")
        name = f"{prefix}_{(module if module.startswith(module_prefix) else module_prefix + module).replace('.', '_')}"
        kohya[f"{name}.{names[kind]}"] = value.detach().contiguous()
        kohya[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=value.dtype)
    return kohya
