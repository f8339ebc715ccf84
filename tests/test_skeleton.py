"""The trainers share one skeleton: their `main` functions are the same lines in the same order, except the parts that
are the recipe's own, so that `diff train_ddpm.py train_lora.py` shows what is really different.

Marker syntax, inside `main`: a domain region (lines that are one recipe's own) starts with a comment line
`# <domain: what it is>` and ends with a comment line `# </domain>`, at any indentation; regions do not nest.
A numbered section header (`# 3. Model: ...`) is shared up to its number: its text, and the `#    ...` comment lines
that continue it, are the recipe's own.

Masking removes each region (markers included) and every header's text; what is left must be identical, byte for
byte, in every trainer. No model is built and nothing is run: the test reads the sources.
"""
import ast
import difflib
import re

import pytest
from conftest import ROOT

TRAINERS = ["train_classifier.py", "train_ddpm.py", "train_lora.py", "train_text_to_image.py"]
START = re.compile(r"^\s*# <domain: \S.*>$")
END = re.compile(r"^\s*# </domain>$")
HEADER = re.compile(r"^(\s*# \d+\.)\s")
CONTINUATION = re.compile(r"^\s*#    ")


def main_lines(source):
    """The lines of `def main(...)`, found with ast (decorators none, comments included)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            return source.splitlines()[node.lineno - 1:node.end_lineno]
    raise AssertionError("no top-level main()")


def skeleton(lines, name="main"):
    """`lines` without the domain regions and the section headers' text; a malformed region fails."""
    kept, start, in_header = [], None, False
    for number, line in enumerate(lines, 1):
        if START.match(line):
            assert start is None, f"{name}, line {number} of main: a domain region opens inside the one of line {start}"
            start = number
        elif END.match(line):
            assert start is not None, f"{name}, line {number} of main: '# </domain>' closes no region"
            start = None
        elif "<domain" in line or "</domain" in line:
            raise AssertionError(f"{name}, line {number} of main: not a marker: {line.strip()!r}")
        elif start is None:
            if in_header and CONTINUATION.match(line):
                continue
            header = HEADER.match(line)
            in_header = header is not None
            kept.append(header.group(1) if header else line)
    assert start is None, f"{name}: the domain region opened at line {start} of main is never closed"
    return kept


def read_skeleton(script):
    return skeleton(main_lines((ROOT / script).read_text()), script)


def test_every_trainer_has_the_same_skeleton():
    first, *others = TRAINERS
    reference = read_skeleton(first)
    for script in others:
        lines = read_skeleton(script)
        if lines != reference:
            diff = "\n".join(difflib.unified_diff(reference, lines, first, script, lineterm=""))
            pytest.fail(f"the shared lines of main() differ (domain regions and header texts masked):\n{diff}")


def test_the_skeleton_has_the_numbered_sections_in_order():
    numbers = [int(line.strip()[2:-1]) for line in read_skeleton(TRAINERS[0]) if HEADER.match(line + " ")]
    assert numbers == list(range(1, 10))


def test_an_edit_to_one_shared_line_is_caught():
    """The masking keeps what it must: a shared line changed in one trainer makes the skeletons differ."""
    lines = main_lines((ROOT / TRAINERS[0]).read_text())
    shared = [i for i, line in enumerate(lines) if "loss_sum.zero_()" in line]
    assert len(shared) == 1
    edited = lines[:shared[0]] + [lines[shared[0]] + "  # edited"] + lines[shared[0] + 1:]
    assert skeleton(edited) != skeleton(lines)


@pytest.mark.parametrize("bad", [["# <domain: a>", "x = 1"], ["x = 1", "# </domain>"],
                                 ["# <domain: a>", "# <domain: b>", "# </domain>", "# </domain>"], ["# <domain>"]])
def test_malformed_markers_fail(bad):
    with pytest.raises(AssertionError):
        skeleton(bad)


@pytest.mark.parametrize("script", TRAINERS)
def test_module_layout(script):
    """parse_args() then main() (helpers after it, constants and flag types before), and the file ends with the run."""
    tree = ast.parse((ROOT / script).read_text())
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert functions[functions.index("parse_args") + 1] == "main", functions
    assert ast.unparse(tree.body[-1]) == "if __name__ == '__main__':\n    run(main, parse_args)"
