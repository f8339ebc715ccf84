"""diffusers' Flux2Transformer2DModel state dict -> FLUX.2's own (Black Forest Labs' names, what ComfyUI loads): the
inverse of diffusers' convert_flux2_transformer_checkpoint_to_diffusers (q, k, v concatenated into qkv, the final
norm's scale and shift halves swapped back, RMSNorm weights as `.scale`). Used by tests/test_ui_lora.py (which checks
it against diffusers' own converter) and by tests/tools/flux2_lora_files.py. Plain torch, no diffusers import."""
import re

RENAMES = (
    (r"x_embedder\.(.*)", r"img_in.\1"), (r"context_embedder\.(.*)", r"txt_in.\1"),
    (r"time_guidance_embed\.timestep_embedder\.linear_1\.(.*)", r"time_in.in_layer.\1"),
    (r"time_guidance_embed\.timestep_embedder\.linear_2\.(.*)", r"time_in.out_layer.\1"),
    (r"time_guidance_embed\.guidance_embedder\.linear_1\.(.*)", r"guidance_in.in_layer.\1"),
    (r"time_guidance_embed\.guidance_embedder\.linear_2\.(.*)", r"guidance_in.out_layer.\1"),
    (r"(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.linear\.(.*)",
     r"\1.lin.\2"),
    (r"proj_out\.(.*)", r"final_layer.linear.\1"),
    (r"transformer_blocks\.(\d+)\.attn\.to_out\.0\.(.*)", r"double_blocks.\1.img_attn.proj.\2"),
    (r"transformer_blocks\.(\d+)\.attn\.to_add_out\.(.*)", r"double_blocks.\1.txt_attn.proj.\2"),
    (r"transformer_blocks\.(\d+)\.ff\.linear_in\.(.*)", r"double_blocks.\1.img_mlp.0.\2"),
    (r"transformer_blocks\.(\d+)\.ff\.linear_out\.(.*)", r"double_blocks.\1.img_mlp.2.\2"),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_in\.(.*)", r"double_blocks.\1.txt_mlp.0.\2"),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_out\.(.*)", r"double_blocks.\1.txt_mlp.2.\2"),
    (r"transformer_blocks\.(\d+)\.attn\.norm_q\.weight", r"double_blocks.\1.img_attn.norm.query_norm.scale"),
    (r"transformer_blocks\.(\d+)\.attn\.norm_k\.weight", r"double_blocks.\1.img_attn.norm.key_norm.scale"),
    (r"transformer_blocks\.(\d+)\.attn\.norm_added_q\.weight", r"double_blocks.\1.txt_attn.norm.query_norm.scale"),
    (r"transformer_blocks\.(\d+)\.attn\.norm_added_k\.weight", r"double_blocks.\1.txt_attn.norm.key_norm.scale"),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj\.(.*)", r"single_blocks.\1.linear1.\2"),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_out\.(.*)", r"single_blocks.\1.linear2.\2"),
    (r"single_transformer_blocks\.(\d+)\.attn\.norm_q\.weight", r"single_blocks.\1.norm.query_norm.scale"),
    (r"single_transformer_blocks\.(\d+)\.attn\.norm_k\.weight", r"single_blocks.\1.norm.key_norm.scale"),
)
FUSED = (r"transformer_blocks\.(\d+)\.attn\.(to_[qkv]|add_[qkv]_proj)\.(weight|bias)",)


def swap_halves(weight):
    import torch

    return torch.cat(weight.chunk(2)[::-1])


def native_state_dict(state):
    """{diffusers name: tensor} -> {FLUX.2's own name: tensor}; KeyError for a name it does not know."""
    import torch

    native, fused = {}, {}
    for key, value in state.items():
        match = re.fullmatch(FUSED[0], key)
        if match:
            block, proj, kind = match.groups()
            stream = "img" if proj.startswith("to_") else "txt"
            fused.setdefault(f"double_blocks.{block}.{stream}_attn.qkv.{kind}", {})[proj[-1] if stream == "img"
                                                                                     else proj[4]] = value
            continue
        if key.startswith("norm_out.linear."):
            native[f"final_layer.adaLN_modulation.1.{key.rsplit('.', 1)[1]}"] = swap_halves(value)
            continue
        for pattern, name in RENAMES:
            match = re.fullmatch(pattern, key)
            if match:
                native[match.expand(name)] = value
                break
        else:
            raise KeyError(key)
    for name, parts in fused.items():
        native[name] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return native
