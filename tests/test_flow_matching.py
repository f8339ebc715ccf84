"""Flow matching (common/objectives.py) and the SD3 / Flux.1 / Qwen-Image / Z-Image family modules against diffusers'
own computation, on the tiny random-init builds: one fixed batch, fixed noise and sigmas, the loss as diffusers'
train_dreambooth_lora_sd3.py, _flux.py, _qwen_image.py and _z_image.py compute it (their get_sigmas, x_t, the
pipelines' packing, ids and img_shapes, the /1000 timestep, SD3's preconditioning, Z-Image's lists, (1000 - t) / 1000
and negated output, compute_loss_weighting_for_sd3), the prompt embeddings as the pipelines' own encode_prompt makes
them, the training sigmas (SD3's and Z-Image's shifted, Flux's and Qwen-Image's not) and the timestep draw; the flags
each objective refuses."""
import argparse

import pytest
import torch
from conftest import ROOT

from common.families import family_module
from common.objectives import check_objective_args, make_objective

FLOW_FLAGS = dict(prediction_type=None, snr_gamma=None, noise_offset=None, weighting_scheme=None, logit_mean=None,
                  logit_std=None, mode_scale=None, precondition_outputs=None)


def flags(**given):
    return argparse.Namespace(**{**FLOW_FLAGS, **given})


@pytest.fixture(scope="module")
def pipes(tiny_flux, tiny_sd3, tiny_qwen_image, tiny_z_image):
    import diffusers

    return {"flux": diffusers.FluxPipeline.from_pretrained(tiny_flux),
            "sd3": diffusers.StableDiffusion3Pipeline.from_pretrained(tiny_sd3),
            "qwen_image": diffusers.QwenImagePipeline.from_pretrained(tiny_qwen_image),
            "z_image": diffusers.ZImagePipeline.from_pretrained(tiny_z_image),
            "paths": {"flux": tiny_flux, "sd3": tiny_sd3, "qwen_image": tiny_qwen_image, "z_image": tiny_z_image}}


def pipeline_embeddings(pipe, name, prompts, length=16):
    """The pipeline's own encode_prompt, at T5's (Z-Image: Qwen3's) length 16 (Qwen-Image: 16 tokens after the
    template's; -> the embeddings and their mask, None when no prompt is padded)."""
    if name == "qwen_image":
        return pipe.encode_prompt(prompts, max_sequence_length=16)
    if name == "z_image":  # a list: each prompt's own tokens
        return pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False, max_sequence_length=length)[0], None
    if name == "flux":
        embeds, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, max_sequence_length=16)
    else:
        embeds, _, pooled, _ = pipe.encode_prompt(prompts, None, None, do_classifier_free_guidance=False,
                                                  max_sequence_length=16)
    return embeds, pooled


@pytest.mark.parametrize("name", ["flux", "sd3", "z_image"])
def test_prompt_embeddings_are_the_pipelines_own(pipes, name):
    family, pipe = family_module(name), pipes[name]
    prompts = ["a handwritten digit seven", "", "red ink on paper"]
    length = 24 if name == "z_image" else 16  # (Z-Image: "" in the chat template takes 19 tokens)
    ours = family.encode_prompts(pipe.components, family.tokenize(pipe.components, prompts, length))
    embeds, pooled = pipeline_embeddings(pipe, name, prompts, length)
    if name == "z_image":  # cached padded with a mask (one shape), given back as the pipeline's list
        kwargs = family.pipeline_prompt_kwargs(ours, None)
        assert [len(e) for e in embeds] == [24, 19, 24] and ours["prompt_embeds"].shape == (3, 24, 32)
        assert all(torch.equal(a, b) for a, b in zip(kwargs["prompt_embeds"], embeds, strict=True))
        return
    assert torch.equal(ours["prompt_embeds"], embeds) and torch.equal(ours["pooled_prompt_embeds"], pooled)


def test_qwen_image_prompt_embeddings_are_the_pipelines_padded(pipes):
    """Qwen2.5-VL's last hidden states after the template's 34 tokens, as QwenImagePipeline.encode_prompt makes them
    (padded to the batch's longest prompt, cut at max_sequence_length), here padded on to max_sequence_length with
    zeros and a mask that leaves them out: one shape for every cached embedding."""
    family, pipe = family_module("qwen_image"), pipes["qwen_image"]
    prompts = ["7", "", "red ink on paper, a much longer prompt than sixteen tokens"]
    with torch.no_grad():
        ours = family.encode_prompts(pipe.components, family.tokenize(pipe.components, prompts, 16))
        embeds, mask = pipeline_embeddings(pipe, "qwen_image", prompts)  # (the long prompt's tokens are all read)
        short, short_mask = pipeline_embeddings(pipe, "qwen_image", prompts[:2])  # padded to 14, not to 16
    assert ours["prompt_embeds"].shape == (3, 16, 32) and embeds.shape[1] == 16 and mask[:, -1].tolist() == [0, 0, 1]
    assert torch.equal(ours["prompt_embeds_mask"], mask)
    assert torch.allclose(ours["prompt_embeds"], embeds, atol=1e-6), (ours["prompt_embeds"] - embeds).abs().max()
    assert short.shape[1] < 16 and short_mask is not None
    assert torch.allclose(ours["prompt_embeds"][:2, :short.shape[1]], short, atol=1e-6)
    assert torch.equal(ours["prompt_embeds_mask"][:2, :short.shape[1]], short_mask)
    assert not ours["prompt_embeds"][:2, short.shape[1]:].any()
    assert not ours["prompt_embeds_mask"][:2, short.shape[1]:].any()
    assert family.prompt_template() == (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx)


def test_qwen_image_latents_are_the_scripts_and_decode_as_the_pipeline(pipes):
    """A 32 px image through the 3-D VAE as one frame, normalised per channel as diffusers' Qwen-Image script does
    ((x - latents_mean) * (1 / latents_std)), and back as QwenImagePipeline decodes (x / (1 / latents_std) + mean)."""
    from common.vae import denormalize, encode_params, mean_latents

    family, vae = family_module("qwen_image"), pipes["qwen_image"].vae
    config = family.latent_config(vae)
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    ours = mean_latents(encode_params(vae, pixels), config)
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        theirs = (vae.encode(pixels[:, :, None]).latent_dist.mean - mean) * inverse_std
    assert ours.shape == (2, 16, 8, 8) and torch.allclose(ours, theirs[:, :, 0], atol=1e-5)
    assert 0.5 < ours.std() < 2  # the tiny VAE's statistics describe its latents
    assert torch.allclose(denormalize(config, ours)[:, :, None], ours[:, :, None] / inverse_std + mean, atol=1e-6)


@pytest.mark.parametrize("name, scheme", [("flux", None), ("sd3", None), ("sd3", "sigma_sqrt"), ("flux", "cosmap"),
                                          ("qwen_image", None), ("qwen_image", "sigma_sqrt"), ("z_image", None)])
def test_one_batch_loss_equals_diffusers_example(pipes, name, scheme):
    """Our objective + family denoiser against the lines of diffusers' example, written out with diffusers' own
    helpers: the same loss to float rounding, for the family's default scheme and a weighted one."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, QwenImagePipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    family, pipe = family_module(name), pipes[name]
    args = flags(weighting_scheme=scheme)
    check_objective_args(args, family)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(pipes["paths"][name], subfolder="scheduler")
    objective = make_objective(family, scheduler, args)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 8, 8, generator=g)
    indices = torch.tensor([100, 750])
    prompts = ["a handwritten digit seven", "a handwritten digit two"]
    cond = family.encode_prompts(pipe.components, family.tokenize(pipe.components, prompts, 16))
    guidance = 3.5 if name == "flux" else None
    if name == "qwen_image":  # one prompt shorter than the other (14 and 16 tokens): padding and its mask matter
        prompts = ["7", "a handwritten digit two, in red ink on paper"]
        cond = family.encode_prompts(pipe.components, family.tokenize(pipe.components, prompts, 16))
        assert cond["prompt_embeds_mask"].sum(1).tolist() == [14, 16]
    with torch.no_grad():
        noised = objective.at(x0, noise, indices)
        ours = objective.losses(family.denoise(pipe.transformer, noised.noisy, noised.timesteps, cond, guidance),
                                noised).mean()

        # diffusers' example: timesteps from the density's indices, get_sigmas, x_t, the model call, the loss
        if name == "qwen_image":  # (the Qwen-Image script loads its scheduler with shift=3.0)
            scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(pipes["paths"][name], subfolder="scheduler",
                                                                        shift=3.0)
        timesteps = scheduler.timesteps[indices]
        steps = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
        sigmas = scheduler.sigmas[steps].flatten().view(-1, 1, 1, 1)
        x_t = (1.0 - sigmas) * x0 + sigmas * noise
        embeds, pooled = pipeline_embeddings(pipe, name, prompts)
        if name == "qwen_image":  # 5-D latents [B, C, 1, h, w], frames first for the packing; pooled: the mask
            vae_scale = pipe.vae_scale_factor
            packed = QwenImagePipeline._pack_latents(x_t[:, :, None].permute(0, 2, 1, 3, 4), 2, 16, 8, 8)
            out = pipe.transformer(hidden_states=packed, encoder_hidden_states=embeds,
                                   encoder_hidden_states_mask=pooled, timestep=timesteps / 1000,
                                   img_shapes=[(1, 4, 4)] * 2, return_dict=False)[0]
            pred = QwenImagePipeline._unpack_latents(out, 8 * vae_scale, 8 * vae_scale, vae_scale)[:, :, 0]
            target = noise - x0
        elif name == "z_image":  # a list of [C, 1, h, w] latents and one of embeddings; (1000 - t) / 1000; negated
            out = pipe.transformer(list(x_t.unsqueeze(2).unbind(dim=0)), (1000 - timesteps) / 1000, embeds,
                                   return_dict=False)[0]
            pred, target = -torch.stack(out, dim=0).squeeze(2), noise - x0
        elif name == "flux":
            vae_scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
            packed = FluxPipeline._pack_latents(x_t, 2, 16, 8, 8)
            out = pipe.transformer(hidden_states=packed, timestep=timesteps / 1000,
                                   guidance=torch.tensor([3.5]).expand(2), pooled_projections=pooled,
                                   encoder_hidden_states=embeds, txt_ids=torch.zeros(embeds.shape[1], 3),
                                   img_ids=FluxPipeline._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32),
                                   return_dict=False)[0]
            pred = FluxPipeline._unpack_latents(out, 8 * vae_scale, 8 * vae_scale, vae_scale)
            target = noise - x0
        else:
            out = pipe.transformer(hidden_states=x_t, timestep=timesteps, encoder_hidden_states=embeds,
                                   pooled_projections=pooled, return_dict=False)[0]
            pred, target = out * (-sigmas) + x_t, x0  # --precondition_outputs 1, the SD3 script's default
        weighting = compute_loss_weighting_for_sd3(args.weighting_scheme, sigmas)
        theirs = torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(2, -1), 1).mean()
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7), (ours, theirs)
    if scheme:  # the weights are not all 1: the comparison can tell
        assert not torch.allclose(weighting, torch.ones_like(weighting))


def test_z_image_trains_on_the_latent_distributions_mode(pipes):
    """diffusers' Z-Image script trains on `(latent_dist.mode() - shift_factor) * scaling_factor`, the Flux and SD3
    scripts on a sample of the distribution: each family's latent_config says which."""
    from common.vae import encode_params, sample_latents

    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    for name in ("z_image", "flux"):
        vae = pipes[name].vae
        with torch.no_grad():
            mode = vae.encode(pixels).latent_dist.mode()
        latents = sample_latents(encode_params(vae, pixels), family_module(name).latent_config(vae))
        expected = (mode - vae.config.shift_factor) * vae.config.scaling_factor
        assert torch.allclose(latents, expected, atol=1e-5) == (name == "z_image"), name


def test_training_sigmas_are_shifted_for_sd3_and_z_image_not_for_flux(pipes):
    """SD3's and Z-Image's schedulers shift their training sigmas by their config's shift (3.0); Flux's and
    Qwen-Image's shift dynamically, at sampling only (diffusers' Qwen-Image script's shift=3.0 changes nothing there): a
    sigma schedule off by a shift would train every step at the wrong noise level."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    for name in ("sd3", "flux", "qwen_image", "z_image"):
        scheduler = pipes[name].scheduler.__class__.from_config(pipes[name].scheduler.config)
        objective = make_objective(family_module(name), scheduler, flags(weighting_scheme="none",
                                                                         precondition_outputs=0))
        plain = torch.linspace(1, 1000, 1000).flip(0) / 1000
        shift = scheduler.config.shift
        expected = shift * plain / (1 + (shift - 1) * plain) if name in ("sd3", "z_image") else plain
        assert torch.allclose(objective.sigmas, expected, atol=1e-6), name
        assert torch.allclose(objective.timesteps, objective.sigmas * 1000, atol=1e-3)
    assert pipes["sd3"].scheduler.config.shift == 3.0 and pipes["flux"].scheduler.config.use_dynamic_shifting
    peer = FlowMatchEulerDiscreteScheduler.from_pretrained(pipes["paths"]["qwen_image"], subfolder="scheduler",
                                                           shift=3.0)
    assert torch.equal(peer.sigmas, plain) and pipes["qwen_image"].scheduler.config.use_dynamic_shifting
    assert pipes["z_image"].scheduler.config.shift == 3.0 and not pipes["z_image"].scheduler.config.use_dynamic_shifting


@pytest.mark.parametrize("scheme", ["logit_normal", "mode", "none"])
def test_the_training_draw_is_diffusers_density(pipes, scheme):
    """noise first, then u from compute_density_for_timestep_sampling, index u * 1000: the draws of diffusers'
    scripts, in their order."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    args = flags(weighting_scheme=scheme)
    family = family_module("sd3")
    check_objective_args(args, family)
    objective = make_objective(family, pipes["sd3"].scheduler.__class__.from_config(pipes["sd3"].scheduler.config),
                               args)
    x0 = torch.zeros(64, 16, 2, 2)
    torch.manual_seed(3)
    noised = objective(x0)
    torch.manual_seed(3)
    noise = torch.randn_like(x0)
    u = compute_density_for_timestep_sampling(scheme, 64, 0.0, 1.0, 1.29)
    indices = (u * 1000).long().clamp(0, 999)
    assert torch.equal(noised.noisy, objective.sigmas[indices].view(-1, 1, 1, 1) * noise)
    assert torch.equal(noised.timesteps, objective.timesteps[indices])


@pytest.mark.parametrize("name, flag, value", [("flux", "prediction_type", "v_prediction"),
                                               ("sd3", "snr_gamma", 5.0), ("flux", "noise_offset", 0.05),
                                               ("sd", "weighting_scheme", "logit_normal"),
                                               ("sdxl", "precondition_outputs", 1)])
def test_a_flag_of_the_other_objective_is_refused(name, flag, value):
    from common.cli import UserError

    with pytest.raises(UserError, match=f"--{flag} .*means nothing for a"):
        check_objective_args(flags(**{flag: value}), family_module(name))


def test_family_defaults_are_diffusers_scripts():
    for name, scheme, precondition in (("flux", "none", 0), ("sd3", "logit_normal", 1), ("qwen_image", "none", 0),
                                       ("z_image", "none", 0)):
        args = flags()
        check_objective_args(args, family_module(name))
        assert (args.weighting_scheme, args.precondition_outputs, args.logit_mean, args.logit_std, args.mode_scale) \
            == (scheme, precondition, 0.0, 1.0, 1.29)


def test_no_code_outside_the_families_names_a_pipeline_class():
    """The recipes dispatch on common/families/: no other code compares family or pipeline class names."""
    import re

    name = r"""["'](StableDiffusion\w*|Flux\w*|QwenImage\w*|ZImage\w*|sd|sdxl|sd3|flux|qwen_image|z_image)["']"""
    pattern = re.compile(rf"(==|!=|startswith\(|\bin\s*[(\[{{])\s*{name}|{name}\s*(==|!=|\bin\b)")
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in [*ROOT.glob("*.py"), *ROOT.glob("common/*.py")]
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
    assert pattern.search('if kind == "sdxl":') and pattern.search("if name in ('sd', 'sdxl'):")
