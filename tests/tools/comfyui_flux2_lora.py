"""ComfyUI's own LoRA key map for FLUX.2, pinned in tests/data/comfyui_lora_keys_flux2.json.gz for
tests/test_ui_lora.py (which runs without ComfyUI), and ComfyUI's own LoRA loader run on the UI files
tests/tools/flux2_lora_files.py writes. Run with a Python that runs ComfyUI (not this project's .venv), from the
repository root:

    .venv/bin/python tests/tools/flux2_lora_files.py --output_dir models/flux2-loras
    /work/comfy-venv/bin/python tests/tools/comfyui_flux2_lora.py --comfyui /path/to/ComfyUI \\
        --folder models/flux2-loras [--write]

The transformer goes through comfy.sd.load_diffusion_model_state_dict (the UNETLoader node's path), which detects
FLUX.2 from its keys. ComfyUI's FLUX.2 detection before klein fixed 48 heads (FLUX.2 dev's); it now derives the heads
from the width (hidden size / 128: klein's 24 and 32); for a ComfyUI that still fixes 48, this tool applies the newer
rule, so that a transformer 2 heads wide loads (names do not depend on the width). comfy.lora.model_lora_keys_unet
gives the names load_lora_for_models (the LoraLoader node) matches a file's keys against; --write keeps its
`lora_unet_` names (kohya's, of FLUX.2's own modules) and `lycoris_` names (diffusers' modules, a slice of a fused
weight for the double blocks' q, k and v) that name a weight of the model: name -> [weight, ndim, [dim, start, size]
of the slice it patches or None, whether ComfyUI swaps the update's halves (the final norm's)].

Each LoRA folder's pytorch_lora_weights_ui.safetensors is loaded as the LoraLoader node loads it (strength 1, and
0.5), and every weight ComfyUI patches (comfy.lora.calculate_weight, in fp32) is compared with expected.safetensors,
the transformer with the adapter merged by peft (at 0.5: halfway between it and the base); the keys ComfyUI leaves
("lora key not loaded") are printed. ComfyUI's DoRA is not peft's (it divides by the base weight's norm): the DoRA file
is also compared with ComfyUI's own formula (tests/tools/comfyui_lora_keys.py check_lora).
"""
import argparse
import gzip
import json
import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "data", "comfyui_lora_keys_flux2.json.gz")
FOLDERS = ("default", "every", "dora", "loha", "lokr")


def load_transformer(comfy, path):
    """FLUX.2's transformer through ComfyUI's diffusion-model loader, its heads from its width as ComfyUI now does."""
    import torch

    detect = comfy.model_detection.detect_unet_config

    def detect_unet_config(state_dict, key_prefix, *args, **kwargs):
        config = detect(state_dict, key_prefix, *args, **kwargs)
        if config and config.get("image_model") == "flux2":
            config["num_heads"] = config["hidden_size"] // sum(config["axes_dim"])
        return config

    comfy.model_detection.detect_unet_config = detect_unet_config
    try:
        sd = comfy.utils.load_torch_file(path)
        return comfy.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": torch.float32})
    finally:
        comfy.model_detection.detect_unet_config = detect


def check(comfy, unet, folder, strength):
    """-> (keys not loaded, weights patched, the largest difference from the expected weights)."""
    import torch
    from safetensors.torch import load_file

    left = []
    handler = logging.Handler()
    handler.emit = lambda record: left.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    lora = comfy.utils.load_torch_file(os.path.join(folder, "pytorch_lora_weights_ui.safetensors"), safe_load=True)
    patched, _ = comfy.sd.load_lora_for_models(unet, None, lora, strength, 0.0)
    logging.getLogger().removeHandler(handler)
    not_loaded = [m for m in left if "lora key not loaded" in m or "NOT LOADED" in m]
    expected = load_file(os.path.join(folder, "expected.safetensors"))
    state = unet.model.state_dict()
    worst = 0.0
    for key, patches in patched.patches.items():
        weight = state[key].float()
        comfy_weight = comfy.lora.calculate_weight(patches, weight.clone(), key)
        merged = expected[key.removeprefix("diffusion_model.")].float()
        target = weight + strength * (merged - weight)
        worst = max(worst, ((comfy_weight - target).abs().max() / merged.abs().max()).item())
    unchanged = [k for k in expected if f"diffusion_model.{k}" not in patched.patches
                 and not torch.equal(expected[k].float(), state[f"diffusion_model.{k}"].float())]
    return not_loaded, len(patched.patches), worst, unchanged


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", required=True, help="A ComfyUI checkout (its folder with comfy/).")
    parser.add_argument("--folder", required=True, help="tests/tools/flux2_lora_files.py's --output_dir.")
    parser.add_argument("--write", action="store_true", help=f"Write the key map to {os.path.normpath(OUT)}.")
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    from comfyui_lora_keys import check_lora, import_comfy

    comfy = import_comfy(args.comfyui)  # (comfy.sd imports comfy.lora, comfy.model_detection, comfy.utils)
    unet = load_transformer(comfy, os.path.join(args.folder, "transformer.safetensors"))
    config = unet.model.model_config.unet_config
    print(f"{type(unet.model.model_config).__name__} ({type(unet.model).__name__}): hidden {config['hidden_size']}, "
          f"{config['num_heads']} heads, {config['depth']} double and {config['depth_single_blocks']} single blocks")
    state = unet.model.state_dict()
    names = {}
    for name, target in comfy.lora.model_lora_keys_unet(unet.model, {}).items():
        weight, offset = (target, None) if isinstance(target, str) else target[:2]
        if name.startswith(("lora_unet_", "lycoris_")) and weight in state:
            names[name] = [weight.removeprefix("diffusion_model."), state[weight].dim(), offset and list(offset),
                           not isinstance(target, str) and len(target) > 2]
    print(f"{sum(n.startswith('lora_unet_') for n in names)} lora_unet_ names, "
          f"{sum(n.startswith('lycoris_') for n in names)} lycoris_ names")
    for kind in FOLDERS:
        for strength in (1.0, 0.5):
            not_loaded, count, worst, unchanged = check(comfy, unet, os.path.join(args.folder, kind), strength)
            print(f"{kind} at strength {strength}: {count} weights patched, {len(not_loaded)} keys not loaded, "
                  f"largest difference from peft's merged weights {worst:.2e} (relative to the weight's largest); "
                  f"weights the adapter changes that ComfyUI left: {len(unchanged)}"
                  + "".join(f"\n  {m}" for m in not_loaded[:10] + unchanged[:10]))
    # DoRA: ComfyUI divides by the base weight's norm (m W' / ||W||, DoRA's is m W' / ||W'||): its formula on the file
    check_lora(comfy, unet, None, os.path.join(args.folder, "dora", "pytorch_lora_weights_ui.safetensors"))
    if args.write:
        text = json.dumps({"flux2": names}, indent=0, sort_keys=True, separators=(",", ":"))
        with open(OUT, "wb") as f:  # (no time stamp: the same bytes for the same map)
            f.write(gzip.compress(text.encode(), 9, mtime=0))
        print(f"wrote {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
