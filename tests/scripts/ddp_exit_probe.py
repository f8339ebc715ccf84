"""A few DDP steps of a small model under common.cli.run, as the recipes run, then a normal exit (for
test_reliability's exit test): the process must exit 0 on every rank.

usage: ddp_exit_probe.py ROOT
"""
import os
import sys

sys.path.insert(0, sys.argv[1])
from common import cli  # noqa: E402

if os.environ.get("PROBE_PLAIN_EXIT"):  # (to see the test fail without common.cli.leave)
    cli.leave = lambda code=0: None


def main(args):
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(3):
        accelerator.backward(model(torch.randn(8, 16)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    accelerator.wait_for_everyone()
    accelerator.end_training()


cli.run(main, lambda argv: None)
