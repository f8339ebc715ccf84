"""ComfyUI's own LoRA key map for Stable Diffusion 1.5 and SDXL, pinned in tests/data/comfyui_lora_keys.json.gz for
tests/test_ui_lora.py (which runs without ComfyUI), and ComfyUI's own LoRA loader run on LoRA files.

ComfyUI is not on the package registry: run this with a ComfyUI checkout and a Python that runs ComfyUI (torch,
transformers, safetensors, ...; not this project's .venv), from the repository root, on random-init bases of the real
architectures (nothing is downloaded; SDXL in bf16 takes 7 GB of memory instead of 14):

    .venv/bin/python -m demo.tiny_sd --architecture sd15 --output_dir models/sd15-random
    .venv/bin/python -c "import torch; torch.set_default_dtype(torch.bfloat16); from demo.tiny_sd import \
write_tiny_sd; write_tiny_sd('models/sdxl-random', 'sdxl')"
    /path/to/comfy-python tests/tools/comfyui_lora_keys.py --comfyui /path/to/ComfyUI --sd15 models/sd15-random \
        --sdxl models/sdxl-random [--write] [--lora sd15=outputs/lora-a/pytorch_lora_weights_ui.safetensors ...]

Each base's UNet goes through comfy.sd.load_diffusion_model (the UNETLoader node's path; it reads diffusers-format
UNets) and its text encoders through comfy.sd.load_text_encoder_state_dicts (the CLIPLoader / DualCLIPLoader path,
with CLIP's `text_model.` level that transformers 5 no longer writes). comfy.lora's model_lora_keys_unet and
model_lora_keys_clip give the names load_lora_for_models (the LoraLoader node) matches a LoRA file's keys against.
--write keeps the kohya-style ones ("lora_unet_...", "lora_te_...", "lora_te1_...", "lora_te2_...") in
tests/data/comfyui_lora_keys.json.gz (gzip: 25 KB instead of 500): per base, each name -> the model and diffusers
module whose weight ComfyUI patches (through ComfyUI's own comfy.utils.unet_to_diffusers for the UNet) and the number
of dimensions of that weight.

It also keeps, for SD3 and Flux.1, the "transformer.<diffusers module>" names comfy.lora reads for their
transformers (through comfy.utils.mmdit_to_diffusers and flux_to_diffusers: ComfyUI's weight, the slice of it a
module's LoRA patches, and whether it swaps its halves), and the names it reads for the CLIP text encoders beside
them, diffusers' "text_encoder." and "text_encoder_2." (from the SDXL base's map).

--sd3 DIR / --flux DIR load a transformer that tests/tools/flow_lora_files.py wrote (with load_diffusion_model, as
the UNets), for --lora sd3=FILE / flux=FILE.

--lora BASE=FILE loads FILE through comfy.sd.load_lora_for_models (strengths 1) and prints the keys ComfyUI leaves
("lora key not loaded"), the weights it patches, and per patched weight the largest difference between ComfyUI's
patched weight (comfy.lora.calculate_weight, in fp32) and W + (alpha / rank) * up @ down; with a `dora_scale`, against
DoRA as peft defines it (m * W' / ||W'||, one norm per output row of W' = W + (alpha / rank) * up @ down) and against
m * W' / ||W|| (the norm of the base weight, what ComfyUI computes for a per-output-row dora_scale).
"""
import argparse
import gzip
import json
import logging
import os
import sys

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "comfyui_lora_keys.json.gz")
PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_")
DIFFUSERS_TEXT = ("text_encoder.", "text_encoder_2.")  # CLIP under diffusers' names (SD3's and Flux.1's LoRAs)
ENCODERS = {"clip_l": "text_encoder", "clip_h": "text_encoder", "clip_g": "text_encoder_2"}


def import_comfy(path):
    sys.path.insert(0, os.path.abspath(path))
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.sd

    return comfy


def text_encoder_state(comfy, folder):
    """A transformers CLIP text model's weights with CLIP's `text_model.` level, as ComfyUI's CLIP loader reads them."""
    sd = comfy.utils.load_torch_file(os.path.join(folder, "model.safetensors"))
    return {k if k.startswith(("text_model.", "text_projection")) else "text_model." + k: v for k, v in sd.items()}


def load_base(comfy, base):
    import torch

    unet = comfy.sd.load_diffusion_model(os.path.join(base, "unet", "diffusion_pytorch_model.safetensors"),
                                         model_options={"dtype": torch.bfloat16})  # SDXL's in 5 GB, not 10
    encoders = [text_encoder_state(comfy, os.path.join(base, name)) for name in ("text_encoder", "text_encoder_2")
                if os.path.isdir(os.path.join(base, name))]
    clip = comfy.sd.load_text_encoder_state_dicts(encoders, clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION)
    return unet, clip


def key_map(comfy, unet, clip):
    """{kohya-style name: [model ("unet", "text_encoder", "text_encoder_2"), diffusers module path, weight ndim]}."""
    unet_keys = comfy.lora.model_lora_keys_unet(unet.model, {})
    clip_keys = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {})
    diffusers = {}  # ComfyUI's UNet weight -> the diffusers UNet weight(s) it comes from, by ComfyUI's own map
    for diffusers_key, sgm_key in comfy.utils.unet_to_diffusers(unet.model.model_config.unet_config).items():
        diffusers.setdefault("diffusion_model." + sgm_key, []).append(diffusers_key)
    unet_sd, clip_sd = unet.model.state_dict(), clip.cond_stage_model.state_dict()
    names = {}
    for name, target in unet_keys.items():
        if name.startswith("lora_unet_") and target in unet_sd:  # (the map names weights some UNets lack)
            modules = sorted(k[:-len(".weight")] for k in diffusers[target] if k.endswith(".weight"))
            names[name] = ["unet", modules, unet_sd[target].dim()]
    for name, target in clip_keys.items():
        if name.startswith((*PREFIXES, *DIFFUSERS_TEXT)) and not name.startswith("lora_unet_") and target in clip_sd:
            encoder, _, module = target.partition(".transformer.")
            names[name] = [ENCODERS[encoder], [module[:-len(".weight")]], clip_sd[target].dim()]
    return names


def transformer_map(comfy, family):
    """{"transformer.<diffusers module>": [ComfyUI weight, [dim, start, size] of a slice of it or None, whether ComfyUI
    swaps the two halves of its rows]}: the names model_lora_keys_unet gives SD3's and Flux.1's transformers
    (comfy.utils.mmdit_to_diffusers and flux_to_diffusers), for 2 blocks of each kind (the names repeat per block)."""
    if family == "flux":
        pairs = comfy.utils.flux_to_diffusers({"depth": 2, "depth_single_blocks": 2, "hidden_size": 3072},
                                              output_prefix="diffusion_model.")
    else:
        pairs = comfy.utils.mmdit_to_diffusers({"depth": 2, "num_blocks": 2}, output_prefix="diffusion_model.")
    names = {}
    for key, target in pairs.items():
        if key.endswith(".weight"):
            target = (target, None) if isinstance(target, str) else target
            names["transformer." + key[:-len(".weight")]] = [target[0], target[1] and list(target[1]),
                                                             len(target) > 2]
    return names


SUFFIXES = {"lora_down.weight": "down", "lora_up.weight": "up", "lora_A.weight": "down", "lora_B.weight": "up",
            "alpha": "alpha", "dora_scale": "dora_scale"}


def check_lora(comfy, unet, clip, file):
    """Loads `file` as the LoraLoader node does (clip None: a transformer alone, as for SD3's and Flux.1's) and compares
    each patched weight, or the slice of it a module patches, with the LoRA formula."""
    left = []
    handler = logging.Handler()
    handler.emit = lambda record: left.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    lora = comfy.utils.load_torch_file(file, safe_load=True)
    new_unet, new_clip = comfy.sd.load_lora_for_models(unet, clip, lora, 1.0, 1.0)
    logging.getLogger().removeHandler(handler)
    not_loaded = [m for m in left if "lora key not loaded" in m or "NOT LOADED" in m]
    print(f"{file}: {len(lora)} tensors, {len(not_loaded)} not loaded by ComfyUI" +
          "".join(f"\n  {m}" for m in not_loaded[:10]))
    keys = comfy.lora.model_lora_keys_unet(unet.model, {})
    if clip is not None:
        keys = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, keys)
    modules = {}  # the file's module name -> {"down", "up", "alpha", "dora_scale"}
    for key, value in lora.items():
        name, part = next(((key[:-len(s) - 1], p) for s, p in SUFFIXES.items() if key.endswith("." + s)), (key, None))
        modules.setdefault(name, {})[part] = value.float()
    states = {"unet": unet.model.state_dict(), "clip": clip.cond_stage_model.state_dict() if clip else {}}
    patches = {**new_unet.patches, **(new_clip.patcher.patches if clip else {})}
    worst = {"lora": 0.0, "dora (peft)": 0.0, "dora (||W||)": 0.0}
    row_norm = lambda w: w.flatten(1).norm(dim=1).reshape(-1, *[1] * (w.dim() - 1))  # noqa: E731
    for name, parts in modules.items():
        if name not in keys or "up" not in parts:
            continue
        target = keys[name] if isinstance(keys[name], tuple) else (keys[name],)
        key, offset, function = (*target, None, None)[:3]
        weight = (states["unet"][key] if key in states["unet"] else states["clip"][key]).float()
        comfy_weight = comfy.lora.calculate_weight(patches[key], weight.clone(), key)
        if offset is not None:  # (e.g. Flux.1's to_q: the first third of ComfyUI's fused qkv weight)
            weight, comfy_weight = weight.narrow(*offset), comfy_weight.narrow(*offset)
        down, up = parts["down"], parts["up"]
        alpha = parts["alpha"].item() if "alpha" in parts else down.shape[0]
        update = alpha / down.shape[0] * (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
        adapted = weight + (function(update) if function else update)
        if "dora_scale" not in parts:
            worst["lora"] = max(worst["lora"], (comfy_weight - adapted).abs().max().item())
            continue
        for kind, norm in (("dora (peft)", row_norm(adapted)), ("dora (||W||)", row_norm(weight))):
            expected = parts["dora_scale"] * adapted / norm
            worst[kind] = max(worst[kind], ((comfy_weight - expected).abs().max() / expected.abs().max()).item())
    print(f"  {len(patches)} weights patched; largest difference from the formula: "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + " (dora: relative to the largest weight)")
    return not_loaded, len(patches), worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", required=True, help="A ComfyUI checkout (its folder with comfy/).")
    parser.add_argument("--sd15", help="A random-init SD 1.5 pipeline folder (demo/tiny_sd.py --architecture sd15).")
    parser.add_argument("--sdxl", help="A random-init SDXL pipeline folder (demo/tiny_sd.py --architecture sdxl).")
    parser.add_argument("--sd3", help="A folder with an SD3 transformer/ (tests/tools/flow_lora_files.py).")
    parser.add_argument("--flux", help="A folder with a Flux.1 transformer/ (tests/tools/flow_lora_files.py).")
    parser.add_argument("--write", action="store_true", help=f"Write the key maps to {os.path.normpath(OUT)}.")
    parser.add_argument("--lora", action="append", default=[],
                        help="BASE=FILE (BASE: sd15, sdxl, sd3 or flux), repeatable.")
    args = parser.parse_args()
    comfy = import_comfy(args.comfyui)
    pinned = {}
    for base, path in (("sd15", args.sd15), ("sdxl", args.sdxl), ("sd3", args.sd3), ("flux", args.flux)):
        if not path:
            continue
        if base in ("sd3", "flux"):
            import torch

            unet, clip = comfy.sd.load_diffusion_model(os.path.join(
                path, "transformer", "diffusion_pytorch_model.safetensors"), {"dtype": torch.bfloat16}), None
            print(f"{base}: {type(unet.model.model_config).__name__}")
        else:
            unet, clip = load_base(comfy, path)
            pinned[base] = key_map(comfy, unet, clip)
            print(f"{base}: {type(unet.model.model_config).__name__}, {len(pinned[base])} kohya-style LoRA names")
        for spec in args.lora:
            name, _, file = spec.partition("=")
            if name == base:
                check_lora(comfy, unet, clip, file)
        del unet, clip
    if args.write:  # (SD 1.5's and SDXL's maps come from the bases given)
        pinned.update({family: transformer_map(comfy, family) for family in ("flux", "sd3")})
        text = json.dumps(pinned, indent=0, sort_keys=True, separators=(",", ":"))
        with open(OUT, "wb") as f:  # (no time stamp: the same bytes for the same map)
            f.write(gzip.compress(text.encode(), 9, mtime=0))
        print(f"wrote {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
