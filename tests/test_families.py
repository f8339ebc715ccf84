"""The family layer: every module of common/families/ has the reference module's (sd.py's) names, the registry maps
each pipeline class to a module that says it draws that class, and a LoRA file's family is read from what each
module declares."""
import ast
import importlib

import pytest
from conftest import ROOT

from common.families import FAMILIES, family_module, lora_family

MODULES = sorted(path.stem for path in (ROOT / "common" / "families").glob("*.py") if path.stem != "__init__")


def public_names(module):
    """The names a module defines at its top level (assignments, functions), not those it imports."""
    names = set()
    for node in ast.parse(open(module.__file__).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            names.update(e.id for t in node.targets if isinstance(t, ast.Tuple) for e in t.elts
                         if isinstance(e, ast.Name))
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("name", MODULES)
def test_every_family_module_has_the_reference_modules_names(name):
    reference = public_names(importlib.import_module("common.families.sd"))
    module = importlib.import_module(f"common.families.{name}")
    missing = sorted(n for n in reference if not hasattr(module, n))
    assert not missing, f"common/families/{name}.py lacks {missing} (sd.py, the reference, has them)"
    assert module.KEY == name


def test_the_registry_maps_each_pipeline_class_to_the_module_that_draws_it():
    assert set(FAMILIES.values()) == set(MODULES)
    for pipeline, name in FAMILIES.items():
        module = family_module(name)
        assert pipeline in (module.PIPELINE, *getattr(module, "PIPELINES", ())), (pipeline, name)


@pytest.mark.parametrize("name", MODULES)
def test_a_lora_files_family_is_read_from_its_metadata(name):
    module = family_module(name)
    for key, prefixes in module.LORA_METADATA.items():
        assert lora_family({key: prefixes[0] + "-something"}, [])[0] == name
    for prefix in module.LORA_KEY_PREFIXES:  # (FLUX.2 dev and klein share theirs: the base's family is the one)
        assert lora_family({}, [prefix + "0.lora_A.weight"], prefer=name)[0] == name


def test_a_family_module_without_the_module_it_builds_on_is_one_line(tmp_path):
    """FLUX.2 dev's module takes klein's: a copy with flux2.py and not flux2_klein.py says which file to copy."""
    import shutil
    import subprocess
    import sys

    (tmp_path / "common" / "families").mkdir(parents=True)
    for name in ("__init__.py", "cli.py", "families/__init__.py", "families/flux2.py"):
        shutil.copy(ROOT / "common" / name, tmp_path / "common" / name)
    proc = subprocess.run([sys.executable, "-c", "from common.families import family_module\n"
                           "from common.cli import UserError\ntry:\n    family_module('flux2')\n"
                           "except UserError as err:\n    print(err)"], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path)})
    assert proc.stdout.strip() == ("common/families/flux2.py needs common/families/flux2_klein.py, the module of "
                                   "Flux2Pipeline bases: copy it beside common/families/__init__.py"), proc.stderr


TURBO_CARD = """# Z-Image-Turbo
```python
image = pipe(
    prompt=prompt,
    height=1024,
    width=1024,
    num_inference_steps=9,  # This actually results in 8 DiT forwards
    guidance_scale=0.0,     # Guidance should be 0 for the Turbo models
).images[0]
```
"""


def test_a_distilled_bases_sampling_defaults_come_from_its_model_card(tiny_z_image, tmp_path):
    """Z-Image-Turbo's card draws with 9 steps and no guidance: sample.py's defaults, the validation images' and the
    LoRA card's snippet follow it (common/sampling_defaults.py); a base whose card names neither (or that has none)
    draws with the family's."""
    import json
    import shutil
    from types import SimpleNamespace

    from common.lora_metadata import lora_card
    from common.sampling_defaults import card_call, sampling_defaults

    z_image = family_module("z_image")
    turbo = tmp_path / "turbo"
    shutil.copytree(tiny_z_image, turbo)
    (turbo / "README.md").write_text(TURBO_CARD)
    config = json.loads((turbo / "transformer" / "config.json").read_text())
    assert card_call(str(turbo)) == {"height": 1024, "width": 1024, "num_inference_steps": 9, "guidance_scale": 0.0}
    drawn = sampling_defaults(z_image, str(turbo), config)
    assert (drawn["num_inference_steps"], drawn["guidance_scale"]) == (9, 0.0)
    plain = sampling_defaults(z_image, str(tiny_z_image), config)
    assert (plain["num_inference_steps"], plain["guidance_scale"]) == (z_image.SAMPLE_STEPS, z_image.SAMPLE_GUIDANCE)
    args = SimpleNamespace(pretrained_model_name_or_path=str(turbo), revision=None, cache_dir=None,
                           dataset_name=None, train_data_dir="data", output_dir="out", resolution=32, rank=8,
                           lora_alpha=8, target_modules=["to_q"], train_text_encoder=False, caption_prefix=None,
                           validation_prompt=[], use_dora=False, adapter="lora")
    usage = lora_card(args, {"base_model": str(turbo), "resolution": 32}, z_image, 10, 0.1, False, "a cat")[3]
    assert "num_inference_steps=9" in usage and "guidance_scale=0.0" in usage, usage


def test_flux2_and_flux1_loras_are_told_apart_by_their_tensor_names():
    """FLUX.2's own layers (the fused single-block projection, the SwiGLU feed-forwards) name FLUX.2, whichever of dev
    and klein the base is; Flux.1's diffusers names (its single blocks' q/k/v, its feed-forwards' net.0.proj) do not."""
    flux2 = ["transformer.single_transformer_blocks.3.attn.to_qkv_mlp_proj.lora_A.weight"]
    assert lora_family({}, flux2)[0] == "flux2_klein"
    assert lora_family({}, flux2, prefer="flux2")[0] == "flux2"
    assert lora_family({}, flux2, prefer="flux")[0] == "flux2_klein"
    assert lora_family({}, ["transformer.transformer_blocks.0.ff_context.linear_in.lora_A.weight"])[0] == "flux2_klein"
    assert lora_family({}, ["transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight"])[0] == "flux"
    assert lora_family({}, ["transformer.transformer_blocks.0.ff_context.net.0.proj.lora_A.weight"])[0] is None
