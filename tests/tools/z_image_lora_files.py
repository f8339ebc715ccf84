"""A Z-Image transformer at Z-Image's own width and the LoRA files train_lora.py writes for it, with its outputs, for
tests/tools/comfyui_z_image.py to judge with ComfyUI's own loader. Run with this project's Python, from the repository
root:

    .venv/bin/python tests/tools/z_image_lora_files.py --output_dir models/z-image-loras
    /path/to/comfy-python tests/tools/comfyui_z_image.py --comfyui /path/to/ComfyUI --folder models/z-image-loras

ComfyUI tells a Z-Image transformer by its width (3840: 30 heads of 128) and always builds 2 refiner blocks of each
kind: the transformer here has Z-Image's width, refiners and caption width (Qwen3-4B's 2560) and 2 main blocks of its
30, random-init, 1.1 G parameters, saved in bf16 (2.2 GB). Each LoRA file is written by common/lora_files.py's
save_lora_weights (train_lora.py's writer) with rank 4, alpha 2, its weights moved as if trained: "default" on
train_lora.py's default targets (to_q, to_k, to_v, to_out.0 of every block), "every" on every Linear layer, "dora" a
DoRA on the default targets. outputs.safetensors holds a fixed input (latents, sigma, 20 caption tokens) and the
transformer's output on it in fp32 (its bf16 weights upcast): the base's, and each file's at LoRA scales 1 and 0.5
(ComfyUI's strength).
"""
import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CONFIG = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=2, n_refiner_layers=2,
              n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
              t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])  # Z-Image-Turbo's, 2 main blocks
KINDS = ("default", "every", "dora")


def main():
    import torch
    from diffusers import ZImageTransformer2DModel
    from peft import LoraConfig
    from safetensors.torch import save_file

    sys.path.insert(0, ROOT)  # (run as a file from tests/tools)
    from common.families import z_image
    from common.lora_files import save_lora_weights

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="models/z-image-loras")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = ZImageTransformer2DModel(**CONFIG)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for token in (model.x_pad_token, model.cap_pad_token):
            token.normal_(std=0.02)
    model.save_pretrained(os.path.join(args.output_dir, "transformer"))
    model.float().eval()
    g = torch.Generator().manual_seed(1)
    inputs = {"latents": torch.randn(1, 16, 8, 8, generator=g), "sigma": torch.tensor([0.6]),
              "caption": torch.randn(20, CONFIG["cap_feat_dim"], generator=g)}

    def forward(scale=1.0):
        with torch.no_grad():
            out = model(list(inputs["latents"].unsqueeze(2).unbind(0)), 1 - inputs["sigma"], [inputs["caption"]],
                        joint_attention_kwargs={"scale": scale}, return_dict=False)[0]
        return torch.stack(out).squeeze(2)

    outputs = {**inputs, "base": forward()}
    layers = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for kind in KINDS:
        targets = layers if kind == "every" else z_image.LORA_TARGETS.split(",")
        model.add_adapter(LoraConfig(r=4, lora_alpha=2, init_lora_weights="gaussian", target_modules=targets,
                                     use_dora=kind == "dora"))
        with torch.no_grad():
            for key, p in model.named_parameters():
                if "lora_" in key:
                    p.add_(0.02 * torch.randn_like(p))
        for scale in (1.0, 0.5):
            outputs[f"{kind}@{scale:g}"] = forward(scale)
        metadata = {"modelspec.implementation": "diffusers", **z_image.base_metadata(model.config, None)}
        save_lora_weights(os.path.join(args.output_dir, kind), z_image, {"transformer": model},
                          {"base_model": "random-init Z-Image", "rank": 4, "lora_alpha": 2}, metadata=metadata)
        model.delete_adapters("default")
    save_file({k: v.contiguous() for k, v in outputs.items()}, os.path.join(args.output_dir, "outputs.safetensors"))
    print(f"wrote the transformer, {', '.join(KINDS)} LoRAs and outputs.safetensors to {args.output_dir}")


if __name__ == "__main__":
    main()
