"""--optimizer: each choice built on the trainers' parameter groups (in-process), a stopped and resumed
train_classifier.py run per optimizer that matches the uninterrupted one bitwise, and the one-line errors."""
import argparse
import copy
import json
import shutil

import pytest
import torch
from conftest import assert_one_line_error, logged_losses, read_results, run_script
from safetensors.torch import load_file

from common.cli import UserError
from common.optimizers import CPU_8BIT, build_optimizer, check_optimizer_args
from common.training import build_param_groups

LR = {"adamw": 1e-2, "adafactor": 1e-2, "prodigy": 1.0}


def optimizer_args(name, **overrides):
    """The flags build_optimizer reads, at the trainers' defaults."""
    values = dict(optimizer=name, learning_rate=LR.get(name, 1e-2), adam_beta1=0.9, adam_beta2=0.999,
                  adam_epsilon=1e-8, prodigy_d_coef=1.0, lr_warmup_steps=0, resume_from_checkpoint=None,
                  output_dir="unused")
    return argparse.Namespace(**{**values, **overrides})


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))


def train_step(model, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def groups_for(name, model):
    """The trainers' groups: decay and no-decay, and a module at its own LR (--lr_groups, --text_encoder_lr) except
    for Prodigy, which takes one LR for all."""
    lr = LR[name]
    return build_param_groups(model, lr, 0.01, {} if name == "prodigy" else {"2": lr / 2})


@pytest.mark.parametrize("name", ["adamw", "adafactor", "prodigy"])
def test_each_optimizer_steps_every_group_and_resumes_from_its_state_dict(name):
    model = tiny_model()
    optimizer = build_optimizer(optimizer_args(name), groups_for(name, model), torch.device("cpu"))
    names = [group["name"] for group in optimizer.param_groups]  # what the logs read, as lr/<name>
    assert names[:2] == ["default", "default/no_decay"] and len(names) == (2 if name == "prodigy" else 4), names
    if name != "prodigy":
        assert {g["name"]: g["lr"] for g in optimizer.param_groups}["2"] == LR[name] / 2
    before = copy.deepcopy(model.state_dict())
    train_step(model, optimizer, 0)
    assert all(not torch.equal(before[k], v) for k, v in model.state_dict().items()), name  # every group moved

    # The state after one step, loaded into a fresh optimizer on a copy of the model: the next steps are identical.
    twin = copy.deepcopy(model)
    twin_optimizer = build_optimizer(optimizer_args(name), groups_for(name, twin), torch.device("cpu"))
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for seed in (1, 2):
        train_step(model, optimizer, seed)
        train_step(twin, twin_optimizer, seed)
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in model.state_dict().items()), name

    # The LR scheduler drives each of them: at LR 0 nothing moves (Adafactor's own relative step is off).
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    frozen = copy.deepcopy(model.state_dict())
    train_step(model, optimizer, 3)
    assert all(torch.equal(frozen[k], v) for k, v in model.state_dict().items()), name


def test_prodigy_refuses_groups_with_different_learning_rates_and_lrs_far_from_one():
    model = tiny_model()
    with pytest.raises(UserError, match=r"different learning rates \(default 1, 2 0.5\)"):
        build_optimizer(optimizer_args("prodigy"), build_param_groups(model, 1.0, 0.01, {"2": 0.5}),
                        torch.device("cpu"))
    with pytest.raises(UserError, match="the learning rate 0.0001 is far from 1"):
        build_optimizer(optimizer_args("prodigy"), build_param_groups(model, 1e-4, 0.01), torch.device("cpu"))


@pytest.mark.parametrize("warmup", [0, 100])
def test_prodigy_keeps_the_lr_out_of_its_estimate_with_or_without_a_warm_up(warmup):
    """prodigyopt's README for diffusion models: use_bias_correction and safeguard_warmup, whatever the schedule."""
    model = tiny_model()
    optimizer = build_optimizer(optimizer_args("prodigy", lr_warmup_steps=warmup), groups_for("prodigy", model),
                                torch.device("cpu"))
    assert all(g["use_bias_correction"] and g["safeguard_warmup"] for g in optimizer.param_groups)
    # Why without a warm-up too: the bias correction Prodigy multiplies into the LR of its estimate starts low and
    # climbs for a thousand steps (the numbers docs/running.md quotes).
    beta1, beta2 = optimizer.param_groups[0]["betas"]
    correction = {k: (1 - beta2 ** k) ** 0.5 / (1 - beta1 ** k) for k in (1, 10, 1000)}
    assert [round(correction[1], 2), round(correction[10], 2), round(correction[1000], 1)] == [0.32, 0.15, 0.8]
    # The safeguard is what runs: the same steps as prodigyopt's Prodigy built with it, not as one without it.
    from prodigyopt import Prodigy

    twins = {safeguard: copy.deepcopy(model) for safeguard in (True, False)}
    references = {safeguard: Prodigy(groups_for("prodigy", twin), use_bias_correction=True, safeguard_warmup=safeguard)
                  for safeguard, twin in twins.items()}
    for seed in range(30):
        for net, opt in [(model, optimizer), *((twins[s], references[s]) for s in twins)]:
            train_step(net, opt, seed)
    assert optimizer.param_groups[0]["d"] == references[True].param_groups[0]["d"]
    assert optimizer.param_groups[0]["d"] != references[False].param_groups[0]["d"]


def test_adamw8bit_needs_cuda_and_bitsandbytes(monkeypatch):
    model = tiny_model()
    with pytest.raises(UserError) as err:
        build_optimizer(optimizer_args("adamw8bit"), build_param_groups(model, 1e-2, 0.01), torch.device("cpu"))
    assert str(err.value) == CPU_8BIT
    # The install hint, on a machine with a GPU but without the package (checked before torch loads):
    import common.optimizers as optimizers

    monkeypatch.setattr(optimizers, "cuda_in_use", lambda: True)
    monkeypatch.setattr(optimizers, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"needs the bitsandbytes package, which is not installed: run `make "
                                        r"install-extras` \(or `pip install bitsandbytes`\)"):
        check_optimizer_args(optimizer_args("adamw8bit"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="adamw8bit trains on a CUDA GPU only")
def test_adamw8bit_on_cuda():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is an extra: make install-extras")
    model = tiny_model().cuda()
    optimizer = build_optimizer(optimizer_args("adamw8bit"), build_param_groups(model, 1e-2, 0.01, {"2": 5e-3}),
                                torch.device("cuda"))
    before = copy.deepcopy(model.state_dict())
    x, y = torch.randn(16, 4, device="cuda"), torch.randint(0, 3, (16,), device="cuda")
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    assert all(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))


@pytest.fixture(scope="module")
def small_digits(digits, tmp_path_factory):
    """80 training and 20 test images of the digits: a run here is mostly start-up."""
    root = tmp_path_factory.mktemp("small") / "digits"
    for split, count in (("train", 80), ("test", 20)):
        (root / split).mkdir(parents=True)
        rows = (digits / split / "metadata.jsonl").read_text().splitlines()[:count]
        (root / split / "metadata.jsonl").write_text("\n".join(rows) + "\n")
        for row in rows:
            shutil.copy(digits / split / json.loads(row)["file_name"], root / split)
    return root


# 72 training images (8 held out for validation) in batches of 16: 5 steps an epoch; checkpoint-3 is mid-epoch and
# the resumed run crosses into epoch 2. Warm-up, then cosine: the scheduler's state matters too.
TINY = ["--train_batch_size", "16", "--max_train_steps", "6", "--checkpointing_steps", "3", "--lr_warmup_steps", "2",
        "--logging_steps", "1", "--eval_batch_size", "64"]


# adamw (the default): every trainer's own resume test
@pytest.mark.parametrize("name", ["prodigy", "adafactor"])
def test_resumed_run_matches_the_uninterrupted_one(small_digits, tmp_path, name):
    flags = ["--train_data_dir", small_digits, *TINY, "--optimizer", name, "--learning_rate", LR[name]]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    proc = run_script("train_classifier.py", *flags, "--output_dir", reference)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed.mkdir()
    shutil.copytree(reference / "checkpoint-3", resumed / "checkpoint-3")
    proc = run_script("train_classifier.py", *flags, "--output_dir", resumed, "--resume_from_checkpoint", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = load_file(reference / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert not [k for k in a if not torch.equal(a[k], b[k])], name
    losses, again = logged_losses(reference), logged_losses(resumed)
    assert sorted(again) == [4, 5, 6] and [again[s] for s in (4, 5, 6)] == [losses[s] for s in (4, 5, 6)]
    assert read_results(resumed)["final_loss"] == read_results(reference)["final_loss"]
    if name == "prodigy":  # its state does not fit another optimizer: refused before anything loads
        other = run_script("train_classifier.py", *flags[:-4], "--optimizer", "adafactor", "--output_dir", resumed,
                           "--resume_from_checkpoint", "latest")
        assert_one_line_error(other, "holds the state of --optimizer prodigy (now adafactor)")


@pytest.mark.parametrize("flags, needles", [
    (["--optimizer", "adamw8bit"], [CPU_8BIT]),
    (["--optimizer", "prodigy", "--learning_rate", "1e-4"],
     ["--optimizer prodigy: --learning_rate 0.0001 is far from 1", "give --learning_rate 1.0"]),
], ids=["adamw8bit-on-cpu", "prodigy-lr"])
def test_bad_optimizer_flags_are_one_line_and_write_nothing(small_digits, tmp_path, flags, needles):
    # offline_env sets ACCELERATE_USE_CPU: the run is on the CPU even where a GPU is present.
    out = tmp_path / "out"
    proc = run_script("train_classifier.py", "--train_data_dir", small_digits, "--output_dir", out, *flags)
    assert_one_line_error(proc, *needles)
    assert not out.exists()
