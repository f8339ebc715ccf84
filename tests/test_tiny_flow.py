"""The offline tiny Stable Diffusion 3 and Flux.1 bases (`make tiny-sd3`, `make tiny-flux`): real pipelines of the
real architectures, built without a download; and the real-size architectures (`--architecture sd3|flux`), counted and
run through their pipelines' encoders and transformer on the meta device, where nothing is allocated."""
import os

import pytest

# The published sizes (parameters() of each component as loaded from the hub: stabilityai/stable-diffusion-3-medium-
# diffusers and black-forest-labs/FLUX.1-dev; the CLIP and T5 embedding tables with their full rows).
CLIP_L, CLIP_L_PROJECTED, CLIP_BIGG_PROJECTED, T5_XXL = 123_060_480, 123_650_304, 694_659_840, 4_762_310_656
PUBLISHED = {
    "sd3": {"transformer": 2_028_328_000, "text_encoder": CLIP_L_PROJECTED, "text_encoder_2": CLIP_BIGG_PROJECTED,
            "text_encoder_3": T5_XXL, "vae": 83_819_683},
    "flux": {"transformer": 11_901_408_320, "text_encoder": CLIP_L, "text_encoder_2": T5_XXL, "vae": 83_819_683},
}
DISK_BUDGET = 7_000_000  # bytes per tiny pipeline


def load(path):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(path, local_files_only=True)


def native_size(pipe):
    """The base's native resolution in pixels, where each family's configs hold it."""
    if type(pipe).__name__ == "FluxPipeline":  # FluxPipeline itself defaults to 128 x the VAE factor
        return pipe.vae.config.sample_size
    return pipe.transformer.config.sample_size * pipe.vae_scale_factor


@pytest.mark.parametrize("base, pipeline, t5", [("tiny_sd3", "StableDiffusion3Pipeline", "text_encoder_3"),
                                                ("tiny_flux", "FluxPipeline", "text_encoder_2")])
def test_tiny_flow_pipeline_samples_offline(request, base, pipeline, t5):
    import numpy as np
    import torch

    path = request.getfixturevalue(base)
    assert not os.path.exists(str(path) + ".tmp")  # written atomically
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size < DISK_BUDGET, size
    pipe = load(path)
    assert type(pipe).__name__ == pipeline and type(pipe.transformer).__name__.endswith("Transformer2DModel")
    assert native_size(pipe) == 32 and pipe.vae.config.sample_size == 32
    assert pipe.vae.config.latent_channels == 16 and pipe.vae_scale_factor == 4
    # The VAE's measured factors bring its latents to about zero mean and unit variance, as the real ones do.
    with torch.no_grad():
        latents = pipe.vae.encode(torch.rand(32, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1)
    latents = (latents.latent_dist.mean - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    assert latents.shape == (32, 16, 8, 8)
    assert abs(latents.mean().item()) < 0.05 and abs(latents.std().item() - 1) < 0.05
    # T5's embedding table has one row per token of its tokenizer.
    tokenizer = getattr(pipe, t5.replace("text_encoder", "tokenizer"))
    assert type(tokenizer).__name__ in ("T5Tokenizer", "T5TokenizerFast")
    assert getattr(pipe, t5).config.vocab_size == len(tokenizer) and tokenizer.model_max_length == 512
    ids = tokenizer("a handwritten digit seven").input_ids
    assert ids[-1] == tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 0
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a handwritten digit seven"

    def sample(**kwargs):
        return pipe("a handwritten digit seven", num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                    output_type="np", **kwargs).images

    image = sample(height=32, width=32)
    assert image.shape == (1, 32, 32, 3) and np.isfinite(image).all() and image.std() > 0
    assert np.array_equal(sample(height=32, width=32), image)  # seeded
    if pipeline == "StableDiffusion3Pipeline":  # SD3's pipeline reads its native size from the configs
        assert np.array_equal(sample(), image)


def test_tiny_flow_configs(tiny_sd3, tiny_flux):
    """What the real configs set and the tiny ones keep: the scheduler's shift settings, Flux.1-dev's guidance."""
    import json

    def config(base, part):
        name = "scheduler_config.json" if part == "scheduler" else "config.json"
        return json.loads((base / part / name).read_text())

    sd3, flux = config(tiny_sd3, "scheduler"), config(tiny_flux, "scheduler")
    assert sd3["_class_name"] == flux["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    assert sd3["shift"] == 3.0 and not sd3["use_dynamic_shifting"]
    assert flux["use_dynamic_shifting"] and (flux["base_shift"], flux["max_shift"]) == (0.5, 1.15)
    assert (flux["base_image_seq_len"], flux["max_image_seq_len"]) == (256, 4096)
    assert config(tiny_flux, "transformer")["guidance_embeds"]
    for base, t5 in ((tiny_sd3, "tokenizer_3"), (tiny_flux, "tokenizer_2")):  # as the published folders say
        assert json.loads((base / "model_index.json").read_text())[t5] == ["transformers", "T5TokenizerFast"]
    for base in (tiny_sd3, tiny_flux):
        vae = config(base, "vae")
        assert not vae["use_quant_conv"] and not vae["use_post_quant_conv"] and vae["shift_factor"] != 0
        for name in ("tokenizer", "tokenizer_2"):  # CLIP's: the classic files beside tokenizer.json
            if json.loads((base / name / "tokenizer_config.json").read_text())["tokenizer_class"].startswith("CLIP"):
                assert (base / name / "merges.txt").read_text().startswith("#version")


def test_tiny_flow_is_deterministic(tmp_path, tiny_flux):
    from demo.tiny_sd import write_tiny_sd

    out = tmp_path / "tiny-flux"
    write_tiny_sd(str(out), architecture="tiny-flux")
    for part in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                 "vae/config.json", "text_encoder_2/model.safetensors", "tokenizer_2/tokenizer.json"):
        assert (out / part).read_bytes() == (tiny_flux / part).read_bytes(), part


@pytest.mark.parametrize("architecture", ["sd3", "flux"])
def test_real_size_architecture(architecture):
    """The published parameter counts, and one pass of the pipeline's own prompt encoding and the transformer at
    the native resolution, on the meta device: the shapes of every component fit each other at full size."""
    import torch

    from demo.tiny_flow import CONFIGS, build_random_flow

    meta = torch.device("meta")
    pipe = build_random_flow(CONFIGS[architecture](), device="meta", dtype=torch.bfloat16)
    counts = {name: sum(p.numel() for p in part.parameters()) for name, part in pipe.components.items()
              if isinstance(part, torch.nn.Module)}
    assert counts == PUBLISHED[architecture]
    assert all(p.dtype == torch.bfloat16 for p in pipe.transformer.parameters())
    size = native_size(pipe)
    assert size == 1024
    with torch.no_grad():
        if architecture == "sd3":
            embeds, _, pooled, _ = pipe.encode_prompt("a photo", "a photo", "a photo", device=meta,
                                                      do_classifier_free_guidance=False)
            latents = torch.empty(1, 16, size // 8, size // 8, device=meta, dtype=torch.bfloat16)
            out = pipe.transformer(hidden_states=latents, encoder_hidden_states=embeds, pooled_projections=pooled,
                                   timestep=torch.empty(1, device=meta)).sample
        else:
            embeds, pooled, text_ids = pipe.encode_prompt("a photo", "a photo", device=meta)
            latents, image_ids = pipe.prepare_latents(1, 16, size, size, torch.bfloat16, meta, None)
            out = pipe.transformer(hidden_states=latents, encoder_hidden_states=embeds, pooled_projections=pooled,
                                   timestep=torch.empty(1, device=meta), guidance=torch.empty(1, device=meta),
                                   txt_ids=text_ids, img_ids=image_ids).sample
    assert out.shape == latents.shape
