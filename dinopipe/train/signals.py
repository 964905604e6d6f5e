"""Preemption: SIGUSR1 (Slurm's ``--signal=USR1@...`` warning) or SIGTERM asks the loop to save a
checkpoint at the next step boundary and exit, so ``--requeue`` restarts it from there."""

from __future__ import annotations

import signal
from typing import Optional

EXIT_PREEMPTED = 124  # what the loop exits with after a preemption save; the sbatch script requeues on it


class PreemptionFlag:
    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)) -> None:
        self.received: Optional[int] = None
        self._old = {}
        for s in signals:
            try:
                self._old[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass

    def _handler(self, signum, frame) -> None:
        self.received = signum

    def __bool__(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


__all__ = ["PreemptionFlag", "EXIT_PREEMPTED"]
