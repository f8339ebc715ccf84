"""A CLIP text encoder's weight file with its keys under `text_model.`, as CLIPTextModel's files have always named
them and as ComfyUI's CLIP loader (comfy/sd.py's detect_te_model) and transformers 4 read them. transformers 5 writes
a CLIPTextModel that it built, or loaded from a file without the prefix, without it (and reads both)."""
import json
import os
import shutil

PREFIX = "text_model."


def add_text_model_prefix(folder):
    """Rewrite the safetensors weights of the CLIPTextModel saved in `folder` with every key under `text_model.`
    where it is missing; tensors, dtypes and the files' metadata unchanged, each file replaced atomically. Other
    models (CLIPTextModelWithProjection already names its keys so) are left alone. -> the files rewritten."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        return []
    with open(config_file) as f:
        if json.load(f).get("architectures") != ["CLIPTextModel"]:
            return []
    index_file = os.path.join(folder, "model.safetensors.index.json")
    index = None
    if os.path.isfile(index_file):
        with open(index_file) as f:
            index = json.load(f)
        files = sorted(set(index["weight_map"].values()))
    else:
        files = [name for name in os.listdir(folder) if name.startswith("model") and name.endswith(".safetensors")]
    rewritten = []
    for name in files:
        path = os.path.join(folder, name)
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
            if all(key.startswith(PREFIX) for key in f.keys()):
                continue
            tensors = {key if key.startswith(PREFIX) else PREFIX + key: f.get_tensor(key) for key in f.keys()}
        tmp = path + ".tmp"
        save_file(tensors, tmp, metadata=metadata)
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
        rewritten.append(path)
    if index is not None and rewritten:
        index["weight_map"] = {key if key.startswith(PREFIX) else PREFIX + key: file
                               for key, file in index["weight_map"].items()}
        with open(index_file + ".tmp", "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        os.replace(index_file + ".tmp", index_file)
    return rewritten
