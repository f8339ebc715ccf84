"""LoRA weights in the kohya key format, which A1111, ComfyUI and diffusers' own loader read.

`lora_unet_<module path, dots as underscores>.lora_down.weight` (peft's lora_A), `.lora_up.weight` (lora_B) and
`.alpha`; `lora_te_...` for the CLIP text encoder. diffusers writes its own names, which ComfyUI reports as
"lora key not loaded".
"""
KOHYA_WEIGHTS = "pytorch_lora_weights_kohya.safetensors"


def peft_to_kohya(state_dict, alpha, prefix):
    """state_dict: `get_peft_model_state_dict(model)` (keys `<module>.lora_A.weight` / `.lora_B.weight`)."""
    import torch

    names = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight"}
    kohya = {}
    for key, value in state_dict.items():
        module, _, kind = key.rpartition(".lora_")
        if "lora_" + kind not in names:
            raise ValueError(f"kohya export: unsupported LoRA tensor '{key}' (DoRA and biases have no kohya name)")
        name = f"{prefix}_{module.replace('.', '_')}"
        kohya[f"{name}.{names['lora_' + kind]}"] = value.detach().contiguous()
        kohya[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=value.dtype)
    return kohya


def save_kohya(path, unet_state, alpha, text_encoder_state=None):
    from safetensors.torch import save_file

    kohya = peft_to_kohya(unet_state, alpha, "lora_unet")
    if text_encoder_state:
        kohya.update(peft_to_kohya(text_encoder_state, alpha, "lora_te"))
    save_file(kohya, path, metadata={"format": "pt"})
