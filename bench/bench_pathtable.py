"""The path table: the old whole build (one process, every id) vs the W-task build, at N synthetic ids.

    python bench/bench_pathtable.py --n 1000000 --parts 64 --tasks 1 4 --work /tmp/ptable

Prints, per build: wall time (without tracing) and the peak Python/numpy heap (tracemalloc) of each task and
of the single-process passes between them; the tasks run inline, one after another in this process. Checks
that every build wrote the same bytes. The old build is tests/curation/_pathtable_whole.py.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from curation.core import pathtable  # noqa: E402
from curation.core import table as tt  # noqa: E402
from tests.curation._pathtable_whole import build_whole  # noqa: E402
from tests.curation.test_pathtable_tasks import FILES, synthetic_parts  # noqa: E402


def traced_tasks(emb: str, metas, rows, w: int) -> dict:
    """Peak heap of each task and of the rest (the passes between the phases) of one W-task build."""
    peaks: dict[str, int] = {}
    real = {name: getattr(tt, name) for name in ("run_task", "rank_task", "copy_task")}

    def wrap(name):
        def fn(t, n, **kw):  # the peak since the last task ended: a single-process pass between them
            peaks["passes between tasks"] = max(peaks.get("passes between tasks", 0), tracemalloc.get_traced_memory()[1])
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            out = real[name](t, n, **kw)
            peaks[f"{name}[{t}]"] = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.reset_peak()
            return out
        return fn

    for name in real:
        setattr(tt, name, wrap(name))
    tracemalloc.start()
    try:
        pathtable.build_table(emb, metas, rows, num_tasks=w)
        peaks["passes between tasks"] = max(peaks.get("passes between tasks", 0), tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()
        for name, fn in real.items():
            setattr(tt, name, fn)
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--parts", type=int, default=64)
    ap.add_argument("--tasks", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--work", default="/tmp/bench_pathtable")
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    emb = os.path.join(a.work, "emb")
    metas, rows = synthetic_parts(emb, a.n, a.parts)
    ref = os.path.join(a.work, "whole")
    t0 = time.perf_counter()
    build_whole(emb, metas, rows, ref)
    old_s = time.perf_counter() - t0
    tracemalloc.start()
    build_whole(emb, metas, rows, ref)
    old_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"whole build: {old_s:.1f} s, peak heap {old_peak / 2**20:.0f} MB ({old_peak / a.n:.0f} B per input)")
    for w in a.tasks:
        shutil.rmtree(os.path.join(emb, "table"), ignore_errors=True)
        t0 = time.perf_counter()
        pathtable.build_table(emb, metas, rows, num_tasks=w)
        wall = time.perf_counter() - t0
        same = all(filecmp.cmp(os.path.join(emb, "table", f), os.path.join(ref, f), shallow=False) for f in FILES)
        shutil.rmtree(os.path.join(emb, "table"))
        peaks = traced_tasks(emb, metas, rows, w)
        task = max(v for k, v in peaks.items() if "[" in k)
        print(f"W={w}: {wall:.1f} s, same bytes: {same}, largest task's peak heap {task / 2**20:.0f} MB "
              f"({task / a.n:.0f} B per input of the pool)")
        for k, v in peaks.items():
            print(f"    {k}: {v / 2**20:.1f} MB")
        print(f"pathtable_task_heap_W{w}_vs_whole: {task / old_peak:.3f}")


if __name__ == "__main__":
    main()
