"""A NaN/inf loss: stop before its update reaches the weights (so the last checkpoint stays good), or skip it.

Checked once per optimizer step, before `optimizer.step()`: one host sync per step, plus one all-reduce with several
processes so that all of them decide alike (a NaN on one rank reaches every rank through the gradient all-reduce).
The check is on the loss, not the gradients: under fp16 an overflowing gradient is normal, the grad scaler skips it.
"""
import logging

from .cli import UserError

logger = logging.getLogger(__name__)


def finite_step(accelerator, loss_sum, step, skip):
    """True when optimizer step `step` may update the weights.

    A non-finite loss raises UserError (one line naming the step, exit 2), or returns False when `skip`
    (--skip_nonfinite_steps): the caller then leaves out clipping and `optimizer.step()` for this step.
    """
    import torch

    bad = (~torch.isfinite(loss_sum)).float()
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, "max")
    if not bad.item():
        return True
    if not skip:
        raise UserError(f"the loss is not finite ({loss_sum.item()}) at optimizer step {step}: stopped before that "
                        "update, the checkpoints written so far are good. Lower --learning_rate or check the data; "
                        "--skip_nonfinite_steps skips such steps instead")
    if accelerator.is_main_process:
        logger.warning(f"optimizer step {step}: the loss is not finite ({loss_sum.item()}); update skipped "
                       "(--skip_nonfinite_steps)")
    return False
