"""Wan end to end on clips, on the tiny random-init Wan 2.1 text-to-video base (`make tiny-wan`) and clips of moving
digits written as mp4, animated GIF and folders of frames (demo/moving_digits.py): train_lora.py with --num_frames and
--frame_stride, its files read back by WanPipeline.load_lora_weights (the UI file under ComfyUI's native Wan names
too), an exact resume, the validation clip, sample.py's clips against WanPipeline's frames, and the one-line errors of
clips that do not fit; Wan 2.2 A14B's experts (--wan_expert high, low, both) on its tiny two-expert build. (Wan on
images, one frame each, is one family of tests/test_lora_flow.py.)"""
import json
import shutil
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, assert_one_line_error, launch, read_results, run_in_process, run_script
from PIL import Image
from safetensors.torch import load_file

from common.cli import UserError
from common.families import family_module

FRAMES = ["--num_frames", "5", "--frame_stride", "2"]
STEPS = ["--train_batch_size", "2", "--max_train_steps", "4", "--checkpointing_steps", "2", "--rank", "4",
         "--lora_alpha", "8", "--learning_rate", "1e-2", "--resolution", "32", "--max_sequence_length", "40",
         "--random_flip", "--logging_steps", "1", "--cache_latents", "--buckets", "auto", *FRAMES]
SPLIT = ["--validation_split", "0.2"]  # a held-out clip: the held-out loss on clips
PROMPT = "a handwritten digit 3 moving left"
VALIDATION = ["--validation_prompt", PROMPT, "--validation_steps", "4", "--num_validation_images", "1",
              "--validation_inference_steps", "2"]  # (at the training size: --buckets auto)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from demo.moving_digits import write_moving_digits

    path = tmp_path_factory.mktemp("clips") / "moving-digits"
    write_moving_digits(str(path), count=6, frames=9, formats=("mp4", "gif", "frames"))
    return path


@pytest.fixture(scope="module")
def trained(tiny_wan, clips, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-wan-video") / "run"
    launch("train_lora.py", "--train_data_dir", clips, "--pretrained_model_name_or_path", tiny_wan, "--output_dir",
           out, *STEPS, *SPLIT, *VALIDATION, config="cpu_2proc.yaml")  # two processes, a clip each a step
    return tiny_wan, clips, out


def transformer_output(pipe, name="transformer"):
    """The transformer's (or expert `name`'s) output on a fixed clip of latents [2, 16, 2, 4, 4] and prompt."""
    family = family_module("wan")
    x = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cond = family.encode_prompts(pipe.components, family.tokenize(pipe.components, [PROMPT] * 2, 40))
        return family.denoise(getattr(pipe, name), x, torch.tensor([100.0, 700.0]), cond)


def test_a_video_lora_loads_back_exactly_in_diffusers_and_under_comfyuis_names(trained):
    from diffusers import WanPipeline
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    from common.lora_adapters import expand_targets

    base, _, out = trained
    results = read_results(out)
    assert results["global_step"] == 4 and results["num_processes"] == 2 and set(results["validation_losses"]) == {
        "0", "4"}
    reference = WanPipeline.from_pretrained(base)
    targets = expand_targets(reference.transformer, family_module("wan").LORA_TARGETS.split(","))
    reference.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                 target_modules=targets))
    adapter = load_file(out / "checkpoint-4" / "transformer" / "adapter_model.safetensors")
    set_peft_model_state_dict(reference.transformer, adapter)
    expected = transformer_output(reference)
    assert (transformer_output(WanPipeline.from_pretrained(base)) - expected).abs().max() > 1e-4  # it learned
    for weights in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ui.safetensors"):
        pipe = WanPipeline.from_pretrained(base)
        pipe.load_lora_weights(out, weight_name=weights)
        assert (transformer_output(pipe) - expected).abs().max() < 1e-5, weights
    ui = load_file(out / "pytorch_lora_weights_ui.safetensors")
    names = {"attn1.to_q": "self_attn.q", "attn1.to_out.0": "self_attn.o", "attn2.to_k": "cross_attn.k"}
    for ours, comfy in names.items():  # ComfyUI's own Wan module names, with alpha / rank as trained
        assert torch.equal(ui[f"diffusion_model.blocks.1.{comfy}.lora_A.weight"],
                           adapter[f"blocks.1.{ours}.lora_A.weight"])
        assert ui[f"diffusion_model.blocks.1.{comfy}.alpha"].item() == 8
    assert all(key.startswith("diffusion_model.blocks.") for key in ui)


def test_a_video_run_resumes_exactly(trained, tmp_path):
    base, clips, out = trained
    resumed = tmp_path / "run"
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    launch("train_lora.py", "--train_data_dir", clips, "--pretrained_model_name_or_path", base, "--output_dir",
           resumed, *STEPS, *SPLIT, "--resume_from_checkpoint", "latest", config="cpu_2proc.yaml")
    straight = load_file(out / "checkpoint-4" / "transformer" / "adapter_model.safetensors")
    again = load_file(resumed / "checkpoint-4" / "transformer" / "adapter_model.safetensors")
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)


def test_the_validation_clip_and_sample_py_draw_wanpipelines_frames(trained, tmp_path):
    from diffusers import WanPipeline

    base, _, out = trained
    validation = Image.open(out / "samples" / "step-4" / "0-0.gif")
    assert validation.n_frames == 5 and validation.size == (32, 32)
    run = run_script("sample.py", "--model", out, "--prompt", PROMPT, "--num_images", "1", "--num_inference_steps",
                     "2", "--output_dir", tmp_path / "samples")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "samples" / "0000.mp4").stat().st_size > 0  # (the frames from --num_frames of the run: 5)
    assert Image.open(tmp_path / "samples" / "0000.gif").n_frames == 5
    grid = np.asarray(Image.open(tmp_path / "samples" / "grid.png").convert("RGB")).astype(int)  # a row of frames
    pipe = WanPipeline.from_pretrained(base)
    pipe.load_lora_weights(out)
    frames = pipe(prompt=PROMPT, num_frames=5, height=32, width=32, num_inference_steps=2, guidance_scale=5.0,
                  max_sequence_length=40, generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
    theirs = np.concatenate(list((frames * 255).round().astype(int)), axis=1)  # [32, 5 x 32, 3]
    assert grid.shape == theirs.shape and np.abs(grid - theirs).max() <= 1
    sys.path.insert(0, str(ROOT))
    import inspect_pipeline  # (in this process: its main returns the report it prints)

    report = inspect_pipeline.main(inspect_pipeline.parse_args([str(out), "--trace", "--json", "--num_inference_steps",
                                                                "1", "--height", "32", "--width", "32"]))
    json.dumps(report)  # (the run's clips: 5 frames, from lora_info.json)
    assert report["vae"]["latent_shape"] == [1, 16, 2, 4, 4] and report["vae"]["packed_latent_shape"] == [1, 8, 64]
    assert report["trace"]["initial_noise"] == [1, 16, 2, 4, 4]


def test_train_text_to_image_trains_the_wan_transformer_on_clips(tiny_wan, clips, tmp_path):
    from diffusers import WanTransformer3DModel

    out = tmp_path / "full"
    launch("train_text_to_image.py", "--train_data_dir", clips, "--pretrained_model_name_or_path", tiny_wan,
           "--output_dir", out, "--train_batch_size", "2", "--max_train_steps", "2", "--resolution", "32",
           "--max_sequence_length", "40", "--learning_rate", "1e-3", *FRAMES)
    trained = WanTransformer3DModel.from_pretrained(out / "transformer").state_dict()
    base = WanTransformer3DModel.from_pretrained(tiny_wan / "transformer").state_dict()
    assert any(not torch.equal(trained[k], base[k]) for k in base)
    assert "num_frames=5" in (out / "README.md").read_text()  # the card (and so sample.py) draws the training clips

def test_clips_are_read_from_video_files_gifs_and_folders_of_frames_and_images_are_one_frame(clips, tmp_path):
    from common.image_data import read_frames

    for name in ("0000.mp4", "0001.gif", "0002"):
        frames = read_frames({"path": str(clips / name)}, 5, 2)
        assert len(frames) == 5 and frames[0].size == (32, 32)
        ink = [np.asarray(f.convert("L"), dtype=float) for f in frames]
        drift = [(x.sum(0) @ np.arange(32)) / x.sum() for x in ink]
        assert drift[-1] < drift[0] - 4  # moving left, 2 pixels a taken frame
    Image.new("RGB", (32, 32)).save(tmp_path / "still.png")
    assert len(read_frames({"path": str(tmp_path / "still.png")}, 5)) == 1


def bad_clip(folder, kind):
    """A folder with one clip that cannot train: empty, not a video, too short."""
    from demo.moving_digits import write_moving_digits

    folder.mkdir()
    if kind == "short":
        write_moving_digits(str(folder), count=1, frames=6)
        return folder / "0000.mp4"
    (folder / "bad.mp4").write_bytes(b"" if kind == "empty" else b"not a video at all")
    (folder / "bad.txt").write_text("a clip")
    return folder / "bad.mp4"


@pytest.mark.parametrize("kind, needles", [
    ("empty", ["the file is empty"]), ("garbage", ["cannot read video"]),
    ("short", ["has 6 frames, fewer than --num_frames 5", "give --frame_stride 1"])])
def test_a_clip_that_cannot_train_is_one_line(kind, needles, tmp_path):
    from common.image_data import read_frames

    path = bad_clip(tmp_path / "clips", kind)
    with pytest.raises(UserError) as err:
        read_frames({"path": str(path)}, 5, 2)
    assert all(needle in str(err.value) for needle in needles) and str(path) in str(err.value)


def test_a_bad_clip_stops_train_lora_in_one_line_with_nothing_written(tiny_wan, tmp_path):
    bad_clip(tmp_path / "clips", "empty")
    out = tmp_path / "out"
    proc = launch("train_lora.py", "--train_data_dir", tmp_path / "clips", "--pretrained_model_name_or_path",
                  tiny_wan, "--output_dir", out, *STEPS, check=False)
    assert_one_line_error(proc, "bad.mp4", "the file is empty")
    assert not any(out.glob("checkpoint-*")) and not (out / "pytorch_lora_weights.safetensors").exists()


@pytest.mark.parametrize("flags, needles", [
    (["--num_frames", "6"], ["--num_frames 6", "4k + 1", "give 5 or 9"]),
    (["--frame_stride", "2"], ["--frame_stride", "give --num_frames too"]),
    (["--num_frames", "5", "--resolution", "40"], ["--resolution 40", "16", "32 or 48"]),
    (["--train_text_encoder"], ["--train_text_encoder", "not offered"]),
    (["--guidance_scale", "3"], ["--guidance_scale", "means nothing for a Wan base"]),
    (["--wan_expert", "low"], ["--wan_expert low", "has one transformer", "leave --wan_expert out"]),
])
def test_flags_that_do_not_fit_a_video_base_are_one_line(tiny_wan, clips, flags, needles, tmp_path):
    proc = run_script("train_lora.py", "--train_data_dir", clips, "--pretrained_model_name_or_path", tiny_wan,
                      "--output_dir", tmp_path / "out", *flags)
    assert_one_line_error(proc, *needles)


def test_num_frames_on_an_image_base_is_one_line(tiny_sd, clips, tmp_path):
    proc = run_script("train_lora.py", "--train_data_dir", clips, "--pretrained_model_name_or_path", tiny_sd,
                      "--output_dir", tmp_path / "out", "--num_frames", "5")
    assert_one_line_error(proc, "--num_frames 5", "draws images, not clips")


def test_a_missing_pyav_is_one_line(clips, monkeypatch):
    from common.image_data import read_frames

    monkeypatch.setitem(sys.modules, "av", None)  # import av: ImportError
    with pytest.raises(UserError, match=r"needs PyAV: `pip install av`"):
        read_frames({"path": str(clips / "0000.mp4")}, 5)
    assert len(read_frames({"path": str(clips / "0001.gif")}, 5)) == 5  # GIFs need only Pillow


def test_the_tiny_wan_build_is_small(tiny_wan):
    size = sum(f.stat().st_size for f in tiny_wan.rglob("*") if f.is_file())
    assert size < 2_000_000 and (ROOT / "demo" / "tiny_wan.py").exists()


def test_a_hub_wan_bases_unipc_scheduler_trains_and_draws_at_its_flow_shift(tmp_path):
    """The hub's Wan bases ship UniPCMultistepScheduler in its flow-matching mode (flow_shift 3.0): training takes the
    same shifted sigmas as FlowMatchEulerDiscreteScheduler(shift=3.0), and the Euler sampler keeps the shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from common.diffusion import sampling_scheduler

    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    unipc.save_pretrained(tmp_path / "scheduler")
    wan = family_module("wan")
    training = wan.TrainingScheduler.from_pretrained(str(tmp_path), subfolder="scheduler")
    assert torch.equal(training.sigmas, FlowMatchEulerDiscreteScheduler(shift=3.0).sigmas)
    assert sampling_scheduler(wan.SAMPLER, unipc.config, wan.SAMPLERS).config.shift == 3.0


def test_wan_22_ti2v_trains_as_its_pipeline_calls_it():
    """Wan 2.2 TI2V-5B in its text-to-video mode (demo/tiny_wan.py --variant ti2v): the pipeline gives the transformer
    one timestep per token (expand_timesteps), all equal without a first frame; the family's call with one timestep per
    clip predicts the same. Its VAE cuts 2 x 2 patches first: sides are multiples of 32."""
    from demo.tiny_wan import build_tiny_wan

    wan = family_module("wan")
    pipe = build_tiny_wan(variant="ti2v")
    configs = {"vae": pipe.vae.config, "transformer": pipe.transformer.config}
    assert pipe.config.expand_timesteps and wan.resolution_factor(configs) == 32
    x = torch.randn(2, 48, 2, 2, 2, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([100.0, 700.0])
    with torch.no_grad():
        cond = wan.encode_prompts(pipe.components, wan.tokenize(pipe.components, [PROMPT] * 2, 40))
        ours = wan.denoise(pipe.transformer, x, t, cond)
        tokens = 2 * 1 * 1  # latent frames x (h / 2) x (w / 2)
        theirs = pipe.transformer(hidden_states=x, timestep=t[:, None].expand(2, tokens),
                                  encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]
    assert (ours - theirs).abs().max() < 1e-5


@pytest.mark.parametrize("cached", [True, False], ids=["decoded-once", "decoded-per-item"])
def test_clips_and_images_batch_by_frame_count(clips, tmp_path, cached):
    """Images train beside clips as clips of one frame: the batches hold one length each (frame-count buckets), and
    every item is drawn once an epoch."""
    import datasets

    from common.buckets import batching
    from common.image_data import ImageDataset, collate_batch

    Image.new("RGB", (32, 32), "white").save(tmp_path / "still.png")
    paths = [str(clips / name) for name in ("0000.mp4", "0001.gif", "0002", "0003.mp4")] + [str(tmp_path / "still.png")]
    rows = datasets.Dataset.from_dict({"image": paths}, features=datasets.Features({"image": datasets.Image()}))
    data = ImageDataset(rows, "image", 32, random_flip=True, columns={"index": torch.arange(5)}, frames=(5, 2),
                        cache_limit_gb=4.0 if cached else 0.0)
    assert data.frame_counts() == [5, 5, 5, 5, 1]
    loader = torch.utils.data.DataLoader(data, collate_fn=collate_batch, **batching(None, 2, 0, data))
    shapes = [tuple(batch["pixel_values"].shape[1:3]) for batch in loader]
    assert sorted(shapes) == [(1, 3), (5, 3), (5, 3)]
    assert sorted(i for batch in loader for i in batch["index"].tolist()) == list(range(5))


def test_a_datasets_video_column_trains_as_clips(clips):
    """A dataset with a Video column (a hub dataset's clips, --image_column naming it), its videos as bytes."""
    import datasets

    from common.image_data import ImageDataset

    video = {"bytes": (clips / "0000.mp4").read_bytes(), "path": "clip.mp4"}
    rows = datasets.Dataset.from_dict({"video": [video]}).cast_column("video", datasets.Video(decode=False))
    data = ImageDataset(rows, "video", 32, frames=(5, 2))
    assert data[0]["pixel_values"].shape == (5, 3, 32, 32)


@pytest.mark.parametrize("kind, script, needles", [
    ("a14b", "train_text_to_image.py", ["is Wan 2.2 A14B", "boundary_ratio 0.875", "train_lora.py --wan_expert"]),
    ("i2v", "train_lora.py", ["names the pipeline class 'WanImageToVideoPipeline'", "WanPipeline"])])
def test_wan_bases_not_trained_yet_are_one_line(tiny_wan, clips, kind, script, needles, tmp_path):
    base = tmp_path / kind
    shutil.copytree(tiny_wan, base)
    index = json.loads((base / "model_index.json").read_text())
    if kind == "a14b":  # two experts: transformer above the boundary timestep, transformer_2 below
        shutil.copytree(tiny_wan / "transformer", base / "transformer_2")
        index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)
    else:
        index["_class_name"] = "WanImageToVideoPipeline"
    (base / "model_index.json").write_text(json.dumps(index))
    proc = run_script(script, "--train_data_dir", clips, "--pretrained_model_name_or_path", base,
                      "--output_dir", tmp_path / "out")
    assert_one_line_error(proc, *needles)


def test_the_video_loras_card_draws_its_clip(trained, tmp_path, monkeypatch):
    """The model card's snippet: WanPipeline with the LoRA, the run's clip length, its frames as an animated GIF."""
    import re

    _, _, out = trained
    code = re.search(r"```python\n(.*?)```", (out / "README.md").read_text(), re.S).group(1)
    assert "num_frames=5" in code and ".frames[0]" in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace("num_inference_steps=50", "num_inference_steps=2"), "card", "exec"), {})
    assert Image.open(tmp_path / "sample.gif").n_frames == 5


# Wan 2.2 A14B: a LoRA of one expert (transformer: t >= 875, transformer_2: below) or of both, on the tiny A14B build
EXPERTS = {"high": "transformer", "low": "transformer_2"}
EXPERT_STEPS = [*STEPS[:3], "2", *STEPS[4:], "--validation_prompt", PROMPT, "--validation_steps", "2",
                "--num_validation_images", "1", "--validation_inference_steps", "2"]


# (high alone runs the code of low alone with the other expert's name; both covers its file and default loading)
@pytest.fixture(scope="module", params=["low", "both"])
def expert_run(request, tiny_wan_a14b, clips, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"lora-wan-{request.param}") / "run"
    both = request.param == "both"  # in two processes: a step may leave an expert unused on a process, or on both
    launch("train_lora.py", "--train_data_dir", clips, "--pretrained_model_name_or_path", tiny_wan_a14b,
           "--output_dir", out, "--wan_expert", request.param, *EXPERT_STEPS,
           config="cpu_2proc.yaml" if both else "cpu.yaml")
    return request.param, tiny_wan_a14b, out


def load_expert_loras(pipe, out, expert, weights="pytorch_lora_weights.safetensors"):
    """As diffusers documents Wan 2.2's LoRAs: the high expert's by default, the low one's load_into_transformer_2."""
    if expert in ("high", "both"):
        pipe.load_lora_weights(out, weight_name=weights)
    if expert in ("low", "both"):
        pipe.load_lora_weights(out / "low" if expert == "both" else out, weight_name=weights,
                               load_into_transformer_2=True)


def test_an_a14b_experts_lora_loads_into_that_expert_with_wanpipelines_loader_and_samples_there(expert_run, tmp_path):
    """Each expert's LoRA, read back as diffusers documents it (high: load_lora_weights, low: with
    load_into_transformer_2=True; both: the two, the low one's from low/), and the UI files, give the trained experts
    within 1e-5 and leave an untrained expert alone; sample.py draws WanPipeline's frames with them (within 1 level)."""
    from diffusers import WanPipeline
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    from common.lora_adapters import expand_targets

    expert, base, out = expert_run
    names = list(EXPERTS.values()) if expert == "both" else [EXPERTS[expert]]
    assert json.loads((out / "lora_info.json").read_text())["wan_expert"] == expert
    step = read_results(out)["global_step"]
    assert read_results(out)["num_processes"] == (2 if expert == "both" else 1)
    checkpoint = out / f"checkpoint-{step}" / ("transformer" if expert == "both" else names[0])
    assert [p.name for p in checkpoint.parent.iterdir() if p.name.startswith("transformer")] == [checkpoint.name]
    adapter = load_file(checkpoint / "adapter_model.safetensors")  # (both: one denoiser, its experts' prefixes)
    reference, base_pipe = WanPipeline.from_pretrained(base), WanPipeline.from_pretrained(base)
    expected = {}
    for name in EXPERTS.values():
        model = getattr(reference, name)
        if name in names:
            model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=expand_targets(
                model, family_module("wan").LORA_TARGETS.split(","))))
            state = {k.removeprefix(name + "."): v for k, v in adapter.items() if k.startswith(name + ".")}
            set_peft_model_state_dict(model, state if expert == "both" else adapter)
        expected[name] = transformer_output(reference, name)
        if name in names:  # it learned
            assert (transformer_output(base_pipe, name) - expected[name]).abs().max() > 1e-4, name
    for weights in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ui.safetensors"):
        pipe = WanPipeline.from_pretrained(base)
        load_expert_loras(pipe, out, expert, weights)
        for name in EXPERTS.values():
            assert (transformer_output(pipe, name) - expected[name]).abs().max() < 1e-5, (weights, name)
    pipe = WanPipeline.from_pretrained(base)
    load_expert_loras(pipe, out, expert)
    # seed 0, Euler at shift 3, two steps: t = 1000 (the high expert), 750 (the low one)
    frames = pipe(prompt=PROMPT, num_frames=5, height=32, width=32, num_inference_steps=2, guidance_scale=5.0,
                  max_sequence_length=40, output_type="np", generator=torch.Generator().manual_seed(0)).frames[0]
    assert Image.open(out / "samples" / f"step-{step}" / "0-0.gif").n_frames == 5  # the validation clip
    run_in_process("sample.py", "--model", out, "--prompt", PROMPT, "--num_images", "1", "--num_inference_steps", "2",
                   "--output_dir", tmp_path / "samples")
    grid = np.asarray(Image.open(tmp_path / "samples" / "grid.png").convert("RGB")).astype(int)
    assert np.abs(grid - np.concatenate(list((frames * 255).round().astype(int)), axis=1)).max() <= 1
    card = (out / "README.md").read_text()
    assert ("load_into_transformer_2=True" in card) == (expert != "high")
    if expert == "both":  # inspect_pipeline.py: both LoRAs, and the expert of each step
        sys.path.insert(0, str(ROOT))
        import inspect_pipeline

        flags = ["--trace", "--json", "--height", "32", "--width", "32", "--num_inference_steps", "2",
                 "--guidance_scale", "1", "--num_frames", "1"]
        report = inspect_pipeline.main(inspect_pipeline.parse_args([str(out), *flags]))
        steps = [(s["t"], s["expert"]) for s in report["trace"]["stages"] if s["stage"] == "denoise"]
        assert [expert for _, expert in steps] == ["transformer", "transformer_2"] and steps[1][0] < 875


def test_an_a14b_expert_trains_on_its_side_of_the_boundary_only(tiny_wan_a14b):
    """Training timesteps: t >= 875 (boundary_ratio 0.875 x 1000) for the high expert, below for the low one; the
    held-out loss's fixed points too; the two sides cover the schedule."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from common.families import load_family
    from common.objectives import FlowMatching

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_wan_a14b, subfolder="scheduler")
    sides = {}
    for expert in ("high", "low"):
        family = load_family(str(tiny_wan_a14b), "--pretrained_model_name_or_path", expert=expert)
        assert family.DENOISER == EXPERTS[expert] and family.PIPELINE_EXTRAS == {"boundary_ratio": 0.875}
        objective = FlowMatching(scheduler, "logit_normal", timestep_range=family.TIMESTEP_RANGE)
        torch.manual_seed(0)
        drawn = torch.cat([objective(torch.zeros(64, 16, 2, 4, 4)).timesteps for _ in range(4)])
        fixed = objective.timesteps[objective.fixed_timesteps([0.0, 0.5, 0.999])]
        sides[expert] = objective.count
        for t in (drawn, fixed):
            assert bool((t >= 875).all()) if expert == "high" else bool((t < 875).all())
    assert sides["high"] + sides["low"] == 1000 and 0 < sides["high"] < 1000


@pytest.mark.parametrize("family, flags, message", [
    ("wan", {}, None),  # no --wan_expert on A14B: high
    ("wan", {"wan_expert": "both", "blocks_to_swap": 1}, "--blocks_to_swap runs on one transformer"),
    ("wan", {"wan_expert": "both", "quantize_base": "fp8"}, "--quantize_base runs on one transformer"),
    ("sd", {"wan_expert": "low"}, "--wan_expert low: a Stable Diffusion .* base has no experts")])
def test_wan_expert_defaults_to_high_and_what_it_cannot_take_is_one_line(tiny_wan_a14b, family, flags, message):
    import argparse

    from common.video import check_video_args

    args = argparse.Namespace(pretrained_model_name_or_path=str(tiny_wan_a14b), num_frames=None, frame_stride=1,
                              **{"wan_expert": None, "blocks_to_swap": None, "quantize_base": None, **flags})
    if message:
        with pytest.raises(UserError, match=message):
            check_video_args(args, family_module(family), None)
    else:
        check_video_args(args, family_module(family), None)
        assert args.wan_expert == "high"
