"""Z-Image LoRA files judged by ComfyUI's own loader, and ComfyUI's Z-Image LoRA names pinned in
tests/data/comfyui_lora_keys_z_image.json.gz for tests/test_ui_lora.py (which runs without ComfyUI). Run with a Python
that runs ComfyUI (see tests/tools/comfyui_lora_keys.py), from the repository root, on what
tests/tools/z_image_lora_files.py wrote:

    /path/to/comfy-python tests/tools/comfyui_z_image.py --comfyui /path/to/ComfyUI --folder models/z-image-loras \\
        [--write]

ComfyUI loads Z-Image in the original layout (Lumina 2's NextDiT: one fused attention.qkv weight per block, its own
names for the rest); it has no converter for a diffusers-format Z-Image transformer, so the diffusers weights are put
into that layout here with ComfyUI's own map, comfy.utils.z_image_to_diffusers (to_q, to_k and to_v each a third of
qkv), and loaded through comfy.sd.load_diffusion_model_state_dict (the UNETLoader node's path), which must detect
ComfyUI's ZImage model. Each LoRA file then goes through comfy.sd.load_lora_for_models (the LoraLoader node's path):
the keys ComfyUI leaves ("lora key not loaded"), each patched weight (or the third of qkv it patches) against
W + (alpha / rank) * up @ down (tests/tools/comfyui_lora_keys.py's check_lora), and the patched model's output on the
fixed input against diffusers' with the LoRA loaded, at strengths 1 and 0.5 (ComfyUI's NextDiT returns the negated
velocity, as ZImagePipeline negates the transformer's output).

--write keeps comfy.lora.model_lora_keys_unet's "diffusion_model.<diffusers module>" names (the UI file's), each ->
[ComfyUI's weight, [dim, start, size] of the slice a module patches or None], for the 2 main and 2 + 2 refiner blocks
of the tiny build's layout (the names repeat per block).
"""
import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from comfyui_lora_keys import check_lora, import_comfy  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "comfyui_lora_keys_z_image.json.gz")
KINDS = ("default", "every", "dora")
UI_FILE = "pytorch_lora_weights_ui.safetensors"


def comfy_layout(comfy, sd, config):
    """A diffusers ZImageTransformer2DModel state dict in ComfyUI's layout, by ComfyUI's own map; -> (it, the
    diffusers keys the map does not name)."""
    import torch

    key_map = comfy.utils.z_image_to_diffusers(config)
    out, unmapped = {}, []
    for key, weight in sd.items():
        target = key_map.get(key)
        if target is None:
            unmapped.append(key)
        elif isinstance(target, str):
            out[target] = weight
        else:
            name, (dim, start, size) = target[0], target[1]
            shape = list(weight.shape)
            shape[dim] = 3 * config["dim"]
            fused = out.setdefault(name, torch.zeros(shape, dtype=weight.dtype))
            fused.narrow(dim, start, size).copy_(weight)
    return out, unmapped


def forward(model_patcher, data):
    """ComfyUI's NextDiT on the fixed input (its timestep is the sigma)."""
    import torch

    with torch.no_grad():
        return model_patcher.model.diffusion_model(data["latents"], data["sigma"], data["caption"][None],
                                                   num_tokens=data["caption"].shape[0]).float()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", required=True, help="A ComfyUI checkout (its folder with comfy/).")
    parser.add_argument("--folder", required=True, help="What tests/tools/z_image_lora_files.py wrote.")
    parser.add_argument("--write", action="store_true", help=f"Write the key map to {os.path.normpath(OUT)}.")
    args = parser.parse_args()
    folder = os.path.abspath(args.folder)
    comfy = import_comfy(args.comfyui)
    import torch
    from safetensors.torch import load_file

    with open(os.path.join(folder, "transformer", "config.json")) as f:
        diffusers_config = json.load(f)
    config = {"n_layers": diffusers_config["n_layers"], "dim": diffusers_config["dim"],
              "n_refiner_layers": diffusers_config["n_refiner_layers"]}
    sd = {}
    for name in sorted(os.listdir(os.path.join(folder, "transformer"))):
        if name.endswith(".safetensors"):
            sd.update(load_file(os.path.join(folder, "transformer", name)))
    comfy_sd, unmapped = comfy_layout(comfy, sd, config)
    print(f"transformer: {len(sd)} diffusers tensors -> {len(comfy_sd)} in ComfyUI's layout; not in ComfyUI's map: "
          f"{unmapped or 'none'}")
    del sd
    model = comfy.sd.load_diffusion_model_state_dict(comfy_sd, model_options={"dtype": torch.float32})
    print(f"ComfyUI detects {type(model.model.model_config).__name__} ({type(model.model).__name__}, "
          f"unet_config {model.model.model_config.unet_config})")
    data = load_file(os.path.join(folder, "outputs.safetensors"))

    def compare(name, got):
        want = -data[name]  # (diffusers' raw output; ComfyUI's is negated)
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
        pinned = {}
        for name, target in keys.items():
            if name.startswith("diffusion_model.") and not isinstance(target, str):
                pinned[name] = [target[0], list(target[1])]
            elif name.startswith("diffusion_model."):
                pinned[name] = [target, None]
        text = json.dumps(pinned, indent=0, sort_keys=True, separators=(",", ":"))
        with open(OUT, "wb") as f:  # (no time stamp: the same bytes for the same map)
            f.write(gzip.compress(text.encode(), 9, mtime=0))
        print(f"wrote {len(pinned)} names to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
