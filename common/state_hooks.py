"""save/load-state hooks: `accelerator.save_state` writes each model in from_pretrained form, `load_state` reads it.

The seed notes' pattern: the save hook writes every prepared model with `save_pretrained` into its own subfolder
and pops its weights so accelerate does not write them a second time; the load hook pops the models and loads
them back from those subfolders. Extra objects (an EMA model) ride along through `extra_save`/`extra_load`.
"""
import os

import safetensors.torch


def _has_pretrained_io(model):
    return hasattr(model, "save_pretrained") and hasattr(type(model), "from_pretrained")


def _save(model, path):
    if _has_pretrained_io(model):
        model.save_pretrained(path, safe_serialization=True)
    else:
        os.makedirs(path, exist_ok=True)
        safetensors.torch.save_model(model, os.path.join(path, "model.safetensors"))


def _load(model, path):
    if _has_pretrained_io(model):
        loaded = type(model).from_pretrained(path)
        model.load_state_dict(loaded.state_dict())
    else:
        safetensors.torch.load_model(model, os.path.join(path, "model.safetensors"))


def register_state_hooks(accelerator, named_models, save_fn=_save, load_fn=_load, extra_save=None, extra_load=None):
    """named_models: {subfolder: model} (the models that were passed to `prepare`, unwrapped with
    keep_torch_compile=False).

    save_fn(model, path) / load_fn(model, path) override how a model is written and read (e.g. LoRA weights only).
    extra_save(output_dir) / extra_load(input_dir) handle state that is not a prepared model, such as EMA.
    """

    def unwrap(model):  # without DDP and torch.compile wrappers: the weights' own names, for from_pretrained
        return accelerator.unwrap_model(model, keep_torch_compile=False)

    def folder_of(model):
        model = unwrap(model)
        for name, candidate in named_models.items():
            if candidate is model:
                return name
        raise ValueError(f"save/load hook: {type(model).__name__} is not one of {list(named_models)}")

    def save_hook(models, weights, output_dir):
        import torch

        # RNG-neutral: some savers build a model to write (diffusers' EMAModel.save_pretrained inits a UNet from its
        # config), which draws from the global generator; a run that saves at step N must draw the same numbers
        # afterwards as one that does not, or a stop-and-resume at N would not match the uninterrupted run.
        with torch.random.fork_rng(devices=[]):
            for model in models:
                if accelerator.is_main_process:
                    save_fn(unwrap(model), os.path.join(output_dir, folder_of(model)))
                if weights:
                    weights.pop()  # written above; accelerate must not write it again
            if extra_save is not None and accelerator.is_main_process:
                extra_save(output_dir)

    def load_hook(models, input_dir):
        while models:
            model = models.pop()
            load_fn(unwrap(model), os.path.join(input_dir, folder_of(model)))
        if extra_load is not None:
            extra_load(input_dir)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
