"""What a model path holds, for the scripts that load any recipe's output (sample.py, inspect_pipeline.py): its kind,
and the class names and ids of a class-conditional DDPM. Plain json, no torch: checked before anything heavy loads."""
import json
import os

from .args import is_hub_id
from .base_models import TINY_HINT
from .cli import UserError
from .families import FAMILIES, read_model_index
from .lora_files import LORA_INFO, LORA_WEIGHTS

LABELS = "labels.json"  # train_ddpm.py's class names, in id order


def model_kind(path, flag=None):
    """-> what `path` holds, one of
    "sd", "sdxl", "sd3", "flux": a pipeline folder (model_index.json) of that family (common/families/); "sd" also
                   for another latent pipeline (with a VAE);
    "ddpm":        a pipeline folder without a VAE: a train_ddpm.py output (DDPMPipeline);
    "checkpoint":  a train_ddpm.py checkpoint-N: unet/ (and unet_ema/ with --use_ema), scheduler/, no model_index.json;
    "lora":        a train_lora.py output or checkpoint-N (lora_info.json, pytorch_lora_weights.safetensors);
    "hub":         a hub id, whose kind shows when it loads.
    Anything else is a UserError; `flag` names the flag in its message."""
    where = f"{flag} '{path}'" if flag else f"'{path}'"
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "model_index.json")):
            index = read_model_index(path, flag or "the model")
            if index.get("_class_name") in FAMILIES:
                return FAMILIES[index["_class_name"]]
            return "sd" if index.get("vae") else "ddpm"
        if any(os.path.isfile(os.path.join(path, name)) for name in (LORA_INFO, LORA_WEIGHTS)):
            return "lora"
        if (not os.path.isdir(os.path.join(path, "vae"))
                and any(os.path.isdir(os.path.join(path, name)) for name in ("unet", "unet_ema"))):
            return "checkpoint"
        raise UserError(f"{where} is not a diffusion pipeline (no model_index.json), a train_ddpm.py checkpoint "
                        f"(unet/, scheduler/) or a LoRA (no {LORA_WEIGHTS}); {TINY_HINT}")
    if is_hub_id(path):
        return "hub"
    raise UserError(f"{where} is neither a folder nor a hub id (owner/name)")


def read_labels(folder):
    """The class names of a train_ddpm.py output or checkpoint (labels.json), or None."""
    path = os.path.join(folder, LABELS)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return [str(name) for name in json.load(f)]


def class_label_ids(requested, names, allow_all=False):
    """--class_label values (class names or ids; "all" for every class where `allow_all`) -> class ids."""
    ids, also = [], ", or 'all'" if allow_all else ""
    for label in requested:
        if allow_all and label == "all":
            ids += range(len(names))
        elif label in names:
            ids.append(names.index(label))
        elif label.isdigit() and int(label) < len(names):
            ids.append(int(label))
        else:
            raise UserError(f"--class_label '{label}' is not a class of this model; its classes are: "
                            f"{', '.join(names)} (or ids 0-{len(names) - 1}{also})")
    return ids
