"""What the text-to-image trainers compute once and every family shares (common/vae.py, common/prompts.py): the VAE
encodes in fp32 whatever autocast is on; VAEs with per-channel latents_mean/latents_std are normalized as diffusers'
SDXL pipeline decodes them; SDXL's caption dropout trains on the zeros its pipeline samples the unconditional branch
with; the prompt cache spills to memory-mapped files and reads back the same."""
import numpy as np
import pytest
import torch


def test_the_vae_encodes_in_fp32_under_any_autocast(tiny_sd):
    """Under bf16 autocast (what accelerator.autocast() gives a bf16 run) a plain encode computes in bf16; the
    recipes' encode_params does not: the same fp32 parameters as without autocast (an fp16 VAE's NaN latents, once
    cached, would poison a whole run)."""
    from diffusers import AutoencoderKL

    from common.vae import encode_params

    vae = AutoencoderKL.from_pretrained(tiny_sd, subfolder="vae")
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    plain = encode_params(vae, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = encode_params(vae, x)
        with torch.no_grad():
            autocast = vae.encode(x).latent_dist.parameters
    assert ours.dtype == torch.float32 and torch.equal(ours, plain)
    assert not torch.equal(autocast.float(), plain)  # the test can tell


def test_latents_mean_and_std_as_the_sdxl_pipeline_decodes(tiny_sdxl, tmp_path):
    """A VAE whose config has latents_mean/latents_std (SDXL-derived ones, Playground's): the recipes' decode of the
    pipeline's latents equals the pipeline's own output, and encode normalizes by the inverse."""
    import shutil

    from diffusers import StableDiffusionXLPipeline

    from common.vae import decode_fp32, denormalize, normalize

    base = tmp_path / "base"
    shutil.copytree(tiny_sdxl, base)
    pipe = StableDiffusionXLPipeline.from_pretrained(base)
    pipe.vae.register_to_config(latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[0.5, 2.0, 1.0, 1.5])
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a digit", num_inference_steps=2, height=32, width=32)
    latents = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="latent").images
    theirs = np.asarray(pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]).astype(int)
    ours = np.asarray(decode_fp32(pipe, latents)[0]).astype(int)
    assert np.abs(ours - theirs).max() <= 1
    config = dict(pipe.vae.config)
    x = torch.randn(2, 4, 8, 8)
    assert torch.allclose(denormalize(config, normalize(config, x)), x, atol=1e-6)
    mean = torch.tensor(config["latents_mean"]).view(1, 4, 1, 1)
    std = torch.tensor(config["latents_std"]).view(1, 4, 1, 1)
    assert torch.allclose(normalize(config, x), (x - mean) * config["scaling_factor"] / std)
    plain = {**config, "latents_mean": None, "latents_std": None}
    assert not torch.allclose(normalize(plain, x), normalize(config, x))


@pytest.mark.parametrize("cache", [True, False])
def test_sdxl_caption_dropout_trains_on_the_pipelines_zeros(tiny_sdxl, cache):
    """StableDiffusionXLPipeline samples the unconditional branch with zeros (force_zeros_for_empty_prompt): the
    empty prompt's conditioning is zeros too, cached or embedded each batch; other prompts are the pipeline's own."""
    from diffusers import StableDiffusionXLPipeline

    from common.families import read_model_index, sdxl
    from common.prompts import Conditioning

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
    assert sdxl.empty_prompt_zeros(read_model_index(str(tiny_sdxl), "--model"))
    prompts = ["", "a handwritten digit seven"]
    condition = Conditioning(sdxl, pipe.components, prompts, None, "cpu", zero_empty=True, cache=cache)
    class Sizes:  # the images' time ids (ImageDataset.time_ids): not what this test is about
        @staticmethod
        def time_ids(indices):
            return torch.tensor([[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]] * len(indices))

    with torch.no_grad():
        cond = condition(torch.tensor([0, 1]), torch.tensor([0, 1]), Sizes())
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(["a handwritten digit seven"], device="cpu")
    assert not cond["prompt_embeds"][0].any() and not cond["pooled_prompt_embeds"][0].any()
    assert torch.equal(negative[0], cond["prompt_embeds"][0]) and torch.equal(negative_pooled[0],
                                                                              cond["pooled_prompt_embeds"][0])
    # (a batch of two against one: float rounding only)
    assert torch.allclose(cond["prompt_embeds"][1], embeds[0], atol=1e-5)
    assert torch.allclose(cond["pooled_prompt_embeds"][1], pooled[0], atol=1e-5)


def test_the_prompt_cache_spills_to_memory_mapped_files_and_reads_back_the_same():
    from common.prompts import PromptCache

    def embed(ids):
        x = ids[0].float()
        return {"prompt_embeds": torch.stack([x, -x], dim=-1).to(torch.bfloat16), "pooled_prompt_embeds": x.sum(-1),
                "prompt_embeds_mask": ids[0] % 3}  # (an integer mask, as Qwen-Image's)

    ids = [torch.arange(40).view(10, 4)]
    memory = PromptCache(embed, ids, batch_size=3, zero_rows=[2])
    spilled = PromptCache(embed, ids, batch_size=3, zero_rows=[2], limit_gb=0)
    assert not memory.spilled and spilled.spilled
    rows = torch.tensor([7, 2, 0])
    assert spilled[rows]["prompt_embeds_mask"].dtype == torch.int64 and spilled[[7]]["prompt_embeds_mask"].sum() > 0
    for name in ("prompt_embeds", "pooled_prompt_embeds", "prompt_embeds_mask"):
        assert torch.equal(memory[rows][name], spilled[rows][name]) and memory[rows][name].dtype == \
            spilled[rows][name].dtype
    assert not memory[[2]]["prompt_embeds"].any()
    assert torch.equal(memory[[7]]["pooled_prompt_embeds"], embed([ids[0][7:8]])["pooled_prompt_embeds"])
    import os

    assert not os.path.exists(spilled.folder)  # the files are unlinked once mapped: nothing left behind, ever
    spilled.close()
    assert not os.path.exists(spilled.folder)
