"""Every sampling path draws what the model was trained for: the samplers built from a training scheduler keep its
noise schedule, prediction type and timestep spacing; a training run's validation images are what sample.py draws
for the same model, seed and settings; and those are what diffusers' own pipeline draws."""
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import launch, run_in_process
from PIL import Image

from common.diffusion import SCHEDULER_CLASSES

SD15_SCHEDULER = {  # stable-diffusion-v1-5's scheduler_config.json: no prediction_type, no timestep_spacing
    "_class_name": "PNDMScheduler", "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
    "trained_betas": None, "clip_sample": False}


def tiny_unet():
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(sample_size=8, block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4).eval()


@pytest.mark.parametrize("name", ["euler", "euler_a"])
def test_euler_samplers_start_from_noise_of_the_first_steps_sigma(name, tmp_path):
    """Pins: the start noise was scaled by init_noise_sigma before set_timesteps, i.e. by the sigma of the training
    schedule's last step (~20,000 for SD's betas) instead of the first inference step's (~15): the model's first
    input had a std in the thousands."""
    from diffusers import DDPMScheduler

    from common.diffusion import sample_images, sampling_scheduler

    DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012).save_pretrained(tmp_path)
    scheduler = sampling_scheduler(name, DDPMScheduler.from_pretrained(tmp_path).config)
    unet, inputs = tiny_unet(), []
    unet.register_forward_pre_hook(lambda module, args: inputs.append(args[0].std().item()))
    sample_images(unet, scheduler, 8, num_inference_steps=10, generator=torch.Generator().manual_seed(0))
    assert 0.5 < inputs[0] < 2.0, inputs[:3]  # scale_model_input(x_T, t) ~ N(0, 1)


@pytest.mark.parametrize("name", sorted(SCHEDULER_CLASSES))
def test_a_sampler_keeps_the_training_schedulers_settings(name, tmp_path):
    """Pins: `X.from_config(config)` drops what a config holds only by default (SD 1.5's scheduler has no
    prediction_type key), so a v-prediction model got an epsilon sampler; and an in-memory config and the same
    config saved and loaded gave different timestep spacings (linspace vs leading)."""
    from diffusers import DDPMScheduler

    from common.diffusion import sampling_scheduler

    (tmp_path / "scheduler_config.json").write_text(json.dumps(SD15_SCHEDULER))
    trained = DDPMScheduler.from_pretrained(tmp_path)
    trained.register_to_config(prediction_type="v_prediction")  # what train_lora.py --prediction_type does
    sampler = sampling_scheduler(name, trained.config)
    for key in ("prediction_type", "timestep_spacing", "beta_schedule", "beta_start", "beta_end", "steps_offset"):
        if key in sampler.config:
            assert sampler.config[key] == trained.config[key], key

    in_memory = DDPMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2")  # train_ddpm.py's
    in_memory.save_pretrained(tmp_path / "saved")
    a = sampling_scheduler(name, in_memory.config)
    b = sampling_scheduler(name, DDPMScheduler.from_pretrained(tmp_path / "saved").config)
    a.set_timesteps(10)
    b.set_timesteps(10)
    assert torch.equal(a.timesteps, b.timesteps) and a.config.timestep_spacing == "leading"


def grid_pixels(path):
    return np.asarray(Image.open(path).convert("RGB"))


def test_ddpm_validation_grid_is_what_sample_py_draws(digits, tmp_path):
    """Pins: validation built its sampler from the in-memory training scheduler, sample.py from the saved one, with
    different timestep spacings for dpm/unipc/euler: the run's validation grid (and its metrics) did not show what
    sample.py draws."""
    out = tmp_path / "ddpm"
    launch("train_ddpm.py", "--train_data_dir", digits, "--output_dir", out, "--resolution", "8",
           "--block_out_channels", "16,32", "--max_train_samples", "32", "--train_batch_size", "8",
           "--max_train_steps", "3", "--ddpm_num_steps", "100", "--class_column", "label", "--use_ema",
           "--validation_scheduler", "euler", "--validation_inference_steps", "4", "--num_validation_images", "2",
           "--guidance_scale", "2", "--report_to", "none")
    run_in_process("sample.py", "--model", out, "--class_label", "all", "--num_images", "2", "--scheduler", "euler",
                   "--num_inference_steps", "4", "--guidance_scale", "2", "--seed", "42", "--batch_size", "200",
                   "--output_dir", tmp_path / "samples")
    validation, sampled = grid_pixels(out / "samples/step-3.png"), grid_pixels(tmp_path / "samples/grid.png")
    assert validation.shape == sampled.shape == (10 * 8, 2 * 8, 3)
    assert np.array_equal(validation, sampled)


def test_lora_validation_images_are_what_sample_py_and_diffusers_draw(digits, tiny_sd, tmp_path):
    """Pins: a v-prediction LoRA on a base whose scheduler config has no prediction_type (as SD 1.5's) got epsilon
    validation images, and sample.py sampled with another scheduler than validation did."""
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    base = tmp_path / "base"
    shutil.copytree(tiny_sd, base)
    config_file = base / "scheduler/scheduler_config.json"
    config = json.loads(config_file.read_text())
    del config["prediction_type"], config["timestep_spacing"]
    config_file.write_text(json.dumps(config))
    out, prompt = tmp_path / "lora", "a handwritten digit seven"
    launch("train_lora.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", base, "--output_dir", out,
           "--resolution", "32", "--max_train_samples", "16", "--train_batch_size", "8", "--max_train_steps", "2",
           "--learning_rate", "1e-2", "--prediction_type", "v_prediction", "--validation_prompt", prompt,
           "--num_validation_images", "1", "--validation_inference_steps", "3", "--report_to", "none")
    run_in_process("sample.py", "--model", out, "--prompt", prompt, "--num_images", "1", "--num_inference_steps", "3",
                   "--seed", "42", "--output_dir", tmp_path / "samples")
    validation = grid_pixels(out / "samples/step-2/0-0.png").astype(int)
    sampled = grid_pixels(tmp_path / "samples/0000.png").astype(int)

    # diffusers' own pipeline with the sampler written out by hand: v-prediction, the base's leading spacing
    pipe = StableDiffusionPipeline.from_pretrained(base)
    pipe.scheduler = DPMSolverMultistepScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                                 prediction_type="v_prediction", timestep_spacing="leading",
                                                 steps_offset=1)
    pipe.load_lora_weights(out)
    reference = np.asarray(pipe(prompt, num_inference_steps=3, generator=torch.Generator().manual_seed(42)).images[0])
    epsilon = pipe.scheduler.__class__.from_config(pipe.scheduler.config, prediction_type="epsilon")
    pipe.scheduler = epsilon
    wrong = np.asarray(pipe(prompt, num_inference_steps=3, generator=torch.Generator().manual_seed(42)).images[0])
    assert np.abs(validation - sampled).max() <= 1  # in-memory peft layers vs the loaded file: rounding at most
    assert np.abs(sampled - reference.astype(int)).max() <= 1
    assert np.abs(sampled - wrong.astype(int)).max() > 10  # the test can tell the prediction types apart


def test_min_snr_loss_is_finite_at_zero_terminal_snr_and_shared_by_the_diffusion_trainers():
    """Pins: train_lora.py weighted min-SNR inline as clamp(snr) / snr, NaN at a zero-SNR timestep (a schedule with
    rescale_betas_zero_snr), where train_ddpm.py's helper fell back to plain MSE: one helper (min_snr_weights) for
    train_ddpm.py's diffusion_loss and the text-to-image trainers' DDPM objective."""
    from conftest import ROOT
    from diffusers import DDPMScheduler

    from common.diffusion import diffusion_loss
    from common.objectives import DDPM

    scheduler = DDPMScheduler(rescale_betas_zero_snr=True, beta_schedule="scaled_linear")
    timesteps = torch.tensor([0, 500, 999])
    prediction, target = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    for kind in ("epsilon", "v_prediction", "sample"):
        scheduler.register_to_config(prediction_type=kind)
        assert torch.isfinite(diffusion_loss(prediction, target, scheduler, timesteps, snr_gamma=5.0))
        noised = DDPM(scheduler, snr_gamma=5.0).at(target, prediction, timesteps)
        assert torch.isfinite(DDPM(scheduler, snr_gamma=5.0).losses(prediction, noised)).all()
    assert "diffusion_loss(" in (ROOT / "train_ddpm.py").read_text()
    assert "min_snr_weights(" in (ROOT / "common" / "objectives.py").read_text()
    for script in ("train_ddpm.py", "train_lora.py", "train_text_to_image.py"):
        assert "compute_snr" not in (ROOT / script).read_text(), script
