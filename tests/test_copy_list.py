"""A script copied into another project with the files its docstring lists runs there unchanged.

Each top-level script's docstring ends with `Copy with: common/__init__.py, common/args.py, ...`: exactly the
common/ and demo/ files it imports, transitively, imports inside functions included (sorted, comma-separated, on
one line so that `grep "^Copy with:"` gives the whole list). The scripts are found by glob: a new one is checked
without being named here.
"""
import ast
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, launch, offline_env

PACKAGES = ("common", "demo")
PREFIX = "Copy with: "
SCRIPTS = sorted(path.name for path in ROOT.glob("*.py"))


def module_file(name):
    """A dotted module name -> its file in this repository (a module or a package's __init__.py), else None."""
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_names(file):
    """Every module name an import in `file` may load, at any depth of its code (function-level imports too)."""
    package = file.relative_to(ROOT).parent.parts
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)  # `from common import args`: a module


FAMILIES = ROOT / "common" / "families"


def copy_set(script):
    """The common/ and demo/ files `script` imports, transitively (with the __init__.py of each package). A script
    that dispatches on common/families/ imports a family's module by name at run time: its list holds what any
    family module imports, the family modules themselves aside (the docstring names them)."""
    todo, found = [ROOT / script], set()
    while todo:
        for name in imported_names(todo.pop()):
            parts = name.split(".")
            if parts[0] not in PACKAGES:
                continue
            for depth in range(1, len(parts) + 1):  # importing common.args runs common/__init__.py first
                file = module_file(".".join(parts[:depth]))
                if file is not None and file not in found:
                    found.add(file)
                    todo.append(file)
        if not todo and FAMILIES / "__init__.py" in found and not found >= family_modules():
            todo = sorted(family_modules() - found)
            found |= set(todo)
    found -= family_modules()
    return sorted(str(file.relative_to(ROOT)) for file in found)


def family_modules():
    return {path for path in FAMILIES.glob("*.py") if path.name != "__init__.py"}


def copy_list(script):
    """The files the last line of the script's docstring lists."""
    doc = ast.get_docstring(ast.parse((ROOT / script).read_text()), clean=False) or ""
    last = doc.rstrip().splitlines()[-1] if doc.strip() else ""
    assert last.startswith(PREFIX), f"{script}: its docstring does not end with a '{PREFIX}...' line"
    return last[len(PREFIX):].split(", ")


@pytest.mark.parametrize("script", SCRIPTS)
def test_copy_list_is_what_the_script_imports(script):
    expected = copy_set(script)
    assert copy_list(script) == expected, f"{script}: its docstring should end with\n{PREFIX}{', '.join(expected)}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_docstring_lines_fit_120_columns(script):
    """The copy list is one line (its closing quotes carry `# noqa: E501`); every other docstring line fits."""
    tree = ast.parse((ROOT / script).read_text())
    doc = tree.body[0]
    lines = (ROOT / script).read_text().splitlines()[doc.lineno - 1:doc.end_lineno]
    assert [line for line in lines if len(line) > 120 and not line.startswith(PREFIX)] == []


def copy_into(folder, script):
    for name in [script, *copy_list(script)]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, folder / name)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_copied_with_its_list_answers_help_in_an_empty_folder(script, tmp_path):
    copy_into(tmp_path, script)
    proc = subprocess.run([sys.executable, script, "--help"], cwd=tmp_path, env=offline_env(PYTHONPATH=""),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr[-3000:]


def test_trainer_copied_with_its_list_trains_in_an_empty_folder(digits, tmp_path):
    copy_into(tmp_path, "train_classifier.py")
    launch(tmp_path / "train_classifier.py", "--train_data_dir", digits, "--output_dir", "out",
           "--max_train_samples", "64", "--max_train_steps", "2", "--report_to", "none", cwd=tmp_path,
           env=offline_env(PYTHONPATH=""))
    assert (tmp_path / "out/model.safetensors").exists()



def test_common_has_no_import_cycle():
    """No module of common/ imports, at any depth of its code (function-level imports too), a module that imports it
    back: each has one job, and the layers go one way (the families below base_models.py, the leaves below both)."""
    modules = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
               for path in ROOT.glob("common/**/*.py")}
    edges = {name: {target for target in imported_names(path) if target in modules and target != name}
             for name, path in modules.items()}

    def cycle_from(name, trail):
        if name in trail:
            return trail[trail.index(name):] + [name]
        for target in sorted(edges[name]):
            found = cycle_from(target, trail + [name])
            if found:
                return found
        return None

    cycles = [cycle for name in sorted(modules) if (cycle := cycle_from(name, []))]
    assert not cycles, " -> ".join(cycles[0])
