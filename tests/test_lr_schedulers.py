"""The LR over a whole run, measured in a real accelerate loop: 1 and 2 processes, accumulation 1 and 4."""
import json
import math

import pytest
import torch
from conftest import ROOT, launch

from common.training import build_lr_scheduler


@pytest.mark.parametrize("config,processes", [("cpu.yaml", 1), ("cpu_2proc.yaml", 2)])
def test_warmup_cosine_over_a_real_run(tmp_path, config, processes):
    out = tmp_path / "lrs.json"
    launch(ROOT / "tests/scripts/lr_probe.py", ROOT, out, "warmup_cosine", 2, 1, 4, config=config)
    result = json.loads(out.read_text())
    assert result["num_processes"] == processes
    for accumulation in (1, 4):
        lrs, total = result[str(accumulation)]["lrs"], result[str(accumulation)]["total"]
        batches = math.ceil(25 / processes)
        assert total == 2 * math.ceil(batches / accumulation) and len(lrs) == total  # one LR per optimizer step
        assert lrs[0] == pytest.approx(1e-3)  # start_factor * lr
        assert lrs[3] == pytest.approx(1e-2)  # lr exactly when the 3 warm-up steps end
        assert lrs[-1] == pytest.approx(1e-4)  # lr_min at the last optimizer step
        assert all(a < b for a, b in zip(lrs[:3], lrs[1:4]))
        assert all(a > b for a, b in zip(lrs[3:-1], lrs[4:]))


@pytest.mark.parametrize("name", ["constant", "constant_with_warmup", "linear", "cosine", "polynomial"])
def test_library_schedulers_scaled_by_processes(name):
    def lrs(processes):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = build_lr_scheduler(name, optimizer, 2, 10, num_processes=processes)
        seen = []
        for _ in range(10):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            for _ in range(processes):  # what a prepared scheduler does per optimizer step
                scheduler.step()
        return seen

    assert lrs(1) == pytest.approx(lrs(2))
    if name != "constant":
        assert lrs(1)[0] == 0.0 and lrs(1)[2] == pytest.approx(1.0)


def test_warmup_zero_is_plain_cosine():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler("warmup_cosine", optimizer, 0, 5, lr_min=0.1)
    seen = []
    for _ in range(5):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen[0] == pytest.approx(1.0) and seen[-1] == pytest.approx(0.1)
