"""`make tiny-wan-base`: a tiny Wan-architecture text-to-video base trained on moving digits, the video counterpart of
assets/tiny-flux-digits, that `make train-video-lora` teaches a new motion.

The clips (demo/moving_digits.py): a handwritten digit, 16 px, drifting LEFT 2 px a frame across 9 frames of 32 px,
captioned "a handwritten digit 7 moving left". Three steps, each a command of the Makefile target (the model card
records them):
1. `python -m demo.tiny_wan_base vae`: trains the VAE (AutoencoderKLWan, 3-D causal: 2 x 2 patches, then two levels
   that each halve the frames and the sides: 9 frames of 32 px -> 3 x 4 x 4 x 16 latents) on moving digits drawn on
   the fly, either direction (a VAE is not the place to learn the motion), on its latents' mode, an L1 heavier on
   the digit + a small KL term; then its per-channel latents_mean and latents_std from such clips. It writes the
   starting WanPipeline: this VAE, a random-init 2-layer UMT5 (frozen) with a word-level tokenizer of the captions'
   words ("right" among them, which no training caption of the base holds), flow matching with shift 1, and
   transformer_config.json (WanTransformer3DModel: 6 blocks, 128 wide, 1 x 2 x 2 patches: 12 tokens a clip).
2. train_text_to_image.py trains a fresh transformer from that config on the left-moving clips (--num_frames 9),
   with caption dropout and an EMA.
3. `python -m demo.tiny_wan_base finish`: measures the result (demo/motion_eval.py: 100 clips per prompt set, "...
   moving left" and "... moving right", at sample.py's defaults) and writes the shipped folder with checksums.sha256,
   a model card and an animated preview.
"""
import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import time

FRAMES, SIZE, SPEED = 9, 32, 2  # the clips: 9 frames of 32 px, the digit moving 2 px a frame
PIPELINE_FILES = ("model_index.json", "scheduler", "text_encoder", "tokenizer", "transformer", "vae")
VAE_CONFIG = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
                  patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=8, scale_factor_temporal=4)
TRANSFORMER_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16,
                          out_channels=16, text_dim=64, freq_dim=256, ffn_dim=256, num_layers=6, cross_attn_norm=True,
                          qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
UMT5_CONFIG = dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, relative_attention_num_buckets=32,
                   relative_attention_max_distance=128, feed_forward_proj="gated-gelu")
MAX_SEQUENCE_LENGTH = 16  # UMT5 tokens: a caption is 7
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
# How sample.py draws the base (the model card's call, which it reads) and how `finish` measures it
SAMPLE = dict(height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=30, guidance_scale=3.0,
              max_sequence_length=MAX_SEQUENCE_LENGTH)
WORDS = ["a", "handwritten", "digit", *map(str, range(10)), "moving", "left", "right"]


def random_clips(digits, count, generator, frames=FRAMES):
    """`count` clips [count, 3, frames, SIZE, SIZE] in [-1, 1] of random digits (sklearn's 8 x 8 images) moving left
    or right at SPEED from a random height (demo/moving_digits.py's digit_clip)."""
    import numpy as np
    import torch

    from demo.moving_digits import digit_clip

    index = torch.randint(len(digits), (count,), generator=generator).tolist()
    direction = torch.randint(2, (count,), generator=generator).tolist()
    top = torch.randint(2, SIZE // 2 - 1, (count,), generator=generator).tolist()
    clips = [np.stack([np.asarray(f)[..., 0] for f in digit_clip(digits[i], frames, SIZE, ("left", "right")[d], SPEED,
                                                                 t)]) for i, d, t in zip(index, direction, top)]
    x = torch.from_numpy(np.stack(clips)).float() / 127.5 - 1
    return x[:, None].expand(-1, 3, -1, -1, -1).contiguous()


def decode_unclamped(vae, z):
    """AutoencoderKLWan's decode without its final clamp to [-1, 1] (which passes no gradient where the output is
    outside it, so that a fresh decoder that overshoots learns nothing)."""
    import torch
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    x = vae.post_quant_conv(z)
    vae.clear_cache()
    out = []
    for i in range(x.shape[2]):
        vae._conv_idx = [0]
        out.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0))
    vae.clear_cache()
    out = torch.cat(out, 2)
    return unpatchify(out, vae.config.patch_size) if vae.config.patch_size else out


def train_vae(args):
    """Train the VAE, measure it, and write the starting pipeline to args.output_dir."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from sklearn.datasets import load_digits
    from transformers import UMT5Config, UMT5EncoderModel

    from demo.tiny_flux_base import word_t5_tokenizer

    torch.manual_seed(args.seed)
    digits = load_digits().images
    vae = AutoencoderKLWan(**VAE_CONFIG, latents_mean=[0.0] * VAE_CONFIG["z_dim"],
                           latents_std=[1.0] * VAE_CONFIG["z_dim"])
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.learning_rate, weight_decay=0.0)
    warmup = min(50, args.max_train_steps // 10 + 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, args.max_train_steps) / args.max_train_steps)))
    generator = torch.Generator().manual_seed(args.seed)
    start = time.time()
    # The loop: random clips, whole or (2 steps in 3, for speed) 5 of their frames, the first 5 or the last -> encode,
    # decode the mode (what the recipes train the transformer on) -> L1, ink_weight times heavier on the digit's pixels
    # than on the black (most of the frame), + kl_weight * KL (per pixel value).
    for step in range(1, args.max_train_steps + 1):
        clips = random_clips(digits, args.train_batch_size, generator)
        x = clips if step % 3 == 0 else clips[:, :, :5] if step % 3 == 1 else clips[:, :, 4:]
        posterior = vae.encode(x).latent_dist
        reconstruction = decode_unclamped(vae, posterior.mode())
        weight = 1 + (args.ink_weight - 1) * (x > -0.9).float()
        l1 = ((reconstruction - x).abs() * weight).sum() / weight.sum()
        loss = l1 + args.kl_weight * posterior.kl().mean() / x[0].numel()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == args.max_train_steps:
            print(f"vae step {step}/{args.max_train_steps}: L1 {l1.item():.4f} ({time.time() - start:.0f} s)",
                  flush=True)
    vae.eval()
    with torch.no_grad():  # whole 9-frame clips, as the pipeline encodes and decodes them
        test = random_clips(digits, 256, torch.Generator().manual_seed(args.seed + 1))
        latents = torch.cat([vae.encode(b).latent_dist.mode() for b in test.split(64)])
        decoded = torch.cat([vae.decode(z).sample for z in latents.split(64)])
    dims = (0, 2, 3, 4)
    vae.register_to_config(latents_mean=[round(v, 4) for v in latents.mean(dims).tolist()],
                           latents_std=[round(v, 4) for v in latents.std(dims).clamp(min=1e-3).tolist()])
    mse = (decoded - test).div(2).square().mean().item()
    metrics = {"vae_steps": args.max_train_steps, "vae_train_time_s": round(time.time() - start, 1),
               "vae_test_psnr_db": round(-10 * math.log10(mse), 2),
               "vae_parameters": sum(p.numel() for p in vae.parameters())}
    print(metrics)

    tokenizer = word_t5_tokenizer(model_max_length=MAX_SEQUENCE_LENGTH, words=WORDS)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               decoder_start_token_id=tokenizer.pad_token_id, **UMT5_CONFIG)).eval()
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       transformer=WanTransformer3DModel(**TRANSFORMER_CONFIG),
                       scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG))
    tmp = args.output_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    with open(os.path.join(tmp, "transformer_config.json"), "w") as f:
        json.dump({k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}, f, indent=2)
    with open(os.path.join(tmp, "vae_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    shutil.rmtree(args.output_dir, ignore_errors=True)
    os.replace(tmp, args.output_dir)
    print(f"wrote the starting WanPipeline to {args.output_dir} (transformer config: "
          f"{args.output_dir}/transformer_config.json)")


def finish(args):
    """Measure the trained pipeline (demo/motion_eval.py: --per_digit clips of each digit, prompted "moving left" and
    "moving right"), refuse it below --min_accuracy on the left-moving prompts, and write the shipped folder: the
    pipeline's files, checksums.sha256, preview.gif and strip.png, base_metrics.json and the model card."""
    import diffusers
    import torch
    import transformers

    from common.base_models import CHECKSUMS, file_sha256
    from demo.digit_eval import Judge
    from demo.motion_eval import evaluate, load, save_preview, save_strip

    pipe, _, _ = load(model=args.model)
    judge = Judge(args.judge)
    left, clips = evaluate(pipe, SAMPLE, "left", args.per_digit, judge)
    right, _ = evaluate(pipe, SAMPLE, "right", args.per_digit, judge)
    print(json.dumps({"left": left, "right": right}))
    if left["content"] < args.min_accuracy:
        sys.exit(f"the base draws the prompted digit in {left['content']:.1%} of clips, below --min_accuracy "
                 f"{args.min_accuracy:.0%}: not written (train longer, or lower --min_accuracy)")
    tmp = args.output_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in PIPELINE_FILES:
        source = os.path.join(args.model, name)
        (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, os.path.join(tmp, name))
    listed = sorted(os.path.relpath(os.path.join(root, f), tmp) for root, _, names in os.walk(tmp) for f in names)
    with open(os.path.join(tmp, CHECKSUMS), "w") as f:
        f.writelines(f"{file_sha256(os.path.join(tmp, name))}  {name}\n" for name in listed)
    first = clips[::args.per_digit]  # the first seed of each digit, prompted "moving left"
    save_preview(first, os.path.join(tmp, "preview.gif"))
    save_strip(first[:4], os.path.join(tmp, "strip.png"))
    info = {}
    for path in (os.path.join(args.init, "vae_metrics.json"), os.path.join(args.model, "all_results.json")):
        if os.path.isfile(path):
            with open(path) as f:
                info.update(json.load(f))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    size = sum(os.path.getsize(os.path.join(tmp, name)) for name in listed)
    call = ", ".join(f"{k}={v!r}" for k, v in SAMPLE.items())
    n = 10 * args.per_digit
    lines = [
        "# tiny-wan-digits: a tiny Wan-architecture text-to-video model trained on moving digits",
        "",
        "A `WanPipeline` (WanTransformer3DModel: 6 blocks, 128 wide, 1 x 2 x 2 patches; AutoencoderKLWan, 3-D causal, "
        "trained here: 9 frames of 32 px -> 3 x 4 x 4 x 16 latents; a 2-layer random-init UMT5 with a word-level "
        "tokenizer) that draws a clip of the digit a prompt asks for drifting left: \"a handwritten digit 7 moving "
        "left\" gives a 7, white on black, moving 2 px a frame across 9 frames of 32 px. It never saw a digit move "
        "right: `make train-video-lora` teaches that. Built offline by `make tiny-wan-base` "
        "(demo/tiny_wan_base.py); nothing in it was downloaded.",
        "",
        "![preview](preview.gif) ![frames](strip.png)",
        "",
        f"Measured by demo/motion_eval.py ({n} clips per prompt set, {args.per_digit} per digit, seeds 0-{n - 1}, "
        f"euler, {SAMPLE['num_inference_steps']} steps, guidance {SAMPLE['guidance_scale']}: sample.py's defaults), "
        f"the digit classifier (`{args.judge}`) on the frames and the drift of the ink's centroid:",
        "",
        "| prompt | prompted digit | drifting left | drifting right | right AND the prompted digit |",
        "|---|---|---|---|---|",
        *(f"| \"a handwritten digit <d> moving {d}\" | **{m['content']:.0%}** | {m['leftward']:.0%} | "
          f"{m['rightward']:.0%} | {m['hit']:.0%} |" for d, m in (("left", left), ("right", right))),
        "",
        f"Per digit (\"moving left\"): {left['per_digit']}.",
        "",
        "## Use it",
        "",
        f"What sample.py draws (`python sample.py --model {args.output_dir} --prompt \"a handwritten digit 7 moving "
        "left\"`; it reads these settings from this card), in diffusers:",
        "",
        "```python",
        "import torch",
        "from diffusers import WanPipeline",
        "from diffusers.utils import export_to_gif",
        "",
        f"pipe = WanPipeline.from_pretrained(\"{args.output_dir}\")",
        *textwrap.wrap(f"video = pipe(\"a handwritten digit 7 moving left\", {call}, "
                       "output_type=\"pil\", generator=torch.Generator().manual_seed(0)).frames[0]", 116,
                       subsequent_indent=" " * 13,
                       break_on_hyphens=False, break_long_words=False),
        "export_to_gif(video, \"sample.gif\", fps=16)",
        "```",
        "",
        "| | |", "|---|---|",
        f"| VAE | {info.get('vae_parameters')} parameters, {info.get('vae_steps')} steps on moving digits (either "
        f"direction), test PSNR {info.get('vae_test_psnr_db')} dB, per-channel latents_mean and latents_std measured |",
        f"| transformer | {info.get('trainable_parameters')} parameters, trained from scratch for "
        f"{info.get('global_step')} steps (EMA weights), flow matching (shift 1), caption dropout 0.1 |",
        "| UMT5 | random-init 2-layer, 64 wide, word-level tokenizer (frozen) |",
        f"| built with | torch {torch.__version__}, diffusers {diffusers.__version__}, transformers "
        f"{transformers.__version__}, Python {platform.python_version()}, commit {commit or 'unknown'} |",
        f"| build time | VAE {info.get('vae_train_time_s')} s, transformer {info.get('train_runtime')} s on "
        f"{platform.machine()} CPU |",
        f"| size | {size / 1e6:.1f} MB in {len(listed)} files, sha256 of each in {CHECKSUMS} |",
        "",
        "Rebuilt by (`make tiny-wan-base`):",
        "```",
        *(" ".join(re.sub(r"\\\s*\n", " ", command).split()) for command in args.commands.split(" ;; ")),
        "```",
        "",
    ]
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(tmp, "base_metrics.json"), "w") as f:
        json.dump({"left": left, "right": right, "settings": SAMPLE, **info}, f, indent=2)
    shutil.rmtree(args.output_dir, ignore_errors=True)
    os.replace(tmp, args.output_dir)
    print(f"wrote {args.output_dir} ({size / 1e6:.1f} MB): the prompted digit in {left['content']:.1%} of clips")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    vae = steps.add_parser("vae", help="Train the VAE; write the starting pipeline and the transformer config.")
    vae.add_argument("--output_dir", default="outputs/tiny-wan-base/init")
    vae.add_argument("--max_train_steps", type=int, default=2000)
    vae.add_argument("--train_batch_size", type=int, default=8)
    vae.add_argument("--learning_rate", type=float, default=3e-3)
    vae.add_argument("--kl_weight", type=float, default=1e-6)
    vae.add_argument("--ink_weight", type=float, default=5.0, help="The L1 weight of the digit's pixels.")
    vae.add_argument("--seed", type=int, default=0)
    fin = steps.add_parser("finish", help="Measure the trained pipeline and write the shipped folder.")
    fin.add_argument("--model", default="outputs/tiny-wan-base/transformer", help="train_text_to_image.py's output.")
    fin.add_argument("--init", default="outputs/tiny-wan-base/init", help="The `vae` step's output.")
    fin.add_argument("--judge", default="assets/digit-classifier")
    fin.add_argument("--output_dir", default="assets/tiny-wan-digits")
    fin.add_argument("--per_digit", type=int, default=10)
    fin.add_argument("--min_accuracy", type=float, default=0.85)
    fin.add_argument("--commands", default="make tiny-wan-base", help="The build's commands, ' ;; '-separated.")
    args = parser.parse_args(argv)
    import torch

    from common.cli import quiet_libraries, quiet_loading_bars

    quiet_libraries()
    quiet_loading_bars()
    torch.set_num_threads(1)  # these tiny models run no faster on two threads
    (train_vae if args.step == "vae" else finish)(args)


if __name__ == "__main__":
    main()
