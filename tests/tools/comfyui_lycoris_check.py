"""A train_lora.py LoHa or LoKr through ComfyUI's own LoRA loader: the update ComfyUI adds to each weight, against the
one peft adds in the trained model. Two steps, as ComfyUI has its own Python (not this project's .venv) and cannot
load the tiny bases as models (its model detection wants the real widths):

    .venv/bin/python tests/tools/comfyui_lycoris_check.py --output outputs/loha --expected /tmp/loha.safetensors
    /path/to/comfy-python tests/tools/comfyui_lycoris_check.py --comfyui /path/to/ComfyUI \\
        --lora outputs/loha/pytorch_lora_weights_ui.safetensors --expected /tmp/loha.safetensors

The first step loads the output as sample.py does (its base, then peft_adapter_weights.safetensors through peft) and
writes, under each module's name in the UI file (the family's ui_lora names), the base weight (`<name>.weight`) and
peft's update of it (`<name>.delta`: the adapter layer's get_delta_weight). The second loads the UI file with
comfy.lora.load_lora (the LoraLoader node's parser: "lora key not loaded" for every tensor it leaves), each name mapped
to its own weight, then applies every patch with comfy.lora.calculate_weight (strength 1) and prints the largest
difference from weight + delta. Which weight ComfyUI patches for a name is its key map's business (pinned and checked
in tests/test_ui_lora.py and tests/test_lycoris.py); --flux DEPTH,SINGLE also checks the names against
comfy.utils.flux_to_diffusers for a Flux.1 transformer of that many blocks.
"""
import argparse
import logging
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def write_expected(output, path):
    import diffusers
    import torch
    from peft.tuners.lycoris_utils import LycorisLayer
    from safetensors.torch import save_file

    sys.path.insert(0, ROOT)
    from common.families import family_module, family_of
    from common.lora_files import load_peft_adapters, read_lora_info

    base = read_lora_info(output)["base_model"]
    family = family_module(family_of(base, "--output"))
    pipe = getattr(diffusers, family.PIPELINE).from_pretrained(base, dtype=torch.float32)
    load_peft_adapters(pipe, output, "checked")
    layers, probe = {}, {}
    for component in (family.DENOISER, *family.LORA_TEXT_ENCODERS):
        for module, layer in getattr(pipe, component).named_modules():
            if isinstance(layer, LycorisLayer) and "checked" in layer._available_adapters:
                layers[len(layers)] = layer
                probe.setdefault(component, {})[f"{module}.lokr_w1"] = torch.full((1, 1), float(len(layers) - 1))
    names = family.ui_lora(probe, 1.0, getattr(pipe, family.DENOISER).config)  # each module's name in the UI file
    expected = {}
    with torch.no_grad():
        for key, value in names.items():
            if key.endswith(".lokr_w1"):
                layer, name = layers[int(value.item())], key.removesuffix(".lokr_w1")
                expected[f"{name}.weight"] = layer.get_base_layer().weight.detach().float().contiguous()
                expected[f"{name}.delta"] = layer.get_delta_weight("checked").float().contiguous()
    save_file(expected, path)
    print(f"{path}: {len(expected) // 2} adapted weights of {output} ({base})")


def check_with_comfyui(comfyui, lora_file, path, flux):
    from safetensors.torch import load_file

    sys.path.insert(0, os.path.abspath(comfyui))
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.lora
    import comfy.sd
    import comfy.utils

    expected = load_file(path)
    left = []
    handler = logging.Handler()
    handler.emit = lambda record: left.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    lora = comfy.utils.load_torch_file(lora_file, safe_load=True)
    names = [key.removesuffix(".weight") for key in expected if key.endswith(".weight")]
    patches = comfy.lora.load_lora(lora, {name: f"{name}.weight" for name in names})
    logging.getLogger().removeHandler(handler)
    not_loaded = [m for m in left if "lora key not loaded" in m]
    kinds = sorted({type(p).__name__ for p in patches.values()})
    print(f"{lora_file}: {len(lora)} tensors; comfy.lora.load_lora: {len(patches)} weights patched ({', '.join(kinds)})"
          f", {len(not_loaded)} keys not loaded" + "".join(f"\n  {m}" for m in not_loaded[:10]))
    worst, largest = 0.0, 0.0
    for name in names:
        weight = expected[f"{name}.weight"]
        patched = comfy.lora.calculate_weight([(1.0, patches[f"{name}.weight"], 1.0, None, None)], weight.clone(),
                                              f"{name}.weight")
        worst = max(worst, (patched - weight - expected[f"{name}.delta"]).abs().max().item())
        largest = max(largest, expected[f"{name}.delta"].abs().max().item())
    print(f"  largest difference between ComfyUI's patched weight and weight + peft's update: {worst:.2e} (the "
          f"largest update entry: {largest:.2e})")
    if flux:
        depth, single = (int(n) for n in flux.split(","))
        pairs = comfy.utils.flux_to_diffusers({"depth": depth, "depth_single_blocks": single, "hidden_size": 3072},
                                              output_prefix="diffusion_model.")
        known = {"transformer." + k.removesuffix(".weight") for k in pairs if k.endswith(".weight")}
        unknown = [n for n in names if n.startswith("transformer.") and n not in known]
        print(f"  transformer names ComfyUI's Flux.1 map lacks: {unknown[:5] or 'none'}")
    return not_loaded, worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="A train_lora.py LoHa or LoKr output (step 1, this project's Python).")
    parser.add_argument("--expected", required=True, help="The file step 1 writes and step 2 reads.")
    parser.add_argument("--comfyui", help="A ComfyUI checkout (step 2, ComfyUI's Python).")
    parser.add_argument("--lora", help="The output's pytorch_lora_weights_ui.safetensors (step 2).")
    parser.add_argument("--flux", default=None, help="DEPTH,SINGLE: the Flux.1 transformer's block counts (step 2).")
    args = parser.parse_args()
    if args.comfyui:
        check_with_comfyui(args.comfyui, args.lora, args.expected, args.flux)
    else:
        write_expected(args.output, args.expected)


if __name__ == "__main__":
    main()
