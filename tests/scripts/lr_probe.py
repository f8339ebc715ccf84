"""Runs real accelerate loops and writes the LR in force at each optimizer step (for test_lr_schedulers).

usage: lr_probe.py ROOT OUT.json SCHEDULER EPOCHS ACCUMULATION [ACCUMULATION ...]
"""
import json
import sys

import torch
from accelerate import Accelerator

sys.path.insert(0, sys.argv[1])
from common.cli import leave  # noqa: E402
from common.training import build_lr_scheduler, plan_steps  # noqa: E402

out, name, epochs, accumulations = sys.argv[2], sys.argv[3], int(sys.argv[4]), [int(a) for a in sys.argv[5:]]
accelerator = Accelerator()
results = {"num_processes": accelerator.num_processes}
for accumulation in accumulations:
    accelerator.gradient_accumulation_steps = accumulation
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.DataLoader(torch.randn(50, 4), batch_size=2)
    steps_per_epoch, total, _ = plan_steps(-(-len(data) // accelerator.num_processes), accumulation, epochs)
    scheduler = build_lr_scheduler(name, optimizer, num_warmup_steps=3, num_training_steps=total,
                                   num_processes=accelerator.num_processes, warmup_start_factor=0.1, lr_min=1e-4)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    lrs = []
    for _ in range(epochs):
        for x in data:
            with accelerator.accumulate(model):
                accelerator.backward(model(x).pow(2).mean())
                if accelerator.sync_gradients:
                    lrs.append(optimizer.param_groups[0]["lr"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    results[str(accumulation)] = {"lrs": lrs, "total": total}
if accelerator.is_main_process:
    json.dump(results, open(out, "w"))
accelerator.wait_for_everyone()
accelerator.end_training()
leave()  # as the recipes' run() does: no interpreter teardown for gloo's worker threads to abort
