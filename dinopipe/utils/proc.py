"""Processes: the cores this one may use, and ending one whose work is done and whose process group is destroyed."""

from __future__ import annotations

import logging
import os
import sys


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask (what a Slurm allocation, taskset or a cgroup cpuset
    gives it), not the machine's count -- ``os.cpu_count()`` says 128 on a node where a job holds 8 of them."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API on this platform
        return max(1, os.cpu_count() or 1)


def exit_now(rc: int = 0) -> None:
    """Exit with ``rc`` now, without interpreter finalisation. For a process that was one rank of a gloo group
    and has finished, written and closed its outputs and destroyed the group (barrier first): gloo's worker
    threads can still hold work objects whose destruction at interpreter exit aborts the process ("terminate
    called without an active exception", SIGABRT), which its launcher (torchrun, srun, torch.multiprocessing)
    then reports as failed although the work is complete (pytorch/pytorch PR 179291 describes the mechanism; seen
    here after complete 2-rank pretrain runs and in 2-rank test workers)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(int(rc))


__all__ = ["usable_cores", "exit_now"]
