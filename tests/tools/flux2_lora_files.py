"""A FLUX.2 transformer in FLUX.2's own names and UI LoRA files for it, written by train_lora.py's own saving code
(common/lora_files.py save_lora_weights with the FLUX.2 klein family), for tests/tools/comfyui_flux2_lora.py to load
with ComfyUI's own loader. Run with this project's Python, from the repository root:

    .venv/bin/python tests/tools/flux2_lora_files.py --output_dir models/flux2-loras
    /work/comfy-venv/bin/python tests/tools/comfyui_flux2_lora.py --comfyui /path/to/ComfyUI \\
        --folder models/flux2-loras [--write]

The transformer: diffusers' Flux2Transformer2DModel with FLUX.2's fixed shapes where ComfyUI's loader fixes them
(heads of 128 with RoPE over 4 axes of 32, 128 latent channels, a 256-wide timestep embedding, guidance input), 2
heads wide (256), 2 blocks of each kind; saved in FLUX.2's own names (tests/tools/flux2_native.py) as
transformer.safetensors. Each LoRA folder (`default`: train_lora.py's default targets, rank 4, alpha 8; `every`: a
LoRA on every Linear layer, alpha 2; `dora`: the same as DoRA; `loha`, `lokr`: a LoHa, a LoKr on every Linear
layer) holds the files
save_lora_weights writes, its weights moved as if trained, and expected.safetensors: the transformer with that
adapter merged by peft, in FLUX.2's own names: what ComfyUI must compute from the UI file.
"""
import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
KINDS = {"default": ("lora", None, 4, 8, False), "every": ("lora", "every", 4, 2, False),
         "dora": ("lora", "every", 4, 2, True), "loha": ("loha", "every", 4, 2, False),
         "lokr": ("lokr", "every", 4, 2, False)}


def transformer():
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(in_channels=128, num_layers=2, num_single_layers=2, attention_head_dim=128,
                                   num_attention_heads=2, joint_attention_dim=64, timestep_guidance_channels=256,
                                   axes_dims_rope=(32, 32, 32, 32), guidance_embeds=True)


def merged_state(model):
    """The model's weights with its active adapter merged (peft's own merge), under the base model's names."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    return {key.replace(".base_layer", ""): value for key, value in model.state_dict().items()
            if not any(part in key for part in (".lora_", ".hada_", ".lokr_"))}


def main():
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, ROOT)  # (run as a file from tests/tools)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from types import SimpleNamespace

    from tools.flux2_native import native_state_dict

    from common.families import flux2_klein
    from common.lora_adapters import adapter_config, comma_list, expand_targets
    from common.lora_files import save_lora_weights

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="models/flux2-loras")
    args = parser.parse_args()
    base = transformer()
    os.makedirs(args.output_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in native_state_dict(base.state_dict()).items()},
              os.path.join(args.output_dir, "transformer.safetensors"))
    every = [name for name, m in base.named_modules() if isinstance(m, torch.nn.Linear)]
    for kind, (adapter, targets, rank, alpha, dora) in KINDS.items():
        model = transformer()
        targets = every if targets else expand_targets(model, comma_list(flux2_klein.LORA_TARGETS))
        flags = SimpleNamespace(adapter=adapter, rank=rank, lora_alpha=alpha, lora_dropout=0.0, use_dora=dora,
                                lokr_factor=-1)
        model.add_adapter(adapter_config(flags, targets))
        with torch.no_grad():
            for key, p in model.named_parameters():
                if any(part in key for part in (".lora_", ".hada_", ".lokr_")):
                    p.add_(0.05 * torch.randn_like(p))
        folder = os.path.join(args.output_dir, kind)
        save_lora_weights(folder, flux2_klein, {"transformer": model},
                          {"base_model": "tiny FLUX.2", "rank": rank, "lora_alpha": alpha, "adapter": adapter},
                          metadata=flux2_klein.base_metadata(model.config, None))
        save_file({k: v.contiguous() for k, v in native_state_dict(merged_state(model)).items()},
                  os.path.join(folder, "expected.safetensors"))
        print(f"wrote {folder}: {adapter} on {len(targets)} modules, rank {rank}, alpha {alpha}"
              + (", DoRA" if dora else ""))


if __name__ == "__main__":
    main()
