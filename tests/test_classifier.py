"""train_classifier.py end to end: real runs through `accelerate launch` on the built-in digits, tiny settings."""
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from conftest import ROOT, assert_one_line_error, launch, offline_env, read_results, run_script

TINY = ["--max_train_samples", "320", "--train_batch_size", "16", "--gradient_accumulation_steps", "2",
        "--max_train_steps", "14", "--checkpointing_steps", "4", "--checkpoints_total_limit", "2", "--random_flip",
        "--lr_warmup_steps", "3", "--eval_batch_size", "64"]


@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    out = tmp_path_factory.mktemp("classifier") / "run"
    launch("train_classifier.py", "--train_data_dir", digits, "--output_dir", out, *TINY)
    return out


def test_outputs_load_with_from_pretrained_and_pipeline(trained, digits):
    from transformers import AutoModelForImageClassification, pipeline

    results = read_results(trained)
    assert results["global_step"] == 14 and results["num_processes"] == 1
    for key in ("train_runtime", "train_steps_per_second", "train_samples_per_second", "peak_memory_mb",
                "final_loss", "eval_accuracy", "eval_f1", "best_eval_accuracy"):
        assert results[key] is not None, key
    assert results["eval_samples"] == 360
    assert sorted(p.name for p in trained.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-8"]  # rotated
    assert (trained / "checkpoint-12/model/config.json").exists()  # from_pretrained form inside checkpoints
    assert list((trained / "logs").rglob("events.out.tfevents.*"))
    assert "eval accuracy" in (trained / "README.md").read_text()
    model = AutoModelForImageClassification.from_pretrained(trained)
    assert model.config.id2label[7] == "7"
    AutoModelForImageClassification.from_pretrained(trained / "best_model")
    classify = pipeline("image-classification", model=str(trained))
    predictions = classify(str(sorted((digits / "test").glob("*.png"))[0]))
    assert predictions[0]["label"] in [str(i) for i in range(10)]


def test_resume_from_mid_epoch_checkpoint_matches_uninterrupted_run(trained, digits, tmp_path):
    # 20 batches/epoch, accumulation 2 -> 10 optimizer steps per epoch: step 8 is mid-epoch
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(trained / "checkpoint-8", resumed / "checkpoint-8")
    launch("train_classifier.py", "--train_data_dir", digits, "--output_dir", resumed, *TINY,
           "--resume_from_checkpoint", "latest")
    assert read_results(resumed)["global_step"] == 14
    a, b = load_file(trained / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    differing = [k for k in a if not (a[k] == b[k]).all()]
    assert not differing, differing[:5]


def test_two_processes(digits, tmp_path):
    out = tmp_path / "ddp"
    launch("train_classifier.py", "--train_data_dir", digits, "--output_dir", out, "--max_train_samples", "200",
           "--train_batch_size", "16", "--max_train_steps", "6", "--report_to", "none", config="cpu_2proc.yaml")
    results = read_results(out)
    assert results["num_processes"] == 2
    assert results["eval_samples"] == 360  # gather_for_metrics drops the padding duplicates
    assert (out / "model.safetensors").exists()


def test_script_copied_with_common_runs_in_an_empty_folder(digits, tmp_path):
    shutil.copy(ROOT / "train_classifier.py", tmp_path)
    shutil.copytree(ROOT / "common", tmp_path / "common")
    env = offline_env(PYTHONPATH="")
    launch(tmp_path / "train_classifier.py", "--train_data_dir", digits, "--output_dir", "out",
           "--max_train_samples", "64", "--max_train_steps", "2", "--report_to", "none", cwd=tmp_path, env=env)
    assert (tmp_path / "out/model.safetensors").exists()


def test_notebook_launcher(digits, tmp_path):
    code = (
        "from accelerate import notebook_launcher\n"
        "import train_classifier as t\n"
        f"args = t.parse_args(['--train_data_dir', r'{digits}', '--output_dir', r'{tmp_path / 'nb'}',"
        " '--max_train_samples', '64', '--max_train_steps', '2', '--report_to', 'none'])\n"
        "notebook_launcher(t.main, (args,), num_processes=1)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=offline_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_results(tmp_path / "nb")["global_step"] == 2


@pytest.mark.parametrize("flags,needle", [
    (["--train_data_dir", "/no/such/dir"], "does not exist"),
    (["--train_batch_size", "0"], "--train_batch_size"),
    (["--max_train_steps", "-3"], "--max_train_steps"),
    (["--learning_rate", "0"], "--learning_rate"),
    (["--lr_scheduler", "warmup_sine"], "--lr_scheduler"),
    (["--resume_from_checkpoint", "checkpoint-77"], "no checkpoint at 'checkpoint-77'"),
    (["--lr_groups", "resnet"], "--lr_groups"),
    (["--text_column", "text"], "go together"),
])
def test_bad_flags_fail_before_anything_loads(digits, tmp_path, flags, needle):
    args = ["--output_dir", tmp_path / "out", *flags]
    if "--train_data_dir" not in flags:
        args += ["--train_data_dir", digits]
    assert_one_line_error(run_script("train_classifier.py", *args), needle)
    assert not (tmp_path / "out").exists()


def test_output_dir_that_is_a_file(digits, tmp_path):
    (tmp_path / "out").write_text("not a folder")
    proc = run_script("train_classifier.py", "--train_data_dir", digits, "--output_dir", tmp_path / "out")
    assert_one_line_error(proc, "is a file")
    assert (tmp_path / "out").read_text() == "not a folder"


def test_empty_dataset_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_script("train_classifier.py", "--train_data_dir", tmp_path / "empty", "--output_dir", tmp_path / "out")
    assert_one_line_error(proc, "holds no files")


@pytest.mark.parametrize("flags,needle", [
    (["--image_column", "picture"], "--image_column 'picture' is not a column of the dataset; columns are: image"),
    (["--lr_groups", "vision=1e-4"], "no module named 'vision'; top-level modules are: resnet, classifier"),
])
def test_bad_input_found_after_loading(digits, tmp_path, flags, needle):
    proc = run_script("train_classifier.py", "--train_data_dir", digits, "--output_dir", tmp_path / "out", *flags)
    assert_one_line_error(proc, needle)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_unreadable_accelerate_yaml_through_make(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: [oops\n  : :")
    proc = subprocess.run(["make", "--no-print-directory", "train-classifier", f"CONFIG={bad}"], cwd=ROOT,
                          env=offline_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"error: accelerate config '{bad}' cannot be read" in proc.stderr


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory):
    """A 2-layer BERT and a WordPiece tokenizer whose vocabulary our own code writes."""
    from transformers import BertConfig, BertModel, BertTokenizer

    from common.digits_data import NAMES

    path = tmp_path_factory.mktemp("text") / "tiny-bert"
    path.mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "handwritten", "digit", *NAMES]
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizer(vocab=str(path / "vocab.txt")).save_pretrained(path)
    config = BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    BertModel(config).save_pretrained(path)
    return path


def test_image_text_classifier_with_per_module_learning_rates(digits, tiny_text_model, tmp_path):
    import torch

    from common.image_text_model import ImageTextClassifier

    out = tmp_path / "fusion"
    launch("train_classifier.py", "--train_data_dir", digits, "--output_dir", out, "--text_column", "text",
           "--text_model_name_or_path", tiny_text_model, "--lr_groups", "image_model=1e-3,text_model=4e-3",
           "--max_train_samples", "128", "--train_batch_size", "32", "--max_train_steps", "8", "--report_to", "none",
           "--lr_scheduler", "constant")
    results = read_results(out)
    assert results["global_step"] == 8
    assert results["eval_accuracy"] > 0.5  # the caption names the digit: the text branch learns it fast
    model = ImageTextClassifier.from_pretrained(out)
    assert model.id2label[3] == "3" and isinstance(model.head, torch.nn.Linear)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / "text_model")  # the tokenizer travels with the model
    assert tokenizer("a handwritten digit three")["input_ids"][1:-1] == [5, 6, 7, 11]


def test_sigterm_saves_a_checkpoint_and_exits_143(digits, tmp_path):
    import os
    import signal
    import time

    out = tmp_path / "preempted"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train_classifier.py"), "--train_data_dir", str(digits),
                             "--output_dir", str(out), "--max_train_steps", "5000", "--logging_steps", "1"],
                            cwd=ROOT, env=offline_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "logs").exists() and time.time() < deadline:  # trackers start just before the loop
        time.sleep(0.2)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]
    checkpoints = [p.name for p in out.glob("checkpoint-*")]
    assert len(checkpoints) == 1 and not checkpoints[0].endswith(".tmp"), checkpoints
    assert f"SIGTERM received: stopped after a complete optimizer step; saved {out / checkpoints[0]}" in stderr
    assert "Traceback" not in stderr
    assert os.path.exists(out / checkpoints[0] / "model" / "model.safetensors")
