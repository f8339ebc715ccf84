"""The offline tiny Stable Diffusion base (`make tiny-sd`): a real StableDiffusionPipeline, built without a download."""
import json
import os


def test_tiny_sd_is_a_stable_diffusion_pipeline(tiny_sd):
    import torch
    from diffusers import StableDiffusionPipeline

    assert not os.path.exists(str(tiny_sd) + ".tmp")  # written atomically
    vocab = json.loads((tiny_sd / "tokenizer" / "vocab.json").read_text())
    assert len(vocab) == 514 and (tiny_sd / "tokenizer" / "merges.txt").read_text().startswith("#version")
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    assert type(pipe.scheduler).__name__ == "DDPMScheduler" and pipe.safety_checker is None
    ids = pipe.tokenizer("a handwritten digit seven").input_ids
    assert ids[0] == vocab["<|startoftext|>"] and ids[-1] == vocab["<|endoftext|>"]
    assert pipe.tokenizer.decode(ids, skip_special_tokens=True) == "a handwritten digit seven"
    latents = pipe.vae.encode(torch.zeros(1, 3, 32, 32)).latent_dist.mean
    assert latents.shape == (1, 4, 8, 8)  # 32 px images, 8x8 latents
    image = pipe("a handwritten digit seven", num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                 output_type="np").images
    assert image.shape == (1, 32, 32, 3)
    params = sum(p.numel() for m in (pipe.unet, pipe.vae, pipe.text_encoder) for p in m.parameters())
    assert params < 3_000_000


def test_tiny_sd_is_deterministic(tmp_path, tiny_sd):
    from demo.tiny_sd import write_tiny_sd

    out = tmp_path / "tiny-sd"
    write_tiny_sd(str(out))
    for part in ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                 "text_encoder/model.safetensors", "tokenizer/vocab.json"):
        assert (out / part).read_bytes() == (tiny_sd / part).read_bytes(), part
