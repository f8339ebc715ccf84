"""The shipped tiny Wan-architecture video base (assets/tiny-wan-digits, `make tiny-wan-base`): its files match their
checksums, its card's numbers are its build's own measurement, it loads in WanPipeline and draws a clip; the motion
measure (demo/motion_eval.py) on clips of known drift and digit; and the make targets' commands."""
import json

import torch
from conftest import ROOT

BASE = ROOT / "assets" / "tiny-wan-digits"


def test_shipped_files_match_their_checksums_and_a_clip_is_drawn():
    from diffusers import WanPipeline

    from common.base_models import CHECKSUMS, file_sha256

    listed = dict(reversed(line.split(maxsplit=1)) for line in (BASE / CHECKSUMS).read_text().splitlines())
    files = {str(p.relative_to(BASE)) for p in BASE.rglob("*") if p.is_file()}
    assert set(listed) == files - {CHECKSUMS, "README.md", "preview.gif", "strip.png", "base_metrics.json"}
    assert all(file_sha256(BASE / name) == digest for name, digest in listed.items())
    assert sum((BASE / name).stat().st_size for name in files) < 10e6
    card = (BASE / "README.md").read_text()
    metrics = json.loads((BASE / "base_metrics.json").read_text())  # the build's own measurement, not typed
    left, right = metrics["left"], metrics["right"]
    assert left["samples"] == right["samples"] == 100 and left["content"] >= 0.85 and left["leftward"] > 0.9
    assert f"**{left['content']:.0%}**" in card and f"{left['per_digit']}" in card and "make tiny-wan-base" in card
    pipe = WanPipeline.from_pretrained(BASE)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        clip = pipe("a handwritten digit 7 moving left", height=32, width=32, num_frames=9, num_inference_steps=2,
                    max_sequence_length=16, generator=torch.Generator().manual_seed(0), output_type="pt").frames
    assert clip.shape == (1, 9, 3, 32, 32) and pipe.vae.config.scale_factor_spatial == 8


def known_clips(direction, speed=2, count=20, seed=0):
    """Real digits drifting `direction` (demo/moving_digits.py), as [N, F, 3, H, W] in [0, 1], and their digits."""
    import numpy as np
    from sklearn.datasets import load_digits

    from demo.moving_digits import digit_clip

    digits, rng = load_digits(), np.random.default_rng(seed)
    index = rng.choice(len(digits.images), count, replace=False)
    clips = [np.stack([np.asarray(f) for f in digit_clip(digits.images[i], 9, 32, direction, speed,
                                                         int(rng.integers(2, 15)))]) for i in index]
    labels = torch.from_numpy(digits.target[index])
    return torch.from_numpy(np.stack(clips)).permute(0, 1, 4, 2, 3).float() / 255, labels


def test_the_motion_measure_reads_the_drift_and_the_digit_of_known_clips():
    from demo.digit_eval import Judge
    from demo.motion_eval import drift, score_clips

    judge = Judge()
    right, labels = known_clips("right")
    result = score_clips(right, labels, judge)
    assert result["rightward"] == 1.0 and result["leftward"] == 0.0 and result["mean_drift_px"] == 2.0
    assert result["content"] >= 0.8 and result["hit"] == result["content"]
    left = score_clips(right.flip(1), labels, judge)  # the same clips backwards: all leftward, none a hit
    assert left["leftward"] == 1.0 and left["hit"] == 0.0 and left["content"] == result["content"]
    wrong = score_clips(right, (labels + 1) % 10, judge)  # the wrong digits asked for: the content fails
    assert wrong["content"] <= 0.1 and wrong["hit"] <= 0.1
    still, _ = known_clips("right", speed=0, count=4)
    assert drift(still).abs().max() < 0.1 and drift(torch.zeros(2, 9, 3, 32, 32)).eq(0).all()


def test_the_make_targets_commands_parse():
    from test_snippets import python_invocations, script_parser

    runs = python_invocations("make tiny-wan-base", None) + python_invocations("make train-video-lora", None)
    scripts = [script for script, _ in runs if script != "demo.moving_digits"]  # (the clips, where missing)
    assert scripts == ["demo.tiny_wan_base", "train_text_to_image.py", "demo.tiny_wan_base", "train_lora.py",
                       "demo.motion_eval"], scripts
    for script, argv in runs:
        args = script_parser(script).parse_args(argv)
        if script.endswith(".py"):  # the clips' motion is the lesson: never mirrored, 9 frames of 32 px
            assert args.num_frames == 9 and args.resolution == 32 and not args.random_flip
    lora = dict(runs)["train_lora.py"]
    assert lora[lora.index("--pretrained_model_name_or_path") + 1] == "assets/tiny-wan-digits"
    assert lora[lora.index("--train_data_dir") + 1] == "data/moving-digits-right"

