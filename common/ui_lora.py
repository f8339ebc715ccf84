"""LoRA files for the UIs: a peft LoRA state dict -> the tensor names ComfyUI, Forge and A1111 read, with each
module's alpha and DoRA magnitudes in the form they apply.

A UI applies a LoRA module as W + (alpha / rank) * up @ down, with alpha from `<module>.alpha` and the rank from the
down weight; without an `.alpha` it applies up @ down at scale 1 (ComfyUI's comfy/weight_adapter/lora.py, A1111's
extensions-builtin/Lora/network.py). peft's scale is lora_alpha / r, so every module gets its `.alpha`: a LoRA trained
with alpha != rank then loads at the strength it was trained at.

DoRA: peft keeps one magnitude per output channel (`lora_magnitude_vector`: [out] for a Linear, [1, out, 1, 1] for a
Conv2d). ComfyUI and Forge read `<module>.dora_scale` as per output channel when its first dimension is the weight's
output size, and divide it by a norm of shape [out, 1] ([out, 1, 1, 1] for a convolution): written in that shape it
divides row by row (a 1-D [out] would broadcast to [out, out]). A1111 reads `dora_scale` per input channel only, so no
file can carry peft's DoRA to A1111.

Two namings: kohya's, `<prefix>_<module path, dots as underscores>.lora_down.weight` / `.lora_up.weight` (what A1111,
Forge and ComfyUI read for SD 1.x/2.x and SDXL), and diffusers' module paths under a prefix,
`transformer.<module>.lora_A.weight` / `.lora_B.weight` (how ComfyUI and Forge read SD3 and Flux.1 LoRAs, through
comfy/utils.py's mmdit_to_diffusers and flux_to_diffusers). Nothing else of common/ is imported: a model family passes
its own renaming (SDXL's UNet: the sgm names of kohya's SDXL files).

LyCORIS's LoHa and LoKr (peft's LoHaConfig, LoKrConfig) go under the same module names with LyCORIS's weight names,
which are peft's too: `.hada_w1_a`, `.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b` (update (w1_a @ w1_b) * (w2_a @ w2_b)),
`.lokr_w1` or `.lokr_w1_a`/`.lokr_w1_b`, `.lokr_w2` or `.lokr_w2_a`/`.lokr_w2_b` (update kron(w1, w2)), and `.alpha`.
ComfyUI (comfy/weight_adapter/loha.py, lokr.py) scales a LoHa by alpha / (rows of hada_w1_b) and a LoKr by alpha /
(rows of its lokr_w2_b, else of its lokr_w1_b), which is peft's alpha / r; a LoKr with both factors full it applies at
scale 1 where peft applies alpha / r: bake_lokr_scale moves that scale into lokr_w1 (as diffusers'
_bake_lokr_alpha_ does when it reads such files)."""
from .cli import UserError

# ModelSpec's `modelspec.implementation` of a file whose names are those of Stability AI's own ("sgm") UNet, as kohya's
# SDXL LoRA files say (kohya-ss/sd-scripts library/sai_model_spec.py); a file with diffusers' module names says
# "diffusers".
SGM_IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"
DIFFUSERS_IMPLEMENTATION = "diffusers"

KOHYA_SUFFIXES = ("lora_down.weight", "lora_up.weight")
DIFFUSERS_SUFFIXES = ("lora_A.weight", "lora_B.weight")
MAGNITUDES = ("magnitude_vector", "magnitude_vector.weight")  # peft's name, and diffusers' text-encoder name
# LoHa's and LoKr's weights, peft's names and LyCORIS's (peft's effective-Conv2d tensors hada_t*/lokr_t2: not written)
LYCORIS_WEIGHTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2",
                   "lokr_w2_a", "lokr_w2_b")


def bake_lokr_scale(state_dict, scale):
    """A peft LoKr state dict with peft's scale (alpha / r) multiplied into lokr_w1 for every module whose two factors
    are full matrices: the UIs apply those at scale 1. Other modules (and LoRA, LoHa) as they are."""
    baked = dict(state_dict)
    for key in state_dict:
        module = key.removesuffix(".lokr_w1")
        if key.endswith(".lokr_w1") and f"{module}.lokr_w2" in state_dict:
            baked[key] = state_dict[key] * scale
    return baked


def kohya_lora(state_dict, alpha, prefix, module_prefix="", rename=None):
    """One model's peft LoRA -> kohya's names: `<prefix>_<module>` (dots as underscores), `.lora_down.weight`
    (peft's lora_A), `.lora_up.weight` (lora_B), `.alpha` and, for DoRA, `.dora_scale`. prefix: "lora_unet",
    "lora_te" (SD 1.x/2.x's text encoder), "lora_te1"/"lora_te2" (SDXL's); module_prefix: a level the UIs' names have
    and the model's may lack (CLIP's "text_model."); rename(module) -> the module's path in the UI's model (SDXL's
    UNet: its sgm path), raising KeyError or ValueError for a module that has none."""
    def name(module):
        module = rename(module) if rename else module
        module = module if module.startswith(module_prefix) else module_prefix + module
        return f"{prefix}_{module.replace('.', '_')}"

    return ui_lora(state_dict, alpha, name, KOHYA_SUFFIXES)


def prefixed_lora(state_dict, alpha, prefix, module_prefix="", swapped_halves=()):
    """One model's peft LoRA -> `<prefix>.<module>.lora_A.weight`, `.lora_B.weight`, `.alpha` and `.dora_scale`:
    diffusers' module paths, as ComfyUI reads SD3's and Flux.1's transformer ("transformer") and text encoders
    ("text_encoder", "text_encoder_2" with module_prefix "text_model."). swapped_halves: modules whose weight ComfyUI
    holds with its two halves of rows swapped (diffusers' AdaLayerNormContinuous, `norm_out.linear`: scale and shift
    in the other order; ComfyUI swaps the LoRA's update, so a DoRA magnitude is swapped here to match)."""
    def name(module):
        return f"{prefix}.{module if module.startswith(module_prefix) else module_prefix + module}"

    return ui_lora(state_dict, alpha, name, DIFFUSERS_SUFFIXES, swapped_halves)


def ui_lora(state_dict, alpha, name, suffixes, swapped_halves=()):
    """peft keys `<module>.lora_A.weight`, `.lora_B.weight`, `.lora_magnitude_vector` -> `<name(module)>.<down>`,
    `.<up>`, `.alpha` (a scalar in the weights' dtype) and `.dora_scale` ([out, 1, ...]: one dimension per dimension of
    the module's weight); LoHa's and LoKr's `<module>.<LYCORIS_WEIGHTS>` -> `<name(module)>.<the same>` and `.alpha`.
    Anything a UI cannot apply is a UserError naming it, before anything is written."""
    import torch

    modules = {}
    for key, value in state_dict.items():
        module, _, kind = key.rpartition(".")
        if kind in LYCORIS_WEIGHTS:
            modules.setdefault(module, {})[kind] = value.detach()
            continue
        module, _, kind = key.rpartition(".lora_")
        part = {"A.weight": "down", "B.weight": "up"}.get(kind) or ("magnitude" if kind in MAGNITUDES else None)
        if not module or part is None:
            raise UserError(f"the UI LoRA file cannot hold '{key}': ComfyUI, Forge and A1111 read LoRA down and up "
                            "weights, alphas, DoRA magnitudes and LoHa's and LoKr's factors, nothing else; train the "
                            "LoRA without it")
        modules.setdefault(module, {})[part] = value.detach()
    weights = {}
    for module, parts in modules.items():
        lycoris = any(part in LYCORIS_WEIGHTS for part in parts)
        if not lycoris and ("down" not in parts or "up" not in parts):
            missing = "lora_A" if "down" not in parts else "lora_B"
            raise UserError(f"the UI LoRA file: the LoRA of '{module}' has no {missing} weight")
        try:
            ui_name = name(module)
        except (KeyError, ValueError) as err:
            raise UserError(f"the UI LoRA file has no name for the module '{module}' ({err}); leave it out of the "
                            "LoRA's target modules") from None
        if lycoris:
            weights.update({f"{ui_name}.{part}": value.contiguous() for part, value in parts.items()})
            weights[f"{ui_name}.alpha"] = torch.tensor(float(alpha), dtype=next(iter(parts.values())).dtype)
            continue
        down, up = parts["down"], parts["up"]
        weights[f"{ui_name}.{suffixes[0]}"] = down.contiguous()
        weights[f"{ui_name}.{suffixes[1]}"] = up.contiguous()
        weights[f"{ui_name}.alpha"] = torch.tensor(float(alpha), dtype=down.dtype)
        if "magnitude" in parts:
            magnitude = parts["magnitude"].reshape(-1)
            if module in swapped_halves:
                magnitude = torch.cat(magnitude.chunk(2)[::-1])
            weights[f"{ui_name}.dora_scale"] = magnitude.reshape(-1, *[1] * (down.dim() - 1)).contiguous()
    return weights
