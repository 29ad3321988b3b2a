"""Stopping cleanly before a scheduler kills the job: SIGTERM / SIGUSR1 (what SLURM's `--signal` and
Kubernetes send first), Ctrl-C (SIGINT) or --time_limit.

A signal only sets a flag; after each optimizer step the ranks agree (the flags summed in the step's own
all-reduce of its figures and read with them; a collective of their own after a step that saves or
evaluates), so every rank stops after the same step even when one rank alone was signalled. The trainer then writes a complete
checkpoint and the process exits with PREEMPTED_EXIT_CODE, which `launch/slurm.sbatch` turns into a requeue.
Further signals are ignored from then on: the save finishes, and a kill that still comes (SIGKILL after the
grace period) leaves a checkpoint without its COMPLETE marker, which no resume loads. Ctrl-C is the exception:
its first SIGINT stops like SIGTERM (rank 0 says so in one line), a second one ends the process at once, by
SIGINT's default action (no traceback, no save: the newest complete checkpoint stays the one to resume from).

scancel, a time limit and --signal reach every process of the job step: DataLoader workers ignore these
signals (the rank decides), and from the rank's first one on a worker that dies anyway is no error: the rank
reads the rows it still needs itself (dstrain/data/loader.py, told by `watch_stop`).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from dstrain import dist
from dstrain.data.loader import watch_stop

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"; the run resumes with --resume auto
# DataLoader workers ignore them (data/loader.py WORKER_IGNORED_SIGNALS): the rank decides
SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
CTRL_C_LINE = (
    "dstrain: Ctrl-C: stopping after this step with a complete checkpoint (--resume auto continues); "
    "Ctrl-C again stops at once, unsaved\n"
)


class Preemption:
    """Install with `start()`; `should_stop(step_time_s)` after each step (every rank, collectively)."""

    def __init__(self, time_limit_min: float | None, device: torch.device) -> None:
        self.device = device
        self.deadline = None if not time_limit_min else time.monotonic() + 60.0 * time_limit_min
        self.received: str | None = None
        self.reason: str | None = None
        self.save_s = 0.0  # the longest save so far: what stopping before the deadline must leave room for
        self._previous: dict[int, Any] = {}
        self._agreed: bool | None = None  # decided in the step's own read (`agree`): no collective of its own

    def start(self) -> None:
        for name in SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        watch_stop(self.stopping)

    def stop(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        watch_stop(None)

    def stopping(self) -> bool:
        """Whether this rank stops after the current step (or is stopping): it has a signal, or the ranks
        agreed to stop."""
        return self.received is not None or self.reason is not None

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal handler signature
        self.received = self.received or signal.Signals(signum).name
        if signum == signal.SIGINT:
            # The next Ctrl-C is "stop now": the default action ends the process even inside a collective or
            # a save, where a Python handler would wait for the call to return.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if dist.env_rank() == 0:
                os.write(2, CTRL_C_LINE.encode())  # not print: the handler may interrupt a print

    def local_flags(self, step_time_s: float) -> torch.Tensor:
        """This rank's [signalled, out of time] (float64): summed over the ranks in the trainer's one
        all-reduce of the step, and read with its figures (`agree`), instead of a collective and a host sync
        of its own after every step."""
        late = self.deadline is not None and time.monotonic() + 2 * step_time_s + self.save_s > self.deadline
        return torch.tensor([float(self.received is not None), float(late)], dtype=torch.float64)

    def agree(self, summed: list[float]) -> None:
        """The world's sums of `local_flags`: the next `should_stop` answers from them."""
        self._agreed = self._decide(summed[0] > 0, summed[1] > 0)

    def should_stop(self, step_time_s: float) -> bool:
        """Whether any rank was signalled, or the next step and a save would not fit before --time_limit."""
        if self._agreed is not None:
            agreed, self._agreed = self._agreed, None
            return agreed
        flags = self.local_flags(step_time_s).to(self.device, torch.float32)
        signalled, out_of_time = (bool(x) for x in dist.all_reduce(flags, torch.distributed.ReduceOp.MAX))
        return self._decide(signalled, out_of_time)

    def _decide(self, signalled: bool, out_of_time: bool) -> bool:
        if signalled:
            self.reason = self.received or "a signal to another rank"
        elif out_of_time:
            self.reason = "--time_limit"
        if self.reason:
            # From here on more signals change nothing: ignored (not left to the default action, which Python
            # restores while it exits), so the save and the exit with the documented code go through.
            for sig in self._previous:
                if sig != signal.SIGINT:  # a second Ctrl-C still stops at once (_on_signal)
                    signal.signal(sig, signal.SIG_IGN)
        return signalled or out_of_time
