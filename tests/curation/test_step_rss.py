"""Memory where it lives (issue 40): every task of `curate run`'s chain in its own fresh process, its peak RSS above
its own start measured by the kernel, at two pool sizes -- the native allocations (faiss's index and search buffers,
numpy's C buffers, the verifier's) that tracemalloc (test_step_memory.py) does not see.

The chain is `curate simulate` on the user's default config (`curate run`'s defaults: k=64, cosine 0.45, the report
on, shards written; only the generated inputs differ), the local launcher with ``tasks.isolate`` (W = 1's task in a
fresh process too), N rows with W = 1 and 4N rows with W = 4 (blocks of 2,048 rows, so each task of the large run
owns as many rows as the one task of the small run). A task that holds h bytes per row of the *pool* (not of its
share) grows by 3N x h between the two; so does the orchestrating process, which should hold nothing per row.

Two kernel figures per process (curation/core/runner.py PeakMemory):
* ``heap``: RssAnon above the start, sampled every 50 ms (anonymous memory: what a process allocated);
* ``hwm``: VmHWM above the start (the kernel's exact high-water mark, reset when the task starts), which also counts
  the pages of memory-mapped files the task touched (its rows of the embeddings and step arrays).
The bounds are per step function, measured on this code (2026-11-28, dim 384, N = 60,000: above the flat index's
50,000 rows, so both sizes build the same on-disk IVF) plus a margin for the sampling and the allocator (a few MB:
~20 B per row at 3N = 180k); the exceptions name what the bytes are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dinopipe.utils import debug_hooks


pytestmark = pytest.mark.memory  # measured in a session of its own (`make test`'s second pytest run)

ROOT = Path(__file__).resolve().parents[2]
N, DIM, BLOCK = 60_000, 384, 2048
MB = 2**20

HEAP_HELD = 40
"""bytes per row of the pool a task's anonymous memory may grow by: the sampling's and the allocator's noise reaches
~20 B/row here (the hash pairs task: 7 to 20 over five runs), so an int64 per row (8) is not told apart, but a Python
object per row (>= 50), the pool's candidate pairs (~27 x 8 = 216) or its embeddings (768) are."""
HEAP_HELD_MEASURED = {
    # the IVF add: the trained index each task loads (coarse centroids, nlist x D float32, and the exact coarse
    # assignment's float64 copy of them): nlist grows with the pool (curation.knn.index.default_nlist), so this is per
    # list, not per row -- measured 95 B/row here for nlist 60k -> 240k rows alone, 168-171 with the test suite
    # running beside it: the sampled RssAnon catches the add's piece temporaries (16,384 rows x 384-d, a constant) in
    # one run and misses them in the other, while the exact VmHWM grew 73 B/row. A copy of the pool's IVF-flat codes
    # is 1,536 B/row, its fp16 embeddings 768
    ("dedup", "add_task"): 320,
}
SKIP = {
    # one task over the IVF's training sample (curation.knn.shards train task): its size is nlist x the points per
    # list faiss trains on, capped by knn.train_size -- the cost model's, not the rows' (measured 185 -> 442 MB)
    ("dedup", "index_train"),
}
HWM_HELD = 48
"""bytes per row of the pool a task's high-water mark may grow by (mapped pages of whole-pool arrays it reads)."""
CODE_BYTES = DIM * 4  # an IVF-flat code: the row's float32 vector
HWM_HELD_MEASURED = {
    # the pool's inverted lists, memory-mapped (index.faiss.ivfdata, CODE_BYTES per row of the pool): a search task's
    # probes touch most lists over its queries, and the merge writes them all -- file pages (the page cache, shared by
    # a node's tasks), not anonymous memory. measured 1,565 (search) and 1,546 (merge) B/row
    ("dedup", "search_task"): int(CODE_BYTES * 1.25),
    ("dedup", "index_merge"): int(CODE_BYTES * 1.25),  # a task of its own since issue 40's last round
    ("dedup", "add_task"): 160,  # the trained index (above), measured 73
    ("decontaminate", "search_task"): 96,  # measured 42.5 (mapped pages; the eval index is the same at both sizes)
}
ORCH_HEAP_HELD = 40
"""bytes per row the orchestrating process's anonymous memory may grow by (the same noise; measured <= 13. The issue's
2 B/row is shown with tracemalloc's exact counts: test_verify_tasks.py, test_step_memory.py)."""


def _simulate(work: Path, n: int, w: int) -> dict:
    code = ("import json; from curation.simulate.run import simulate\n"
            "if __name__ == '__main__':\n"
            f"    r = simulate({str(work)!r}, {n}, dim={DIM}, tasks={w}, n_clusters=50, n_eval=1000, overlap=100, "
            "isolate=True, overrides=['progress=false'])\n"
            "    print(json.dumps(r))\n")
    script = work.parent / f"run_{n}_{w}.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **debug_hooks.env(curate_block=BLOCK))
    out = subprocess.run([sys.executable, str(script)], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _tasks(res: dict) -> dict:
    """{(step, fn, k-th run of fn in the step): (heap MB, hwm MB) of the largest task}, tasks out of process only."""
    got = {}
    for step, row in res["steps"].items():
        seen: dict = {}
        for run in row["runs"]:
            if run["inline"]:  # the orchestrator's own phases: bounded with it below
                continue
            k = seen[run["fn"]] = seen.get(run["fn"], -1) + 1
            got[(step, run["fn"], k)] = (run["task_heap_mb"], run["task_rss_added_mb"])
    return got


@pytest.fixture(scope="module")
def two_sizes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_rss")
    return _simulate(tmp / "small", N, 1), _simulate(tmp / "large", 4 * N, 4)


@pytest.mark.slow
def test_every_task_and_the_orchestrator_hold_their_rows_not_the_pool_in_rss(two_sizes):
    small, large = two_sizes
    assert small["config"]["dedup"]["k"] == 64 and small["config"]["write"]["shards"]  # the user's defaults
    t1, t4 = _tasks(small), _tasks(large)
    assert {k[:2] for k in t1} <= {k[:2] for k in t4}, set(t1) - set(t4)
    over = {}
    for key, (heap, hwm) in sorted(t4.items()):
        step, fn, _ = key
        if step == "generate" or key not in t1 or (step, fn) in SKIP:
            continue  # the planted pool, not the product's chain; the training sample (above)
        h1, w1 = t1[key]
        per_heap, per_hwm = (heap - h1) * MB / (3 * N), (hwm - w1) * MB / (3 * N)
        hb, wb = HEAP_HELD_MEASURED.get((step, fn), HEAP_HELD), HWM_HELD_MEASURED.get((step, fn), HWM_HELD)
        print(f"{step:14s} {fn:24s} heap {h1:7.1f} -> {heap:7.1f} MB ({per_heap:6.1f} B/row, bound {hb}); "
              f"hwm {w1:7.1f} -> {hwm:7.1f} MB ({per_hwm:6.1f} B/row, bound {wb})")
        if per_heap >= hb:
            over[key + ("heap",)] = f"{per_heap:.1f} B/row >= {hb}"
        if per_hwm >= wb:
            over[key + ("hwm",)] = f"{per_hwm:.1f} B/row >= {wb}"
    for step in small["chain"]:
        a, b = small["steps"][step]["orchestrator_heap_mb"], large["steps"][step]["orchestrator_heap_mb"]
        per = (b - a) * MB / (3 * N)
        print(f"{step:14s} orchestrator heap {a:7.1f} -> {b:7.1f} MB ({per:6.1f} B/row, bound {ORCH_HEAP_HELD})")
        if per >= ORCH_HEAP_HELD:
            over[(step, "orchestrator")] = f"{per:.1f} B/row >= {ORCH_HEAP_HELD}"
    assert not over, over
    assert small["decisions_sha256"] and large["counts"]["input"] == 4 * N
