"""SD3 and Flux.1 transformers and LoRA files for them in the UIs' names (common/ui_lora.py's prefixed_lora), for
tests/tools/comfyui_lora_keys.py to load with ComfyUI's own loader. Run with this project's Python, from the
repository root:

    .venv/bin/python tests/tools/flow_lora_files.py --output_dir models/flow-loras
    /path/to/comfy-python tests/tools/comfyui_lora_keys.py --comfyui /path/to/ComfyUI \\
        --sd3 models/flow-loras/sd3 --lora sd3=models/flow-loras/sd3/lora.safetensors \\
        --lora sd3=models/flow-loras/sd3/dora.safetensors --flux models/flow-loras/flux \\
        --lora flux=models/flow-loras/flux/lora.safetensors --lora flux=models/flow-loras/flux/dora.safetensors

Random-init transformers whose widths ComfyUI's model detection accepts: Flux.1-dev's own (ComfyUI fixes 24 heads of
128) with one block of each kind, 1.1 GB in bf16; SD3 with 2 blocks 128 wide (ComfyUI reads 64 per block). Each gets
a LoRA (rank 4, alpha 2) and a DoRA on every Linear and Conv2d, its weights moved as if trained.
"""
import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def transformers():
    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    flux = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    torch.set_default_dtype(torch.float32)
    sd3 = SD3Transformer2DModel(sample_size=32, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=64,
                                num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=128,
                                pooled_projection_dim=64, pos_embed_max_size=32)
    # the modules whose weight ComfyUI holds with its halves swapped (scale/shift order): prefixed_lora's argument
    return {"flux": (flux, ("norm_out.linear",)), "sd3": (sd3, ("norm_out.linear",
                                                              "transformer_blocks.1.norm1_context.linear"))}


def main():
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    sys.path.insert(0, ROOT)  # (run as a file from tests/tools)
    from common.ui_lora import prefixed_lora

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="models/flow-loras")
    args = parser.parse_args()
    for family, (model, swapped) in transformers().items():
        folder = os.path.join(args.output_dir, family)
        model.save_pretrained(os.path.join(folder, "transformer"))
        model.float()
        layers = [name for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
        for kind in ("lora", "dora"):
            model.add_adapter(LoraConfig(r=4, lora_alpha=2, init_lora_weights="gaussian", target_modules=layers,
                                         use_dora=kind == "dora"), adapter_name=f"ui_{kind}")
            with torch.no_grad():
                for key, p in model.named_parameters():
                    if f".ui_{kind}." in key:
                        p.add_(0.05 * torch.randn_like(p))
            state = get_peft_model_state_dict(model, adapter_name=f"ui_{kind}")
            save_file(prefixed_lora(state, 2, "transformer", swapped_halves=swapped),
                      os.path.join(folder, f"{kind}.safetensors"))
        print(f"wrote {folder}: transformer/, lora.safetensors, dora.safetensors ({len(layers)} modules)")


if __name__ == "__main__":
    main()
