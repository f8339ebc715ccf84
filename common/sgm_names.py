"""diffusers' UNet2DConditionModel module paths -> the same modules' paths in Stability's original "sgm" UNet
(input_blocks/middle_block/output_blocks): the names kohya's SDXL LoRA files and the single-file checkpoints use, and
that A1111 and ComfyUI map."""
import re

RESNET_PARTS = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
                "conv_shortcut": "skip_connection", "norm1": "in_layers.0", "norm2": "out_layers.0"}
TOP_LEVEL = {"conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
             "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}


def sgm_module_name(module, unet_config):
    """A diffusers UNet module path of an SDXL base -> the same module's path in the sgm UNet: down block b's layer l
    is input_blocks[1 + b * (L + 1) + l] (L: layers per block), its downsampler the block's last input block; the mid
    block is middle_block 0-2; up block b's layer l is output_blocks[b * (L + 1) + l], its upsampler that block's
    index 2 (1 without attention). In each, index 0 is the ResNet (whose layers have other names), 1 the
    transformer."""
    for name, sgm in TOP_LEVEL.items():
        if module == name or module.startswith(name + "."):
            return sgm + module[len(name):]
    per_block = unet_config["layers_per_block"] + 1
    match = re.fullmatch(r"(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)",
                         module)
    mid = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", module)
    if match:
        kind, block, part, layer, rest = match.groups()
        block, layer = int(block), int(layer)
        if kind == "down_blocks":
            if part == "downsamplers":
                return f"input_blocks.{1 + block * per_block + per_block - 1}.0.{rest.replace('conv', 'op', 1)}"
            index, inner = 1 + block * per_block + layer, 0 if part == "resnets" else 1
        else:
            if part == "upsamplers":
                has_attention = "CrossAttn" in unet_config["up_block_types"][block]
                return f"output_blocks.{block * per_block + per_block - 1}.{2 if has_attention else 1}.{rest}"
            index, inner = block * per_block + layer, 0 if part == "resnets" else 1
        prefix = "input_blocks" if kind == "down_blocks" else "output_blocks"
        return f"{prefix}.{index}.{inner}.{resnet_part(rest) if part == 'resnets' else rest}"
    if mid:
        part, layer, rest = mid.groups()
        if part == "attentions":
            return f"middle_block.1.{rest}"
        return f"middle_block.{2 * int(layer)}.{resnet_part(rest)}"
    raise ValueError(f"no sgm name for the UNet module '{module}'")


def resnet_part(rest):
    first, _, tail = rest.partition(".")
    return RESNET_PARTS.get(first, first) + (f".{tail}" if tail else "")
