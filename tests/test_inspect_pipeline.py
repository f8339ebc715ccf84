"""inspect_pipeline.py on the tiny SD base, a LoRA, and train_ddpm.py-style DDPM folders (built here, not trained)."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, assert_one_line_error, offline_env, run_in_process, run_script
from PIL import Image
from safetensors.torch import load_file

from common.pipeline_report import print_trace

STEPS = 3


def save_lora(pipe, folder, base, metadata=True):
    """A LoRA in train_lora.py's layout: diffusers-format weights (with the adapter config as metadata, which carries
    alpha) and lora_info.json naming the base."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                     init_lora_weights="gaussian"))
    StableDiffusionPipeline.save_lora_weights(
        folder, unet_lora_layers=get_peft_model_state_dict(pipe.unet),
        unet_lora_adapter_metadata=pipe.unet.peft_config["default"].to_dict() if metadata else None)
    (folder / "lora_info.json").write_text(json.dumps({"base_model": str(base), "rank": 4, "lora_alpha": 8}))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    from demo.tiny_sd import build_tiny_sd, write_tiny_sd

    root = tmp_path_factory.mktemp("inspect")
    paths = {"sd": root / "tiny-sd"}
    write_tiny_sd(str(paths["sd"]))
    paths["lora"] = save_lora(build_tiny_sd(), root / "lora", paths["sd"])
    paths["lora_no_alpha"] = save_lora(build_tiny_sd(), root / "lora_no_alpha", paths["sd"], metadata=False)
    paths["other_lora"] = save_lora(build_tiny_sd(unet_channels=(16, 32)), root / "other_lora", root / "other")
    for name, classes in (("ddpm", ["cat", "dog"]), ("ddpm_uncond", None)):
        unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                           block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                           up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
                           num_class_embeds=len(classes) + 1 if classes else None)
        DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=100)).save_pretrained(root / name)
        if classes:
            (root / name / "labels.json").write_text(json.dumps(classes))
    checkpoint = paths["ddpm_checkpoint"] = root / "ddpm_run" / "checkpoint-4"  # unet/, labels.json, no model_index
    checkpoint.mkdir(parents=True)
    for part in ("unet", "scheduler", "labels.json"):
        src = root / "ddpm" / part
        subprocess.run(["cp", "-r", str(src), str(checkpoint / part)], check=True)
    paths.update(ddpm=root / "ddpm", ddpm_uncond=root / "ddpm_uncond")
    return paths


@pytest.fixture(scope="module")
def ip():
    torch.set_num_threads(1)
    import inspect_pipeline

    return inspect_pipeline


def loaded(ip, *argv):
    args = ip.parse_args([str(a) for a in argv])
    pipe, labels, _ = ip.load_pipeline(args, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return args, pipe, labels


def test_help_answers_without_importing_torch():
    code = ("import sys, inspect_pipeline\ntry:\n    inspect_pipeline.parse_args(['--help'])\nexcept SystemExit:\n"
            "    pass\nassert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=offline_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "--save_trajectory" in proc.stdout and "--trace" in proc.stdout


def test_tables_count_what_the_modules_hold(ip, models, capsys):
    from diffusers import StableDiffusionPipeline

    report = ip.main(ip.parse_args([str(models["sd"])]))
    out = capsys.readouterr().out
    pipe = StableDiffusionPipeline.from_pretrained(models["sd"])
    rows = {row["name"]: row for row in report["components"]}
    for name in ("unet", "vae", "text_encoder"):
        module = getattr(pipe, name)
        n = sum(p.numel() for p in module.parameters())
        # no "trainable" column: a loaded pipeline's parameters all require grad, which says nothing about training
        assert rows[name]["parameters"] == n and "trainable" not in rows[name]
        assert rows[name]["size_mb"] == pytest.approx(sum(p.numel() * 4 for p in module.parameters()) / 1e6, abs=0.01)
        assert f"{n:,}" in out
    assert rows["tokenizer"]["class"] == "CLIPTokenizer" and rows["safety_checker"]["class"] is None
    assert report["scheduler"]["class"] == "DDPMScheduler" and report["scheduler"]["beta_schedule"] == "scaled_linear"
    assert report["denoiser"]["cross_attention_dim"] == pipe.text_encoder.config.hidden_size
    assert report["tokenizers"]["tokenizer"]["model_max_length"] == pipe.tokenizer.model_max_length
    assert report["vae"]["downsampling_factor"] == 4 and report["vae"]["latent_shape"] == [1, 4, 8, 8]
    assert "scheduler: DDPMScheduler" in out and "vae: AutoencoderKL" in out


@pytest.mark.parametrize("guidance,batch", [(7.5, 2), (1.0, 1)])
def test_trace_follows_the_real_call(ip, models, guidance, batch, capsys):
    args, pipe, labels = loaded(ip, models["sd"], "--trace", "--num_inference_steps", STEPS, "--guidance_scale",
                                guidance, "--num_images", batch)
    report, images, _ = ip.trace(pipe, args, labels, torch.device("cpu"))
    length, hidden = pipe.tokenizer.model_max_length, pipe.text_encoder.config.hidden_size
    cfg = 2 if guidance > 1 else 1
    order = [s["stage"] for s in report["stages"]]
    assert order == ["text_encoder"] * cfg + ["scheduler.set_timesteps", "prepare_latents"] + ["denoise"] * STEPS + [
        "vae.decode", "image_processor.postprocess"]
    assert all(s["input_ids"] == [1, length] and s["last_hidden_state"] == [1, length, hidden]
               for s in report["stages"][:cfg])
    steps = [s for s in report["stages"] if s["stage"] == "denoise"]
    assert [s["t"] for s in steps] == report["stages"][cfg]["timesteps"] == pipe.scheduler.timesteps.tolist()
    latents = [batch, 4, 8, 8]
    assert report["initial_noise"] == report["stages"][cfg + 1]["latents"] == latents
    embeds = [cfg * batch, length, hidden]  # [2B, 77, hidden] under guidance, [B, 77, hidden] without
    for s in steps:
        assert s["unet_in"] == {"sample": [cfg * batch, 4, 8, 8], "encoder_hidden_states": embeds}
        assert s["unet_out"] == [cfg * batch, 4, 8, 8] and s["scheduler_in"] == s["latents"] == latents
        assert ("guidance" in s) == (cfg == 2) and s["callback_on_step_end"]["prompt_embeds"] == embeds
    assert report["guided"] == (cfg == 2)
    assert report["stages"][-2]["image"] == [batch, 3, 32, 32]
    # The hooks are gone and changed nothing: the same call without them gives the same pixels.
    assert not pipe.unet._forward_hooks and "step" not in vars(pipe.scheduler) and "decode" not in vars(pipe.vae)
    direct = pipe(args.prompt, num_inference_steps=STEPS, guidance_scale=guidance, num_images_per_prompt=batch,
                  generator=torch.Generator().manual_seed(args.seed)).images
    assert [i.tobytes() for i in images] == [i.tobytes() for i in direct]
    print_trace(report)
    assert f"step {STEPS - 1} t=" in capsys.readouterr().out


def test_trajectory_from_alphas_when_the_scheduler_gives_no_x0(ip, models):
    from diffusers import DPMSolverMultistepScheduler

    args, pipe, labels = loaded(ip, models["sd"], "--num_inference_steps", 4, "--save_trajectory", "x.png",
                                "--trajectory_steps", 3)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    report, _, panels = ip.trace(pipe, args, labels, torch.device("cpu"))
    assert [p["step"] for p in report["trajectory"]] == [0, 2, 3]  # first, middle, last step
    assert {p["source"] for p in report["trajectory"]} == {"alphas_cumprod"}
    assert len(panels) == 3 and panels[0].size == (32, 32)


def test_class_conditional_ddpm_is_traced_with_labels_and_guidance(ip, models, tmp_path, capsys):
    picture = tmp_path / "x0.png"
    report = ip.main(ip.parse_args([str(models["ddpm"]), "--trace", "--num_inference_steps", str(STEPS),
                                    "--class_label", "dog", "--guidance_scale", "2", "--num_images", "2",
                                    "--save_trajectory", str(picture), "--trajectory_steps", str(STEPS)]))
    out = capsys.readouterr().out
    assert report["denoiser"]["labels"] == ["cat", "dog"] and report["denoiser"]["null_class_id"] == 2
    assert "sample_images" in report["trace"]["how"] and "class 'dog' (id 1)" in out
    steps = [s for s in report["trace"]["stages"] if s["stage"] == "denoise"]
    assert len(steps) == STEPS
    for s in steps:  # the guided batch: two of class 1, then two of the null class
        assert s["unet_in"] == {"sample": [4, 3, 8, 8], "class_labels": [1, 1, 2, 2]}
        assert s["guidance"]["out"] == s["latents"] == [2, 3, 8, 8]
    assert report["trace"]["stages"][-1]["stage"] == "postprocess (rest of the call)"
    assert Image.open(picture).size == (STEPS * 8, 8)


def test_unconditional_ddpm_and_checkpoint(ip, models, capsys):
    report = ip.main(ip.parse_args([str(models["ddpm_uncond"]), "--trace", "--num_inference_steps", "2"]))
    assert report["trace"]["how"].startswith("DDPMPipeline.__call__")
    steps = [s for s in report["trace"]["stages"] if s["stage"] == "denoise"]
    assert [s["unet_in"] for s in steps] == [{"sample": [1, 3, 8, 8]}] * 2
    with pytest.raises(ip.UserError, match="unconditional"):
        ip.main(ip.parse_args([str(models["ddpm_uncond"]), "--trace", "--guidance_scale", "3"]))
    report = ip.main(ip.parse_args([str(models["ddpm_checkpoint"])]))
    assert report["pipeline"] == "DDPMPipeline" and report["denoiser"]["labels"] == ["cat", "dog"]
    capsys.readouterr()


def test_lora_folder_as_model_text_output(ip, models, capsys):
    report = ip.main(ip.parse_args([str(models["lora"]), "--trace", "--num_inference_steps", "2"]))
    out = capsys.readouterr().out
    unet = report["lora"]["components"]["unet"]
    assert report["model"] == str(models["sd"]) and unet["rank"] == [4] and unet["alpha"] == [8]
    assert set(unet["targets"]) == {"to_q", "to_k", "to_v", "to_out.0"}
    for needle in ("lora in unet", "trace: StableDiffusionPipeline.__call__", "vae.decode", "step 1 t="):
        assert needle in out
    assert report["lora"]["warnings"] == []
    # Weights saved without their adapter config load with alpha = rank: shown, not hidden.
    report = ip.main(ip.parse_args([str(models["sd"]), "--lora", str(models["lora_no_alpha"])]))
    assert report["lora"]["warnings"] == ["lora_info.json says lora_alpha 8, but the weights load with alpha 4"]
    assert "warning: lora_info.json says lora_alpha 8" in capsys.readouterr().out


def test_json_with_lora_trace_and_trajectory(models, tmp_path, capsys):
    picture = tmp_path / "x0.png"
    run_in_process("inspect_pipeline.py", models["sd"], "--lora", models["lora"], "--num_inference_steps", 4,
                   "--save_trajectory", picture, "--trajectory_steps", 3, "--json")
    report = json.loads(capsys.readouterr().out)
    for key in ("components", "scheduler", "denoiser", "text_encoders", "tokenizers", "vae", "lora", "trace",
                "trajectory"):
        assert key in report, key
    added = sum(t.numel() for t in load_file(models["lora"] / "pytorch_lora_weights.safetensors").values())
    assert report["lora"]["parameters_added"] == added
    image = Image.open(picture)
    assert image.size == (3 * 32, 32) and report["trajectory"]["panels"] == 3
    assert [p["step"] for p in json.loads(image.text["trajectory"])] == [0, 2, 3]


def test_bad_input_is_one_line(models, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run_script("inspect_pipeline.py", tmp_path / "empty"), "not a diffusion pipeline")
    assert_one_line_error(run_script("inspect_pipeline.py", models["sd"], "--save_trajectory", "x.png",
                                     "--trajectory_steps", 20), "--trajectory_steps")
    assert_one_line_error(run_script("inspect_pipeline.py", models["sd"], "--lora", models["other_lora"]),
                          "made for another base", "[4, 16] in the LoRA but [4, 32]")


def test_trajectory_panels_default_to_at_most_the_steps(ip, models, tmp_path):
    """Pins: --save_trajectory with --num_inference_steps 4 failed on the default --trajectory_steps 5."""
    for steps, panels in ((4, 4), (12, 5)):
        args = ip.parse_args([str(models["sd"]), "--num_inference_steps", str(steps), "--save_trajectory",
                              str(tmp_path / "x.png")])
        assert args.trajectory_steps == panels


def test_height_must_fit_the_vae(ip, models):  # in-process: the one-line path itself is tested above
    with pytest.raises(ip.UserError, match="--height 30 is not divisible by 4, the VAE's downsampling factor"):
        ip.main(ip.parse_args([str(models["sd"]), "--trace", "--height", "30"]))
    with pytest.raises(ip.UserError, match="have to be divisible by 8"):  # the pipeline's own check, passed on
        ip.main(ip.parse_args([str(models["sd"]), "--trace", "--height", "36"]))


def test_a_first_frame_is_for_an_image_to_video_trace_only(ip, models, tmp_path):  # (Wan's: tests/test_video.py)
    first = tmp_path / "first.png"
    Image.new("RGB", (32, 32)).save(first)
    with pytest.raises(ip.UserError, match="--image: the first frame of a --trace call; add --trace"):
        ip.parse_args([str(models["sd"]), "--image", str(first)])
    with pytest.raises(ip.UserError, match="--image: StableDiffusionPipeline takes no first frame"):
        ip.main(ip.parse_args([str(models["sd"]), "--trace", "--image", str(first), "--num_inference_steps", "1"]))
