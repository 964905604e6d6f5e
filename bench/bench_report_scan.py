"""The report's first pass over one task's rows (curation.report.tasks.report_scan_task, the function `curate run`'s
report runs) at growing row counts: its seconds and their log-log slope. Every row is its own copy group (as
~99% of a curated pool's rows are), so the task's distinct roots grow with its rows.

    python bench/bench_report_scan.py --rows 2000000 8000000 32000000 --work /tmp/rscan

Synthetic step arrays (dedup's nn_sim and component, decontaminate's eval_sim, rebalance's cluster and status),
memory-mapped as a curation run writes them. Prints per size the task's seconds and the slope.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_curation_scale import slope  # noqa: E402
from bench.run_meta import run_meta  # noqa: E402
from curation.report.tasks import report_scan_task  # noqa: E402
from curation.core.stepfiles import StepWriter, blocks  # noqa: E402


def folder(work: str, n: int) -> str:
    out = os.path.join(work, f"n{n}")
    rng = np.random.default_rng(0)
    for name, arrays in (("dedup", {"nn_sim": np.float32, "component": np.int64, "status": np.int8}),
                         ("decontaminate", {"eval_sim": np.float32, "status": np.int8}),
                         ("rebalance", {"cluster": np.int32, "status": np.int8})):
        w = StepWriter(out, name)
        cols = {k: w.array(k, t, n) for k, t in arrays.items()}
        for s, e in blocks(n):
            for k, a in cols.items():
                a[s:e] = (np.arange(s, e) if k == "component" else rng.integers(0, 1000, e - s) if k == "cluster"
                          else 0 if k == "status" else rng.random(e - s))
        w.finish()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[2_000_000, 8_000_000, 32_000_000])
    p.add_argument("--work", required=True)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    got = []
    for n in a.rows:
        out = folder(a.work, n)
        parts = os.path.join(out, "parts")
        os.makedirs(parts, exist_ok=True)
        t0 = time.perf_counter()
        report_scan_task(0, 1, out, parts, 0.5, 0.45, 65536)
        got.append((n, time.perf_counter() - t0))
        shutil.rmtree(out, ignore_errors=True)
        print(f"{n:>12,} rows: report_scan_task {got[-1][1]:7.2f} s", flush=True)
    if len(got) > 1:
        print(f"slope of seconds against rows: {slope([n for n, _ in got], [t for _, t in got]):.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": [{"rows": n, "seconds": t} for n, t in got], "meta": run_meta()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
