"""train_lora.py's Qwen-Image UI files through ComfyUI's own loader, and ComfyUI's Qwen-Image LoRA names pinned in
tests/data/comfyui_lora_keys_qwen_image.json.gz for tests/test_ui_lora.py (which runs without ComfyUI).

Run with a Python that runs ComfyUI (torch, transformers, safetensors, diffusers and peft: not this project's .venv),
from the repository root, on the tiny base (`make tiny-qwen-image`) and train_lora.py outputs trained on it:

    /path/to/comfy-python tests/tools/comfyui_qwen_image.py --comfyui /path/to/ComfyUI --base models/tiny-qwen-image \\
        --lora outputs/qwen-lora --lora outputs/qwen-dora [--write]

The base's transformer goes through comfy.sd.load_diffusion_model_state_dict (the UNETLoader node's path: ComfyUI's
model detection, its QwenImage model class, its weight loading). That detection reads a Qwen-Image transformer's
input channels and depth only and takes the rest of its shape from the real model (24 heads of 128, text states 3584
wide); for the tiny base the tool adds the widths of its config.json to what the detection returns, nothing else.
comfy.lora.model_lora_keys_unet then gives the names ComfyUI maps onto that model; --write keeps the
"diffusion_model.<module>" ones (ComfyUI's own, which train_lora.py writes) and the "transformer.<module>" ones
(diffusers'), each with the weight it patches and its shape.

Each --lora (a train_lora.py output folder) is loaded as the LoraLoader node does (comfy.sd.load_lora_for_models,
strength 1) from its pytorch_lora_weights_ui.safetensors: the "lora key not loaded" lines, the largest difference
between each weight ComfyUI patches and W + (alpha / rank) * up @ down (tests/tools/comfyui_lora_keys.py's
check_lora), and, end to end, ComfyUI's patched transformer against diffusers' (QwenImagePipeline.load_lora_weights of
the same folder) on one fixed input: the largest difference of their outputs, beside how far the LoRA moves them.
"""
import argparse
import gzip
import json
import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "data", "comfyui_lora_keys_qwen_image.json.gz")
WIDTHS = ("patch_size", "out_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim",
          "axes_dims_rope")


def load_transformer(comfy, base):
    """ComfyUI's QwenImage model of the base's transformer, through load_diffusion_model_state_dict, its detected
    config given the base's widths."""
    import torch

    with open(os.path.join(base, "transformer", "config.json")) as f:
        config = json.load(f)
    detect = comfy.model_detection.detect_unet_config

    def with_widths(*args, **kwargs):
        found = detect(*args, **kwargs)
        if found and found.get("image_model") == "qwen_image":
            found.update({key: tuple(config[key]) if isinstance(config[key], list) else config[key]
                          for key in WIDTHS})
        return found

    comfy.model_detection.detect_unet_config = with_widths
    try:
        sd = comfy.utils.load_torch_file(os.path.join(base, "transformer", "diffusion_pytorch_model.safetensors"))
        unet = comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.float32})
    finally:
        comfy.model_detection.detect_unet_config = detect
    return unet


def pinned_names(comfy, unet):
    """{name: [ComfyUI weight, its shape]} of model_lora_keys_unet, for the names of modules with a weight under
    ComfyUI's own `diffusion_model.` (what train_lora.py writes) and diffusers' `transformer.`."""
    state = unet.model.state_dict()
    return {name: [target, list(state[target].shape)]
            for name, target in comfy.lora.model_lora_keys_unet(unet.model, {}).items()
            if name.startswith(("diffusion_model.", "transformer.")) and isinstance(target, str) and target in state
            and target.endswith(".weight") and target.removeprefix("diffusion_model.")[:-7] == name.split(".", 1)[1]}


def end_to_end(comfy, unet, base, output):
    """ComfyUI's patched transformer and diffusers' with the LoRA loaded (its pytorch_lora_weights.safetensors, as
    QwenImagePipeline.load_lora_weights reads it), on one fixed input: -> (largest difference
    of their outputs, largest difference of diffusers' with and without the LoRA)."""
    import importlib.metadata

    import torch
    from packaging.version import InvalidVersion, Version

    try:
        Version(importlib.metadata.version("torchvision"))
    except (InvalidVersion, importlib.metadata.PackageNotFoundError):  # ComfyUI's torchvision stub here: no version,
        version = importlib.metadata.version  # which diffusers' and transformers' imports parse; any old one will do
        importlib.metadata.version = lambda name: "0.1" if name == "torchvision" else version(name)
    from diffusers import QwenImageTransformer2DModel
    from diffusers.loaders import QwenImageLoraLoaderMixin  # (QwenImagePipeline's loader, without its text model)

    lora = comfy.utils.load_torch_file(os.path.join(output, "pytorch_lora_weights_ui.safetensors"), safe_load=True)
    patched, _ = comfy.sd.load_lora_for_models(unet, None, lora, 1.0, 1.0)
    patched.patch_model()
    transformer = QwenImageTransformer2DModel.from_pretrained(base, subfolder="transformer", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 1, 8, 8, generator=g)
    context = torch.randn(1, 7, transformer.config.joint_attention_dim, generator=g)
    t = torch.tensor([0.6])

    def diffusers_out():  # QwenImagePipeline's packing and unpacking of one frame
        packed = x[:, :, 0].reshape(1, 16, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 16, 64)
        out = transformer(hidden_states=packed, timestep=t, encoder_hidden_states=context,
                          img_shapes=[[(1, 4, 4)]], return_dict=False)[0]
        return out.reshape(1, 4, 4, 16, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 16, 1, 8, 8)

    with torch.no_grad():
        plain = diffusers_out()
        state, metadata = QwenImageLoraLoaderMixin.lora_state_dict(output, return_lora_metadata=True)
        QwenImageLoraLoaderMixin.load_lora_into_transformer(state, transformer=transformer, metadata=metadata)
        theirs = diffusers_out()
        ours = patched.model.diffusion_model(x, t, context)
    patched.unpatch_model()
    return (ours - theirs).abs().max().item(), (theirs - plain).abs().max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", required=True, help="A ComfyUI checkout (its folder with comfy/).")
    parser.add_argument("--base", required=True, help="The tiny Qwen-Image pipeline (make tiny-qwen-image).")
    parser.add_argument("--lora", action="append", default=[], help="A train_lora.py output folder, repeatable.")
    parser.add_argument("--write", action="store_true", help=f"Write the key map to {os.path.normpath(OUT)}.")
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    from comfyui_lora_keys import check_lora, import_comfy

    comfy = import_comfy(args.comfyui)
    unet = load_transformer(comfy, args.base)
    names = pinned_names(comfy, unet)
    print(f"{args.base}: {type(unet.model.model_config).__name__}, {len(names)} LoRA module names")
    for output in args.lora:
        check_lora(comfy, unet, None, os.path.join(output, "pytorch_lora_weights_ui.safetensors"))
        difference, effect = end_to_end(comfy, unet, args.base, output)
        print(f"  end to end: ComfyUI's patched transformer vs diffusers' load_lora_weights: largest difference "
              f"{difference:.2e} (the LoRA moves the output by up to {effect:.2e})")
    if args.write:
        text = json.dumps(names, indent=0, sort_keys=True, separators=(",", ":"))
        with open(OUT, "wb") as f:  # (no time stamp: the same bytes for the same map)
            f.write(gzip.compress(text.encode(), 9, mtime=0))
        print(f"wrote {os.path.normpath(OUT)}")
    logging.shutdown()


if __name__ == "__main__":
    main()
