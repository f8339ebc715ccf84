"""Wan LoRA files judged by ComfyUI's own loader, and ComfyUI's Wan LoRA names pinned in
tests/data/comfyui_lora_keys_wan.json.gz for tests/test_ui_lora.py (which runs without ComfyUI). Run with a Python that
runs ComfyUI (see tests/tools/comfyui_lora_keys.py), from the repository root, on what tests/tools/wan_lora_files.py
wrote:

    /path/to/comfy-python tests/tools/comfyui_wan.py --comfyui /path/to/ComfyUI --folder models/wan-loras [--write]

The transformer's original-layout weights (native.safetensors) go through comfy.sd.load_diffusion_model_state_dict
(the UNETLoader node's path), which must detect ComfyUI's WAN21 model. Each LoRA file then goes through
comfy.sd.load_lora_for_models (the LoraLoader node's path): the keys ComfyUI leaves ("lora key not loaded"), each
patched weight against W + (alpha / rank) * up @ down (tests/tools/comfyui_lora_keys.py's check_lora), and the
patched model's output on the fixed input against diffusers' with the LoRA loaded, at strengths 1 and 0.5.

--write keeps comfy.lora.model_lora_keys_unet's "diffusion_model.<module>" names (the UI file's), each -> ComfyUI's
weight, for the tiny layout's 2 blocks (the names repeat per block).
"""
import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from comfyui_lora_keys import check_lora, import_comfy  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "comfyui_lora_keys_wan.json.gz")
KINDS = ("default", "ffn", "dora")
UI_FILE = "pytorch_lora_weights_ui.safetensors"


def forward(model_patcher, data):
    """ComfyUI's WanModel on the fixed input (its timestep in the scheduler's units, as diffusers')."""
    import torch

    with torch.no_grad():
        return model_patcher.model.diffusion_model(data["latents"], data["timestep"], data["context"]).float()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", required=True, help="A ComfyUI checkout (its folder with comfy/).")
    parser.add_argument("--folder", required=True, help="What tests/tools/wan_lora_files.py wrote.")
    parser.add_argument("--write", action="store_true", help=f"Write the key map to {os.path.normpath(OUT)}.")
    args = parser.parse_args()
    folder = os.path.abspath(args.folder)
    comfy = import_comfy(args.comfyui)
    import torch
    from safetensors.torch import load_file

    model = comfy.sd.load_diffusion_model_state_dict(load_file(os.path.join(folder, "native.safetensors")),
                                                     model_options={"dtype": torch.float32})
    print(f"ComfyUI detects {type(model.model.model_config).__name__} ({type(model.model).__name__}, "
          f"unet_config {model.model.model_config.unet_config})")
    data = load_file(os.path.join(folder, "outputs.safetensors"))

    def compare(name, got):
        want = data[name]
        error = ((got - want).abs().max() / want.abs().max()).item()
        change = ((data[name] - data["base"]).abs().max() / want.abs().max()).item()
        print(f"  output {name}: largest difference from diffusers' {error:.2e} (relative; the LoRA moves it "
              f"{change:.2e})" if name != "base" else f"  output of the base: largest difference from diffusers' "
              f"{error:.2e} (relative)")

    compare("base", forward(model, data))
    for kind in KINDS:
        file = os.path.join(folder, kind, UI_FILE)
        check_lora(comfy, model, None, file)
        lora = comfy.utils.load_torch_file(file, safe_load=True)
        for strength in (1.0, 0.5):
            patched, _ = comfy.sd.load_lora_for_models(model, None, lora, strength, 0)
            patched.patch_model()
            compare(f"{kind}@{strength:g}", forward(patched, data))
            patched.unpatch_model()
    if args.write:
        keys = comfy.lora.model_lora_keys_unet(model.model, {})
        pinned = {name: target for name, target in keys.items()
                  if name.startswith("diffusion_model.blocks.") and isinstance(target, str)}
        text = json.dumps(pinned, indent=0, sort_keys=True, separators=(",", ":"))
        with open(OUT, "wb") as f:  # (no time stamp: the same bytes for the same map)
            f.write(gzip.compress(text.encode(), 9, mtime=0))
        print(f"wrote {len(pinned)} names to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
