"""`python -m demo.tiny_sd`: a random-init Stable Diffusion (SDXL, SD3, Flux.1) pipeline, built locally, offline.

The same layout as stable-diffusion-v1-5 (UNet2DConditionModel, AutoencoderKL, CLIPTextModel, CLIPTokenizer,
DDPMScheduler with SD's betas), so `StableDiffusionPipeline.from_pretrained` loads it and train_lora.py trains on it
exactly as on the real model. Its weights are random: it produces noise, not pictures. Nothing is downloaded: the
tokenizer's byte-level vocabulary (no merges) is written here.

--architecture tiny (default, `make tiny-sd`): 2.4 M parameters, 32 px images -> 8x8x4 latents (a 3-level VAE with
SD's two ResNet layers per level, so that encoding costs what it costs in SD relative to the UNet), a 2-level UNet
with cross-attention at both levels, a 2-layer CLIP text encoder (77 tokens).
--architecture sd15: Stable Diffusion 1.5's own architecture from its public configs (UNet 860 M parameters, VAE
84 M, CLIP ViT-L/14 text encoder 123 M), 512 px -> 64x64x4 latents: what GPU speed and memory are measured on
(`make bench-gpu`). About 4 GB on disk; build it on a GPU (--device cuda) if one is there.
--architecture sd2: Stable Diffusion 2.1's (OpenCLIP ViT-H/14 text tower, 1024-wide cross-attention), likewise.
--architecture tiny-sdxl (`make tiny-sdxl`): the same for Stable Diffusion XL (StableDiffusionXLPipeline): two text
encoders (CLIPTextModel and CLIPTextModelWithProjection, 32- and 64-wide: the UNet attends to their 96-wide
concatenation and takes the second's pooled embedding and the six size "time ids" through its added conditioning),
a 2-level UNet with SDXL's block layout (no attention at the top level), the tiny VAE, SDXL's Euler scheduler.
--architecture sdxl: SDXL's own architecture from its public configs (UNet 2.6 G parameters, VAE 84 M, text encoders
123 M and 695 M), 1024 px -> 128x128x4 latents, for `make bench-gpu`; about 14 GB on disk (--device cuda).
--architecture tiny-sd3, tiny-flux (`make tiny-sd3`, `make tiny-flux`), sd3, flux: Stable Diffusion 3 and Flux.1
(StableDiffusion3Pipeline, FluxPipeline; transformer, 16-channel VAE, CLIP and T5 encoders, flow-matching scheduler),
tiny (32 px, about 5 MB) or at the real sizes of SD3 Medium (transformer 2.0 G parameters) and Flux.1-dev (11.9 G), in
bfloat16; see demo/tiny_flow.py.
--architecture wan21-1.3b, wan22-a14b: Wan 2.1 T2V 1.3B and Wan 2.2 T2V A14B (WanPipeline; UMT5-XXL, Wan 2.1's VAE;
A14B's two experts, the second a link to the first's files), at their real sizes in bfloat16, for GPU benchmarks; see
demo/wan_architectures.py (the tiny Wan bases: demo/tiny_wan.py).
"""
import argparse
import json
import os
import shutil

from common.text_encoder_keys import add_text_model_prefix

# The public configs of stable-diffusion-v1-5 (unet/config.json, vae/config.json) and of CLIP ViT-L/14's text
# tower (its text_encoder/config.json); only the vocabulary differs: the byte-level one below has 514 tokens, the
# embedding table keeps CLIP's 49,408 rows.
SD15 = {
    "unet": dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280, 1280),
                 down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                   "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                 cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32),
    "vae": dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                layers_per_block=2, norm_num_groups=32, sample_size=512, scaling_factor=0.18215),
    "text": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu"),
}

# stable-diffusion-2-1's public configs: the same VAE; the UNet attends to OpenCLIP ViT-H/14's text tower (1024 wide,
# GELU; diffusers keeps its first 23 of 24 layers, as SD 2 reads the penultimate one) through linear projections,
# with 64-channel attention heads.
SD2 = {
    "unet": {**SD15["unet"], "sample_size": 96, "cross_attention_dim": 1024, "attention_head_dim": (5, 10, 20, 20),
             "use_linear_projection": True},
    "vae": {**SD15["vae"], "sample_size": 768},
    "text": dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=23,
                 num_attention_heads=16, max_position_embeddings=77, projection_dim=512, hidden_act="gelu"),
}


# stable-diffusion-xl-base-1.0's public configs (unet/, vae/, text_encoder/, text_encoder_2/config.json).
SDXL = {
    "unet": dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280),
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
                 use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816, norm_num_groups=32),
    "vae": dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.13025, force_upcast=True),
    "text": SD15["text"],
    "text_2": dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                   num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu"),
}


def byte_level_vocab():
    """CLIP's layout with no merges: the 256 byte symbols, the same with the end-of-word mark, then BOS and EOS."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return {token: i for i, token in enumerate(tokens)}


def clip_config(config, vocab):
    """-> CLIPTextConfig for a text tower of `config`'s sizes on the byte-level vocabulary."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(**{"vocab_size": len(vocab), **config}, bos_token_id=vocab["<|startoftext|>"],
                          eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"])


def write_clip_vocab_files(folder):
    """The classic vocab.json and merges.txt beside tokenizer.json, which older transformers versions read."""
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(byte_level_vocab(), f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")


def tiny_configs(unet_channels=(32, 64), text_dim=32):
    return {
        "unet": dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                     block_out_channels=tuple(unet_channels),
                     down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                     up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                     cross_attention_dim=text_dim, attention_head_dim=4, norm_num_groups=min(unet_channels) // 2),
        "vae": dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64, 64),
                    down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
                    layers_per_block=2, norm_num_groups=32, sample_size=32),
        "text": dict(hidden_size=text_dim, intermediate_size=2 * text_dim, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=77, projection_dim=text_dim),
    }


def tiny_sdxl_configs(unet_channels=(32, 64), text_dims=(32, 64)):
    """SDXL's layout scaled down: the UNet attends to both encoders' states side by side and adds the second's
    pooled embedding and 6 time ids (each embedded in 8 sinusoidal channels)."""
    tiny = tiny_configs(unet_channels, text_dims[0])
    time_dim = 8
    tiny["unet"] = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                        block_out_channels=tuple(unet_channels),
                        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2),
                        attention_head_dim=(2, 4), cross_attention_dim=sum(text_dims), use_linear_projection=True,
                        addition_embed_type="text_time", addition_time_embed_dim=time_dim,
                        projection_class_embeddings_input_dim=text_dims[1] + 6 * time_dim,
                        norm_num_groups=min(unet_channels) // 2)
    tiny["text_2"] = dict(hidden_size=text_dims[1], intermediate_size=2 * text_dims[1], num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=77, projection_dim=text_dims[1],
                          hidden_act="gelu")
    return tiny


def build_random_sd(configs, seed=0, device="cpu", empty=False):
    """-> StableDiffusionPipeline with random weights (deterministic for a seed and device), on the CPU. `empty`: the
    models' weights on the meta device, for `materialize` to fill (their buffers as built)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        DDPMScheduler,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    torch.manual_seed(seed)
    vocab = byte_level_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)

    with empty_weights() if empty else torch.device(device):  # a large model initialises far faster on a GPU
        text_encoder = CLIPTextModel(clip_config(configs["text"], vocab))
        text_2 = configs.get("text_2")
        text_encoder_2 = CLIPTextModelWithProjection(clip_config(text_2, vocab)) if text_2 else None
        vae = AutoencoderKL(**configs["vae"])
        if "scaling_factor" not in configs["vae"] and not empty:
            scale_vae(vae)
        unet = UNet2DConditionModel(**configs["unet"])
    if empty:
        torch.manual_seed(seed)  # (materialize draws the weights)
        place = lambda model: model  # noqa: E731
    else:
        place = lambda model: model.cpu()  # noqa: E731
    if text_encoder_2 is not None:  # SDXL's own scheduler config
        scheduler = EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                           beta_schedule="scaled_linear", prediction_type="epsilon", steps_offset=1,
                                           timestep_spacing="leading", interpolation_type="linear")
        return StableDiffusionXLPipeline(vae=place(vae), text_encoder=place(text_encoder),
                                         text_encoder_2=place(text_encoder_2), tokenizer=tokenizer,
                                         tokenizer_2=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77),
                                         unet=place(unet), scheduler=scheduler, force_zeros_for_empty_prompt=True)
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear", prediction_type="epsilon", clip_sample=False,
                              steps_offset=1)
    return StableDiffusionPipeline(vae=place(vae), text_encoder=place(text_encoder), tokenizer=tokenizer,
                                   unet=place(unet), scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def empty_weights():
    """A context in which models are built with their weights on the meta device (nothing allocated, no init work)
    and their buffers as usual."""
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


def scale_vae(vae):
    """Scale a random VAE's latents to unit variance, as SD's 0.18215 does for its own (a config without a factor)."""
    import torch

    with torch.no_grad():
        size = vae.config.sample_size
        param = next(vae.parameters())
        x = torch.rand(16, 3, size, size, device=param.device, dtype=param.dtype) * 2 - 1
        std = vae.encode(x).latent_dist.mean.float().std().item()
    vae.register_to_config(scaling_factor=round(1.0 / std, 5))


def materialize(pipe, device, dtype=None):
    """Fill the meta weights of an `empty` pipeline's models on `device` (in `dtype`), with PyTorch's default
    initialisation statistics drawn at once (uniform within +-1/sqrt(fan_in) for matrices, convolution kernels and
    embeddings; norm scales 1, biases 0), and move their buffers there: seconds for a 12 B model on a GPU, where each
    layer's own init would run layer by layer (or minutes on a CPU). The weights a model ties (T5's token embeddings:
    `shared` and the encoder's `embed_tokens`) are tied again, one tensor saved once, as in the published model."""
    import torch
    from accelerate.utils import set_module_tensor_to_device

    for model in pipe.components.values():
        if not isinstance(model, torch.nn.Module):
            continue
        for name, param in list(model.named_parameters()):
            if not param.is_meta:
                continue
            value = torch.empty(param.shape, device=device, dtype=dtype or param.dtype)
            if value.ndim >= 2:
                bound = 1 / max(1, value[0].numel()) ** 0.5
                value.uniform_(-bound, bound)
            elif name.endswith("bias") or value.ndim == 0:
                value.zero_()
            else:
                value.fill_(1.0)  # norms' scales (and the rare other vector: a neutral 1)
            set_module_tensor_to_device(model, name, device, value=value, dtype=value.dtype)
        if hasattr(model, "tie_weights"):  # (transformers' models: built empty, their tied weights were drawn apart)
            model.tie_weights()
        model.to(device)


def build_tiny_sd(unet_channels=(32, 64), text_dim=32, seed=0):
    """-> the tiny StableDiffusionPipeline with random weights (deterministic for a seed)."""
    return build_random_sd(tiny_configs(unet_channels, text_dim), seed)


# What each --architecture is, for the model card and the message.
WHAT = {"tiny": "tiny Stable Diffusion", "sd15": "Stable Diffusion 1.5 architecture",
        "sd2": "Stable Diffusion 2.1 architecture", "tiny-sdxl": "tiny Stable Diffusion XL",
        "sdxl": "Stable Diffusion XL architecture",
        "tiny-sd3": "tiny Stable Diffusion 3", "sd3": "Stable Diffusion 3 Medium architecture",
        "tiny-flux": "tiny Flux.1", "flux": "Flux.1-dev architecture",
        "wan21-1.3b": "Wan 2.1 T2V 1.3B architecture", "wan22-a14b": "Wan 2.2 T2V A14B architecture"}
FLOW = ("tiny-sd3", "tiny-flux", "sd3", "flux")  # the flow-matching transformers: demo/tiny_flow.py
WAN = ("wan21-1.3b", "wan22-a14b")  # the video transformers at their real sizes: demo/wan_architectures.py


def write_tiny_sd(output_dir, architecture="tiny", seed=0, device="cpu", fast=False, **kwargs):
    """Build and save; the folder appears under its final name only when complete. -> the number of parameters.
    `fast`: weights drawn at once on `device` (materialize), the real architectures in bf16: for benchmarks, where
    building fast matters and a weight's exact init does not."""
    import torch

    if architecture in WAN:
        from demo.wan_architectures import write_random_wan

        return write_random_wan(output_dir, architecture, seed, device, fast)
    if architecture in FLOW:
        from demo.tiny_flow import CONFIGS, build_random_flow, shift_and_scale_vae

        # the real sizes in 16 bits, as published (Flux.1-dev's in float32 would take 67 GB)
        dtype = None if architecture.startswith("tiny") else torch.bfloat16
        pipe = build_random_flow(CONFIGS[architecture](), seed, device, dtype, empty=fast)
    else:
        configs = {"sd15": SD15, "sd2": SD2, "sdxl": SDXL, "tiny-sdxl": tiny_sdxl_configs(**kwargs)}.get(architecture) \
            or tiny_configs(**kwargs)
        dtype = None if architecture.startswith("tiny") else torch.bfloat16
        pipe = build_random_sd(configs, seed, device, empty=fast)
    if fast:
        materialize(pipe, device, dtype)
        if architecture in FLOW and "scaling_factor" not in CONFIGS[architecture]()["vae"]:
            shift_and_scale_vae(pipe.vae)
        elif architecture not in FLOW and "scaling_factor" not in configs["vae"]:
            scale_vae(pipe.vae)
    output_dir = output_dir.rstrip("/")
    tmp = output_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    for name in pipe.components:
        if name.startswith("text_encoder"):  # (a CLIPTextModel's: the key names ComfyUI's CLIP loader reads)
            add_text_model_prefix(os.path.join(tmp, name))
    for name, component in pipe.components.items():
        if type(component).__name__.startswith("CLIPTokenizer"):
            write_clip_vocab_files(os.path.join(tmp, name))
    # transformers 5 calls its tokenizer.json T5 tokenizer T5Tokenizer; the published folders name it T5TokenizerFast,
    # which transformers 5 and 4 both load from tokenizer.json (4's T5Tokenizer needs a SentencePiece file instead).
    with open(os.path.join(tmp, "model_index.json")) as f:
        index = json.load(f)
    t5 = [k for k, v in index.items() if v == ["transformers", "T5Tokenizer"]]
    if t5:
        with open(os.path.join(tmp, "model_index.json"), "w") as f:
            f.write(json.dumps({**index, **{k: ["transformers", "T5TokenizerFast"] for k in t5}}, indent=2,
                               sort_keys=True) + "\n")
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write(f"# {os.path.basename(output_dir)}\n\nA **random-init** {WHAT[architecture]} pipeline written by "
                "`python -m demo.tiny_sd`, for offline runs, tests and benchmarks. It produces noise, not pictures.\n")
    if os.path.exists(output_dir):
        shutil.rmtree(output_dir)
    os.replace(tmp, output_dir)
    return sum(p.numel() for m in pipe.components.values() if hasattr(m, "parameters") for p in m.parameters())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="models/tiny-sd", help="The pipeline folder to write.")
    parser.add_argument("--architecture", choices=list(WHAT), default="tiny", help="Which pipeline (see above).")
    parser.add_argument("--device", default="cpu", help="Where the weights are initialised (cuda: much faster).")
    parser.add_argument("--seed", type=int, default=0, help="The seed of the random weights.")
    parser.add_argument("--fast", action="store_true", help="Draw every weight at once on --device (PyTorch's default "
                        "init statistics, not each layer's own), the real architectures in bf16: seconds on a GPU.")
    args = parser.parse_args()
    n = write_tiny_sd(args.output_dir, args.architecture, args.seed, args.device, fast=args.fast)
    print(f"wrote a random-init {WHAT[args.architecture]} pipeline ({args.architecture}, {n / 1e6:.2f} M "
          f"parameters) to {args.output_dir}")
