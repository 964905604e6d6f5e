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


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MAP_ABOVE = 1 << 20
"""Allocations of at least this many bytes get their own mapping (:func:`map_large_allocations`)."""
# Kept process-wide (issue 38): glibc has one allocator per process, so the setting is the process's by nature; it is
# made only by curation's task runner (each task process, and the orchestrator that merges their parts), never on import.
_mapped_above: int | None = None


def map_large_allocations(threshold: int = MAP_ABOVE) -> bool:
    """Serve every allocation of ``threshold`` bytes or more from its own mapping (glibc ``mallopt``
    M_MMAP_THRESHOLD), so freeing a large array gives its pages back to the system at once.

    glibc's default threshold starts at 128 KiB and rises to the size of each mapped block freed, up to 32 MiB:
    after a few frees, arrays of a task's working size (a few MB to 32 MB: 2.5M hashes, a list of an inverted
    file) come from the heap, whose freed pages it keeps and fragments. A curation task then holds more than its
    live arrays, and the more so the smaller its share: measured on the hash pairs of 10M rows, one task of four
    peaked at 440 MB of resident heap for 371 MB of live arrays (tracemalloc), 387 MB with this set. A fixed
    threshold also ends the dynamic rise. Process-wide and idempotent; False where the C library is not glibc."""
    global _mapped_above
    if _mapped_above == threshold:
        return True
    try:
        import ctypes

        ok = bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        ok = False
    _mapped_above = threshold if ok else None
    return ok
