"""The decontamination step's membership test (curation/pipeline.py:step_decontaminate): for every block of alive
rows, whether its copy component is one of the direct eval matches' components. np.isin against the sorted
components (what the step did) vs binary search in them (`_in_sorted`, what it does), the same blocks and answer.

    python bench/bench_decontam_members.py --rows 10000000 --hits 712000

Prints each one's time and tracemalloc peak, and the ratios (np.isin sorts the block together with every hit, so
it copies all of them per block; the binary search holds a block's positions).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from curation.pipeline import _in_sorted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--hits", type=int, default=712_000, help="direct matches' components (7%% of 10M: the growth "
                                                             "bench's dim-128 pool)")
    p.add_argument("--block", type=int, default=65536)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    comp = rng.integers(0, a.rows, a.rows)
    hit = np.unique(rng.integers(0, a.rows, a.hits))
    got = {}
    for name, f in (("np.isin", lambda v: np.isin(v, hit)), ("_in_sorted", lambda v: _in_sorted(v, hit))):
        tracemalloc.start()
        t0, members = time.perf_counter(), 0
        for s in range(0, a.rows, a.block):
            members += int(f(comp[s:s + a.block]).sum())
        got[name] = (time.perf_counter() - t0, tracemalloc.get_traced_memory()[1], members)
        tracemalloc.stop()
        print(f"{name:11s} {got[name][2]:,} members  {got[name][0]:7.1f} s  traced peak {got[name][1] / 2**20:6.1f} MB")
    (t0, m0, n0), (t1, m1, n1) = got["np.isin"], got["_in_sorted"]
    assert n0 == n1
    print(f"binary search / np.isin: time {t1 / t0:.3f}, peak {m1 / m0:.3f} ({a.rows:,} rows, {len(hit):,} components)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
