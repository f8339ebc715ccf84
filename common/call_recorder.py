"""Watch a call run: timed wrappers around methods and forward hooks on modules, each removable.

inspect_pipeline.py --trace uses it so that a pipeline runs its own code while we record shapes and wall times;
nothing is re-implemented, so what is recorded is what ran.
"""
import functools
import time


def shape(x):
    """A tensor's shape as a JSON-able list; None for anything else."""
    return list(x.shape) if hasattr(x, "shape") else None


def scalar(t):
    """A timestep (tensor or number) as an int when it is one, else a rounded float (Euler's sigmas-based ones)."""
    value = float(t)
    return int(value) if value.is_integer() else round(value, 4)


class CallRecorder:
    """Collects `stages` (dicts in call order); remove() takes every wrapper and hook away again."""

    def __init__(self, cuda=False):
        self.cuda, self.stages, self.last_end, self._undo = cuda, [], None, []

    def clock(self):
        if self.cuda:  # GPU work is asynchronous: wait for it, or its time lands in a later stage
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, stage, ms, **info):
        entry = {"stage": stage, "ms": round(ms, 3), **info}
        self.stages.append(entry)
        return entry

    def wrap(self, owner, name, record):
        """owner.name(...) also calls record(args, kwargs, result, ms, start). The wrapper is an instance attribute
        that shadows the class's method; functools.wraps keeps the signature, which pipelines inspect (eta,
        generator)."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*a, **kw):
            start = self.clock()
            out = original(*a, **kw)
            self.last_end = self.clock()
            record(a, kw, out, (self.last_end - start) * 1e3, start)
            return out

        had = name in vars(owner)
        setattr(owner, name, wrapper)
        self._undo.append(lambda: setattr(owner, name, original) if had else delattr(owner, name))

    def hook(self, module, pre, post):
        """Forward pre-hook pre(module, args, kwargs) and hook post(module, args, kwargs, output) on a module."""
        self._undo.append(module.register_forward_pre_hook(pre, with_kwargs=True).remove)
        self._undo.append(module.register_forward_hook(post, with_kwargs=True).remove)

    def remove(self):
        while self._undo:
            self._undo.pop()()
