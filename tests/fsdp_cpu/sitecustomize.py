"""FSDP on CPU processes, for tests/test_fsdp.py: Python imports this file at start-up when this folder is on
PYTHONPATH (the tests put it there; nothing else does).

accelerate 1.15 sets `DistributedType.FSDP` only for GPU-like devices: launched with `ACCELERATE_USE_CPU=1` and an FSDP
config it keeps `MULTI_CPU` and trains with plain DDP (without the variable, each process trains alone). torch's
FSDP itself runs on CPU with gloo when given `device_id=torch.device("cpu")`. This lifts that one gate: when the
launcher asked for FSDP on CPU processes, accelerate's state says FSDP and its device is the plain CPU (accelerate
passes it to FSDP as `device_id`). Everything else, accelerate's FSDP wrapping, its sharded checkpoints and the
recipes' FSDP code, runs as it would on GPUs.
"""
import os

if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and os.environ.get("ACCELERATE_USE_CPU"):
    import accelerate.state
    import torch
    from accelerate.utils import DistributedType

    _init = accelerate.state.AcceleratorState.__init__

    def _init_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
        _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # Both shared states: AcceleratorState copies PartialState's every time one is made.
            for shared in (accelerate.state.PartialState._shared_state, self.__dict__):
                shared.update(distributed_type=DistributedType.FSDP, device=torch.device("cpu"))
            self.fsdp_plugin = fsdp_plugin

    accelerate.state.AcceleratorState.__init__ = _init_fsdp_on_cpu
