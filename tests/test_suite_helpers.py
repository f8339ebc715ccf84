"""The suite's own machinery (tests/conftest.py): its scheduler (each module, or test_lora_flow.py's family, whole on
one worker; the longest first) and the launch server (a one-process launch forked from imported libraries)."""
import subprocess
import sys

import pytest
from conftest import launch, longest_scope_first

SENT = []  # (worker, [node ids]) in the order the scheduler sends them


class Worker:
    """What pytest-xdist's scheduler asks of a worker: the tests it is sent, by index in its collection."""

    def __init__(self, name, collection):
        self.gateway = type("Gateway", (), {"id": name})()
        self.name, self.collection, self.shutting_down = name, collection, False

    def send_runtest_some(self, indexes):
        SENT.append((self.name, [self.collection[i] for i in indexes]))

    def shutdown(self):
        self.shutting_down = True


def test_scopes_go_whole_to_a_worker_the_longest_first(pytestconfig, monkeypatch):
    monkeypatch.setattr(pytestconfig.option, "tx", ["popen"] * 2, raising=False)  # as `-n 2` sets them
    monkeypatch.setattr(pytestconfig.option, "numprocesses", 2, raising=False)
    collection = ["tests/test_a.py::test_one", "tests/test_a.py::test_two", "tests/test_b.py::test_one",
                  "tests/test_lora_flow.py::test_x[flux]", "tests/test_lora_flow.py::test_x[sd3]",
                  "tests/test_lora_flow.py::test_y[flux]", "tests/test_c.py::test_one"]
    seconds = {"tests/test_b.py": 100.0, "tests/test_lora_flow.py[sd3]": 50.0, "tests/test_a.py": 1.0}
    scheduler = longest_scope_first(pytestconfig, None, seconds)
    for name in ("gw0", "gw1"):
        worker = Worker(name, collection)
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    SENT.clear()
    scheduler.schedule()
    # b (100 s) and lora_flow[sd3] (50 s) first, one a worker; then lora_flow[flux] (2 tests without a record: 4 s),
    # c (2 s), a (1 s); each scope whole
    assert SENT == [("gw0", ["tests/test_b.py::test_one"]), ("gw1", ["tests/test_lora_flow.py::test_x[sd3]"]),
                    ("gw0", ["tests/test_lora_flow.py::test_x[flux]", "tests/test_lora_flow.py::test_y[flux]"]),
                    ("gw1", ["tests/test_c.py::test_one"])]
    assert list(scheduler.workqueue) == ["tests/test_a.py"]  # for the first worker that runs low


PROBE = """import os, signal, sys, time
print("out", __name__, sys.argv[1:], os.getcwd() == {cwd!r}, sys.path[0] == {folder!r})
print("err", file=sys.stderr)
what = sys.argv[1]
if what == "exit":
    sys.exit(3)
if what == "raise":
    raise ValueError("boom")
if what == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
if what == "sleep":
    time.sleep(60)
"""


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_forked_launch_runs_a_script_as_a_new_interpreter_does(fresh, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(cwd=str(tmp_path / "work"), folder=str(tmp_path)))
    (tmp_path / "work").mkdir()
    runs = {what: launch(script, what, cwd=tmp_path / "work", check=False, fresh=fresh)
            for what in ("ok", "exit", "raise", "signal")}
    assert runs["ok"].returncode == 0 and runs["ok"].stdout == "out __main__ ['ok'] True True\n"
    assert runs["ok"].stderr == "err\n" and runs["exit"].returncode == 3
    assert runs["raise"].returncode == 1 and runs["raise"].stderr.rstrip().endswith("ValueError: boom")
    assert "Traceback" in runs["raise"].stderr and runs["signal"].returncode == -15
    assert all(run.args[0] == sys.executable and run.args[2] == str(run_name) for run, run_name in
               zip(runs.values(), runs))
    with pytest.raises(subprocess.TimeoutExpired):
        launch(script, "sleep", cwd=tmp_path, timeout=1, fresh=fresh)
    assert launch(script, "ok", cwd=tmp_path / "work", fresh=fresh).returncode == 0  # and the next one runs
