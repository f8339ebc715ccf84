"""The UNet2DModel config of train_ddpm.py: the small default, a local json config, and whether either fits the data.

Plain json and dicts, no torch: the scripts check a config while parsing their flags, before anything heavy loads.
"""
import json
import math
import os

from .args import is_hub_id
from .cli import UserError


def channel_list(text):
    channels = tuple(int(c) for c in text.split(","))
    if not channels or min(channels) <= 0:
        raise ValueError
    return channels


channel_list.__name__ = "comma-separated list of positive integers"


def unet_config_source(args):
    """(config dict or None for a hub id, its name for messages) of --model_config_name_or_path or the default."""
    path = args.model_config_name_or_path
    if path is None:
        return default_unet_config(args.block_out_channels, args.layers_per_block, None), "the default UNet"
    source = f"the config '{path}'"
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        if not is_hub_id(path):
            raise UserError(f"--model_config_name_or_path: no UNet2DModel config at '{path}'")
        return None, source
    return read_json_config(file, "--model_config_name_or_path"), source


def read_json_config(file, flag):
    """A model config file -> its dict; anything unreadable or not a json object is one line naming `flag`."""
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(f"{flag}: '{file}' is not a json config: {err}") from None
    if not isinstance(config, dict):
        raise UserError(f"{flag}: '{file}' is not a json object")
    return config


def pretrained_unet_config(path):
    """(config dict, name for messages) of a local --pretrained_model_name_or_path (a UNet2DModel folder, or a
    pipeline / train_ddpm.py checkpoint with unet/), None for a hub id; a local folder of another kind is an error."""
    flag = "--pretrained_model_name_or_path"
    if not os.path.isdir(path):
        if not is_hub_id(path):
            raise UserError(f"{flag} '{path}' is neither a folder nor a hub id (owner/name)")
        return None
    folder = os.path.join(path, "unet") if os.path.isdir(os.path.join(path, "unet")) else path
    config = None
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        pass
    if not isinstance(config, dict) or config.get("_class_name") != "UNet2DModel":
        found = (f"it holds a {config.get('_class_name') or config.get('model_type') or 'model of another kind'}"
                 if isinstance(config, dict) else "no readable unet/config.json or config.json")
        raise UserError(f"{flag} '{path}' is not a UNet2DModel ({found}); give a train_ddpm.py output or "
                        "checkpoint-N, a DDPM pipeline, or a UNet2DModel folder")
    return config, f"the pretrained UNet '{path}'"


def check_unet_shape(config, resolution, source):
    """The UNet fits the data: 3 channels in and out, and a resolution its down blocks can halve evenly."""
    blocks = len(config.get("down_block_types", [None] * 4))  # UNet2DModel's default has 4
    factor = 2 ** (blocks - 1)  # every down block but the last halves the resolution
    if resolution % factor:
        raise UserError(f"--resolution {resolution} is not divisible by {factor}, the total downsampling of "
                        f"{source} ({blocks} down blocks)")
    channels = config.get("in_channels", 3), config.get("out_channels", 3)
    if channels != (3, 3):
        raise UserError(f"{source} has in_channels={channels[0]}, out_channels={channels[1]}, "
                        "but the images have 3 (RGB)")


def default_unet_config(block_out_channels, layers_per_block, num_class_embeds):
    """A small UNet2DModel config: 0.7 M parameters with the defaults, fast enough for CPU demos."""
    levels = len(block_out_channels)
    down, up = ["DownBlock2D"] * levels, ["UpBlock2D"] * levels
    if levels > 1:  # self-attention only at the coarsest level, where it is cheap
        down[-1], up[0] = "AttnDownBlock2D", "AttnUpBlock2D"
    return {"in_channels": 3, "out_channels": 3, "block_out_channels": list(block_out_channels),
            "layers_per_block": layers_per_block, "down_block_types": down, "up_block_types": up,
            # groups of >= 4 channels, at most 32 groups (diffusers' default)
            "norm_num_groups": min(32, max(1, math.gcd(*block_out_channels) // 4)),
            "num_class_embeds": num_class_embeds}
