"""Random-init Wan pipelines at the real sizes, for GPU benchmarks (`make gpu-evidence`): the configs and the builder
behind `python -m demo.tiny_sd --architecture wan21-1.3b|wan22-a14b --fast --device cuda`.

wan21-1.3b: Wan-AI/Wan2.1-T2V-1.3B-Diffusers' layout (WanPipeline): WanTransformer3DModel 30 blocks, 1536 wide (12
heads of 128), FFN 8960; AutoencoderKLWan's default config (Wan 2.1's VAE: 16 channels, 4x fewer frames, 8x fewer
pixels a side); UMT5-XXL's encoder (4096 wide, 24 layers, 64 heads, FFN 10240, 256,384 embedding rows: 5.7 B
parameters); FlowMatchEulerDiscreteScheduler with shift 3 (the published UniPCMultistepScheduler's flow_shift at 480p).
wan22-a14b: Wan 2.2 T2V A14B's: two experts of 40 blocks, 5120 wide (40 heads of 128), FFN 13824, switched at
boundary_ratio 0.875, with Wan 2.1's VAE and UMT5, shift 12 (Wan 2.2's own t2v_A14B config). Its `transformer_2`
folder is a link to `transformer`'s: both experts hold the same random weights, so the folder takes one expert's
28 GB, not two; a run that trains one expert (train_lora.py --wan_expert high) never runs the other, and loads it all
the same. The tokenizer is demo/tiny_flow.py's character-level T5 vocabulary (UMT5's tokenizer has T5's layout); the
embedding table keeps UMT5's rows. Saved in bfloat16, as the published weights are 16-bit.

The configs are the published config.json values (transformer/, vae/, text_encoder/; model_index.json's
boundary_ratio), written out here: nothing is downloaded.
"""
import json
import os
import shutil

# google/umt5-xxl's encoder, Wan's text_encoder (Wan-AI/Wan2.1-T2V-1.3B-Diffusers' text_encoder/config.json).
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128)
# Wan 2.1's transformer/config.json keys that both sizes share.
WAN_TRANSFORMER = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                       freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                       rope_max_seq_len=1024)
WAN21_1_3B = {
    "transformer": dict(WAN_TRANSFORMER, num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "vae": {},  # AutoencoderKLWan's defaults are Wan 2.1's VAE (base_dim 96, z_dim 16, its latents_mean and _std)
    "text": UMT5_XXL,
    "scheduler": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
}
WAN22_A14B = {
    "transformer": dict(WAN_TRANSFORMER, num_attention_heads=40, ffn_dim=13824, num_layers=40),
    "vae": {},
    "text": UMT5_XXL,
    "scheduler": dict(num_train_timesteps=1000, shift=12.0, use_dynamic_shifting=False),
    "boundary_ratio": 0.875,
}
CONFIGS = {"wan21-1.3b": WAN21_1_3B, "wan22-a14b": WAN22_A14B}
WHAT = {"wan21-1.3b": "Wan 2.1 T2V 1.3B architecture", "wan22-a14b": "Wan 2.2 T2V A14B architecture"}


def build_random_wan(configs, seed=0, device="cpu", dtype=None, empty=False):
    """-> WanPipeline with random weights, built on `device` in `dtype` one model at a time and moved to the CPU;
    `empty`: the weights on the meta device and the buffers as built, for demo.tiny_sd's `materialize` to fill. An
    A14B layout (boundary_ratio) holds one expert, `transformer` (write_random_wan links the second to it)."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from demo.tiny_flow import build_model, t5_tokenizer

    torch.manual_seed(seed)
    tokenizer = t5_tokenizer(model_max_length=512)
    def make(build):
        return build_model(build, device, dtype, empty)

    text_config = UMT5Config(**configs["text"], pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
    text_encoder = make(lambda: UMT5EncoderModel(text_config).eval())
    vae = make(lambda: AutoencoderKLWan(**configs["vae"]))
    transformer = make(lambda: WanTransformer3DModel(**configs["transformer"]))
    scheduler = FlowMatchEulerDiscreteScheduler(**configs["scheduler"])
    experts = {"boundary_ratio": configs["boundary_ratio"]} if "boundary_ratio" in configs else {}
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler, **experts)


def write_random_wan(output_dir, architecture, seed=0, device="cpu", fast=False, configs=None):
    """Build and save `architecture` (CONFIGS; `configs` replaces its sizes) in bfloat16; an A14B layout's
    transformer_2 a link to its transformer. `fast`: every weight drawn at once on `device` (demo.tiny_sd's
    materialize). The folder appears under its final name only when complete. -> the number of parameters, the
    second expert's counted."""
    import torch

    from demo.tiny_sd import materialize

    configs = configs or CONFIGS[architecture]
    pipe = build_random_wan(configs, seed, device, torch.bfloat16, empty=fast)
    if fast:
        materialize(pipe, device, torch.bfloat16)  # (UMT5's tied embedding table stays one, saved once)
    output_dir = output_dir.rstrip("/")
    tmp = output_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    experts = 1
    if "boundary_ratio" in configs:
        os.symlink("transformer", os.path.join(tmp, "transformer_2"))
        with open(os.path.join(tmp, "model_index.json")) as f:
            index = json.load(f)
        index["transformer_2"] = index["transformer"]
        with open(os.path.join(tmp, "model_index.json"), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        experts = 2
    two = (" Its `transformer_2` is a link to `transformer`: both experts hold the same random weights."
           if experts == 2 else "")
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write(f"# {os.path.basename(output_dir)}\n\nA **random-init** {WHAT.get(architecture, architecture)} "
                "pipeline written by `python -m demo.tiny_sd`, for GPU benchmarks. It produces noise, not videos."
                f"{two}\n")
    if os.path.lexists(output_dir):
        shutil.rmtree(output_dir)
    os.replace(tmp, output_dir)
    count = {name: sum(p.numel() for p in m.parameters())
             for name, m in pipe.components.items() if hasattr(m, "parameters")}
    return sum(count.values()) + (experts - 1) * count["transformer"]
