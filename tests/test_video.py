"""Wan end to end on clips, on the tiny random-init Wan 2.1 text-to-video base (`make tiny-wan`) and clips of moving
digits written as mp4, animated GIF and folders of frames (demo/moving_digits.py): train_lora.py with --num_frames and
--frame_stride, its files read back by WanPipeline.load_lora_weights (the UI file under ComfyUI's native Wan names
too), an exact resume, the validation clip, sample.py's clips against WanPipeline's frames, and the one-line errors of
clips that do not fit; Wan 2.2 A14B's experts (--wan_expert high, low, both) on its tiny two-expert build. (Wan on
images, one frame each, is one family of tests/test_lora_flow.py.)"""
import json
import re
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
                                                                "1"]))
    json.dumps(report)  # (the run's clips, size and T5 length, as sample.py draws it: 5 frames, 32 px, 40 tokens)
    assert report["vae"]["latent_shape"] == [1, 16, 2, 4, 4] and report["vae"]["packed_latent_shape"] == [1, 8, 64]
    assert report["trace"]["initial_noise"] == [1, 16, 2, 4, 4]
    assert [s["input_ids"] for s in report["trace"]["stages"] if s["stage"] == "text_encoder"] == [[1, 40]] * 2


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
    (["--validation_prompt", PROMPT], ["--validation_prompt draws at the pipeline's default size, 480 x 832 px",
                                       "rope_max_seq_len 32", "give --buckets auto"]),
])
def test_flags_that_do_not_fit_a_video_base_are_one_line(tiny_wan, clips, flags, needles, tmp_path):
    proc = run_script("train_lora.py", "--train_data_dir", clips, "--pretrained_model_name_or_path", tiny_wan,
                      "--output_dir", tmp_path / "out", *flags)
    assert_one_line_error(proc, *needles)


def test_a_size_the_tiny_bases_transformer_cannot_place_is_one_line_and_its_card_gives_its_size(tiny_wan, tmp_path):
    """WanPipeline's default 480 x 832 is 30 x 52 patches; the tiny base's rotary table places 32 an axis. sample.py
    draws it at its card's size by default, and says what it takes when asked for more."""
    flags = ["--model", tiny_wan, "--prompt", PROMPT, "--num_images", "1", "--num_inference_steps", "1",
             "--num_frames", "1", "--output_dir", tmp_path / "samples"]
    with pytest.raises(UserError, match=r"--height/--width 480 x 832 px: .* at most 32 patches .* at most 512"):
        run_in_process("sample.py", *flags, "--height", "480", "--width", "832")
    run_in_process("sample.py", *flags)
    assert Image.open(tmp_path / "samples" / "0000.png").size == (32, 32)  # (the card: 32 x 32)


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


@pytest.mark.parametrize("variant", ["ti2v", "ti2v-i2v"])
def test_wan_22_ti2v_trains_as_its_pipeline_calls_it(variant):
    """Wan 2.2 TI2V-5B (demo/tiny_wan.py --variant ti2v): the pipeline gives the transformer one timestep per token
    (expand_timesteps). Text-to-video: all equal, the same prediction as one timestep per clip. Image-to-video
    (WanImageToVideoPipeline, --variant ti2v-i2v): the first latent frame is the clean first frame's, its tokens at
    timestep 0, as the pipeline's first_frame_mask makes them; the loss leaves that frame out. Its VAE cuts 2 x 2
    patches first: sides are multiples of 32."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from common.objectives import FlowMatching
    from demo.tiny_wan import build_tiny_wan

    wan = family_module("wan")
    pipe = build_tiny_wan(variant=variant)
    configs = {"vae": pipe.vae.config, "transformer": pipe.transformer.config}
    assert pipe.config.expand_timesteps and wan.resolution_factor(configs) == 32
    i2v = variant == "ti2v-i2v"
    family = wan.first_frame_view(wan) if i2v else wan
    generator = torch.Generator().manual_seed(0)
    x, noise = (torch.randn(2, 48, 3, 4, 4, generator=generator) for _ in range(2))  # 3 latent frames of 2 x 2 tokens
    objective = family.training_objective(FlowMatching(FlowMatchEulerDiscreteScheduler(shift=3.0))) if i2v else \
        FlowMatching(FlowMatchEulerDiscreteScheduler(shift=3.0))
    noised = objective.at(x, noise, torch.tensor([100, 700]))
    plain = FlowMatching(FlowMatchEulerDiscreteScheduler(shift=3.0)).at(x, noise, torch.tensor([100, 700]))
    t = noised.timesteps
    with torch.no_grad():
        cond = wan.encode_prompts(pipe.components, wan.tokenize(pipe.components, [PROMPT] * 2, 40))
        ours = family.denoise(pipe.transformer, noised.noisy, t, cond)
        mask = torch.ones(1, 1, 3, 4, 4)  # WanImageToVideoPipeline's first_frame_mask (text-to-video: none)
        if i2v:
            mask[:, :, 0] = 0
        given = (1 - mask) * x[:, :, :1] + mask * plain.noisy  # (the pipeline's condition: the first frame's latents)
        timestep = torch.stack([(mask[0][0][:, ::2, ::2] * step).flatten() for step in t])
        theirs = pipe.transformer(hidden_states=given, timestep=timestep, encoder_hidden_states=cond["prompt_embeds"],
                                  return_dict=False)[0]
    assert torch.equal(noised.noisy, given) and (ours - theirs).abs().max() < 1e-5
    losses = objective.losses(ours, noised)
    kept = slice(1, None) if i2v else slice(None)
    expected = ((ours - noised.target)[:, :, kept] ** 2).mean(dim=(1, 2, 3, 4))
    assert torch.allclose(losses, expected)
    if i2v:  # the first frame's prediction is no part of the loss; a one-frame clip (an image) trains as text-to-image
        assert torch.equal(objective.losses(torch.cat([ours[:, :, :1] + 1, ours[:, :, 1:]], 2), noised), losses)
        one = objective.at(x[:, :, :1], noise[:, :, :1], torch.tensor([100, 700]))
        assert torch.equal(one.noisy, plain.noisy[:, :, :1])


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
    ("i2v", "train_lora.py", ["WanImageToVideoPipeline base whose transformer takes in_channels 16, not the 36",
                              "give a Wan 2.2 I2V A14B or Wan 2.1 I2V base"])])
def test_wan_bases_not_trained_yet_are_one_line(tiny_wan, clips, kind, script, needles, tmp_path):
    base = tmp_path / kind
    shutil.copytree(tiny_wan, base)
    index = json.loads((base / "model_index.json").read_text())
    if kind == "a14b":  # two experts: transformer above the boundary timestep, transformer_2 below
        shutil.copytree(tiny_wan / "transformer", base / "transformer_2")
        index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)
    else:  # a text-to-video transformer (16 channels in) under the image-to-video pipeline
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


@pytest.fixture(scope="module", params=["high", "low", "both"])
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
    from common.lora_files import lora_file_metadata

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
    theirs = np.concatenate(list((frames * 255).round().astype(int)), axis=1)
    grid = np.asarray(Image.open(tmp_path / "samples" / "grid.png").convert("RGB")).astype(int)
    assert np.abs(grid - theirs).max() <= 1
    if expert != "both":  # the .safetensors file, with its lora_info.json beside it or alone (its metadata names it)
        def drawn(load, steps=3):  # (3 steps: t = 1000, 750, 9; at 2, the low expert's 9 hardly shows)
            pipe = WanPipeline.from_pretrained(base)
            load(pipe)
            frames = pipe(prompt=PROMPT, num_frames=5, height=32, width=32, num_inference_steps=steps,
                          guidance_scale=5.0, max_sequence_length=40, output_type="np",
                          generator=torch.Generator().manual_seed(0)).frames[0]
            return np.concatenate(list((frames * 255).round().astype(int)), axis=1)

        right = drawn(lambda pipe: load_expert_loras(pipe, out, expert))
        wrong = drawn(lambda pipe: pipe.load_lora_weights(out, load_into_transformer_2=expert == "high"))
        assert np.abs(right - wrong).max() > 4  # (the expert it loads into shows)
        lora = tmp_path / "bare.safetensors"  # (a copy alone: no lora_info.json beside it)
        shutil.copy(out / "pytorch_lora_weights.safetensors", lora)
        for path in (out / "pytorch_lora_weights.safetensors", lora):
            assert family_module("wan").lora_expert(str(path), lora_file_metadata(str(path))) == expert
        assert family_module("wan").lora_expert(str(lora), {}) is None  # (says nothing: diffusers' default, high)
        run_in_process("sample.py", "--model", base, "--lora", lora, "--prompt", PROMPT, "--num_images", "1",
                       "--num_inference_steps", "3", "--num_frames", "5", "--height", "32", "--width", "32",
                       "--max_sequence_length", "40", "--output_dir", tmp_path / "bare")
        grid = np.asarray(Image.open(tmp_path / "bare" / "grid.png").convert("RGB")).astype(int)
        assert np.abs(grid - right).max() <= 1
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


@pytest.mark.parametrize("expert", ["high", "low"])
def test_an_a14b_experts_run_loads_the_other_expert_only_to_draw_validation_clips(tiny_wan_a14b, expert):
    """The frozen expert is only the pipeline's, for validation clips: a run without --validation_prompt leaves it
    unloaded (on A14B about 28 GB of host memory), one with it loads it."""
    import argparse

    from common.base_models import load_parts, unused_parts
    from common.families import load_family

    family = load_family(str(tiny_wan_a14b), "--pretrained_model_name_or_path", expert=expert)
    other = "transformer_2" if expert == "high" else "transformer"
    for prompts in (None, [PROMPT]):
        args = argparse.Namespace(drop_t5=False, validation_prompt=prompts)
        parts = load_parts(family, str(tiny_wan_a14b), dtype=torch.float32, skip=unused_parts(family, args))
        assert parts[EXPERTS[expert]] is not None and (parts[other] is None) == (prompts is None), (expert, prompts)


# Image-to-video (WanImageToVideoPipeline): each clip's own first frame is the condition. Wan 2.2 TI2V-5B: its clean
# latents in the first latent frame's place; Wan 2.2 I2V A14B: its latents and a mask beside the noise (its low
# expert); Wan 2.1 I2V: the same, and its CLIP image embeddings
I2V = {"ti2v-i2v": [], "i2v-a14b": ["--wan_expert", "low"], "i2v": []}


@pytest.fixture(scope="module")
def i2v_bases(tmp_path_factory):
    from demo.tiny_wan import write_tiny_wan

    bases = {variant: tmp_path_factory.mktemp("models") / f"tiny-wan-{variant}" for variant in I2V}
    for variant, path in bases.items():
        write_tiny_wan(str(path), variant=variant)
    return bases


@pytest.fixture(scope="module", params=list(I2V))
def i2v_run(request, i2v_bases, clips, tmp_path_factory):
    variant, base = request.param, i2v_bases[request.param]
    out = tmp_path_factory.mktemp(f"lora-wan-{variant}") / "run"
    launch("train_lora.py", "--train_data_dir", clips, "--pretrained_model_name_or_path", base, "--output_dir", out,
           *i2v_steps(variant), *SPLIT, *VALIDATION, *I2V[variant], config=i2v_config(variant))
    return variant, base, clips, out


def i2v_steps(variant):  # (Wan 2.1 I2V's condition and CLIP embeddings cached; A14B's encoded from the pixels)
    return [flag for flag in STEPS if flag != "--cache_latents" or variant != "i2v-a14b"]


def i2v_config(variant):  # (TI2V-5B's and Wan 2.1 I2V's in two processes, I2V A14B's in one)
    return "cpu.yaml" if variant == "i2v-a14b" else "cpu_2proc.yaml"


@pytest.mark.parametrize("variant", ["i2v-a14b", "i2v"])
def test_the_i2v_condition_is_its_pipelines(i2v_bases, variant):
    """The condition train_lora.py gives Wan 2.2 I2V A14B's experts (and Wan 2.1 I2V's transformer) beside each clip's
    noise is WanImageToVideoPipeline.prepare_latents' from the clip's first frame: a 4-channel mask of the first
    latent frame, then the normalized latents of that frame followed by black ones; Wan 2.1 I2V's CLIP image
    embeddings are its encode_image's of that frame as a picture."""
    from diffusers import WanImageToVideoPipeline

    from common.families import load_family
    from common.vae import encode_params

    family = load_family(str(i2v_bases[variant]), "--pretrained_model_name_or_path",
                         expert="low" if variant == "i2v-a14b" else None)
    pipe = WanImageToVideoPipeline.from_pretrained(i2v_bases[variant])
    clip = torch.randint(0, 256, (2, 5, 3, 32, 32), generator=torch.Generator().manual_seed(0)) / 127.5 - 1
    ours = family.image_condition(lambda pixels: encode_params(pipe.vae, pixels), clip, family.latent_config(pipe.vae))
    with torch.no_grad():
        theirs = torch.cat([pipe.prepare_latents(clip[b:b + 1, 0], 1, 16, 32, 32, 5, torch.float32, "cpu",
                                                 torch.Generator().manual_seed(0))[1] for b in range(2)])
    assert ours["image_condition"].shape == theirs.shape == (2, 20, 2, 4, 4)
    assert (ours["image_condition"] - theirs).abs().max() < 1e-5
    assert ("image_embeds" in ours) == (variant == "i2v")
    if variant == "i2v-a14b":  # --wan_expert both: each sample through its timestep's expert, 36 channels in, 16 out
        x = torch.cat([torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1)),
                       ours["image_condition"]], dim=1)
        t, text = torch.tensor([950.0, 100.0]), torch.zeros(2, 40, 32)
        with torch.no_grad():
            both = family_module("wan").experts_model(pipe.transformer, pipe.transformer_2, 900)(x, t, text)[0]
            alone = [expert(hidden_states=x[b:b + 1], timestep=t[b:b + 1], encoder_hidden_states=text[b:b + 1],
                            return_dict=False)[0] for b, expert in enumerate((pipe.transformer, pipe.transformer_2))]
        assert both.shape == (2, 16, 2, 4, 4) and (both - torch.cat(alone)).abs().max() < 1e-5
    if variant == "i2v":  # the first frame as the 8-bit picture the pipeline is given
        frames = [Image.fromarray(((clip[b, 0] + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()) for b in (0, 1)]
        with torch.no_grad():
            embeds = pipe.encode_image(frames, "cpu")
        assert (ours["image_embeds"] - embeds).abs().max() < 1e-5


def test_an_image_to_video_lora_loads_back_and_sample_py_draws_wanimagetovideopipelines_frames(i2v_run, tmp_path,
                                                                                              monkeypatch):
    """An image-to-video LoRA (TI2V-5B's; I2V A14B's low expert: its held-out loss, validation clips from the first
    held-out clip's first frame, written beside it for the card) loads back in WanImageToVideoPipeline within 1e-5,
    the UI file too; sample.py --image draws the pipeline's frames from that first frame within 1 level; the card's
    snippet draws its clip."""
    from diffusers import WanImageToVideoPipeline
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    from common.families import load_family
    from common.lora_adapters import expand_targets

    variant, base, clips, out = i2v_run
    a14b = variant == "i2v-a14b"
    family = load_family(str(base), "--pretrained_model_name_or_path", expert="low" if a14b else None)
    name, low = ("transformer_2", {"load_into_transformer_2": True}) if a14b else ("transformer", {})
    results = read_results(out)
    assert results["global_step"] == 4 and set(results["validation_losses"]) == {"0", "4"}
    assert results["num_processes"] == (1 if a14b else 2)
    assert json.loads((out / "lora_info.json").read_text())["num_frames"] == 5

    def output(pipe):  # the expert on a fixed clip of 2 latent frames, given its first frame as the family gives it
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(2, *((48, 2, 2, 2) if variant == "ti2v-i2v" else (16, 2, 4, 4)), generator=generator)
        with torch.no_grad():
            cond = family.encode_prompts(pipe.components, family.tokenize(pipe.components, [PROMPT] * 2, 40))
            if variant != "ti2v-i2v":  # (the mask and condition latents; Wan 2.1: CLIP's 32 x 32 + 1 embeddings)
                cond["image_condition"] = torch.randn(2, 20, 2, 4, 4, generator=generator)
            if variant == "i2v":
                cond["image_embeds"] = torch.randn(2, 1025, 4, generator=generator)
            return family.denoise(getattr(pipe, name), x, torch.tensor([100.0, 700.0]), cond)

    reference = WanImageToVideoPipeline.from_pretrained(base)
    model = getattr(reference, name)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=expand_targets(
        model, family.LORA_TARGETS.split(","))))
    set_peft_model_state_dict(model, load_file(out / "checkpoint-4" / name / "adapter_model.safetensors"))
    expected = output(reference)
    assert (output(WanImageToVideoPipeline.from_pretrained(base)) - expected).abs().max() > 1e-4  # it learned
    for weights in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ui.safetensors"):
        pipe = WanImageToVideoPipeline.from_pretrained(base)
        pipe.load_lora_weights(out, weight_name=weights, **low)
        assert (output(pipe) - expected).abs().max() < 1e-5, weights
    assert Image.open(out / "samples" / "step-4" / "0-0.gif").n_frames == 5  # the validation clip
    first = out / "first_frame.png"  # (its first frame: the held-out clip's)
    assert Image.open(first).size == (32, 32)
    run_in_process("sample.py", "--model", out, "--prompt", PROMPT, "--image", first, "--num_images", "1",
                   "--num_inference_steps", "3", "--output_dir", tmp_path / "samples")
    grid = np.asarray(Image.open(tmp_path / "samples" / "grid.png").convert("RGB")).astype(int)
    family_module("wan").i2v_without_ftfy()  # (diffusers 0.42's WanImageToVideoPipeline needs ftfy otherwise)
    frames = pipe(image=Image.open(first), prompt=PROMPT, num_frames=5, height=32, width=32, num_inference_steps=3,
                  guidance_scale=5.0, max_sequence_length=40, output_type="np",
                  generator=torch.Generator().manual_seed(0)).frames[0]  # (A14B: t = 1000 high, 750 and 9 low)
    assert np.abs(grid - np.concatenate(list((frames * 255).round().astype(int)), axis=1)).max() <= 1
    code = re.search(r"```python\n(.*?)```", (out / "README.md").read_text(), re.S).group(1)
    assert "WanImageToVideoPipeline" in code and "image=reference" in code and str(first) in code
    assert ("load_into_transformer_2=True" in code) == a14b
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace("num_inference_steps=50", "num_inference_steps=2"), "card", "exec"), {})
    assert Image.open(tmp_path / "sample.gif").n_frames == 5


def test_an_i2v_a14b_expert_trains_in_two_processes_without_loading_the_other_expert(i2v_bases, clips, tmp_path):
    """Wan 2.2 I2V A14B's low expert, its condition from the batch's pixels, in two processes, without validation clips
    (the high expert left unloaded: unused_parts); the LoRA loads into WanImageToVideoPipeline's transformer_2."""
    from diffusers import WanImageToVideoPipeline

    out = tmp_path / "run"
    launch("train_lora.py", "--train_data_dir", clips, "--pretrained_model_name_or_path", i2v_bases["i2v-a14b"],
           "--output_dir", out, *i2v_steps("i2v-a14b"), "--max_train_steps", "2", "--wan_expert", "low",
           config="cpu_2proc.yaml")
    results = read_results(out)
    assert results["global_step"] == 2 and results["num_processes"] == 2
    pipe = WanImageToVideoPipeline.from_pretrained(i2v_bases["i2v-a14b"])
    pipe.load_lora_weights(out, load_into_transformer_2=True)
    assert pipe.get_list_adapters() == {"transformer_2": ["default_0"]}


def test_an_image_to_video_run_resumes_exactly(i2v_run, tmp_path):
    """Each image-to-video run resumed from checkpoint-2 ends where the straight run ends: I2V A14B's condition encoded
    from the batch's pixels (the held-out clips' once), in one process; Wan 2.1 I2V's condition and CLIP embeddings
    in the latent cache, and TI2V-5B's first frame from it, in two processes."""
    variant, base, clips, out = i2v_run
    resumed = tmp_path / "run"
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    launch("train_lora.py", "--train_data_dir", clips, "--pretrained_model_name_or_path", base, "--output_dir", resumed,
           *i2v_steps(variant), *SPLIT, *I2V[variant], "--resume_from_checkpoint", "latest", config=i2v_config(variant))
    name = "transformer_2" if variant == "i2v-a14b" else "transformer"
    straight, again = (load_file(run / "checkpoint-4" / name / "adapter_model.safetensors") for run in (out, resumed))
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)


@pytest.mark.parametrize("variant", ["i2v", "ti2v-i2v"])
def test_inspect_pipeline_traces_an_image_to_video_call_from_its_first_frame(i2v_bases, variant, tmp_path):
    """inspect_pipeline.py --trace --image: the call draws from the first frame, and the trace shows its condition
    (Wan 2.1 I2V: the mask and the frame's latents, 20 channels beside the noise, and CLIP's image embeddings;
    TI2V-5B: the frame's latents, one latent frame, and the mask of the latents they replace)."""
    import inspect_pipeline

    first = tmp_path / "first.png"
    Image.new("RGB", (32, 32), (200, 30, 30)).save(first)
    report = inspect_pipeline.main(inspect_pipeline.parse_args([
        str(i2v_bases[variant]), "--trace", "--image", str(first), "--json", "--num_inference_steps", "1",
        "--num_frames", "5", "--height", "32", "--width", "32"]))
    stages = {stage["stage"]: stage for stage in report["trace"]["stages"]}
    prepare = stages["prepare_latents"]
    if variant == "i2v":
        assert prepare["latents"] == [1, 16, 2, 4, 4] and prepare["condition"] == [1, 20, 2, 4, 4]
        assert stages["encode_image"]["image_embeds"][0] == 1
    else:
        assert prepare["latents"] == [1, 48, 2, 2, 2] and prepare["latent_condition"] == [1, 48, 1, 2, 2]
        assert prepare["first_frame_mask"] == [1, 1, 2, 2, 2] and "encode_image" not in stages


@pytest.mark.parametrize("variant, script, flags, needles", [
    ("ti2v-i2v", "train_text_to_image.py", [], ["is Wan 2.2 TI2V-5B's image-to-video", "which train_lora.py trains"]),
    ("i2v-a14b", "sample.py", [], ["is an image-to-video base (WanImageToVideoPipeline): it draws from a first frame",
                                   "give --image FIRST_FRAME.png"]),
    ("t2v", "sample.py", ["--image"], ["--image:", "is a Wan text-to-video base", "leave --image out"]),
    ("ti2v-i2v", "inspect_pipeline.py", ["--trace"], ["--trace: WanImageToVideoPipeline draws from a first frame",
                                                      "give --image FIRST_FRAME.png"])])
def test_an_image_to_video_base_without_a_first_frame_is_one_line(i2v_bases, tiny_wan, clips, variant, script, flags,
                                                                   needles, tmp_path):
    base = i2v_bases.get(variant, tiny_wan)
    if script == "inspect_pipeline.py":
        with pytest.raises(UserError, match=re.escape(needles[0])):
            run_in_process(script, base, *flags, "--num_inference_steps", "1")
        return
    if script == "sample.py":  # an image-to-video base without a first frame; a first frame for a text-to-video one
        first = tmp_path / "first.png"
        Image.new("RGB", (32, 32)).save(first)
        with pytest.raises(UserError) as err:
            run_in_process("sample.py", "--model", base, "--prompt", PROMPT, *(["--image", first] if flags else []),
                           "--output_dir", tmp_path / "samples")
        assert all(needle in str(err.value) for needle in needles), err.value
        return
    proc = run_script(script, "--train_data_dir", clips, "--pretrained_model_name_or_path", base, "--output_dir",
                      tmp_path / "out", *FRAMES, "--resolution", "32", *flags)
    assert_one_line_error(proc, *needles)
