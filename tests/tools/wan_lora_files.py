"""A Wan 2.1 transformer ComfyUI can build and the LoRA files train_lora.py writes for it, with its outputs, for
tests/tools/comfyui_wan.py to judge with ComfyUI's own loader. Run with this project's Python, from the repository
root:

    .venv/bin/python tests/tools/wan_lora_files.py --output_dir models/wan-loras
    /path/to/comfy-python tests/tools/comfyui_wan.py --comfyui /path/to/ComfyUI --folder models/wan-loras [--write]

ComfyUI reads Wan in its original layout only (no converter for diffusers' WanTransformer3DModel) and takes its
heads (width / 128), UMT5's width (4096) and the frequency width (256) as fixed: the transformer here has 1 head of
128, Wan's text and frequency widths and 2 blocks, random-init, fp32. Its weights are written twice: diffusers'
layout (transformer/) and the original one (native.safetensors, the inverse of diffusers'
scripts/convert_wan_to_diffusers.py map). Each LoRA file is written by common/lora_files.py's save_lora_weights
(train_lora.py's writer) with rank 4, alpha 2, its weights moved as if trained: "default" on train_lora.py's default
targets (to_q, to_k, to_v, to_out.0 of both attentions of every block), "ffn" on those and the feed-forward layers,
"dora" a DoRA on the default targets. outputs.safetensors holds a fixed input (latents of 2 frames, a timestep, 12
text tokens) and the transformer's output on it: the base's, and each file's at LoRA scales 1 and 0.5 (ComfyUI's
strength).
"""
import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=1, attention_head_dim=128, in_channels=16, out_channels=16,
              text_dim=4096, freq_dim=256, ffn_dim=256, num_layers=2, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
KINDS = ("default", "ffn", "dora")
# diffusers' names -> the original layout's (scripts/convert_wan_to_diffusers.py's map, inverted; norm2 and norm3
# trade places: diffusers' norm2 is the cross-attention's, the original's norm3)
NATIVE = [("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
          ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
          ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
          ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
          ("condition_embedder.time_proj", "time_projection.1"), ("proj_out", "head.head"),
          ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), (".norm2.", ".norm3."),
          ("attn1.to_out.0", "self_attn.o"), ("attn2.to_out.0", "cross_attn.o"), ("attn1.to_", "self_attn."),
          ("attn2.to_", "cross_attn."), ("attn1.norm_", "self_attn.norm_"), ("attn2.norm_", "cross_attn.norm_")]


def native_name(key):
    if key == "scale_shift_table":
        return "head.modulation"
    if key.endswith(".scale_shift_table"):
        return key.replace(".scale_shift_table", ".modulation")
    for ours, theirs in NATIVE:
        key = key.replace(ours, theirs)
    return key


def main():
    import torch
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig
    from safetensors.torch import save_file

    sys.path.insert(0, ROOT)  # (run as a file from tests/tools)
    from common.families import wan
    from common.lora_files import save_lora_weights

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="models/wan-loras")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = WanTransformer3DModel(**CONFIG).eval()
    with torch.no_grad():  # (diffusers zero-initialises nothing that matters here; the norms' weights: moved a bit)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(os.path.join(args.output_dir, "transformer"))
    save_file({native_name(k): v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(args.output_dir, "native.safetensors"))
    g = torch.Generator().manual_seed(1)
    inputs = {"latents": torch.randn(1, 16, 2, 4, 4, generator=g), "timestep": torch.tensor([600.0]),
              "context": torch.randn(1, 12, CONFIG["text_dim"], generator=g)}

    def forward(scale=1.0):
        with torch.no_grad():
            return model(inputs["latents"], inputs["timestep"], inputs["context"], attention_kwargs={"scale": scale},
                         return_dict=False)[0]

    outputs = {**inputs, "base": forward()}
    for kind in KINDS:
        targets = wan.LORA_TARGETS.split(",") + (["ffn.net.0.proj", "ffn.net.2"] if kind == "ffn" else [])
        model.add_adapter(LoraConfig(r=4, lora_alpha=2, init_lora_weights="gaussian", target_modules=targets,
                                     use_dora=kind == "dora"))
        with torch.no_grad():
            for key, p in model.named_parameters():
                if "lora_" in key:
                    p.add_(0.05 * torch.randn_like(p))
        for scale in (1.0, 0.5):
            outputs[f"{kind}@{scale:g}"] = forward(scale)
        metadata = {"modelspec.implementation": "diffusers", **wan.base_metadata(model.config, None)}
        save_lora_weights(os.path.join(args.output_dir, kind), wan, {"transformer": model},
                          {"base_model": "random-init Wan 2.1", "rank": 4, "lora_alpha": 2}, metadata=metadata)
        model.delete_adapters("default")
    save_file({k: v.contiguous() for k, v in outputs.items()}, os.path.join(args.output_dir, "outputs.safetensors"))
    print(f"wrote the transformer (both layouts), {', '.join(KINDS)} LoRAs and outputs.safetensors to "
          f"{args.output_dir}")


if __name__ == "__main__":
    main()
