"""Every snippet a user copies runs and draws what it says: the python block of each model card the recipes write
(run as printed, only paths substituted) draws what sample.py draws at the same seed, within one level; the README's
and the scripts' docstrings' commands parse with their script's own parser (the hub ones, which cannot run offline, and
every `make` target's commands), and their local python commands run with tiny settings.

The cards of trained outputs are checked where a test module already trains that output (`card_draws_what_sample_py
_draws` below): test_lora.py (SD), test_lora_sdxl.py (SDXL), test_lora_flow.py (SD3 and Flux.1, LoRA and full
fine-tune), test_text_to_image.py (SD), test_classifier.py (the classifier's card); here the shipped assets' cards,
SDXL's full fine-tune, the commands, and the checkpoint log lines.
"""
import ast
import contextlib
import io
import json
import logging
import os
import re
import shlex
import subprocess

import numpy as np
import pytest
import torch
from conftest import ROOT, launch
from PIL import Image

SCRIPTS = ("train_classifier.py", "train_ddpm.py", "train_lora.py", "train_text_to_image.py", "sample.py",
           "inspect_pipeline.py")


def code_blocks(text, language="python"):
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def card_code(folder):
    """The python block of a model card (README.md); exactly one."""
    blocks = code_blocks((folder / "README.md").read_text())
    assert len(blocks) == 1, blocks
    return blocks[0]


def run_code(code, cwd, monkeypatch, substitutions=None):
    """Run a card's code as printed, in `cwd`, with only the paths in `substitutions` replaced ({printed: local});
    -> its namespace."""
    for printed, local in (substitutions or {}).items():
        assert printed in code, printed
        code = code.replace(printed, str(local))
    monkeypatch.chdir(cwd)
    namespace = {"__name__": "__card__"}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def called_prompt_and_seed(code):
    """The prompt and the generator's seed of the snippet's pipeline call."""
    call = next(node for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name) and node.func.id == "pipe")
    seed = next(node for node in ast.walk(call) if isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "manual_seed")
    prompt = call.args[0] if call.args else next(k.value for k in call.keywords if k.arg == "prompt")
    return ast.literal_eval(prompt), ast.literal_eval(seed.args[0])


def sample_py(model, prompt, seed, output_dir, *flags):
    """sample.py's image (in this process: its imports are already here) -> pixels."""
    import sample

    sample.main(sample.parse_args(["--model", str(model), "--prompt", prompt, "--seed", str(seed), "--num_images", "1",
                                   "--output_dir", str(output_dir), *flags]))
    return pixels(output_dir / "0000.png")


@contextlib.contextmanager
def one_thread():
    """Tiny models run fastest on one thread, the more so on a busy machine (as the scripts' subprocesses run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def pixels(path):
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def card_draws_what_sample_py_draws(model, tmp_path, monkeypatch, substitutions=None, flags=()):
    """The model card of `model` (a train_lora.py or train_text_to_image.py output, a shipped base): its code, run as
    printed, draws what `python sample.py --model <model> --prompt <its prompt> --seed <its seed> <flags>` draws
    (an edit LoRA's: --image <its reference>), within one level. -> the code."""
    code = card_code(model)
    with one_thread():
        run_code(code, tmp_path, monkeypatch, substitutions)
        prompt, seed = called_prompt_and_seed(code)
        drawn = sample_py(model, prompt, seed, tmp_path / "sample_py", *flags)
    card = pixels(tmp_path / "sample.png")
    assert card.shape == drawn.shape and np.abs(card - drawn).max() <= 1, np.abs(card - drawn).max()
    return code


@pytest.mark.parametrize("asset", ["tiny-flux-digits", "tiny-sd-digits"])
def test_the_shipped_bases_cards_draw_what_sample_py_draws(asset, tmp_path, monkeypatch):
    """As printed in assets/<base>/README.md (the path made absolute): the settings sample.py reads back from the card,
    which are those demo/tiny_sd_base.py measured the base with and writes there (no drift: the block is what it
    writes today)."""
    from demo.tiny_sd_base import usage_snippet

    folder = ROOT / "assets" / asset
    code = card_draws_what_sample_py_draws(folder, tmp_path, monkeypatch, {f'"assets/{asset}"': f'"{folder}"'})
    assert code.strip() == usage_snippet(str(folder), f"assets/{asset}").strip()
    if asset == "tiny-flux-digits":  # a base trained with caption dropout for true CFG: the card says so, at T5's 16
        assert 'true_cfg_scale=3.5, negative_prompt=""' in " ".join(code.split()) and "max_sequence_length=16" in code


def test_the_classifier_card_reads_a_digit(digits, tmp_path, monkeypatch):
    """assets/digit-classifier's card, with a real digit image in place of digit.png: the top label is the digit, as
    the demos' judge reads it."""
    from demo.digit_eval import Judge

    code = card_code(ROOT / "assets" / "digit-classifier")
    image_path = sorted((digits / "test").glob("*.png"))[0]
    label = next(json.loads(line)["label"] for line in (digits / "test" / "metadata.jsonl").open()
                 if json.loads(line)["file_name"] == image_path.name)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_code(code, tmp_path, monkeypatch, {'"assets/digit-classifier"': f'"{ROOT / "assets" / "digit-classifier"}"',
                                               '"digit.png"': f'"{image_path}"'})
    top = ast.literal_eval(printed.getvalue().strip())[0]["label"]
    image = torch.from_numpy(pixels(image_path)).permute(2, 0, 1)[None].float() / 255
    assert top == str(label) == str(Judge(str(ROOT / "assets" / "digit-classifier")).predict(image)[0].item())


def test_a_full_fine_tunes_card_on_sdxl(tiny_sdxl, digits, tmp_path, monkeypatch):
    """train_text_to_image.py's card for SDXL (its other families: test_text_to_image.py, test_lora_flow.py), one
    step."""
    out = tmp_path / "out"
    launch("train_text_to_image.py", "--train_data_dir", digits, "--pretrained_model_name_or_path", tiny_sdxl,
           "--output_dir", out, "--max_train_samples", "4", "--train_batch_size", "4", "--max_train_steps", "1",
           "--report_to", "none")
    code = card_draws_what_sample_py_draws(out, tmp_path, monkeypatch)
    assert "StableDiffusionXLPipeline" in code and "height=32, width=32" in code


# The commands of the README and the docstrings


def documented_commands():
    """[(where, command)]: every command in README.md's bash blocks and inline code, and in each script's docstring
    (its indented lines, `\\`-continued; a line that starts with `...` continues the one before)."""
    commands = []
    readme = (ROOT / "README.md").read_text()
    for block in code_blocks(readme, "bash"):
        commands += [("README.md", line) for line in joined_lines(block)]
    commands += [("README.md", c) for c in re.findall(r"`((?:make|python|accelerate launch) [^`]+)`", readme)]
    for script in SCRIPTS:
        doc = ast.get_docstring(ast.parse((ROOT / script).read_text()))
        previous = None
        for line in joined_lines("\n".join(line for line in doc.splitlines() if line.startswith("    "))):
            line = re.sub(r"^Then:\s*", "", line)
            if line.startswith("..."):
                line = previous + line[3:]
            commands.append((script, line))
            previous = line
        commands += [(script, c) for c in re.findall(r"`((?:make|python) [^`]+)`", doc)]
        commands += [(script, c) for c in re.findall(r"Then:\s+(python .+)", doc)]
    return [(where, re.sub(r"\s+#.*$|\s{2,}\(.*\)$", "", c).strip()) for where, c in commands]  # (comments)


def joined_lines(text):
    return [line.strip() for line in re.sub(r"\\\n\s*", " ", text).splitlines() if line.strip()]


def python_invocations(command, default_script):
    """The script (a file, or `-m` module) and its arguments of every python run in a command line: a make target's
    recipe as `make -n` prints it, `accelerate launch`'s script, `python x.py`. Placeholders (<...>) are dropped, a
    `...` value is a dummy."""
    runs = []
    for part in re.split(r"\s*&&\s*", command):
        part = re.sub(r"<[^>]*>", " ", part)
        tokens = ["x" if token == "..." else token for token in shlex.split(part)]
        if tokens[0] == "make":
            assignments = [t.removesuffix("...") for t in tokens[1:] if "=" in t]  # (ARGS="...": none here)
            targets = [t for t in tokens[1:] if "=" not in t]
            clean = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "ARGS")}
            dry = subprocess.run(["make", "-n", "--no-print-directory", *targets, *assignments], cwd=ROOT,
                                 capture_output=True, text=True, env=clean)  # (not `make test ARGS=...`'s ARGS)
            assert dry.returncode == 0, dry.stderr
            for line in joined_lines(dry.stdout):
                runs += python_invocations(line, None) if "python" in line else []
            continue
        while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):  # VAR=value before the command
            tokens = tokens[1:]
        if not tokens:
            continue
        if "-m" in tokens and tokens[tokens.index("-m") + 1] not in ("common.launch", "accelerate.commands.launch"):
            i = tokens.index("-m") + 1
            runs.append((tokens[i], tokens[i + 1:]))
            continue
        scripts = [i for i, t in enumerate(tokens) if t.endswith(".py")]
        if scripts:
            runs.append((tokens[scripts[0]], tokens[scripts[0] + 1:]))
        elif default_script:  # `<the launch above> --flag ...`: the docstring's own script
            flags = next((i for i, t in enumerate(tokens) if t.startswith("--") and t != "--config_file"), len(tokens))
            runs.append((default_script, tokens[flags:] if tokens[0] != "accelerate" else []))
        for flag in ("--config_file",):  # the accelerate configs named exist
            if flag in tokens:
                assert (ROOT / tokens[tokens.index(flag) + 1]).is_file(), command
    return runs


class Captured(Exception):
    pass


def script_parser(script):
    """The argparse parser a script (or `-m` module) builds, caught as it starts parsing."""
    import argparse
    import runpy
    import warnings

    parse = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise Captured(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (runpy: the module was imported before: fine here)
            if script.endswith(".py"):
                runpy.run_path(str(ROOT / script), run_name="__main__")
            else:
                runpy.run_module(script, run_name="__main__", alter_sys=False)
    except Captured as caught:
        return caught.args[0]
    finally:
        argparse.ArgumentParser.parse_args = parse
    raise AssertionError(f"{script} parses no flags")


def test_every_documented_command_parses():
    """Each command's flags are its script's, with values its parser takes (the script's own checks of files and
    hub ids aside: hub commands cannot run offline); each `make` target's commands as make would run them."""
    from common.cli import UserError

    commands = documented_commands()
    assert len(commands) > 40 and any("make train-lora" in c for _, c in commands)
    parsers, checked = {}, set()
    for where, command in dict.fromkeys(commands):
        first = re.sub(r"<[^>]*>", "", command).split()[0]
        if first not in ("make", "python", "accelerate") and not first.startswith("--"):
            continue
        for script, argv in python_invocations(command, where if where.endswith(".py") else None):
            if script in ("pytest", "ruff", "pip", "venv") or (script, *argv) in checked:
                continue
            checked.add((script, *argv))
            parser = parsers.get(script) or parsers.setdefault(script, script_parser(script))
            try:
                parser.parse_args(argv)
            except (UserError, SystemExit) as err:
                raise AssertionError(f"{where}: `{command}` -> {script} {' '.join(argv)}: {err}") from None
    assert len(checked) > 40 and {"train_lora.py", "demo.style_report", "sample.py"} <= set(parsers)


@pytest.fixture(scope="module")
def documented_models(tiny_sd, tiny_sdxl, tmp_path_factory):
    """What the docstrings' local commands read: a LoRA in train_lora.py's layout on the tiny SD base, a
    class-conditional DDPM in train_ddpm.py's (both built here, not trained), the tiny bases."""
    from diffusers import DDPMPipeline, DDPMScheduler, StableDiffusionPipeline, UNet2DModel
    from peft import LoraConfig

    from common.families import sd
    from common.lora_files import save_lora_weights

    root = tmp_path_factory.mktemp("documented")
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    pipe.unet.add_adapter(LoraConfig(r=2, target_modules=["to_q", "to_k"], init_lora_weights="gaussian"))
    save_lora_weights(str(root / "lora"), sd, {"unet": pipe.unet}, {"base_model": str(tiny_sd), "rank": 2,
                                                                    "lora_alpha": 2})
    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                       norm_num_groups=8, num_class_embeds=11)
    DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=100)).save_pretrained(root / "ddpm")
    (root / "ddpm" / "labels.json").write_text(json.dumps([str(i) for i in range(10)]))
    return {"outputs/lora-naruto": root / "lora", "outputs/lora-sdxl": root / "lora", "outputs/lora": root / "lora",
            "outputs/ddpm": root / "ddpm", "outputs/sd-naruto": tiny_sd, "models/tiny-sdxl": tiny_sdxl,
            "models/tiny-sd": tiny_sd}


def test_the_docstrings_local_python_commands_run(documented_models, tmp_path, monkeypatch, capsys):
    """Every `python sample.py ...` and `python inspect_pipeline.py ...` of a docstring that names no hub model, run
    (in this process) on tiny stand-ins for the paths it names, with at most 2 sampling steps."""
    import importlib

    ran = []
    for where, command in documented_commands():
        tokens = shlex.split(command)
        if tokens[:1] != ["python"] or tokens[1] not in ("sample.py", "inspect_pipeline.py"):
            continue
        if any(re.fullmatch(r"[\w.-]+/[\w.-]+", t) and not t.startswith(("outputs/", "models/")) for t in tokens):
            continue  # a hub model: parsed above
        if "--image" in tokens:
            continue  # an edit LoRA's reference: sample.py --image runs in tests/test_references.py
        argv = [str(documented_models.get(t, t)) for t in tokens[2:]]
        argv = [str(tmp_path / t) if t.endswith(".png") else t for t in argv]
        if "--num_inference_steps" in argv:
            argv[argv.index("--num_inference_steps") + 1] = "2"
        else:
            argv += ["--num_inference_steps", "2"]
        if tokens[1] == "sample.py":  # one image per prompt or label
            if "--num_images" in argv:
                del argv[argv.index("--num_images"):argv.index("--num_images") + 2]
            argv += ["--num_images", "1", "--output_dir", str(tmp_path / f"s{len(ran)}")]
        module = importlib.import_module(tokens[1].removesuffix(".py"))
        monkeypatch.chdir(tmp_path)
        with one_thread():
            module.main(module.parse_args(argv))
        ran.append(command)
    capsys.readouterr()
    assert len(ran) >= 9, ran


def test_a_checkpoint_is_one_log_line(tmp_path, caplog):
    """save_checkpoint says one INFO line per checkpoint; accelerate's line per saved file (optimizer, scheduler,
    sampler, random states) is at DEBUG, and shows when DEBUG is on; the same for a load."""
    from accelerate import Accelerator
    from accelerate.logging import get_logger

    from common.checkpoints import load_checkpoint, save_checkpoint

    get_logger("train", log_level="INFO")  # as the scripts set the root logger's level
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with caplog.at_level(logging.INFO):
        save_checkpoint(accelerator, str(tmp_path), 1)
        load_checkpoint(accelerator, str(tmp_path / "checkpoint-1"))
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert lines == [f"saved {tmp_path / 'checkpoint-1'}"], lines
    caplog.clear()
    logging.getLogger("accelerate").setLevel(logging.DEBUG)
    try:
        with caplog.at_level(logging.DEBUG):
            save_checkpoint(accelerator, str(tmp_path), 2)
    finally:
        logging.getLogger("accelerate").setLevel(logging.NOTSET)
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.name.startswith("accelerate")]
    assert any("Optimizer state saved in" in m for m in debug) and any("Random states saved" in m for m in debug)
