"""LR schedulers counted in optimizer steps, correct under gradient accumulation and several processes.

A scheduler passed through `accelerator.prepare` steps once per process for every optimizer step (and not at all
on accumulation steps), so every length given to the underlying scheduler is multiplied by `num_processes`.
"""
import torch



def build_lr_scheduler(name, optimizer, num_warmup_steps, num_training_steps, num_processes=1,
                       warmup_start_factor=0.1, lr_min=0.0):
    """Build scheduler `name`; steps are optimizer steps of the whole run (not counting processes)."""
    warmup = num_warmup_steps * num_processes
    if name != "warmup_cosine":
        from diffusers.optimization import get_scheduler  # importing diffusers costs seconds: only when needed

        return get_scheduler(name, optimizer, num_warmup_steps=warmup,
                             num_training_steps=num_training_steps * num_processes)
    # The seed notes' warm-up -> cosine: LR is start_factor*lr at step 0, lr at step `num_warmup_steps`,
    # and lr_min at the last optimizer step (num_training_steps - 1).
    cosine_steps = max(num_training_steps - 1 - num_warmup_steps, 1) * num_processes
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cosine_steps, eta_min=lr_min)
    if num_warmup_steps == 0:
        return cosine
    linear = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=warmup_start_factor, total_iters=warmup)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [linear, cosine], milestones=[warmup])
