"""train_ddpm.py and sample.py (DDPM outputs) end to end: real runs through `accelerate launch`, tiny UNets at 8 px."""
import json
import shutil
import sys

import pytest
import torch
from conftest import (
    ROOT,
    assert_one_line_error,
    launch,
    logged_losses,
    read_results,
    run_in_process,
    run_script,
    signal_when_ready,
)
from safetensors.torch import load_file

# 48 images in batches of 8 with accumulation 2: 3 optimizer steps per epoch, so checkpoint-4 is mid-epoch.
TINY = ["--resolution", "8", "--block_out_channels", "16,32", "--max_train_samples", "48", "--train_batch_size", "8",
        "--gradient_accumulation_steps", "2", "--max_train_steps", "8", "--ddpm_num_steps", "100",
        "--lr_warmup_steps", "2", "--checkpointing_steps", "4", "--validation_steps", "4",
        "--num_validation_images", "2", "--validation_inference_steps", "2", "--logging_steps", "1"]
CONDITIONAL = ["--class_column", "label", "--use_ema", "--ema_inv_gamma", "0.1", "--snr_gamma", "5",
               "--guidance_scale", "2"]
WEIGHTS = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def eval_classifier(tmp_path_factory):
    """A random-weight ResNet in the layout train_classifier.py writes (enough to exercise the metrics)."""
    from transformers import AutoModelForImageClassification, ResNetConfig
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    from train_classifier import small_resnet_config

    path = tmp_path_factory.mktemp("classifier") / "clf"
    config = small_resnet_config(ResNetConfig, 10, {i: str(i) for i in range(10)})
    AutoModelForImageClassification.from_config(config).save_pretrained(path)
    ViTImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(
        path)
    return path


@pytest.fixture(scope="module")
def trained(digits, eval_classifier, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddpm") / "run"
    launch("train_ddpm.py", "--train_data_dir", digits, "--output_dir", out, *TINY, *CONDITIONAL,
           "--eval_classifier", eval_classifier)
    return out


def test_class_conditional_run_writes_a_pipeline_with_ema_weights(trained):
    from diffusers import DDPMPipeline, UNet2DModel

    results = read_results(trained)
    assert results["global_step"] == 8 and results["num_processes"] == 1
    assert 0.0 <= results["sample_accuracy"] <= 1.0 and results["frechet_distance"] >= 0.0
    assert json.loads((trained / "labels.json").read_text()) == [str(i) for i in range(10)]
    for step in (4, 8):
        checkpoint = trained / f"checkpoint-{step}"
        for part in ("unet/config.json", "unet_ema/config.json", "scheduler/scheduler_config.json", "labels.json"):
            assert (checkpoint / part).exists(), part
        assert (trained / f"samples/step-{step}.png").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in (trained / "logs").rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["images"]) | set(accumulator.Tags()["scalars"])
    assert {"validation", "validation/sample_accuracy", "train/loss"} <= tags, tags
    unet = UNet2DModel.from_pretrained(trained / "unet")
    assert unet.config.num_class_embeds == 11 and unet.config.sample_size == 8
    pipe = DDPMPipeline.from_pretrained(trained)
    assert pipe.scheduler.config.num_train_timesteps == 100
    # The export is the EMA, and the EMA is not the training weights.
    exported = load_file(trained / WEIGHTS)
    ema = load_file(trained / "checkpoint-8/unet_ema/diffusion_pytorch_model.safetensors")
    raw = load_file(trained / "checkpoint-8" / WEIGHTS)
    assert all(torch.equal(exported[k], ema[k]) for k in exported)
    assert any(not torch.equal(exported[k], raw[k]) for k in exported)


def test_resume_and_sigterm_stop_match_the_uninterrupted_run(trained, digits, eval_classifier, tmp_path):
    # From the mid-epoch checkpoint-4, SIGTERM stops after a complete step (accumulation 2: the signal often lands
    # mid-cycle); `latest` finishes. Losses, weights, EMA, validation samples and metrics equal the uninterrupted run's.
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(trained / "checkpoint-4", out / "checkpoint-4")
    args = ["--train_data_dir", digits, "--output_dir", out, *TINY, *CONDITIONAL, "--eval_classifier", eval_classifier,
            "--resume_from_checkpoint", "latest"]
    returncode, stderr = signal_when_ready([sys.executable, ROOT / "train_ddpm.py", *args], out / "logs")
    assert returncode == 143, stderr[-3000:]
    assert "SIGTERM received: stopped after a complete optimizer step" in stderr and "Traceback" not in stderr
    assert max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) > 4
    launch("train_ddpm.py", *args)
    assert read_results(out)["global_step"] == 8
    for weights in (WEIGHTS, "checkpoint-8/" + WEIGHTS, "checkpoint-8/unet_ema/diffusion_pytorch_model.safetensors"):
        a, b = load_file(trained / weights), load_file(out / weights)
        differing = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differing, (weights, differing[:5])
    reference, resumed = logged_losses(trained), logged_losses(out)
    assert [resumed[s] for s in range(5, 9)] == [reference[s] for s in range(5, 9)]
    assert (out / "samples/step-8.png").read_bytes() == (trained / "samples/step-8.png").read_bytes()
    for key in ("final_loss", "sample_accuracy", "frechet_distance"):
        assert read_results(out)[key] == read_results(trained)[key], key


def test_sample_py_is_deterministic_and_records_its_parameters(trained, tmp_path):
    from PIL import Image

    args = ["--model", trained / "checkpoint-8", "--class_label", "3", "--class_label", "all", "--num_images", "2",
            "--guidance_scale", "3", "--num_inference_steps", "3", "--batch_size", "8"]
    runs = []
    for name in ("a", "b", "raw"):  # (in this process: the same command twice across processes is test_reliability's)
        extra = ["--no_ema"] if name == "raw" else []
        run_in_process("sample.py", *args, *extra, "--output_dir", tmp_path / name)
        runs.append({p.name: p.read_bytes() for p in (tmp_path / name).glob("*.png")})
    assert len(runs[0]) == 22 + 1 and runs[0] == runs[1]  # (1 + 10 classes) x 2 images, and grid.png
    assert runs[2]["0000.png"] != runs[0]["0000.png"]  # --no_ema: the raw weights draw other pixels
    info = Image.open(tmp_path / "a/0001.png").text
    assert info["class_label"] == "3" and info["guidance_scale"] == "3.0" and info["weights"] == "ema"
    assert json.loads(info["parameters"])["scheduler"] == "ddim"
    assert Image.open(tmp_path / "a/grid.png").size == (2 * 8, 11 * 8)


def test_guidance_one_is_plain_conditional_sampling_and_guidance_combines_both():
    from diffusers import DDIMScheduler, UNet2DModel

    from common.diffusion import sample_images

    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=8, block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4, num_class_embeds=4).eval()
    scheduler = DDIMScheduler(num_train_timesteps=100)
    labels = torch.tensor([0, 1, 2])

    def by_hand(w):
        x = torch.randn((3, 3, 8, 8), generator=torch.Generator().manual_seed(7))
        scheduler.set_timesteps(4)
        for t in scheduler.timesteps:
            with torch.no_grad():
                cond = unet(x, t, class_labels=labels).sample
                uncond = unet(x, t, class_labels=torch.full_like(labels, 3)).sample
            x = scheduler.step(cond if w == 1 else uncond + w * (cond - uncond), t, x).prev_sample
        return (x / 2 + 0.5).clamp(0, 1)

    def sampled(w):
        return sample_images(unet, scheduler, 3, class_labels=labels, null_class=3, guidance_scale=w,
                             num_inference_steps=4, generator=torch.Generator().manual_seed(7))

    assert torch.equal(sampled(1.0), by_hand(1))
    torch.testing.assert_close(sampled(3.0), by_hand(3.0), atol=1e-5, rtol=0)
    assert not torch.allclose(sampled(3.0), sampled(1.0))


def test_class_dropout_rate():
    from train_ddpm import drop_class_labels

    torch.manual_seed(0)
    labels = torch.randint(0, 10, (200_000,))
    dropped = drop_class_labels(labels, 10, 0.1)
    is_null = dropped == 10
    assert abs(is_null.float().mean().item() - 0.1) < 0.005
    assert torch.equal(dropped[~is_null], labels[~is_null])
    assert torch.equal(drop_class_labels(labels, 10, 0.0), labels)
    assert (drop_class_labels(labels, 10, 1.0) == 10).all()


def test_frechet_distance():
    from common.classifier_metrics import frechet_distance

    a = torch.randn(4000, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert abs(frechet_distance(a, a)) < 1e-6
    assert frechet_distance(a, a + 3) == pytest.approx(36.0, rel=1e-6)  # mean shift of 3 in 4 dimensions
    assert frechet_distance(a, 2 * a) == pytest.approx(4.0, rel=0.05)  # tr(I + 4I - 2 * 2I) = 4


def test_min_snr_weights():
    from common.diffusion import min_snr_weights

    snr = torch.tensor([0.5, 5.0, 50.0])
    torch.testing.assert_close(min_snr_weights(snr, 5.0, "epsilon"), torch.tensor([1.0, 1.0, 0.1]))
    torch.testing.assert_close(min_snr_weights(snr, 5.0, "v_prediction"), torch.tensor([0.5 / 1.5, 5 / 6, 5 / 51]))
    torch.testing.assert_close(min_snr_weights(snr, 5.0, "sample"), torch.tensor([0.5, 5.0, 5.0]))


def test_resuming_an_ema_with_other_settings_is_refused(trained, digits, tmp_path):
    """Pins: EMAModel.load_state_dict took decay, inv_gamma and power from the checkpoint whatever the flags said."""
    out = tmp_path / "run"
    shutil.copytree(trained / "checkpoint-4", out / "checkpoint-4")
    base = ["--train_data_dir", digits, "--output_dir", out, *TINY, "--class_column", "label",
            "--resume_from_checkpoint", "latest"]
    line = assert_one_line_error(run_script("train_ddpm.py", *base, "--use_ema", "--ema_inv_gamma", "0.5"),
                                 "--ema_inv_gamma 0.1 (now 0.5)")
    assert "same EMA settings" in line
    assert_one_line_error(run_script("train_ddpm.py", *base), "holds an EMA of the weights", "--use_ema")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4"]


def test_two_processes_draw_their_own_noise(digits, tmp_path):
    """Pins: set_seed without device_specific: every process drew the same noise and timesteps. On a data set of one
    image repeated, two processes then computed the same gradient as one, and trained exactly like it."""
    from diffusers import UNet2DModel

    data = tmp_path / "same"
    data.mkdir()
    for i in range(16):
        shutil.copy(digits / "train" / "0000.png", data / f"{i:02d}.png")
    weights = []
    for config in ("cpu.yaml", "cpu_2proc.yaml"):
        out = tmp_path / config
        launch("train_ddpm.py", "--train_data_dir", data, "--output_dir", out, "--resolution", "8",
               "--block_out_channels", "16,32", "--train_batch_size", "4", "--max_train_steps", "2",
               "--ddpm_num_steps", "100", "--validation_steps", "100", "--num_validation_images", "1",
               "--validation_inference_steps", "1", "--report_to", "none", config=config)
        weights.append(UNet2DModel.from_pretrained(out / "unet").state_dict())
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.fixture(scope="module")
def unconditional_model(tmp_path_factory):
    from diffusers import DDPMScheduler, UNet2DModel

    path = tmp_path_factory.mktemp("uncond") / "model"
    UNet2DModel(sample_size=8, block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4).save_pretrained(path / "unet")
    DDPMScheduler(num_train_timesteps=100).save_pretrained(path / "scheduler")
    return path


def test_sample_py_bad_input(trained, unconditional_model, tmp_path):
    broken = tmp_path / "broken"
    (broken / "unet").mkdir(parents=True)
    (broken / "scheduler").mkdir()
    (tmp_path / "empty").mkdir()
    cases = [
        (["--model", unconditional_model, "--class_label", "3"], "is unconditional"),
        (["--model", trained, "--class_label", "eleven"], "--class_label 'eleven' is not a class of this model"),
        (["--model", trained, "--class_label", "10"], "is not a class of this model"),
        (["--model", broken], "is not a train_ddpm.py output"),
        (["--model", trained, "--prompt", "a digit"], "--prompt/--lora/--image are for text-to-image models"),
        (["--model", trained, "--height", "16"], "--height/--width are for text-to-image models"),  # was ignored
        (["--model", tmp_path / "empty"], "error"),  # not a DDPM folder at all: handled by the other branch
        # pins: --no_ema on a final output (unet/ holds the EMA weights) silently gave the EMA weights
        (["--model", trained, "--no_ema"], "--no_ema: "),
    ]
    for args, needle in cases:
        out = tmp_path / "out"
        line = assert_one_line_error(run_script("sample.py", *args, "--output_dir", out), needle)
        assert not out.exists(), line


@pytest.mark.parametrize("layout", ["imagefolder", "parquet"])
def test_classlabel_datasets_train_and_keep_the_class_names(digits, layout, tmp_path):
    # The bug this pins: a ClassLabel class column (hub datasets such as CIFAR-10; an imagefolder with one subfolder
    # per class) stops the run with KeyError: '0' (the ClassLabel's ints looked up as names).
    import datasets
    from test_classifier import write_class_datasets

    folder, parquet = write_class_datasets(digits, tmp_path / "data", per_class=(8, 2))
    source = ["--train_data_dir", folder] if layout == "imagefolder" else ["--dataset_name", parquet]
    loaded = (datasets.load_dataset("imagefolder", data_dir=str(folder)) if layout == "imagefolder"
              else datasets.load_dataset(str(parquet)))
    names = loaded["train"].features["label"].names
    assert names == (["one", "two", "zero"] if layout == "imagefolder" else ["zero", "one", "two"])
    out = tmp_path / "out"
    proc = run_script("train_ddpm.py", *source, "--output_dir", out, "--class_column", "label", "--resolution", "8",
                      "--block_out_channels", "16,32", "--train_batch_size", "8", "--max_train_steps", "2",
                      "--ddpm_num_steps", "100", "--num_validation_images", "1", "--validation_inference_steps", "2",
                      "--report_to", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "labels.json").read_text()) == names
