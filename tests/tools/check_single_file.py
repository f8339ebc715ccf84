"""The single-file checkpoint (common/single_file_checkpoint.py) against its real readers, live. Not part of the
suite: ComfyUI cannot be installed in CI, so what this finds is pinned in tests/pinned/comfyui_checkpoint_keys.json,
which tests/test_single_file.py checks the converter against.

    .venv/bin/python tests/tools/check_single_file.py --architecture sd15 [--pin]

1. builds a random-init pipeline of that architecture (demo/tiny_sd.py's configs: tiny, sd15, sd2, tiny-sdxl,
   sdxl; `shipped`: the shipped base assets/tiny-sd-digits) and writes it as one single file;
2. diffusers: StableDiffusion(XL)Pipeline.from_single_file(file, config=<a folder of the pipeline's configs>), offline:
   the UNet's, text encoders' and VAE's outputs against the original's (max abs difference);
3. ComfyUI: comfy.sd.load_checkpoint_guess_config in ComfyUI's own Python (tests/tools/comfyui_load_checkpoint.py,
   --comfy_python, --comfyui): the model class and prediction type it detected, every missing / unexpected /
   left-over key it logged, the keys its own checkpoint saver writes for the loaded model against the file's, and
   its UNet's, text encoders' and VAE's outputs on the same inputs;
4. --pin: writes ComfyUI's key set (key -> shape) for the architecture into tests/pinned/comfyui_checkpoint_keys.json.

Prints one JSON summary (also <work>/summary.json); exit code 1 when a reader disagrees. Memory: about 3x the
model's fp32 size (sd15 ~13 GB, sd2 ~16 GB; sdxl needs ~45 GB).
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PINNED = ROOT / "tests" / "pinned" / "comfyui_checkpoint_keys.json"


def build(architecture):
    from diffusers import StableDiffusionPipeline

    from common.base_models import SHIPPED_BASE
    from demo.tiny_sd import SD2, SD15, SDXL, build_random_sd, tiny_configs, tiny_sdxl_configs

    if architecture == "shipped":
        return StableDiffusionPipeline.from_pretrained(ROOT / SHIPPED_BASE)
    configs = {"tiny": tiny_configs(), "sd15": SD15, "sd2": SD2, "tiny-sdxl": tiny_sdxl_configs(),
               "sdxl": SDXL}[architecture]
    return build_random_sd(configs, seed=0)


def write_configs(pipe, folder):
    """The pipeline's folder without its weights: what from_single_file's config= reads."""
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    pipe.save_config(folder)
    for name, part in pipe.components.items():
        if part is None:
            continue
        if isinstance(part, ModelMixin):
            part.save_config(os.path.join(folder, name))
        elif isinstance(part, PreTrainedModel):
            part.config.save_pretrained(os.path.join(folder, name))
        else:  # tokenizers, the scheduler
            part.save_pretrained(os.path.join(folder, name))


def make_inputs(pipe):
    import torch

    g = torch.Generator().manual_seed(0)
    unet, vae = pipe.unet, pipe.vae
    side = min(unet.config.sample_size, 32)
    inputs = {"x": torch.randn(1, unet.config.in_channels, side, side, generator=g), "t": torch.tensor([500.0]),
              "context": torch.randn(1, 77, unet.config.cross_attention_dim, generator=g),
              "z": torch.randn(1, vae.config.latent_channels, 8, 8, generator=g),
              "image": torch.rand(1, 3, 64, 64, generator=g) * 2 - 1}
    eos, position = pipe.text_encoder.config.eos_token_id, 9
    ids = torch.randint(0, eos - 1, (1, 77), generator=g)  # (the byte-level vocabulary: 514 tokens, EOS last)
    ids[0, position] = eos
    inputs["ids"], inputs["num_tokens"] = ids, torch.tensor([position + 1])  # ComfyUI pools where it is told
    added = None
    if unet.config.addition_embed_type == "text_time":
        pooled = torch.randn(1, pipe.text_encoder_2.config.projection_dim, generator=g)
        time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]])
        added = {"text_embeds": pooled, "time_ids": time_ids}
        with torch.no_grad():  # ComfyUI's UNet takes the pooled text and the embedded time ids side by side
            inputs["y"] = torch.cat([pooled, unet.add_time_proj(time_ids.flatten()).reshape(1, -1)], dim=1)
    return inputs, added


def outputs(pipe, inputs, added):
    """{name: tensor} of the diffusers models on `inputs`, named as tests/tools/comfyui_load_checkpoint.py names
    ComfyUI's (text: the final layer norm of the last layer; SD 2's is ComfyUI's penultimate of its 24)."""
    import torch

    out = {}
    with torch.no_grad():
        out["unet"] = pipe.unet(inputs["x"], inputs["t"], inputs["context"], added_cond_kwargs=added).sample
        encoders = [pipe.text_encoder] + ([pipe.text_encoder_2] if getattr(pipe, "text_encoder_2", None) else [])
        for i, encoder in enumerate(encoders):
            result = encoder(inputs["ids"])
            out[f"text_encoder{'_2' * i}.last"] = result.last_hidden_state
            if hasattr(result, "text_embeds"):
                out[f"text_encoder{'_2' * i}.projected"] = result.text_embeds
        out["vae.decode"] = pipe.vae.decode(inputs["z"]).sample
        out["vae.encode"] = pipe.vae.encode(inputs["image"]).latent_dist.mean
    return out


def differences(reference, other, pairs):
    """{name: max abs difference (and relative to the reference's largest value)} over (ours, theirs) names."""
    result = {}
    for ours, theirs in pairs:
        if theirs not in other:
            continue
        a, b = reference[ours].float(), other[theirs].float()
        diff = (a - b).abs().max().item()
        name = ours if ours == theirs else f"{ours} vs {theirs}"
        result[name] = {"max_abs_diff": diff, "relative": diff / max(a.abs().max().item(), 1e-12)}
    return result


def keys_only_models(architecture):
    """(unet, vae, [text encoders]) of the architecture: the UNet on the meta device (shapes without memory), the
    VAE and text encoders real (random init)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from demo.tiny_sd import SD2, SD15, SDXL, byte_level_vocab

    configs = {"sd15": SD15, "sd2": SD2, "sdxl": SDXL}[architecture]
    eos = byte_level_vocab()["<|endoftext|>"]
    torch.manual_seed(0)
    encoders = [cls(CLIPTextConfig(**configs[name], eos_token_id=eos))
                for cls, name in ((CLIPTextModel, "text"), (CLIPTextModelWithProjection, "text_2")) if name in configs]
    with torch.device("meta"):
        unet = UNet2DConditionModel(**configs["unet"])
    return unet, AutoencoderKL(**configs["vae"]), encoders


def check_keys_only(args):
    """--keys_only: ComfyUI's view of the file from its keys, the text encoders' and VAE's outputs compared."""
    import torch
    from safetensors.torch import load_file, save_file

    from common.single_file_checkpoint import single_file_weights

    torch.set_grad_enabled(False)
    work = Path(args.work or tempfile.mkdtemp(prefix=f"single-file-keys-{args.architecture}-"))
    work.mkdir(parents=True, exist_ok=True)
    unet, vae, encoders = keys_only_models(args.architecture)
    weights = single_file_weights(unet, vae, encoders)
    ours = {key: [list(t.shape), str(t.dtype).removeprefix("torch.")] for key, t in weights.items()}
    (work / "shapes.json").write_text(json.dumps(ours))
    save_file({k: v.contiguous() for k, v in weights.items() if not v.is_meta}, work / "weights.safetensors")
    g = torch.Generator().manual_seed(0)
    eos, position = encoders[0].config.eos_token_id, 9
    ids = torch.randint(0, eos - 1, (1, 77), generator=g)
    ids[0, position] = eos
    inputs = {"ids": ids, "num_tokens": torch.tensor([position + 1]), "z": torch.randn(1, 4, 8, 8, generator=g),
              "image": torch.rand(1, 3, 64, 64, generator=g) * 2 - 1}
    save_file(inputs, work / "inputs.safetensors")
    reference = {"vae.decode": vae.decode(inputs["z"]).sample,
                 "vae.encode": vae.encode(inputs["image"]).latent_dist.mean}
    for i, encoder in enumerate(encoders):
        result = encoder(ids)
        reference[f"text_encoder{'_2' * i}.last"] = result.last_hidden_state
        if hasattr(result, "text_embeds"):
            reference[f"text_encoder{'_2' * i}.projected"] = result.text_embeds
    report_file, comfy_outputs = work / "comfyui_report.json", work / "comfyui_outputs.safetensors"
    proc = subprocess.run([args.comfy_python, str(ROOT / "tests" / "tools" / "comfyui_load_checkpoint.py"),
                           str(work / "shapes.json"), "--keys_only", "--weights", str(work / "weights.safetensors"),
                           "--inputs", str(work / "inputs.safetensors"), "--outputs", str(comfy_outputs),
                           "--comfyui", args.comfyui, "--report", str(report_file)], capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        sys.exit(1)
    report = json.loads(report_file.read_text())
    summary = {key: value for key, value in report.items() if key != "saved_keys"}
    if report.get("loaded"):
        theirs = report["saved_keys"]
        summary["keys_comfyui_has_and_the_file_not"] = sorted(set(theirs) - set(ours))
        summary["keys_the_file_has_and_comfyui_not"] = sorted(set(ours) - set(theirs))
        summary["shape_mismatches"] = sorted(k for k in set(ours) & set(theirs) if ours[k][0] != theirs[k])
        first = report["text_encoders"][0]
        pairs = [("vae.decode", "vae.decode"), ("vae.encode", "vae.encode"),
                 ("text_encoder.last", f"{first}.penultimate" if first == "clip_h" else f"{first}.last")]
        if first == "clip_h":  # and its last: the file's 24th layer is an identity
            pairs.append(("text_encoder.last", "clip_h.last"))
        if len(encoders) == 2:
            pairs += [("text_encoder_2.last", "clip_g.last"), ("text_encoder_2.projected", "clip_g.projected")]
        summary["outputs"] = differences(reference, load_file(comfy_outputs), pairs)
        if args.pin:
            pinned = json.loads(PINNED.read_text()) if PINNED.exists() else {}
            pinned[args.architecture] = {"model_config": report["model_config"], "model_type": report["model_type"],
                                         "keys": theirs}
            write_pinned(pinned)
            summary["pinned"] = str(PINNED)
    print(json.dumps(summary, indent=1))


def write_pinned(pinned):
    """tests/pinned/comfyui_checkpoint_keys.json, one key a line (a diff shows what changed)."""
    lines = ["{"]
    for i, (name, entry) in enumerate(sorted(pinned.items())):
        lines.append(f'"{name}": {{"model_config": {json.dumps(entry["model_config"])}, '
                     f'"model_type": {json.dumps(entry["model_type"])}, "keys": {{')
        keys = sorted(entry["keys"].items())
        lines += [f"  {json.dumps(k)}: {json.dumps(v)}{',' * (j < len(keys) - 1)}" for j, (k, v) in enumerate(keys)]
        lines.append("}}" + "," * (i < len(pinned) - 1))
    PINNED.parent.mkdir(parents=True, exist_ok=True)
    PINNED.write_text("\n".join(lines + ["}"]) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--architecture", default="sd15", choices=["tiny", "shipped", "sd15", "sd2", "tiny-sdxl",
                                                                    "sdxl"])
    parser.add_argument("--work", default=None, help="Folder for the files (default: a temporary one).")
    parser.add_argument("--comfyui", default="/work/comfyui", help="ComfyUI's folder.")
    parser.add_argument("--comfy_python", default="/work/comfy-venv/bin/python", help="ComfyUI's Python.")
    parser.add_argument("--pin", action="store_true", help="Write ComfyUI's key set to " + str(PINNED))
    parser.add_argument("--keys_only", action="store_true",
                        help="No weights (the models on the meta device): ComfyUI's detection and key sets only, "
                             "for models too large to load here (sdxl).")
    args = parser.parse_args()
    if args.keys_only:
        return check_keys_only(args)
    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from common.cli import quiet_libraries, quiet_loading_bars
    from common.single_file_checkpoint import save_single_file

    quiet_libraries()
    quiet_loading_bars()
    torch.set_grad_enabled(False)
    work = Path(args.work or tempfile.mkdtemp(prefix=f"single-file-{args.architecture}-"))
    work.mkdir(parents=True, exist_ok=True)
    summary = {"architecture": args.architecture, "work": str(work)}
    start = time.time()
    pipe = build(args.architecture)
    write_configs(pipe, work / "pipeline")
    checkpoint = work / "model.safetensors"
    summary["metadata"] = save_single_file(pipe, str(checkpoint))
    summary["size_mb"] = round(checkpoint.stat().st_size / 1e6, 1)
    inputs, added = make_inputs(pipe)
    reference = outputs(pipe, inputs, added)
    save_file({k: v.contiguous() for k, v in inputs.items()}, work / "inputs.safetensors")
    pipeline_class = type(pipe)
    del pipe
    gc.collect()
    summary["built_and_written_s"] = round(time.time() - start, 1)

    # diffusers: from_single_file, offline, with the pipeline's configs
    start = time.time()
    kind = StableDiffusionXLPipeline if pipeline_class is StableDiffusionXLPipeline else StableDiffusionPipeline
    back = kind.from_single_file(str(checkpoint), config=str(work / "pipeline"), local_files_only=True)
    names = list(reference)
    summary["diffusers"] = differences(reference, outputs(back, inputs, added), [(n, n) for n in names])
    summary["diffusers_s"] = round(time.time() - start, 1)
    del back
    gc.collect()

    # ComfyUI: its checkpoint loader in its own Python
    start = time.time()
    report_file, comfy_outputs = work / "comfyui_report.json", work / "comfyui_outputs.safetensors"
    proc = subprocess.run([args.comfy_python, str(ROOT / "tests" / "tools" / "comfyui_load_checkpoint.py"),
                           str(checkpoint), "--comfyui", args.comfyui, "--report", str(report_file), "--inputs",
                           str(work / "inputs.safetensors"), "--outputs", str(comfy_outputs)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        summary["comfyui"] = {"crashed": proc.stderr[-3000:]}
    else:
        report = json.loads(report_file.read_text())
        comfy = {key: report[key] for key in ("loaded", "error", "model_config", "model_type",
                                              "latent_scale_factor", "text_encoders", "messages") if key in report}
        if report.get("loaded"):
            with safe_open(str(checkpoint), "pt") as f:
                ours = {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
            theirs = report["saved_keys"]
            comfy["keys_comfyui_has_and_the_file_not"] = sorted(set(theirs) - set(ours))
            comfy["keys_the_file_has_and_comfyui_not"] = sorted(set(ours) - set(theirs))
            comfy["shape_mismatches"] = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
            theirs_out = load_file(comfy_outputs)
            second = "text_encoder_2" if "text_encoder_2.last" in reference else None
            pairs = [("unet", "unet"), ("vae.decode", "vae.decode"), ("vae.encode", "vae.encode")]
            first = report["text_encoders"][0]
            # SD 2's text encoder is ComfyUI's 24-layer OpenCLIP ViT-H without its last layer: its penultimate
            pairs.append(("text_encoder.last", f"{first}.penultimate" if first == "clip_h" else f"{first}.last"))
            if first == "clip_h":  # and its last: the file's 24th layer is an identity
                pairs.append(("text_encoder.last", "clip_h.last"))
            if second:
                pairs += [("text_encoder_2.last", "clip_g.last"), ("text_encoder_2.projected", "clip_g.projected")]
            comfy["outputs"] = differences(reference, theirs_out, pairs)
            if args.pin:
                pinned = json.loads(PINNED.read_text()) if PINNED.exists() else {}
                pinned[args.architecture] = {"model_config": report["model_config"],
                                             "model_type": report["model_type"], "keys": theirs}
                write_pinned(pinned)
                comfy["pinned"] = str(PINNED)
        summary["comfyui"] = comfy
    summary["comfyui_s"] = round(time.time() - start, 1)
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    bad = any(v["max_abs_diff"] >= 1e-5 for v in summary["diffusers"].values())
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
