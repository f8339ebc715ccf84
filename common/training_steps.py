"""Step accounting shared by the loops: how many optimizer steps a run makes, and where a resumed run picks up."""
import math


def plan_steps(batches_per_epoch, gradient_accumulation_steps, num_train_epochs, max_train_steps=None):
    """-> (optimizer steps per epoch, total optimizer steps, epochs).

    accelerate steps the optimizer at the end of every epoch even when the last accumulation cycle is short,
    hence the ceil. `max_train_steps` wins over `num_train_epochs` when given.
    """
    per_epoch = math.ceil(batches_per_epoch / gradient_accumulation_steps)
    total = max_train_steps if max_train_steps is not None else num_train_epochs * per_epoch
    return per_epoch, total, math.ceil(total / per_epoch)


def resume_position(global_step, steps_per_epoch, gradient_accumulation_steps, max_train_steps):
    """(epoch, batches of that epoch already seen) after `global_step` optimizer steps.

    A checkpoint at (or past) the last step -> the epoch after the last one: the loop runs no further step.
    """
    if global_step >= max_train_steps:
        return math.ceil(max_train_steps / steps_per_epoch), 0
    epoch = global_step // steps_per_epoch
    return epoch, (global_step % steps_per_epoch) * gradient_accumulation_steps
