"""The LoRA files train_lora.py writes, judged by the clients that load them: ComfyUI (its own key map, pinned in
tests/data/comfyui_lora_keys.json.gz by tests/tools/comfyui_lora_keys.py from ComfyUI's loader on SD 1.5 and SDXL)
and diffusers' load_lora_weights, for every variant (plain, text encoders, DoRA, alpha != rank; SD 1.x and SDXL).

The models are SD 1.5's and SDXL's own block structures (every module under its real name, as ComfyUI's map knows
them) at tiny widths, so that they build and run in a second."""
import gzip
import json

import pytest
import torch
from conftest import ROOT
from safetensors import safe_open
from safetensors.torch import load_file

from common.cli import UserError

TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]  # train_lora.py's
ATTENTION = ["to_k", "to_q", "to_v", "to_out.0"]  # train_lora.py's default UNet targets
EVERY_LAYER = [*ATTENTION, "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1", "conv2", "conv_shortcut",
               "time_emb_proj", "conv_in", "conv_out", "conv", "linear_1", "linear_2"]  # every Linear and Conv2d
VARIANTS = {  # name: (UNet targets, text encoders, DoRA, rank, alpha)
    "plain": (ATTENTION, False, False, 4, 4),
    "text_encoder": (ATTENTION, True, False, 4, 4),
    "dora": (EVERY_LAYER, True, True, 4, 4),
    "alpha": (EVERY_LAYER, True, False, 4, 2),
}
UI_FILE = "pytorch_lora_weights_ui.safetensors"


def real_structure(kind):
    """SD 1.5's or SDXL's UNet with its own block structure, and CLIP text encoders, at tiny widths and depths: every
    module has a name the real model's has."""
    from demo.tiny_sd import SD15, SDXL, build_random_sd, tiny_configs

    configs = tiny_configs()  # (its VAE)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=77, projection_dim=32, hidden_act="quick_gelu")
    if kind == "sd15":
        configs["unet"] = {**SD15["unet"], "sample_size": 8, "block_out_channels": (32, 32, 64, 64),
                           "cross_attention_dim": 32, "norm_num_groups": 8}
        return build_random_sd({**configs, "text": text})
    configs["unet"] = {**SDXL["unet"], "sample_size": 8, "block_out_channels": (32, 64, 64),
                       "transformer_layers_per_block": (1, 2, 2), "attention_head_dim": (2, 4, 4),
                       "cross_attention_dim": 96, "addition_time_embed_dim": 8,
                       "projection_class_embeddings_input_dim": 64 + 6 * 8, "norm_num_groups": 8}
    text_2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=77, projection_dim=64, hidden_act="gelu")
    return build_random_sd({**configs, "text": text, "text_2": text_2})


@pytest.fixture(scope="module")
def bases():
    """Both real-structure pipelines, built once: each use takes a fresh copy (load_pipe)."""
    return {kind: real_structure(kind) for kind in ("sd15", "sdxl")}


@pytest.fixture(scope="module")
def comfyui_keys():
    with gzip.open(ROOT / "tests" / "data" / "comfyui_lora_keys.json.gz", "rt") as f:
        return json.load(f)


def load_pipe(base):
    import copy

    return copy.deepcopy(base)


def text_encoders(pipe):
    return {name: getattr(pipe, name) for name in ("text_encoder", "text_encoder_2") if hasattr(pipe, name)}


def fixed_outputs(pipe):
    """The UNet's output on fixed inputs (SDXL: with its added conditioning) and each text encoder's on one prompt."""
    g = torch.Generator().manual_seed(0)
    config = pipe.unet.config
    x, hidden = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, config.cross_attention_dim, generator=g)
    added = None
    if config.addition_embed_type == "text_time":
        added = {"text_embeds": torch.randn(2, pipe.text_encoder_2.config.projection_dim, generator=g),
                 "time_ids": torch.tensor([[32.0, 48, 0, 8, 32, 32], [40, 24, 4, 0, 40, 24]])}
    ids = pipe.tokenizer(["a handwritten digit seven"], padding="max_length", max_length=77,
                         return_tensors="pt").input_ids
    with torch.no_grad():
        return [pipe.unet(x, torch.tensor([10, 700]), hidden, added_cond_kwargs=added).sample,
                *(encoder(ids)[0] for encoder in text_encoders(pipe).values())]


def trained_lora(base, variant):
    """The base with LoRA as train_lora.py adds it (the same LoraConfig, SDXL's first encoder without its last layer),
    every LoRA weight and DoRA magnitude moved as if trained. -> (pipe, {name: peft-adapted model})."""
    from peft import LoraConfig

    from common.families import family_module

    targets, with_text, dora, rank, alpha = VARIANTS[variant]
    pipe = load_pipe(base)
    family = family_module("sdxl" if hasattr(pipe, "text_encoder_2") else "sd")
    models = {"unet": pipe.unet, **(text_encoders(pipe) if with_text else {})}
    torch.manual_seed(0)
    for name, model in models.items():
        module_targets = targets if name == "unet" else family.text_encoder_targets(name, model, TEXT_TARGETS)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", use_dora=dora,
                                     target_modules=module_targets))
        with torch.no_grad():
            for key, p in model.named_parameters():
                if "lora_" in key:
                    p.add_(0.2 * torch.randn_like(p))
    return pipe, models


@pytest.fixture(scope="module")
def saved(bases, tmp_path_factory):
    """save_lora_weights (train_lora.py's writer) for every base and variant, with the metadata train_lora.py gives.
    -> {(kind, variant): (folder, {name: peft state dict}, the in-memory models' fixed outputs)}."""
    from peft.utils import get_peft_model_state_dict

    from common.families import family_module
    from common.lora_files import save_lora_weights

    out = {}
    for kind, base in bases.items():
        for variant in VARIANTS:
            pipe, models = trained_lora(base, variant)
            folder = tmp_path_factory.mktemp(f"{kind}-{variant}")
            family = family_module("sdxl" if hasattr(pipe, "text_encoder_2") else "sd")
            metadata = {"modelspec.implementation": "diffusers", **family.base_metadata(pipe.unet.config, "epsilon")}
            save_lora_weights(folder, family, models, {"base_model": kind, "rank": VARIANTS[variant][3],
                                               "lora_alpha": VARIANTS[variant][4]}, metadata=metadata)
            states = {name: get_peft_model_state_dict(model) for name, model in models.items()}
            out[kind, variant] = folder, states, fixed_outputs(pipe)
    return out


CASES = [(kind, variant) for kind in ("sd15", "sdxl") for variant in VARIANTS]


def comfyui_reads(weights, keys):
    """What ComfyUI's load_lora (comfy/lora.py) makes of a LoRA file, by its own key map: for each name it maps
    with an `<name>.lora_up.weight` in the file, its LoRA adapter (comfy/weight_adapter/lora.py: up, down, the
    `.alpha` and `.dora_scale` beside them); every other tensor is "lora key not loaded". -> ({name: (model, the
    diffusers modules of the weight it patches, up, down, strength alpha / rank, dora_scale, the weight's ndim)},
    the tensors it leaves)."""
    loaded, used = {}, set()
    for name, (model, modules, ndim) in keys.items():
        if f"{name}.lora_up.weight" not in weights:
            continue
        up, down = weights[f"{name}.lora_up.weight"], weights[f"{name}.lora_down.weight"]
        alpha = weights.get(f"{name}.alpha")
        strength = 1.0 if alpha is None else alpha.item() / down.shape[0]  # LoRAAdapter.calculate_weight
        loaded[name] = model, modules, up, down, strength, weights.get(f"{name}.dora_scale"), ndim
        used |= {f"{name}.{part}" for part in ("lora_up.weight", "lora_down.weight", "alpha", "dora_scale")}
    return loaded, sorted(set(weights) - used)


@pytest.mark.parametrize("kind,variant", CASES)
def test_comfyui_loads_every_key_at_the_trained_strength(saved, comfyui_keys, kind, variant):
    """The UI file against ComfyUI's own key map: no key left unloaded, every trained module patched once (the
    weight ComfyUI patches is the trained module's), with the trained up/down weights at alpha / rank, DoRA's
    magnitudes as a per-output-row dora_scale with as many dimensions as the weight."""
    folder, states, _ = saved[kind, variant]
    loaded, unread = comfyui_reads(load_file(folder / UI_FILE), comfyui_keys[kind])
    assert unread == []
    _, _, dora, rank, alpha = VARIANTS[variant]
    trained = {}
    for model, state in states.items():
        for key, value in state.items():
            module, _, part = key.rpartition(".lora_")
            module = module if model == "unet" or module.startswith("text_model.") else "text_model." + module
            trained.setdefault((model, module), {})[part] = value
    names = {(model, module): name for name, (model, modules, *_) in loaded.items() for module in modules
             if (model, module) in trained}
    assert sorted(names) == sorted(trained) and len(set(names.values())) == len(loaded)
    for (model, module), parts in trained.items():
        _, _, up, down, strength, dora_scale, ndim = loaded[names[model, module]]
        assert torch.equal(up, parts["B.weight"]) and torch.equal(down, parts["A.weight"]), module
        assert strength == alpha / rank and up.dim() == down.dim() == ndim, module
        if dora:
            assert dora_scale.shape == (up.shape[0],) + (1,) * (ndim - 1), module
            assert torch.equal(dora_scale.flatten(), parts["magnitude_vector"].flatten()), module
        else:
            assert dora_scale is None


@pytest.mark.parametrize("kind,variant", CASES)
def test_diffusers_reads_both_files_back_to_the_trained_models(saved, bases, kind, variant):
    """pytorch_lora_weights.safetensors through load_lora_weights gives the trained UNet and text encoders (under
    1e-5); so does the UI file, except with DoRA: diffusers' loader drops `dora_scale` (with a warning)."""
    folder, _, expected = saved[kind, variant]
    dora = VARIANTS[variant][2]
    for weight_name in (None,) if dora else (None, UI_FILE):
        pipe = load_pipe(bases[kind])
        pipe.load_lora_weights(folder, weight_name=weight_name)
        outputs = fixed_outputs(pipe)
        for got, want in zip(outputs, expected, strict=True):
            assert (got - want).abs().max() < 1e-5, weight_name
    if VARIANTS[variant][1]:  # the text encoders moved: the comparison above sees them
        base = fixed_outputs(load_pipe(bases[kind]))
        assert all((a - b).abs().max() > 1e-4 for a, b in zip(base, expected))


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_each_file_says_whose_module_names_it_uses(saved, kind):
    """ModelSpec's modelspec.implementation as kohya's files have it: the sgm UNet's names in SDXL's UI file
    (Stability AI's generative-models), diffusers' names everywhere else."""
    folder = saved[kind, "plain"][0]
    found = {}
    for file in ("pytorch_lora_weights.safetensors", UI_FILE):
        with safe_open(folder / file, "pt") as f:
            found[file] = f.metadata()["modelspec.implementation"]
    ui = "https://github.com/Stability-AI/generative-models" if kind == "sdxl" else "diffusers"
    assert found == {"pytorch_lora_weights.safetensors": "diffusers", UI_FILE: ui}
    with safe_open(folder / UI_FILE, "pt") as f:  # diffusers refuses adapter configs beside `.alpha` tensors
        assert "lora_adapter_metadata" not in f.metadata()


def test_an_adapter_the_ui_file_cannot_hold_is_one_line_and_writes_nothing(bases, tmp_path):
    """A LoRA with biases (peft's lora_bias): the UIs' format has no place for them. save_lora_weights stops before
    writing either file."""
    from peft import LoraConfig

    from common.families import sd
    from common.lora_files import save_lora_weights

    pipe = load_pipe(bases["sd15"])
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=ATTENTION, lora_bias=True))
    with pytest.raises(UserError) as err:
        save_lora_weights(tmp_path / "out", sd, {"unet": pipe.unet}, {"base_model": "x", "rank": 4, "lora_alpha": 4})
    message = str(err.value)
    assert "\n" not in message and "lora_B.bias" in message and "cannot hold" in message, message
    assert not (tmp_path / "out").exists()


def test_conversion_names_and_what_it_refuses():
    """The pure conversions on peft-style state dicts: kohya's names (with a renaming, as SDXL's sgm names are
    made), diffusers' prefixed names as ComfyUI reads SD3 and Flux.1 transformers, DoRA magnitudes in ComfyUI's shape
    (swapped halves where ComfyUI swaps the weight's), and one line for what no UI name exists for."""
    from common.ui_lora import kohya_lora, prefixed_lora

    g = torch.Generator().manual_seed(0)
    state = {"blocks.0.attn.to_q.lora_A.weight": torch.randn(2, 8, generator=g),
             "blocks.0.attn.to_q.lora_B.weight": torch.randn(6, 2, generator=g),
             "blocks.0.attn.to_q.lora_magnitude_vector": torch.randn(6, generator=g),
             "norm_out.linear.lora_A.weight": torch.randn(2, 8, generator=g),
             "norm_out.linear.lora_B.weight": torch.randn(4, 2, generator=g),
             "norm_out.linear.lora_magnitude_vector": torch.arange(4.0),
             "conv.lora_A.weight": torch.randn(2, 3, 3, 3, generator=g),
             "conv.lora_B.weight": torch.randn(5, 2, 1, 1, generator=g),
             "conv.lora_magnitude_vector": torch.randn(1, 5, 1, 1, generator=g)}
    kohya = kohya_lora(state, 3, "lora_unet", rename=lambda m: m.replace("blocks", "input_blocks"))
    assert sorted(kohya) == sorted(f"lora_unet_{m}.{p}" for m in ("input_blocks_0_attn_to_q", "norm_out_linear",
                                                                   "conv")
                                   for p in ("lora_down.weight", "lora_up.weight", "alpha", "dora_scale"))
    assert torch.equal(kohya["lora_unet_conv.lora_down.weight"], state["conv.lora_A.weight"])
    assert kohya["lora_unet_conv.alpha"].item() == 3 and kohya["lora_unet_conv.dora_scale"].shape == (5, 1, 1, 1)
    assert kohya["lora_unet_input_blocks_0_attn_to_q.dora_scale"].shape == (6, 1)
    flux = prefixed_lora(state, 3, "transformer", swapped_halves=("norm_out.linear",))
    assert flux["transformer.norm_out.linear.dora_scale"].flatten().tolist() == [2, 3, 0, 1]
    assert torch.equal(flux["transformer.blocks.0.attn.to_q.lora_B.weight"], state["blocks.0.attn.to_q.lora_B.weight"])
    text = prefixed_lora({"encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 4)} |
                         {"encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(4, 2)}, 2, "text_encoder",
                         "text_model.")
    assert "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.alpha" in text

    def no_name(module):
        raise ValueError(f"no sgm name for '{module}'")

    for bad, needle in (({"x.lora_embedding_A": torch.ones(2, 4)}, "x.lora_embedding_A"),
                        ({"x.lora_A.weight": torch.ones(2, 4)}, "no lora_B weight"),
                        ({"x.lora_A.weight": torch.ones(2, 4), "x.lora_B.weight": torch.ones(4, 2)}, "'x'")):
        with pytest.raises(UserError) as err:
            kohya_lora(bad, 1, "lora_unet", rename=no_name)
        assert needle in str(err.value) and "\n" not in str(err.value)


def tiny_transformer(family):
    """diffusers' Flux.1 or SD3 transformer (2 blocks of each kind, SD3.5's dual attention in its first) at tiny
    widths, and a fixed input for it."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if family == "flux":
        model = FluxTransformer2DModel(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                                       num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                       guidance_embeds=True, axes_dims_rope=(4, 6, 6))
        inputs = dict(hidden_states=torch.randn(1, 16, 16, generator=g),
                      encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
                      pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                      img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3), guidance=torch.tensor([3.5]))
    else:
        model = SD3Transformer2DModel(sample_size=8, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                                      num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
                                      pooled_projection_dim=32, pos_embed_max_size=8, dual_attention_layers=(0,))
        inputs = dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g),
                      encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
                      pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([500]))
    return model, inputs


# The transformer modules whose weight ComfyUI holds with its halves of rows swapped (BFL's and SAI's scale/shift
# order), for the tiny transformers above: what a family module passes as prefixed_lora's swapped_halves.
SWAPPED = {"flux": ("norm_out.linear",), "sd3": ("norm_out.linear", "transformer_blocks.1.norm1_context.linear")}


@pytest.mark.parametrize("family", ["flux", "sd3"])
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_sd3_and_flux_transformer_names_are_comfyuis(comfyui_keys, tmp_path, family, dora):
    """prefixed_lora on a LoRA over every Linear and Conv2d of diffusers' SD3 and Flux.1 transformers: each module under
    a name ComfyUI maps ("transformer.<module>"), its alpha, DoRA's magnitudes swapped where ComfyUI swaps the weight's
    halves (and nowhere else). diffusers' Flux loader reads the same file back (its `.alpha` tensors as network alphas)
    to the trained transformer; diffusers' SD3 loader refuses `.alpha` tensors, so SD3 needs the two files."""
    from diffusers import FluxPipeline, StableDiffusion3Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from common.ui_lora import prefixed_lora

    model, inputs = tiny_transformer(family)
    layers = [name for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    model.add_adapter(LoraConfig(r=4, lora_alpha=2, init_lora_weights="gaussian", target_modules=layers,
                                 use_dora=dora))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_" in key:
                p.add_(0.2 * torch.randn_like(p))
        expected = model(**inputs).sample
    state = get_peft_model_state_dict(model)
    weights = prefixed_lora(state, 2, "transformer", swapped_halves=SWAPPED[family])
    names = {key.rsplit(".", 2 if key.endswith(".weight") else 1)[0] for key in weights}
    assert sorted(names) == sorted(f"transformer.{layer}" for layer in layers)
    assert set(names) <= set(comfyui_keys[family])
    for name in names:
        assert weights[f"{name}.alpha"].item() / weights[f"{name}.lora_A.weight"].shape[0] == 2 / 4
        swapped = comfyui_keys[family][name][2]
        assert swapped == (name.removeprefix("transformer.") in SWAPPED[family])
        if dora:
            magnitude = state[f"{name.removeprefix('transformer.')}.lora_magnitude_vector"].flatten()
            magnitude = torch.cat(magnitude.chunk(2)[::-1]) if swapped else magnitude
            assert torch.equal(weights[f"{name}.dora_scale"].flatten(), magnitude)
    save_file(weights, tmp_path / "ui.safetensors")
    if family == "sd3":
        from diffusers import FlowMatchEulerDiscreteScheduler

        pipe = StableDiffusion3Pipeline(model, FlowMatchEulerDiscreteScheduler(), *[None] * 7)
        with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):
            pipe.load_lora_weights(str(tmp_path / "ui.safetensors"))
    elif not dora:  # (diffusers drops `dora_scale`)
        fresh, _ = tiny_transformer(family)
        state_dict, alphas = FluxPipeline.lora_state_dict(str(tmp_path / "ui.safetensors"), return_alphas=True)
        FluxPipeline.load_lora_into_transformer(state_dict, alphas, fresh)
        with torch.no_grad():
            assert (fresh(**inputs).sample - expected).abs().max() < 1e-5


def test_sd3_and_flux_text_encoder_names_are_comfyuis(bases, comfyui_keys):
    """CLIP's LoRA under diffusers' names (`text_encoder.text_model...`, `text_encoder_2...`), which ComfyUI maps for
    the CLIP models of SD3 and Flux.1 as for SDXL's."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from common.ui_lora import prefixed_lora

    pipe = load_pipe(bases["sdxl"])
    for name, encoder in text_encoders(pipe).items():
        encoder.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=TEXT_TARGETS + ["fc1", "fc2"]))
        weights = prefixed_lora(get_peft_model_state_dict(encoder), 4, name, "text_model.")
        modules = {key.rsplit(".", 2)[0] for key in weights if key.endswith(".lora_A.weight")}
        assert len(modules) == 6 * encoder.config.num_hidden_layers
        for module in modules:
            assert comfyui_keys["sdxl"][module][:2] == [name, [module.removeprefix(f"{name}.")]]


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_qwen_image_transformer_names_are_comfyuis(tmp_path, dora):
    """Qwen-Image's ui_lora on a LoRA over every Linear of diffusers' tiny Qwen-Image transformer (the tiny base's
    config): each module under ComfyUI's own name for its QwenImage model (`diffusion_model.<module>`, pinned in
    tests/data/comfyui_lora_keys_qwen_image.json.gz by tests/tools/comfyui_qwen_image.py, which also ran ComfyUI's
    loader on train_lora.py's files: docs/train_lora.md), mapped onto the weight of the same module and shape, with its
    alpha and DoRA's magnitudes unswapped (ComfyUI keeps diffusers' scale/shift order in the final norm). diffusers'
    Qwen-Image loader reads the same file back (alphas as scales) to the trained transformer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from common.families import qwen_image
    from demo.tiny_qwen_image import TINY

    with gzip.open(ROOT / "tests" / "data" / "comfyui_lora_keys_qwen_image.json.gz", "rt") as f:
        comfyui = json.load(f)
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**TINY["transformer"])
    layers = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    model.add_adapter(LoraConfig(r=4, lora_alpha=2, init_lora_weights="gaussian", target_modules=list(layers),
                                 use_dora=dora))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 16, 64, generator=g), encoder_hidden_states=torch.randn(1, 5, 32,
                  generator=g), timestep=torch.tensor([0.5]), img_shapes=[[(1, 4, 4)]])
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_" in key:
                p.add_(0.2 * torch.randn_like(p))
        expected = model(**inputs).sample
    state = get_peft_model_state_dict(model)
    weights = qwen_image.ui_lora({"transformer": state}, 2, model.config)
    names = {key.rsplit(".", 2 if key.endswith(".weight") else 1)[0] for key in weights}
    assert sorted(names) == sorted(f"diffusion_model.{layer}" for layer in layers) and len(names) == 34
    for name in names:
        module = name.removeprefix("diffusion_model.")
        assert comfyui[name] == [f"{name}.weight", list(layers[module].weight.shape)]
        assert comfyui[f"transformer.{module}"] == comfyui[name]  # (diffusers' names map there too)
        assert weights[f"{name}.alpha"].item() / weights[f"{name}.lora_A.weight"].shape[0] == 2 / 4
        if dora:
            assert torch.equal(weights[f"{name}.dora_scale"].flatten(), state[f"{module}.lora_magnitude_vector"])
    if not dora:  # (diffusers drops `dora_scale`)
        save_file(weights, tmp_path / "ui.safetensors")
        torch.manual_seed(0)
        pipe = QwenImagePipeline(FlowMatchEulerDiscreteScheduler(), None, None, None,
                                 QwenImageTransformer2DModel(**TINY["transformer"]))
        pipe.load_lora_weights(str(tmp_path / "ui.safetensors"))
        with torch.no_grad():
            assert (pipe.transformer(**inputs).sample - expected).abs().max() < 1e-5


@pytest.fixture(scope="module")
def comfyui_z_image_keys():
    """ComfyUI's Z-Image LoRA names (tests/tools/comfyui_z_image.py: model_lora_keys_unet on ComfyUI's own ZImage
    model, loaded through its UNETLoader path): {"diffusion_model.<module>": [ComfyUI's weight, the slice of it]}."""
    with gzip.open(ROOT / "tests" / "data" / "comfyui_lora_keys_z_image.json.gz", "rt") as f:
        return json.load(f)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_z_image_transformer_names_are_comfyuis(comfyui_z_image_keys, tmp_path, dora):
    """z_image.ui_lora on a LoRA over every Linear of the tiny build's Z-Image transformer (Z-Image's block layout: 2
    noise- and 2 context-refiner blocks, here 2 main ones): each module under a name ComfyUI maps, its alpha; to_q,
    to_k and to_v each onto its third of ComfyUI's fused qkv weight, in that order. diffusers' Z-Image loader reads the
    same file back (its `.alpha` tensors as scales) to the trained transformer (DoRA aside: it drops `dora_scale`)."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from common.families import z_image
    from demo.tiny_z_image import TINY

    def tiny():
        torch.manual_seed(0)
        return ZImageTransformer2DModel(**TINY["transformer"])

    g = torch.Generator().manual_seed(1)
    x, caption = [torch.randn(16, 1, 8, 8, generator=g)], [torch.randn(20, 32, generator=g)]
    model = tiny()
    layers = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    model.add_adapter(LoraConfig(r=4, lora_alpha=2, init_lora_weights="gaussian", target_modules=layers,
                                 use_dora=dora))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_" in key:
                p.add_(0.2 * torch.randn_like(p))
        expected = model(x, torch.tensor([0.4]), caption, return_dict=False)[0][0]
    weights = z_image.ui_lora({"transformer": get_peft_model_state_dict(model)}, 2, model.config)
    names = {key.rsplit(".", 2 if key.endswith(".weight") else 1)[0] for key in weights}
    assert sorted(names) == sorted(f"diffusion_model.{layer}" for layer in layers)
    assert names <= set(comfyui_z_image_keys)
    for name in names:
        assert weights[f"{name}.alpha"].item() / weights[f"{name}.lora_A.weight"].shape[0] == 2 / 4
        target, part = comfyui_z_image_keys[name]
        if name.endswith((".to_q", ".to_k", ".to_v")):
            assert target.endswith(".attention.qkv.weight") and part[0] == 0
            assert part[1] // part[2] == "qkv".index(name[-1])
        else:
            assert part is None
        assert ("dora_scale" in str(sorted(k for k in weights if k.startswith(name + ".")))) == dora
    save_file(weights, tmp_path / "ui.safetensors")
    if not dora:
        fresh = tiny()
        state_dict = ZImagePipeline.lora_state_dict(str(tmp_path / "ui.safetensors"))
        ZImagePipeline.load_lora_into_transformer(state_dict, fresh)
        with torch.no_grad():
            got = fresh(x, torch.tensor([0.4]), caption, return_dict=False)[0][0]
        assert (got - expected).abs().max() < 1e-5


# FLUX.2: the UI file holds FLUX.2's own module names (kohya's lora_unet_ prefix), the double blocks' q, k and v fused
# (common/families/flux2_klein.py); ComfyUI's map for a FLUX.2 model, pinned from ComfyUI's loader by
# tests/tools/comfyui_flux2_lora.py, which also ran ComfyUI's loader on such files.
@pytest.fixture(scope="module")
def comfyui_flux2_keys():
    with gzip.open(ROOT / "tests" / "data" / "comfyui_lora_keys_flux2.json.gz", "rt") as f:
        return json.load(f)["flux2"]


def flux2_transformer():
    """diffusers' FLUX.2 transformer (2 blocks of each kind, the guidance input) at tiny widths."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32,
                                   axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)


def flux2_adapter(adapter, targets, dora=False, alpha=2):
    """The transformer with train_lora.py's adapter (rank 4) on `targets`, its weights moved as if trained."""
    from types import SimpleNamespace

    from common.lora_adapters import adapter_config

    model = flux2_transformer()
    flags = SimpleNamespace(adapter=adapter, rank=4, lora_alpha=alpha, lora_dropout=0.0, use_dora=dora, lokr_factor=-1)
    model.add_adapter(adapter_config(flags, targets))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if any(part in key for part in (".lora_", ".hada_", ".lokr_")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def flux2_native(model, merge):
    """The model's weights (its adapter merged by peft, or not) in FLUX.2's own names."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer
    from tools.flux2_native import native_state_dict

    model = copy.deepcopy(model)
    for module in model.modules():
        if merge and isinstance(module, BaseTunerLayer):
            module.merge()
    return native_state_dict({k.replace(".base_layer", ""): v for k, v in model.state_dict().items()
                              if not any(part in k for part in (".lora_", ".hada_", ".lokr_"))})


def test_flux2_native_names_are_diffusers_own_conversion():
    """tests/tools/flux2_native.py (diffusers' names -> FLUX.2's) inverts diffusers' own FLUX.2 checkpoint converter."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    from tools.flux2_native import native_state_dict

    state = flux2_transformer().state_dict()
    back = convert_flux2_transformer_checkpoint_to_diffusers(native_state_dict(state))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def comfyui_update(weights, module, adapter):
    """A module's update as ComfyUI computes it from the file (comfy/weight_adapter/lora.py, loha.py, lokr.py): its
    product at alpha / rank (a LoKr whose factors are both full: at scale 1)."""
    get = weights.get
    alpha = weights[f"{module}.alpha"].item()
    if adapter == "loha":
        return alpha / get(f"{module}.hada_w1_b").shape[0] * (get(f"{module}.hada_w1_a") @ get(f"{module}.hada_w1_b")) \
            * (get(f"{module}.hada_w2_a") @ get(f"{module}.hada_w2_b"))
    if adapter == "lokr":
        w1 = get(f"{module}.lokr_w1")
        w1 = w1 if w1 is not None else get(f"{module}.lokr_w1_a") @ get(f"{module}.lokr_w1_b")
        w2 = get(f"{module}.lokr_w2")
        w2 = w2 if w2 is not None else get(f"{module}.lokr_w2_a") @ get(f"{module}.lokr_w2_b")
        low = get(f"{module}.lokr_w2_b", get(f"{module}.lokr_w1_b"))
        return (1.0 if low is None else alpha / low.shape[0]) * torch.kron(w1, w2)
    down = weights[f"{module}.lora_down.weight"]
    return alpha / down.shape[0] * (weights[f"{module}.lora_up.weight"] @ down)


@pytest.mark.parametrize("adapter,targets,dora", [
    ("lora", "every", False), ("lora", "every", True), ("loha", "every", False), ("lokr", "every", False),
    ("lora", "to_q,to_k,add_v_proj", False), ("lora", "default", False)],
    ids=["lora", "dora", "loha", "lokr", "some-of-qkv", "default-targets"])
def test_flux2_ui_file_is_comfyuis_names_and_the_trained_weights(comfyui_flux2_keys, adapter, targets, dora):
    """flux2_klein.ui_lora on an adapter over diffusers' FLUX.2 transformer (a LoKr's scale baked as
    save_lora_weights bakes it): every module under a name ComfyUI's map gives a FLUX.2 model, and the file applied as
    ComfyUI applies it (the update on the weight, or the slice of it, the name maps to, its halves swapped where the
    map says; DoRA by peft's definition, m W' / ||W'|| per row) gives, weight for weight, peft's merged model in
    FLUX.2's names: fused q/k/v, swapped halves and alphas included."""
    from peft.utils import get_peft_model_state_dict

    from common.families import flux2_klein
    from common.lora_adapters import comma_list, expand_targets
    from common.ui_lora import bake_lokr_scale

    every = [name for name, m in flux2_transformer().named_modules() if isinstance(m, torch.nn.Linear)]
    names = {"every": every, "default": comma_list(flux2_klein.LORA_TARGETS)}.get(targets) or comma_list(targets)
    model = flux2_adapter(adapter, expand_targets(flux2_transformer(), names), dora)
    state = get_peft_model_state_dict(model)
    weights = flux2_klein.ui_lora({"transformer": bake_lokr_scale(state, 2 / 4) if adapter == "lokr" else state}, 2,
                                  model.config)
    base, expected = flux2_native(model, merge=False), flux2_native(model, merge=True)
    modules = {key.rsplit(".", 2 if key.endswith(".weight") else 1)[0] for key in weights}
    assert modules <= set(comfyui_flux2_keys), sorted(modules - set(comfyui_flux2_keys))
    patched = {}
    for module in modules:
        target, ndim, offset, swapped = comfyui_flux2_keys[module]
        weight = patched.setdefault(target, base[target].float().clone())
        assert weight.dim() == ndim
        update = comfyui_update(weights, module, adapter)
        update = torch.cat(update.chunk(2)[::-1]) if swapped else update
        if offset:  # a third of the fused qkv weight (the pinned model's width: the same third of this one's)
            dim, start, size = offset
            view = weight.narrow(dim, start // size * weight.shape[dim] // 3, weight.shape[dim] // 3)
        else:
            view = weight
        view += update
        if dora:
            view.copy_(weights[f"{module}.dora_scale"] * view / view.norm(dim=1, keepdim=True))
    changed = {key for key in expected if not torch.equal(expected[key], base[key])}
    assert changed and changed <= set(patched)
    for target, weight in patched.items():
        assert (weight - expected[target]).abs().max() / expected[target].abs().max() < 1e-5, target


def test_flux2_ui_file_refuses_a_dora_on_part_of_a_fused_weight():
    """A DoRA on some of a double block's q, k and v cannot be written as FLUX.2's fused qkv weight (the missing
    parts' magnitudes are the base weight's norms, which the file cannot know): one line, naming what to do."""
    from peft.utils import get_peft_model_state_dict

    from common.families import flux2_klein

    model = flux2_adapter("lora", ["to_q", "to_k"], dora=True)
    with pytest.raises(UserError) as err:
        flux2_klein.ui_lora({"transformer": get_peft_model_state_dict(model)}, 2, model.config)
    assert "DoRA" in str(err.value) and "target all three" in str(err.value) and "\n" not in str(err.value)


def test_wan_transformer_names_are_comfyuis():
    """wan.ui_lora on a LoRA over the attention and feed-forward layers of the tiny build's Wan transformer: each
    module under ComfyUI's native Wan name (`diffusion_model.blocks.N.self_attn.q`...: its map has no diffusers branch
    for Wan), pinned in tests/data/comfyui_lora_keys_wan.json.gz by tests/tools/comfyui_wan.py, which also ran ComfyUI's
    loader on train_lora.py's files (docs/train_lora.md), onto the weight of that name, with its alpha; a module
    ComfyUI has no LoRA name for is one line. (tests/test_video.py: diffusers reads the file back exactly.)"""
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from common.cli import UserError
    from common.families import wan
    from demo.tiny_wan import TINY

    with gzip.open(ROOT / "tests" / "data" / "comfyui_lora_keys_wan.json.gz", "rt") as f:
        comfyui = json.load(f)
    model = WanTransformer3DModel(**TINY["transformer"])
    model.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0",
                                                                     "ffn.net.0.proj", "ffn.net.2"]))
    weights = wan.ui_lora({"transformer": get_peft_model_state_dict(model)}, 2, model.config)
    names = {key.rsplit(".", 2 if key.endswith(".weight") else 1)[0] for key in weights}
    assert len(names) == 10 * TINY["transformer"]["num_layers"] and names <= set(comfyui)
    for name in names:
        assert comfyui[name] == f"{name}.weight"
        assert weights[f"{name}.alpha"].item() / weights[f"{name}.lora_A.weight"].shape[0] == 2 / 4
    model.add_adapter(LoraConfig(r=4, target_modules=["condition_embedder.text_embedder.linear_1"]), "other")
    with pytest.raises(UserError, match="has no name for the module 'condition_embedder.text_embedder.linear_1'"):
        wan.ui_lora({"transformer": get_peft_model_state_dict(model, adapter_name="other")}, 4, model.config)
