"""Load a single-file checkpoint with ComfyUI's own checkpoint loader, in ComfyUI's own Python, and report what it
made of it (JSON): the model class and prediction type it detected, every missing / unexpected / left-over key it
logged, the keys its own checkpoint saver writes for the loaded model (what the loader expects), and, given
--inputs, its UNet's, text encoders' and VAE's outputs on them.

Run by tests/tools/check_single_file.py; by hand:
    /work/comfy-venv/bin/python tests/tools/comfyui_load_checkpoint.py model.safetensors --comfyui /work/comfyui \
        --report report.json [--inputs inputs.safetensors --outputs comfy_outputs.safetensors]
Needs nothing from this project (ComfyUI's venv has no diffusers).
"""
import argparse
import json
import logging
import os
import sys

KEY_MESSAGES = ("missing", "unexpected", "left over", "leftover", "no match", "could not detect", "not loaded")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="A .safetensors file, or with --keys_only a JSON {key: [shape, dtype]}.")
    parser.add_argument("--keys_only", action="store_true",
                        help="From the keys and shapes alone, without the weights (for models too large to load "
                             "here): detection, and the keys ComfyUI's models have against the file's.")
    parser.add_argument("--comfyui", default="/work/comfyui", help="ComfyUI's folder.")
    parser.add_argument("--report", required=True, help="Where the JSON report goes.")
    parser.add_argument("--weights", default=None, help="With --keys_only: the real weights among them (safetensors).")
    parser.add_argument("--inputs", default=None, help="x, t, context, y, ids, z, image (safetensors).")
    parser.add_argument("--outputs", default=None, help="Where ComfyUI's outputs on --inputs go (safetensors).")
    args = parser.parse_args()
    checkpoint, report_file = os.path.abspath(args.checkpoint), os.path.abspath(args.report)
    inputs_file = args.inputs and os.path.abspath(args.inputs)
    outputs_file = args.outputs and os.path.abspath(args.outputs)
    weights_file = args.weights and os.path.abspath(args.weights)

    os.chdir(args.comfyui)
    sys.path.insert(0, args.comfyui)
    sys.argv = ["main.py", "--cpu", "--fp32-text-enc"]  # (its default keeps text encoders in fp16, even on a CPU)
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.sd
    import torch

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if any(needle in text.lower() for needle in KEY_MESSAGES):
                messages.append(f"{record.levelname}: {text[:2000]}")

    root = logging.getLogger()
    root.setLevel(logging.DEBUG)  # ComfyUI logs left-over and unexpected keys at DEBUG
    root.addHandler(Keep())
    report = {"checkpoint": checkpoint}
    if args.keys_only:
        report.update(keys_only(checkpoint, torch, weights_file, inputs_file, outputs_file), messages=messages)
        with open(report_file, "w") as f:
            json.dump(report, f, indent=1)
        return
    try:
        model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=True, output_clip=True)
    except Exception as err:  # a checkpoint it cannot read: that is the finding
        report.update(loaded=False, error=f"{type(err).__name__}: {' '.join(str(err).split())[:1500]}",
                      messages=messages)
        with open(report_file, "w") as f:
            json.dump(report, f, indent=1)
        return
    base = model.model
    encoders = [name for name in ("clip_l", "clip_h", "clip_g") if hasattr(clip.cond_stage_model, name)]
    saved = base.state_dict_for_saving(clip.get_sd(), vae.get_sd(), None)
    report.update(loaded=True, model_config=type(base.model_config).__name__, model_type=base.model_type.name,
                  latent_scale_factor=base.latent_format.scale_factor, text_encoders=encoders,
                  unet_dtype=str(next(base.diffusion_model.parameters()).dtype), messages=messages,
                  saved_keys={key: list(tensor.shape) for key, tensor in sorted(saved.items())})
    if inputs_file:
        from safetensors.torch import load_file, save_file

        inputs, out = load_file(inputs_file), {}
        with torch.no_grad():
            unet = base.diffusion_model.float()
            out["unet"] = unet(inputs["x"], timesteps=inputs["t"], context=inputs["context"], y=inputs.get("y"))
            for name in encoders:
                transformer = getattr(clip.cond_stage_model, name).transformer.float()
                ids = inputs[f"ids_{name}"] if f"ids_{name}" in inputs else inputs["ids"]
                last, penultimate, projected, _ = transformer(
                    input_tokens=ids, intermediate_output=-2, num_tokens=inputs["num_tokens"].tolist())
                out[f"{name}.last"], out[f"{name}.penultimate"], out[f"{name}.projected"] = \
                    last, penultimate, projected
            autoencoder = vae.first_stage_model.float()
            out["vae.decode"] = autoencoder.decode(inputs["z"])
            out["vae.encode"] = autoencoder.encode(inputs["image"])
        save_file({k: v.contiguous() for k, v in out.items()}, outputs_file)
    with open(report_file, "w") as f:
        json.dump(report, f, indent=1)


def keys_only(shapes_file, torch, weights_file=None, inputs_file=None, outputs_file=None):
    """What load_checkpoint_guess_config does with the keys, for a checkpoint too large to load here: the weights in
    `weights_file` (the text encoders and VAE) real, the UNet on the meta device (no memory; real zeros for its
    vectors, such as the norm bias by whose spread ComfyUI tells an SD 2 v-prediction model). Detection, the UNet's
    and text encoders' strict=False missing and unexpected keys as its loaders compute them, what its checkpoint
    saver writes, and given `inputs_file` the text encoders' and VAE's outputs."""
    import comfy.model_detection
    import comfy.sd
    import comfy.utils
    from safetensors.torch import load_file, save_file

    with open(shapes_file) as f:
        shapes = json.load(f)
    real = load_file(weights_file) if weights_file else {}
    sd = {key: real[key] if key in real else torch.zeros(shape, dtype=getattr(torch, dtype)) if len(shape) < 2
          else torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for key, (shape, dtype) in shapes.items()}
    prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
    config = comfy.model_detection.model_config_from_unet(sd, prefix)
    if config is None:
        return {"loaded": False, "error": "ComfyUI could not detect the model type"}
    model = config.get_model(sd, prefix, device=torch.device("meta"))
    unet_sd = config.process_unet_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)})
    unet_have = set(model.diffusion_model.state_dict())
    target = config.clip_target(state_dict=sd)
    clip_sd = config.process_clip_state_dict(dict(sd))
    on_meta = any(tensor.is_meta for tensor in clip_sd.values())
    clip = target.clip(device=torch.device("meta" if on_meta else "cpu"), dtype=torch.float32, **target.params)
    clip_missing, clip_unexpected = (set(clip.state_dict()) - set(clip_sd), set(clip_sd) - set(clip.state_dict())) \
        if on_meta else map(set, clip.load_state_dict(clip_sd, strict=False))
    vae_sd = comfy.utils.state_dict_prefix_replace(dict(sd), {k: "" for k in config.vae_key_prefix}, filter_keys=True)
    if any(tensor.is_meta for tensor in vae_sd.values()):
        vae_sd = {key: torch.zeros_like(tensor, device="cpu") for key, tensor in vae_sd.items()}
    vae = comfy.sd.VAE(sd=config.process_vae_state_dict(vae_sd))
    saved = model.state_dict_for_saving(clip.state_dict(), vae.get_sd(), None)
    encoders = [n for n in ("clip_l", "clip_h", "clip_g") if hasattr(clip, n)]
    if inputs_file and not on_meta:
        inputs, out = load_file(inputs_file), {}
        with torch.no_grad():
            for name in encoders:
                last, penultimate, projected, _ = getattr(clip, name).transformer(
                    input_tokens=inputs["ids"], intermediate_output=-2, num_tokens=inputs["num_tokens"].tolist())
                out[f"{name}.last"], out[f"{name}.penultimate"], out[f"{name}.projected"] = \
                    last, penultimate, projected
            autoencoder = vae.first_stage_model.float()
            out["vae.decode"] = autoencoder.decode(inputs["z"])
            out["vae.encode"] = autoencoder.encode(inputs["image"])
        save_file({k: v.contiguous() for k, v in out.items()}, outputs_file)
    return {"loaded": True, "keys_only": True, "model_config": type(config).__name__,
            "model_type": model.model_type.name, "latent_scale_factor": model.latent_format.scale_factor,
            "text_encoders": encoders, "unet_missing": sorted(unet_have - set(unet_sd)),
            "unet_unexpected": sorted(set(unet_sd) - unet_have), "clip_missing": sorted(clip_missing),
            "clip_unexpected": sorted(clip_unexpected),
            "saved_keys": {key: list(tensor.shape) for key, tensor in sorted(saved.items())}}


if __name__ == "__main__":
    main()
