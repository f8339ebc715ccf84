"""Edit LoRAs (common/references.py): reference images paired with the training images by name, following them
through every crop, flip and bucket and into the latent cache; train_lora.py with --control_data_dir on the tiny
random-init Flux.1 (FLUX.1 Kontext's way) and FLUX.2 klein (its reference tokens), each run's file read back by its edit
pipeline's load_lora_weights, an exact resume, sample.py --image against the edit pipeline and the run's validation
image, the denoiser call against the pipelines' own token and id lines (and diffusers' Kontext script's), two processes
with missing references, and the one-line errors of bad pairs."""
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, launch, logged_losses, read_results, run_script
from PIL import Image, ImageOps
from safetensors.torch import load_file

from common.cli import UserError
from common.families import family_module

INSTRUCTION = "invert it"
STEPS = ["--train_batch_size", "4", "--rank", "4", "--lora_alpha", "8", "--learning_rate", "1e-2",
         "--max_sequence_length", "8", "--caption_dropout_prob", "0.2", "--random_flip", "--logging_steps", "1",
         "--cache_latents"]
# family: (its tiny build's fixture, its edit pipeline, the size it trains and draws at: FLUX.2's image processor
# takes references of 64 px and more); FLUX.2 dev: its bad input only (it trains as klein, with klein's code)
EDITS = {"flux": ("tiny_flux", "FluxKontextPipeline", 32),
         "flux2_klein": ("tiny_flux2_klein", "Flux2KleinPipeline", 64)}


def write_pairs(digits, root, size, count=20):
    """`count` digits inverted (the targets, captioned with the instruction) and the digits themselves (the
    references), same names, in two folders, at `size` px."""
    (root / "targets").mkdir(parents=True)
    (root / "controls").mkdir()
    names = sorted(p.name for p in (digits / "train").glob("*.png"))[:count]
    with open(root / "targets" / "metadata.jsonl", "w") as f:
        for name in names:
            image = Image.open(digits / "train" / name).convert("RGB").resize((size, size), Image.BICUBIC)
            image.save(root / "controls" / name)
            ImageOps.invert(image).save(root / "targets" / name)
            f.write(json.dumps({"file_name": name, "text": INSTRUCTION}) + "\n")
    return root


@pytest.fixture(scope="module")
def pairs(digits, tmp_path_factory):
    return write_pairs(digits, tmp_path_factory.mktemp("pairs"), 32)


@pytest.fixture(scope="module")
def pairs64(digits, tmp_path_factory):
    return write_pairs(digits, tmp_path_factory.mktemp("pairs64"), 64, count=10)  # (8 train, 2 held out)


class Edit:
    """A family's edit run: its base, pairs, output folder (`out`, None before it trains)."""

    def __init__(self, name, base, pairs, out=None):
        self.name, self.base, self.pairs, self.out = name, base, pairs, out
        self.family, self.size = family_module(name), EDITS[name][2]

    def pipeline(self):
        import diffusers

        return getattr(diffusers, EDITS[self.name][1]).from_pretrained(self.base)

    def args(self, out, controls=None, validation=True):
        args = ["--pretrained_model_name_or_path", self.base, "--train_data_dir", self.pairs / "targets",
                "--control_data_dir", controls or self.pairs / "controls", "--output_dir", out, "--resolution",
                self.size, *STEPS]
        return args + ["--validation_prompt", INSTRUCTION, "--validation_steps", "4", "--num_validation_images", "1",
                       "--validation_inference_steps", "2", "--validation_split", "0.2", "--validation_image",
                       self.reference()] * validation

    def reference(self):
        return self.pairs / "controls" / sorted(p.name for p in (self.pairs / "controls").glob("*.png"))[0]


def edit(name, request):
    return Edit(name, request.getfixturevalue(EDITS[name][0]),
                request.getfixturevalue("pairs" if EDITS[name][2] == 32 else "pairs64"))


@pytest.fixture(scope="module", params=sorted(EDITS))
def edit_run(request, tmp_path_factory):
    run = edit(request.param, request)
    run.out = tmp_path_factory.mktemp("edit") / "run"
    launch("train_lora.py", *run.args(run.out), "--max_train_steps", "4", "--checkpointing_steps", "2")
    return run


def fixed_outputs(run, pipe):
    """The transformer's output on fixed noisy latents and reference latents (16 channels in every tiny build)."""
    g = torch.Generator().manual_seed(0)
    x, reference = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 8, 8, generator=g)
    family = run.family
    with torch.no_grad():
        cond = family.encode_prompts(pipe.components, family.tokenize(pipe.components, [INSTRUCTION] * 2, 8))
        return family.denoise(pipe.transformer, x, torch.tensor([100.0, 700.0]), {**cond, "reference_latents": [
            reference]}, family.TRAINING_GUIDANCE)


def kontext_lines(pipe, x, cond_input, timesteps, cond):
    """train_dreambooth_lora_flux_kontext.py's lines: pack both, ids with first coordinate 1 appended, the prediction
    cut to the image tokens."""
    from diffusers import FluxKontextPipeline as P

    ids = P._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32)
    cond_ids = P._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32)
    cond_ids[..., 0] = 1
    packed = torch.cat([P._pack_latents(x, 2, 16, 8, 8), P._pack_latents(cond_input[0], 2, 16, 8, 8)], dim=1)
    pred = pipe.transformer(hidden_states=packed, timestep=timesteps / 1000, guidance=torch.tensor([3.5, 3.5]),
                            pooled_projections=cond["pooled_prompt_embeds"],
                            encoder_hidden_states=cond["prompt_embeds"], txt_ids=torch.zeros(8, 3),
                            img_ids=torch.cat([ids, cond_ids]), return_dict=False)[0][:, :16]
    return P._unpack_latents(pred, 32, 32, 4)


def flux2_lines(pipe, x, references, timesteps, cond):
    """Flux2KleinPipeline's and Flux2Pipeline's lines: each reference's tokens appended, with _prepare_image_ids' ids
    (10, 20, ...), the prediction cut to the image tokens."""
    P = type(pipe)
    ids = P._prepare_latent_ids(x)
    reference_ids = P._prepare_image_ids([r[:1] for r in references]).expand(x.shape[0], -1, -1)
    tokens = torch.cat([P._pack_latents(x), *[P._pack_latents(r) for r in references]], dim=1)
    guidance = torch.full((2,), 3.5) if pipe.transformer.config.guidance_embeds else None
    pred = pipe.transformer(hidden_states=tokens, timestep=timesteps / 1000, guidance=guidance,
                            encoder_hidden_states=cond["prompt_embeds"], txt_ids=P._prepare_text_ids(
                                cond["prompt_embeds"]), img_ids=torch.cat([ids, reference_ids], dim=1),
                            return_dict=False)[0][:, :ids.shape[1]]
    return P._unpack_latents_with_ids(pred, ids)


@pytest.mark.parametrize("name", sorted(EDITS))
def test_the_denoiser_call_is_the_pipelines(name, request):
    """family.denoise with reference latents (FLUX.2 klein: two) = the pipeline's (and Kontext's training script's)
    lines; the reference changes it."""
    run = Edit(name, request.getfixturevalue(EDITS[name][0]), None)
    pipe, family = run.pipeline(), run.family
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 8, 8, generator=g)
    references = [torch.randn(2, 16, 8, 8, generator=g) for _ in range(1 if name == "flux" else 2)]
    timesteps = torch.tensor([300.0, 900.0])
    with torch.no_grad():
        cond = family.encode_prompts(pipe.components, family.tokenize(pipe.components, [INSTRUCTION] * 2, 8))
        ours = family.denoise(pipe.transformer, x, timesteps, {**cond, "reference_latents": references},
                              family.TRAINING_GUIDANCE)
        theirs = (kontext_lines if name == "flux" else flux2_lines)(pipe, x, references, timesteps, cond)
        plain = family.denoise(pipe.transformer, x, timesteps, cond, family.TRAINING_GUIDANCE)
    assert (ours - theirs).abs().max() < 1e-6
    assert (ours - plain).abs().max() > 1e-3


def test_the_vae_encode_mode_mode_is_the_mean():
    """--vae_encode_mode mode (the Kontext script's default) trains on the distribution's mean; sample draws around
    it."""
    from common.vae import mean_latents, sample_latents

    params = torch.cat([torch.randn(2, 4, 8, 8), torch.full((2, 4, 8, 8), -2.0)], dim=1)
    config = {"scaling_factor": 0.5, "shift_factor": 0.1}
    assert torch.equal(sample_latents(params, config, "mode"), mean_latents(params, config))
    assert not torch.equal(sample_latents(params, config), mean_latents(params, config))


def test_an_edit_lora_loads_back_exactly(edit_run):
    """The edit pipeline's load_lora_weights gives the trained transformer (set from the checkpoint's own adapter
    state) within 1e-5; the validation images show reference | base | LoRA."""
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    from common.lora_adapters import expand_targets

    run = edit_run
    expected = run.pipeline()
    expected.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                target_modules=expand_targets(expected.transformer,
                                                                              run.family.LORA_TARGETS.split(","))))
    set_peft_model_state_dict(expected.transformer,
                              load_file(run.out / "checkpoint-4" / "transformer" / "adapter_model.safetensors"))
    pipe = run.pipeline()
    pipe.load_lora_weights(run.out)
    got, want, plain = (fixed_outputs(run, p) for p in (pipe, expected, run.pipeline()))
    assert (got - want).abs().max() < 1e-5 and (plain - want).abs().max() > 1e-4
    assert json.loads((run.out / "lora_info.json").read_text())["references"] == 1
    results = read_results(run.out)
    assert set(results["validation_losses"]) == {"0", "4"}  # the held-out pairs' loss, with their references
    side = Image.open(run.out / "samples" / "step-4" / "0-side_by_side.png")
    assert side.size == (3 * run.size, run.size)
    if run.name == "flux2_klein":  # the UI file: FLUX.2's, under ComfyUI's map (pinned), read back by diffusers too
        import gzip

        from conftest import ROOT

        with gzip.open(ROOT / "tests" / "data" / "comfyui_lora_keys_flux2.json.gz", "rt") as f:
            comfyui = json.load(f)["flux2"]
        ui = load_file(run.out / "pytorch_lora_weights_ui.safetensors")
        assert {key.rsplit(".", 2 if key.endswith(".weight") else 1)[0] for key in ui} <= set(comfyui)
        pipe = run.pipeline()
        pipe.load_lora_weights(run.out, weight_name="pytorch_lora_weights_ui.safetensors")
        assert (fixed_outputs(run, pipe) - want).abs().max() < 1e-5


def test_an_edit_lora_resumes_exactly(edit_run, tmp_path):
    run = edit_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(run.out / "checkpoint-2", resumed / "checkpoint-2")
    launch("train_lora.py", *run.args(resumed), "--max_train_steps", "4", "--checkpointing_steps", "2",
           "--resume_from_checkpoint", "latest")
    full, again = logged_losses(run.out), logged_losses(resumed)
    assert [again[s] for s in (3, 4)] == [full[s] for s in (3, 4)]
    a, b = (load_file(folder / "pytorch_lora_weights.safetensors") for folder in (run.out, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def pixels(path):
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def test_sample_py_with_an_image_is_the_edit_pipeline(edit_run, tmp_path):
    """sample.py --image on the run's output draws what the edit pipeline draws with the LoRA loaded (within one
    level), and what the run drew for its last validation from the same reference."""
    from test_snippets import one_thread, sample_py

    run = edit_run
    reference = run.reference()
    with one_thread():  # (sample.py's subprocesses run on one: the same float order)
        drawn = sample_py(run.out, INSTRUCTION, 42, tmp_path, "--image", str(reference), "--num_inference_steps", "2")
        params = json.loads(Image.open(tmp_path / "0000.png").text["parameters"])
        assert params["image"] == str(reference)
        pipe = run.pipeline()
        pipe.load_lora_weights(run.out)
        size, image = run.size, Image.open(reference).convert("RGB")
        kwargs = {"max_area": size * size, "_auto_resize": False} if run.name == "flux" else {}
        kwargs.update(run.family.guidance_kwargs(pipe.transformer.config, params["guidance_scale"], 1)[0])
        image = pipe(image=image, prompt=INSTRUCTION, num_inference_steps=2, height=size, width=size,
                     max_sequence_length=8, generator=torch.Generator().manual_seed(42), **kwargs).images[0]
    assert np.abs(drawn - np.asarray(image).astype(int)).max() <= 1
    assert np.abs(drawn - pixels(run.out / "samples" / "step-4" / "0-0.png")).max() <= 1


def test_the_card_draws_what_sample_py_with_an_image_draws(edit_run, tmp_path, monkeypatch):
    """The edit LoRA's model card: its edit pipeline from the run's validation reference, run as printed, draws what
    sample.py --image draws."""
    from test_snippets import card_draws_what_sample_py_draws

    run = edit_run
    code = card_draws_what_sample_py_draws(run.out, tmp_path, monkeypatch, flags=("--image", str(run.reference())))
    assert f"pipe = {EDITS[run.name][1]}.from_pretrained(" in code and f'load_image("{run.reference()}")' in code
    assert f"--image {run.reference()}" in (run.out / "README.md").read_text()


def test_two_processes_with_missing_references(request, tmp_path):
    """Two CPU processes, three training images without their reference (--allow_missing_control): batches all with
    or all without references, the run finishes and saves."""
    run = edit("flux", request)
    controls = tmp_path / "controls"
    shutil.copytree(run.pairs / "controls", controls)
    for path in sorted(controls.glob("*.png"))[-3:]:
        path.unlink()
    proc = launch("train_lora.py", *run.args(tmp_path / "two", controls, validation=False),
                  "--max_train_steps", "2", "--allow_missing_control", config="cpu_2proc.yaml")
    assert "2 process(es)" in proc.stderr and read_results(tmp_path / "two")["num_processes"] == 2
    assert (tmp_path / "two" / "pytorch_lora_weights.safetensors").is_file()


def test_references_follow_their_targets_through_crops_flips_buckets_and_the_cache(tmp_path):
    """A reference that is its target's own image (stored as it is, or at twice its size): after every random crop,
    flip and bucket, and in the latent cache, the reference's pixels are the target's."""
    import datasets

    from common.image_data import CachedLatents, ImageDataset

    rng = np.random.default_rng(0)
    paths, controls, sizes = [], [], []
    for i, (w, h) in enumerate([(40, 32), (40, 32), (32, 48), (32, 48)]):
        image = Image.fromarray(rng.integers(0, 255, (h // 8, w // 8, 3), dtype=np.uint8)).resize((w, h),
                                                                                                Image.BICUBIC)
        paths.append(str(tmp_path / f"{i}.png"))
        image.save(paths[-1])
        controls.append({"path": str(tmp_path / f"{i}-control.png"), "bytes": None})
        (image if i % 2 else image.resize((2 * w, 2 * h), Image.BICUBIC)).save(controls[-1]["path"])
        sizes.append((24, 32) if w > h else (32, 24))
    ds = datasets.Dataset.from_dict({"image": paths}).cast_column("image", datasets.Image())
    for buckets in (None, sizes):
        data = ImageDataset(ds, "image", 24, center_crop=False, random_flip=True, seed=3, sizes=buckets,
                            columns={"index": torch.arange(4)}, references=[[c] for c in controls], masks="ones")
        for epoch in range(3):
            data.set_epoch(epoch)
            for i in range(4):
                item = data[i]
                if i % 2:  # (the same file: the same pixels)
                    assert torch.equal(item["reference_values"][0], item["pixel_values"])
                assert torch.allclose(item["reference_values"][0], item["pixel_values"], atol=0.05)
        cached = CachedLatents(data, lambda x: torch.cat([x[:, :, ::4, ::4], x[:, :, ::4, ::4]], dim=1), 2)
        for epoch in range(3):
            cached.set_epoch(epoch)
            batch = cached.__getitems__([0, 1])
            mean = batch["latent_params"].chunk(2, dim=1)[0]
            assert torch.allclose(batch["reference_latents"][:, 0], mean, atol=0.05)


def make_args(**flags):
    import argparse

    defaults = {"control_data_dir": [], "control_image_column": [], "allow_missing_control": False,
                "validation_image": [], "with_prior_preservation": False, "dataset_name": None,
                "image_column": "image", "pretrained_model_name_or_path": "base", "revision": None, "cache_dir": None,
                "resolution": 32}
    return argparse.Namespace(**{**defaults, **flags})


def test_missing_references_train_apart_and_leave_the_held_out_loss(pairs, tiny_flux):
    """--allow_missing_control with a dataset's column: a training image without its reference is batched apart (a
    batch is all with or all without), a held-out one is left out; without the flag the image is named."""
    import datasets

    from common.buckets import BucketBatchSampler
    from common.families import flux
    from common.references import paired_references

    targets = sorted(str(p) for p in (pairs / "targets").glob("*.png"))[:8]
    controls = [None if i % 3 == 1 else str(pairs / "controls" / p.rsplit("/", 1)[-1]) for i, p in enumerate(targets)]
    ds = datasets.Dataset.from_dict({"image": targets, "control": controls}).cast_column(
        "image", datasets.Image()).cast_column("control", datasets.Image())
    args = make_args(control_image_column=["control"], allow_missing_control=True)
    args.pretrained_model_name_or_path = str(tiny_flux)
    refs, held_out = paired_references(args, flux, ds.select(range(6)), ds.select(range(6, 8)))
    assert len(held_out) == 1 and refs.rows[1] == [[{"path": controls[6], "bytes": None}]]
    assert refs.present.tolist() == [True, False, True, True, False, True]
    for epoch in range(3):
        for batch in BucketBatchSampler(refs.batch_keys(None), 2, epoch, type("Data", (), {"epoch": epoch})()):
            assert len({bool(refs.present[i]) for i in batch}) == 1
    assert refs({"index": torch.tensor([1, 4])}, None, None) == {}
    with pytest.raises(UserError, match="has no reference image; add it, or give --allow_missing_control"):
        paired_references(make_args(control_image_column=["control"], pretrained_model_name_or_path=str(tiny_flux)),
                          flux, ds, None)


BAD = {
    "a-reference-missing": ("missing", "--control_data_dir", "1 training image(s)", "have no reference image",
                            "--allow_missing_control"),
    "a-reference-too-many": ("extra", "--control_data_dir", "with no training image of the same name", "9999.png"),
    "another-aspect-ratio": ("wide", "is 64x32 px", "32x32", "aspect ratios differ"),
    "a-reference-too-small": ("small", "at least 8 px a side"),
    "an-unreadable-reference": ("broken", "cannot read reference image", "replace or delete it"),
    "references-on-sd": ("sd", "takes no reference images", "Stable Diffusion 1.x/2.x"),
    "two-references-for-kontext": ("two", "2 reference images", "FluxKontextPipeline takes at most 1"),
    "prior-preservation": ("prior", "--with_prior_preservation", "no reference images"),
    "missing-control-flag-alone": ("alone", "--allow_missing_control is for edit LoRAs"),
    "a-32-px-reference-for-flux2": ("klein-small", "is 32x32 px", "at least 64 px a side"),
    "five-references-for-klein": ("klein-five", "5 reference images", "Flux2KleinPipeline takes at most 4"),
    "seven-references-for-flux2-dev": ("dev-seven", "7 reference images", "Flux2Pipeline takes at most 6"),
    "flux2-references-trained-at-32-px": ("klein-32", "--resolution 32", "at least 64 px a side", "--resolution 64"),
    "references-on-qwen-image": ("qwen", "(Qwen-Image) takes no reference images here", "Qwen2VLProcessor",
                                 "torchvision", "not supported yet"),
    "a-qwen-image-edit-base": ("qwen-edit", "is a QwenImageEditPlusPipeline base", "not supported yet"),
}


@pytest.fixture(scope="module")
def qwen_image_edit(tmp_path_factory):
    """A Qwen-Image-Edit-Plus base as far as the recipes read it before refusing it: its model_index.json."""
    folder = tmp_path_factory.mktemp("models") / "qwen-image-edit"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPlusPipeline"}))
    return folder


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_pairs_are_one_line_and_write_nothing(case, pairs, tiny_flux, tiny_sd, request, tmp_path):
    kind, *needles = BAD[case]
    if kind == "klein-32":
        pairs = request.getfixturevalue("pairs64")
    controls = tmp_path / "controls"
    shutil.copytree(pairs / "controls", controls)
    first = sorted(controls.glob("*.png"))[0]
    base, extra = tiny_flux, []
    if kind.startswith(("klein", "dev")):
        base = request.getfixturevalue("tiny_flux2" if kind.startswith("dev") else "tiny_flux2_klein")
        count = {"klein-five": 4, "dev-seven": 6}.get(kind, 0)
        extra = ["--resolution", "32" if kind == "klein-32" else "64", *["--control_data_dir", controls] * count]
    if kind == "missing":
        first.unlink()
    elif kind == "extra":
        shutil.copy(first, controls / "9999.png")
    elif kind in ("wide", "small"):
        Image.new("RGB", (64, 32) if kind == "wide" else (4, 4)).save(first)
    elif kind == "broken":
        first.write_bytes(b"not an image")
    elif kind == "sd":
        base = tiny_sd
    elif kind.startswith("qwen"):
        base = request.getfixturevalue("qwen_image_edit" if kind == "qwen-edit" else "tiny_qwen_image")
    elif kind == "two":
        extra = ["--control_data_dir", controls]
    elif kind == "prior":
        extra = ["--with_prior_preservation", "--class_data_dir", tmp_path / "class", "--class_prompt", "a digit"]
    args = ["--pretrained_model_name_or_path", base, "--train_data_dir", pairs / "targets", "--output_dir",
            tmp_path / "out", "--max_train_steps", "1", *extra]
    if kind == "alone":
        args += ["--allow_missing_control"]
    else:
        args += ["--control_data_dir", controls]
    proc = run_script("train_lora.py", *args)
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "out").exists()


SAMPLE_BAD = {
    "image-on-sd": ("{sd}", ["--image", "{ref}"], "--image", "takes no reference images"),
    "two-images-for-kontext": ("{flux}", ["--image", "{ref}", "--image", "{ref}"], "at most 1"),
    "an-unreadable-image": ("{flux}", ["--image", "{broken}"], "--image", "cannot read it as an image"),
    "a-too-small-image": ("{flux}", ["--image", "{small}"], "4x4 px", "at least 8 px a side"),
    "a-32-px-image-for-klein": ("{klein}", ["--image", "{ref}"], "32x32 px", "at least 64 px a side"),
    "a-32-px-drawing-for-klein": ("{klein}", ["--image", "{ref64}", "--height", "32", "--width", "32"], "32x32 px",
                                  "at least 64 px a side", "--height and --width"),
}


@pytest.mark.parametrize("case", sorted(SAMPLE_BAD))
def test_bad_sample_images_are_one_line(case, tiny_flux, tiny_sd, request, tmp_path):
    base, flags, *needles = SAMPLE_BAD[case]
    (tmp_path / "broken.png").write_bytes(b"not an image")
    Image.new("RGB", (4, 4)).save(tmp_path / "small.png")
    paths = {"sd": tiny_sd, "flux": tiny_flux, "ref": edit("flux", request).reference(),
             "broken": tmp_path / "broken.png", "small": tmp_path / "small.png"}
    if "klein" in case:
        paths.update(klein=request.getfixturevalue("tiny_flux2_klein"),
                     ref64=edit("flux2_klein", request).reference())
    proc = run_script("sample.py", "--model", base.format(**paths), *[f.format(**paths) for f in flags],
                      "--prompt", INSTRUCTION, "--output_dir", tmp_path / "out")
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "out").exists()
