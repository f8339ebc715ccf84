"""SIGTERM / SIGINT during training: finish the optimizer step, checkpoint on every process, exit 143 / 130.

A cluster preempts a job with SIGTERM (then SIGKILL after a grace period); Ctrl-C sends SIGINT. The handler only
records the signal; the loop asks `should_stop()` at each optimizer-step boundary, so the checkpoint holds a
consistent state. With several processes the signal may reach only some of them, so they agree through one
all-reduce, done every `check_every` steps to keep per-step host syncs away from the hot path. A second signal
stops at once, without a checkpoint (for a Ctrl-C during a long start-up), if it comes a second or more after the
first: sooner, it is a copy of the same event (torchrun forwards the signal it got to every worker, and a job
scheduler such as Slurm may signal every process of the job as well).
"""
import signal
import sys
import time

REPEAT_AFTER_S = 1.0  # a second signal this long after the first means "stop now"


class PreemptionGuard:
    def __init__(self, accelerator, check_every=1):
        self.accelerator = accelerator
        self.check_every = check_every if accelerator.num_processes > 1 else 1
        self.received = 0  # the signal this process got
        self.received_at = 0.0
        self.signum = 0  # the signal the processes agreed on
        self._previous = {sig: signal.signal(sig, self._record) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _record(self, signum, frame):
        if self.received:  # a second Ctrl-C / SIGTERM: stop now, without a checkpoint (the last one stays good)
            if time.monotonic() - self.received_at < REPEAT_AFTER_S:
                return  # the same event again (a launcher's or a scheduler's copy)
            print(f"{signal.Signals(signum).name} again: stopping now, without a checkpoint", file=sys.stderr,
                  flush=True)
            raise SystemExit(128 + signum)
        self.received, self.received_at = signum, time.monotonic()

    def should_stop(self, global_step):
        """True on every process once any process got a signal (checked every `check_every` steps)."""
        if self.accelerator.num_processes == 1:
            self.signum = self.received
            return bool(self.signum)
        if global_step % self.check_every:
            return False
        import torch

        flag = torch.tensor(self.received, device=self.accelerator.device)
        self.signum = int(self.accelerator.reduce(flag, "max"))
        return bool(self.signum)

    def exit(self, checkpoint):
        """After the checkpoint is written: one line, then the conventional exit code 128 + signal number."""
        name = signal.Signals(self.signum).name
        if self.accelerator.is_main_process:
            print(f"{name} received: stopped after a complete optimizer step; saved {checkpoint}. "
                  f"Continue with --resume_from_checkpoint latest", file=sys.stderr, flush=True)
        sys.exit(128 + self.signum)  # the script's `finally` still ends the trackers

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
