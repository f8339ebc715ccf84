"""Run by tests/test_fsdp.py under `accelerate launch` with cpu_fsdp.yaml (2 CPU processes, real FSDP): common/fsdp.py's
clip_grad_norm and load_full_weights against the same computation on an unsharded copy of the model.

A model with frozen weights beside trained ones, in one FSDP unit and in nested ones (as a UNet with LoRA): the
gradient norm must be the norm of the trained weights' gradients over every shard (accelerate's own clipping would
clip each shard by its own norm), and the clipped SGD step the unsharded one. Prints "ok" at the end.
"""
import copy

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from common.cli import leave  # (the repository root is on PYTHONPATH)
from common.fsdp import clip_grad_norm, is_fsdp, load_full_weights

accelerator = Accelerator()
assert is_fsdp(accelerator) and accelerator.num_processes == 2
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                            torch.nn.Linear(64, 4))
model[0].requires_grad_(False)  # frozen weights in the root FSDP unit (the nested one: Linear(64, 64))
model[4].requires_grad_(False)
reference = copy.deepcopy(model)
x = torch.randn(16, 8)  # the same batch on both processes: FSDP's averaged gradients are the unsharded ones


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


optimizer = torch.optim.SGD(trainable(model), lr=1.0)
model, optimizer = accelerator.prepare(model, optimizer)
assert isinstance(model, FSDP) and len(FSDP.fsdp_modules(model)) > 1
accelerator.backward(model(x).pow(2).sum())
norm = clip_grad_norm(accelerator, [model], trainable(model), 0.05)
optimizer.step()

reference(x).pow(2).sum().backward()
expected = torch.nn.utils.clip_grad_norm_(trainable(reference), 0.05)
torch.optim.SGD(trainable(reference), lr=1.0).step()
assert expected > 0.05 and torch.allclose(norm, expected, rtol=1e-5), (norm, expected)  # it clipped, by the total
with FSDP.summon_full_params(model):
    for (name, got), want in zip(accelerator.unwrap_model(model).state_dict().items(),
                                 reference.state_dict().values()):
        assert torch.allclose(got, want, atol=1e-6), name

# load_full_weights: the reference's weights into the sharded model, every process.
state = {k: v + 1 for k, v in reference.state_dict().items()}
load_full_weights(accelerator, model, state)
with FSDP.summon_full_params(model):
    got = accelerator.unwrap_model(model).state_dict()
    assert all(torch.equal(got[k], state[k]) for k in state), "load_full_weights"
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    print("ok")
accelerator.end_training()
leave()  # as the recipes' run() does: no interpreter teardown for gloo's worker threads to abort
