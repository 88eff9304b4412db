"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (what a cluster scheduler sends before preemption).

The first signal asks the training loop to stop after the current step: it saves a checkpoint and
raises Interrupted, which the CLI turns into a resume hint and exit status 128 + signal (130, 143).
A second signal ends the process at once with the signal's default action; copies arriving within a
second of the first count as the first, because a terminal's Ctrl-C reaches torchrun and its workers
together and torchrun forwards its own copy to the workers.
"""

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist


class Interrupted(Exception):
    """Training stopped on a signal after saving `checkpoint` at `step`."""

    def __init__(self, signum: int, step: int, checkpoint):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; saved {checkpoint}")


class StopOnSignal:
    """A context in which SIGINT/SIGTERM set a flag (the main thread only: Python delivers signals
    there) instead of killing the process; `requested` reads it for the loop."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum, self.first, self.previous = 0, 0.0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum and time.monotonic() - self.first > 1.0:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif not self.signum:
            self.signum, self.first = signum, time.monotonic()
            name = signal.Signals(signum).name
            print(
                f"\n{name}: finishing this step, then saving a checkpoint (again: exit now)", file=sys.stderr
            )

    def requested(self, device: torch.device) -> int:
        """The signal any rank received (0: none). Under torchrun every rank calls it after each step,
        so all stop after the same one: one all-reduce of a scalar per step."""
        if not dist.is_initialized():
            return self.signum
        flag = torch.tensor(self.signum, device=device)
        dist.all_reduce(flag, dist.ReduceOp.MAX)
        return int(flag)
