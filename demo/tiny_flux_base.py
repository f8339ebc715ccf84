"""`make tiny-flux-base`: a tiny Flux.1-architecture base trained on the digits, the flow-matching counterpart of
assets/tiny-sd-digits, that `make train-lora BASE=assets/tiny-flux-digits` fine-tunes.

Three steps, each a command of the Makefile target (the model card records them):
1. `python -m demo.tiny_flux_base init`: writes the starting FluxPipeline: the shipped SD base's VAE (trained here on
   the digits; 32 px -> 8x8x4 latents -> 16 packed tokens; shift_factor 0, which FluxPipeline needs set) and its
   frozen random-init CLIP text encoder and tokenizer (the pooled embedding), a random-init 2-layer T5 encoder
   (frozen) with a word-level tokenizer of the digits' caption words (a caption is about 10 tokens, so
   --max_sequence_length 16 holds it: text length, not width, sets the cost of a step), FLUX.1's flow-matching
   scheduler, and transformer_config.json: one double-stream and three single-stream blocks, 128 wide, no guidance
   embedding (a base trained from scratch with caption dropout is guided by true classifier-free guidance).
2. train_text_to_image.py trains a fresh transformer from that config on the digits' captions by flow matching,
   with caption dropout and an EMA.
3. `python -m demo.tiny_flux_base finish`: measures the result (20 samples per digit prompt at sample.py's defaults,
   scored by the digit classifier) and writes the shipped folder with checksums.sha256 and a model card
   (demo/tiny_sd_base.py's `ship`).
"""
import argparse
import json
import os
import shutil

from demo.digits import NAMES, STYLE, SUFFIX_WORDS

SHIPPED_SD = "assets/tiny-sd-digits"
PIPELINE_FILES = ("model_index.json", "scheduler", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                  "transformer", "vae")
TRANSFORMER_CONFIG = dict(patch_size=1, in_channels=16, out_channels=None, num_layers=1, num_single_layers=3,
                          attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                          pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(8, 12, 12))
T5_CONFIG = dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, feed_forward_proj="gated-gelu",
                 relative_attention_num_buckets=32, relative_attention_max_distance=128)
MAX_SEQUENCE_LENGTH = 16  # T5 tokens: every caption of the digits fits (about 10)
# FLUX.1's scheduler: training sigmas unshifted, sampling shifted by the image's token count
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def caption_words():
    """Every word of the digits' captions (demo/digits.py), the style's included."""
    words = {"a", "handwritten", "digit", *NAMES, *STYLE.replace(",", " ").split(), *SUFFIX_WORDS}
    return sorted(words)


def word_t5_tokenizer(model_max_length=512, words=None):
    """T5TokenizerFast over a Unigram vocabulary in T5's layout: each caption word (`words`, the digits' by default)
    one piece ("▁seven"), any other word spelt in characters; <pad> 0, </s> 1, <unk> 2, then the pieces and 100
    sentinels."""
    import string

    from transformers import T5TokenizerFast

    chars = [c for c in string.printable if c not in string.whitespace]
    pieces = ([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
              + [("▁" + w, -1.0) for w in words or caption_words()] + [(c, -4.0) for c in chars])
    return T5TokenizerFast(vocab=pieces, extra_ids=100, model_max_length=model_max_length)


def init(args):
    """Write the starting pipeline and transformer_config.json to args.output_dir."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

    from common.base_models import verify_checksums
    from common.text_encoder_keys import add_text_model_prefix

    verify_checksums(args.sd_base, "--sd_base")
    torch.manual_seed(args.seed)
    vae = AutoencoderKL.from_pretrained(args.sd_base, subfolder="vae")
    vae.register_to_config(shift_factor=0.0)  # FluxPipeline adds it when decoding
    tokenizer = word_t5_tokenizer(model_max_length=MAX_SEQUENCE_LENGTH)  # what sample.py and the trainers default to
    t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
                                 **T5_CONFIG))
    pipe = FluxPipeline(transformer=FluxTransformer2DModel(**TRANSFORMER_CONFIG), vae=vae,
                        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
                        text_encoder=CLIPTextModel.from_pretrained(args.sd_base, subfolder="text_encoder"),
                        tokenizer=CLIPTokenizer.from_pretrained(args.sd_base, subfolder="tokenizer"),
                        text_encoder_2=t5, tokenizer_2=tokenizer)
    tmp = args.output_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    add_text_model_prefix(os.path.join(tmp, "text_encoder"))
    shutil.rmtree(os.path.join(tmp, "tokenizer"))
    shutil.copytree(os.path.join(args.sd_base, "tokenizer"), os.path.join(tmp, "tokenizer"))  # the SD base's files
    with open(os.path.join(tmp, "model_index.json")) as f:
        index = json.load(f)
    index["tokenizer_2"] = ["transformers", "T5TokenizerFast"]  # (the published folders' name for it)
    with open(os.path.join(tmp, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    with open(os.path.join(tmp, "transformer_config.json"), "w") as f:
        json.dump(dict(pipe.transformer.config), f, indent=2)
    shutil.rmtree(args.output_dir, ignore_errors=True)
    os.replace(tmp, args.output_dir)
    n = sum(p.numel() for p in pipe.transformer.parameters())
    print(f"wrote the starting FluxPipeline to {args.output_dir} (transformer: {n / 1e6:.2f} M parameters; "
          f"T5 vocabulary {len(tokenizer)})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    start = steps.add_parser("init", help="Write the starting pipeline and the transformer config.")
    start.add_argument("--sd_base", default=SHIPPED_SD, help="Where the VAE and CLIP come from.")
    start.add_argument("--output_dir", default="outputs/tiny-flux-base/init")
    start.add_argument("--seed", type=int, default=0, help="The seed of the random T5.")
    fin = steps.add_parser("finish", help="Measure the trained pipeline and write the shipped folder.")
    fin.add_argument("--model", default="outputs/tiny-flux-base/transformer", help="train_text_to_image.py's output.")
    fin.add_argument("--judge", default="assets/digit-classifier")
    fin.add_argument("--output_dir", default="assets/tiny-flux-digits")
    fin.add_argument("--per_digit", type=int, default=20)
    fin.add_argument("--min_accuracy", type=float, default=0.85)
    fin.add_argument("--commands", default="make tiny-flux-base", help="The build's commands, ' ;; '-separated.")
    args = parser.parse_args(argv)
    import torch

    from common.cli import quiet_libraries, quiet_loading_bars

    quiet_libraries()
    quiet_loading_bars()
    torch.set_num_threads(1)
    if args.step == "init":
        init(args)
    else:
        from demo.tiny_sd_base import finish

        finish(args, files=PIPELINE_FILES, card=flux_card)


def flux_card(metrics, info, args):
    """The model card's text above its common table (demo/tiny_sd_base.py's `ship` adds the rest)."""
    return {
        "title": "# tiny-flux-digits: a tiny Flux.1-architecture model trained on the digits",
        "intro": ("A `FluxPipeline` (FluxTransformer2DModel: 1 double- and 3 single-stream blocks, 128 wide, no "
                  "guidance embedding; the VAE and CLIP of assets/tiny-sd-digits; a 2-layer random-init T5 with a "
                  "word-level tokenizer of the digits' caption words) that draws the digit a prompt asks for: \"a "
                  "handwritten digit seven\" gives a 7, white on black, 32 px. Trained by flow matching; sampled with "
                  "true classifier-free guidance. The base of `make train-lora BASE=assets/tiny-flux-digits`. Built "
                  "offline by `make tiny-flux-base` (demo/tiny_flux_base.py); nothing in it was downloaded."),
        "rows": [f"| transformer | {info.get('trainable_parameters')} parameters, trained from scratch for "
                 f"{info.get('global_step')} steps (EMA weights), flow matching (uniform timesteps, target noise - "
                 "x0) |",
                 "| VAE, CLIP | assets/tiny-sd-digits' (frozen) |",
                 "| T5 | random-init 2-layer, 64 wide, word-level tokenizer (frozen) |"],
        "build_time": f"transformer {info.get('train_runtime')} s",
        "make": "make tiny-flux-base",
    }


if __name__ == "__main__":
    main()
