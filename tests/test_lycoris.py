"""LoHa and LoKr (train_lora.py --adapter loha|lokr, peft's LyCORIS adapters) on the shipped tiny Flux.1 and SD bases:
they train (with text encoders and an EMA), resume exactly, load back through sample.py's peft path to the trained
models, and their UI file is what ComfyUI reads: its names in ComfyUI's pinned key map (tests/data/
comfyui_lora_keys.json.gz) and, applied as ComfyUI's comfy/weight_adapter/loha.py and lokr.py compute it, the update
peft applies (tests/tools/comfyui_lycoris_check.py runs ComfyUI's own loader on such files). Paths that read only LoRA
refuse them in one line."""
import gzip
import json
import re
import shutil

import pytest
import torch
from conftest import ROOT, assert_one_line_error, launch, logged_losses, run_in_process, run_script
from safetensors import safe_open
from safetensors.torch import load_file

from common.cli import UserError

FLUX, SD = ROOT / "assets" / "tiny-flux-digits", ROOT / "assets" / "tiny-sd-digits"
STEPS = ["--max_train_samples", "16", "--train_batch_size", "4", "--max_train_steps", "4", "--checkpointing_steps",
         "2", "--rank", "4", "--lora_alpha", "2", "--learning_rate", "1e-2", "--cache_latents", "--logging_steps", "1",
         "--train_text_encoder"]
RUNS = {  # name: (base, flags); LoKr on SD at the default factor: both factors full, where the UIs' scale is 1
    "loha-flux": (FLUX, ["--adapter", "loha", "--use_ema"]),
    "lokr-flux": (FLUX, ["--adapter", "lokr", "--lokr_factor", "4"]),
    "lokr-sd": (SD, ["--adapter", "lokr"]),
}
UI_FILE, PEFT_FILE = "pytorch_lora_weights_ui.safetensors", "peft_adapter_weights.safetensors"


def train(name, digits, out, *extra, check=True):
    base, flags = RUNS[name]
    return launch("train_lora.py", "--pretrained_model_name_or_path", base, "--train_data_dir", digits,
                  "--output_dir", out, *STEPS, *flags, *extra, check=check)


@pytest.fixture(scope="module")
def runs(digits, tmp_path_factory):
    root = tmp_path_factory.mktemp("lycoris")
    for name in RUNS:
        train(name, digits, root / name)
    return root


@pytest.fixture(scope="module")
def comfyui_keys():
    with gzip.open(ROOT / "tests" / "data" / "comfyui_lora_keys.json.gz", "rt") as f:
        return json.load(f)


def load_pipe(base):
    import diffusers

    from common.families import family_module, family_of

    family = family_module(family_of(str(base), "--model"))
    return family, getattr(diffusers, family.PIPELINE).from_pretrained(base, dtype=torch.float32)


def fixed_outputs(family, pipe):
    """The denoiser's output on a fixed input and the CLIP text encoder's on one prompt."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, pipe.vae.config.latent_channels, 8, 8, generator=g)
    ids = family.tokenize(pipe.components, ["a handwritten digit seven"] * 2, 40)
    with torch.no_grad():
        cond = family.encode_prompts(pipe.components, ids)
        out = family.denoise(getattr(pipe, family.DENOISER), x, torch.tensor([100, 700]), cond, None)
        return out, pipe.text_encoder(ids[0])[0]


def trained_models(base, checkpoint, info):
    """The trained models as the run held them: the base with --adapter's peft config, set from the checkpoint's
    raw adapter state (what the training loop had, not an exported file)."""
    from argparse import Namespace

    from peft.utils import set_peft_model_state_dict

    from common.lora_adapters import adapter_config

    family, pipe = load_pipe(base)
    args = Namespace(adapter=info["adapter"], rank=info["rank"], lora_alpha=info["lora_alpha"],
                     lokr_factor=info["lokr_factor"], lora_dropout=0.0, use_dora=False)
    for part, targets in ((family.DENOISER, info["target_modules"]), ("text_encoder", list(family.TEXT_LORA_TARGETS))):
        model = getattr(pipe, part)
        model.add_adapter(adapter_config(args, targets))
        result = set_peft_model_state_dict(model, load_file(checkpoint / part / "adapter_model.safetensors"))
        assert not result.unexpected_keys
    return family, pipe


def test_trainable_weights_and_metadata_are_lycoris(runs):
    for name in RUNS:
        adapter = name.split("-")[0]
        state = load_file(runs / name / "checkpoint-4" / "transformer" / "adapter_model.safetensors"
                          if "flux" in name else runs / name / "checkpoint-4" / "unet" / "adapter_model.safetensors")
        prefix = {"loha": ".hada_", "lokr": ".lokr_"}[adapter]
        assert state and all(prefix in key for key in state), name
        with safe_open(runs / name / UI_FILE, "pt") as f:
            metadata = f.metadata()
        assert metadata["ss_network_module"] == "lycoris.kohya"
        assert json.loads(metadata["ss_network_args"])["algo"] == adapter
        assert json.loads((runs / name / "lora_info.json").read_text())["adapter"] == adapter
        assert not (runs / name / "pytorch_lora_weights.safetensors").exists()  # diffusers could not read it


@pytest.mark.parametrize("name", ["loha-flux", "lokr-flux"])
def test_resume_is_exact(runs, digits, tmp_path, name):
    """From checkpoint-2 the same steps 3-4 and the same adapter weights (and LoHa's EMA), bit for bit."""
    out, resumed = runs / name, tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    train(name, digits, resumed, "--resume_from_checkpoint", "latest")
    full, again = logged_losses(out), logged_losses(resumed)
    assert [again[s] for s in (3, 4)] == [full[s] for s in (3, 4)]
    for file in [PEFT_FILE, UI_FILE] + ([f"raw/{PEFT_FILE}"] if "--use_ema" in RUNS[name][1] else []):
        a, b = load_file(out / file), load_file(resumed / file)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file


@pytest.mark.parametrize("name", list(RUNS))
def test_sample_py_loads_the_trained_models(runs, name):
    """sample.py's peft path (load_peft_adapters) gives the trained denoiser and text encoder (the EMA run: its raw/
    weights, the trained ones); diffusers' set_adapters, as sample.py's --lora_scale uses it, scales it (0: the
    base)."""
    from common.lora_files import load_peft_adapters

    out = runs / name
    info = json.loads((out / "lora_info.json").read_text())
    family, reference = trained_models(RUNS[name][0], out / "checkpoint-4", info)
    expected = fixed_outputs(family, reference)
    _, pipe = load_pipe(RUNS[name][0])
    base = fixed_outputs(family, pipe)
    load_peft_adapters(pipe, out / "raw" if (out / "raw").is_dir() else out, "lora0")
    for got, want, plain in zip(fixed_outputs(family, pipe), expected, base):
        assert (got - want).abs().max() < 1e-5 and (want - plain).abs().max() > 1e-4
    pipe.set_adapters(["lora0"], adapter_weights=[0.0])
    assert all((got - plain).abs().max() < 1e-6 for got, plain in zip(fixed_outputs(family, pipe), base))


def test_sample_py_draws_a_loha(runs, tmp_path, capsys):
    """The command of the LoHa's model card (diffusers cannot load it), with tiny settings added."""
    import shlex

    command = re.search(r"# (python sample\.py .*)", (runs / "loha-flux" / "README.md").read_text()).group(1)
    assert shlex.split(command)[2:4] == ["--model", str(runs / "loha-flux")]
    run_in_process("sample.py", *shlex.split(command)[2:], "--num_images", "1", "--num_inference_steps", "2",
                   "--lora_scale", "0", "1", "--output_dir", tmp_path)
    assert "LoHa, rank 4, alpha 2" in capsys.readouterr().out
    assert (tmp_path / "0000.png").read_bytes() != (tmp_path / "0001.png").read_bytes()  # scale 0, then 1


def test_the_style_report_measures_a_loha(runs, tmp_path):
    """demo/style_report.py reads the output through peft, as sample.py does, and measures it at each scale."""
    shutil.copytree(runs / "loha-flux", tmp_path / "loha", ignore=shutil.ignore_patterns("checkpoint-*"))
    run_in_process("demo/style_report.py", "--lora", tmp_path / "loha", "--per_digit", "1", "--lora_scales", "0,1")
    sweep = json.loads((tmp_path / "loha" / "all_results.json").read_text())["style_eval"]["lora_scale_sweep"]
    assert [row["lora_scale"] for row in sweep] == [0, 1] and (tmp_path / "loha" / "side_by_side.png").is_file()


def comfyui_update(weights, name, shape):
    """The update ComfyUI adds for module `name` of a LyCORIS file at strength 1, as comfy/weight_adapter/loha.py and
    lokr.py compute it: LoHa (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / rows(w1_b); LoKr kron(w1, w2) (each factor full
    or a product) * alpha / rows(w2_b, else w1_b), at scale 1 when both factors are full."""
    get = weights.get
    alpha = get(f"{name}.alpha")
    if f"{name}.hada_w1_a" in weights:
        w1b = weights[f"{name}.hada_w1_b"]
        scale = 1.0 if alpha is None else alpha.item() / w1b.shape[0]
        update = (weights[f"{name}.hada_w1_a"] @ w1b) * (weights[f"{name}.hada_w2_a"] @ weights[f"{name}.hada_w2_b"])
        return scale * update.reshape(shape)
    dim = None
    w1, w2 = get(f"{name}.lokr_w1"), get(f"{name}.lokr_w2")
    if w1 is None:
        dim, w1 = weights[f"{name}.lokr_w1_b"].shape[0], weights[f"{name}.lokr_w1_a"] @ weights[f"{name}.lokr_w1_b"]
    if w2 is None:
        dim, w2 = weights[f"{name}.lokr_w2_b"].shape[0], weights[f"{name}.lokr_w2_a"] @ weights[f"{name}.lokr_w2_b"]
    scale = alpha.item() / dim if alpha is not None and dim is not None else 1.0
    return scale * torch.kron(w1, w2).reshape(shape)


def ui_modules(family, pipe):
    """{UI file module name: the peft layer of the pipeline it names}: the family's ui_lora names, probed with one
    tensor per adapted module."""
    from peft.tuners.lycoris_utils import LycorisLayer

    layers, probe = [], {}
    for part in (family.DENOISER, "text_encoder"):
        for module, layer in getattr(pipe, part).named_modules():
            if isinstance(layer, LycorisLayer):
                probe.setdefault(part, {})[f"{module}.lokr_w1"] = torch.full((1, 1), float(len(layers)))
                layers.append(layer)
    names = family.ui_lora(probe, 1.0, getattr(pipe, family.DENOISER).config)
    return {key.removesuffix(".lokr_w1"): layers[int(value.item())] for key, value in names.items()
            if key.endswith(".lokr_w1")}


@pytest.mark.parametrize("name", list(RUNS))
def test_comfyui_names_and_update_are_peft_s(runs, comfyui_keys, name):
    """Every tensor of the UI file read (no "lora key not loaded"), every module under a name of ComfyUI's pinned key
    map (Flux.1: its transformer names, block numbers aside; CLIP under diffusers' names, as SDXL's map reads them; SD:
    kohya's names, those of modules SD 1.5 has in SD 1.5's map, for the same module), and ComfyUI's update of each
    weight is peft's (alpha / rank conventions, LoKr's full factors included)."""
    from common.lora_files import load_peft_adapters

    out = runs / name
    family, pipe = load_pipe(RUNS[name][0])
    load_peft_adapters(pipe, out, "default")
    modules = ui_modules(family, pipe)
    weights = load_file(out / UI_FILE)
    parts = {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2",
             "lokr_w2_a", "lokr_w2_b", "alpha"}
    assert {key.rpartition(".")[0] for key in weights} == set(modules)
    assert all(key.rpartition(".")[2] in parts for key in weights)
    in_map = 0
    for module, layer in modules.items():
        if "flux" in name:
            pinned = (comfyui_keys["sdxl"] if module.startswith("text_encoder.")
                      else comfyui_keys["flux"])
            assert re.sub(r"blocks\.\d+\.", "blocks.0.", module) in pinned, module
            in_map += 1
        elif module in comfyui_keys["sd15"]:
            model, diffusers_modules, _ = comfyui_keys["sd15"][module]
            assert len(diffusers_modules) == 1 and getattr(pipe, model).get_submodule(
                diffusers_modules[0].removeprefix("text_model.") if model == "text_encoder"
                else diffusers_modules[0]) is layer, module
            in_map += 1
        with torch.no_grad():
            want = layer.get_delta_weight("default")
        got = comfyui_update(weights, module, layer.get_base_layer().weight.shape)
        assert (got - want).abs().max() < 1e-6 * max(1.0, want.abs().max().item()) and want.abs().max() > 0, module
    assert in_map >= len(modules) // 2


def test_bad_input_is_one_line(runs, digits, tmp_path):
    """--use_dora with LoHa; a resume with another --adapter; the UI file where only LoRA loads; a LoHa output given to
    inspect_pipeline.py --lora."""
    assert_one_line_error(run_script("train_lora.py", "--adapter", "loha", "--use_dora", "--train_data_dir", digits,
                                     "--output_dir", tmp_path / "dora"), "--use_dora", "--adapter loha")
    copy = tmp_path / "other"
    shutil.copytree(runs / "lokr-flux" / "checkpoint-2", copy / "checkpoint-2")
    assert_one_line_error(train("loha-flux", digits, copy, "--resume_from_checkpoint", "latest", check=False),
                          "adapter=lokr (now loha)")
    assert not (copy / "checkpoint-4").exists()
    ui = runs / "loha-flux" / UI_FILE
    assert_one_line_error(run_script("sample.py", "--model", FLUX, "--lora", ui, "--prompt", "x", "--output_dir",
                                     tmp_path / "s"), "LoHa weights in LyCORIS's names", "give sample.py the "
                          "train_lora.py output folder")
    assert_one_line_error(run_script("inspect_pipeline.py", runs / "lokr-sd"), "is a LoKr", "sample.py")


def test_flag_checks(digits):
    from train_lora import parse_args

    for argv, needle in ((["--adapter", "lokr", "--lora_dropout", "0.1"], "--lora_dropout"),
                         (["--adapter", "loha", "--lokr_factor", "4"], "--lokr_factor"),
                         (["--adapter", "loha", "--quantize_base", "nf4"], "--quantize_base"),
                         (["--adapter", "lokr", "--lokr_factor", "0"], "--lokr_factor")):
        with pytest.raises(UserError, match=re.escape(needle)) as err:
            parse_args(["--pretrained_model_name_or_path", str(FLUX), "--train_data_dir", str(digits), *argv])
        assert "\n" not in str(err.value)
