"""Optimizer parameter groups: per-module learning rates, and no weight decay on biases and norm weights."""
from .cli import UserError


def parse_lr_groups(text):
    """`image_model=2e-5,text_model=4e-5` -> {"image_model": 2e-5, "text_model": 4e-5}."""
    groups = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        prefix, sep, value = item.partition("=")
        try:
            lr = float(value)
        except ValueError:
            lr = None
        if not sep or not prefix or lr is None or lr <= 0:
            raise UserError(f"--lr_groups: '{item}' is not PREFIX=LR with a positive LR (e.g. text_model=4e-5)")
        groups[prefix.strip()] = lr
    return groups


def build_param_groups(model, learning_rate, weight_decay, lr_groups=None):
    """One group per (prefix, decay/no-decay). Longest matching prefix wins; the rest use `learning_rate`."""
    import torch

    norms = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase, torch.nn.RMSNorm)
    lr_groups = lr_groups or {}
    module_names = {name for name, _ in model.named_modules()}
    for prefix in lr_groups:
        if prefix not in module_names:
            top = ", ".join(name for name, _ in model.named_children())
            raise UserError(f"--lr_groups: no module named '{prefix}'; top-level modules are: {top}")
    no_decay = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(module, norms) or param_name == "bias" or param.ndim < 2:
                no_decay.add(f"{module_name}.{param_name}" if module_name else param_name)
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matches = [p for p in lr_groups if name.startswith(p + ".")]
        prefix = max(matches, key=len) if matches else "default"
        decay = name not in no_decay
        key = f"{prefix}" if decay else f"{prefix}/no_decay"
        if key not in groups:
            groups[key] = {"name": key, "params": [], "lr": lr_groups.get(prefix, learning_rate),
                           "weight_decay": weight_decay if decay else 0.0}
        groups[key]["params"].append(param)
    return list(groups.values())
