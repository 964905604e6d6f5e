"""Every step of the chain `curate simulate` runs (= `curate run`'s steps after embedding: the same
pipeline.run_steps) at N rows with W=1 and at 4N rows with W=4, tasks inline, each task under tracemalloc
(curation/steps/runner.py, CURATE_TRACE_TASKS=1). A task owns the same rows at both sizes, so its peak must not
grow with N: ``peak(4N, W=4) - peak(N, W=1) < bound x N``; a task holding h bytes per row of the whole pool grows
by 3N x h. The orchestrating process may hold whole step arrays (status, component), bounded the same way.

The bounds are bytes per row of N. The general ones are tight; the steps that still hold O(N) state have
their own bound, the figure measured here (2026-11-27, W=1 at 20k rows vs W=4 at 80k, dim 32, blocks and kNN
chunks of 2048 rows, so a chunk-sized buffer is the same size at both N)
plus ~10%, and a comment naming the structure (docs/curation-scale.md, "Per-step memory at two pool sizes").
tracemalloc counts numpy buffers and Python objects alike (an O(N) list of strings costs >= 50 B per row), and
not the pages of memory-mapped files (a task maps its rows of the step arrays and the embeddings).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dinopipe.utils import debug_hooks

ROOT = Path(__file__).resolve().parents[2]
N, DIM, BLOCK = 20_000, 32, 2048

TASK_BOUND = 4
"""bytes per row of N a task may grow by (measured <= 2.4; the small pool's peak varies by up to ~50 kB between
runs, 2.5 B/row here: a whole int8 array (3) hides in that noise, an int32 one (12) or a Python object per row
(>= 100) does not)."""
TASK_BOUNDS = {
    # open_embeddings() builds EmbeddingSet.source_codes = input_source[ids] (int32, 4 B per row of the whole
    # pool) in every process that opens the embeddings: curation/embeddings.py, left to the path-table rewrite.
    # measured 14.3-16.6
    ("write", "_decisions_part_task"): 19,
    # owned_pairs() sorts the first image of every pair of the call in every task (curation/steps/runner.py), and
    # the planted verifier gathers the whole planted truth (curation/simulate/chain.py:truth). measured 5.9
    ("dedup", "verify_arrays_task"): 8,
    # inline, the k-means tree runs as ONE rank over all rows (W ranks need W processes: steps/kmeans_tree.py);
    # its per-rank memory at W local processes: test_run_tasks.py::test_kmeans_tree_task_memory_... measured 27.7
    ("rebalance", "tree_task"): 32,
    # the IVF add runs as W tasks only when W > 1 (W = 1 builds the index in the orchestrator), so its whole
    # peak at 4N counts here: one chunk of rows and its codes (O(chunk), not O(N)). measured 38.8-39.3
    ("dedup", "add_task"): 45,
}

ORCH_BOUND = 8
"""bytes per row of N the orchestrating process may grow by (write: the selection and digests streamed a block at
a time over the mapped status array; measured 5.0-6.7)."""
ORCH_BOUNDS = {
    # hash groups + keep, survivors, copy components, status, nn_sim, the merged kNN pairs: whole arrays in
    # pipeline.step_dedup / knn_steps.sharded_copy_dedup. measured 156
    "dedup": 172,
    # dedup's status + component loaded whole, alive rows, their sims, nearest eval rows, the component
    # expansion (pipeline.step_decontaminate). measured 209
    "decontaminate": 230,
    # rebalance_rows (alive, rows_idx, ids), the k-means record, status / cluster / nearest_seed / seed_sim
    # (pipeline.step_rebalance). measured 203
    "rebalance": 224,
}
RETAINED_BLOCKS = 1000
"""allocation blocks a step may leave alive beyond the small pool's (measured growth <= 430)."""
RETAINED_BYTES = 4
"""bytes per row of N a step may leave allocated beyond the small pool's (measured <= 1.6; an int32 per row is 12)."""


def _simulate(work: Path, n: int, w: int) -> dict:
    code = ("import json, sys; from curation.simulate.run import simulate; "
            f"r = simulate({str(work)!r}, {n}, dim={DIM}, tasks={w}, n_clusters=50, n_eval=1000, overlap=100, "
            f"levels=(64, 8), nlist=32, chunk_size={BLOCK}, processes=0); print(json.dumps(r))")
    env = dict(os.environ, CURATE_TRACE_TASKS="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               **debug_hooks.env(curate_block=BLOCK))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _task_peaks(res: dict) -> dict:
    """{(step, fn, k-th run of fn in the step): the largest task's traced peak}."""
    got = {}
    for step, row in res["steps"].items():
        seen: dict = {}
        for run in row["runs"]:
            k = seen[run["fn"]] = seen.get(run["fn"], -1) + 1
            got[(step, run["fn"], k)] = max(run["task_traced_peaks"])
    return got


@pytest.fixture(scope="module")
def two_sizes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_memory")
    return _simulate(tmp / "small", N, 1), _simulate(tmp / "large", 4 * N, 4)


@pytest.mark.slow
def test_every_step_task_memory_follows_its_rows_not_the_pool(two_sizes):
    small, large = two_sizes
    assert small["recall"]["copies"] > 0.95 and large["recall"]["copies"] > 0.95  # the chain really ran
    p1, p4 = _task_peaks(small), _task_peaks(large)
    assert set(p1) <= set(p4), set(p1) - set(p4)
    over = {}
    for key, peak in sorted(p4.items()):
        step, fn, _ = key
        if step == "generate":
            continue  # the planted pool, not the product's chain (its tasks are within TASK_BOUND anyway)
        bound = TASK_BOUNDS.get((step, fn), TASK_BOUND)
        growth = (peak - p1.get(key, 0)) / N
        print(f"{step:14s} {fn:22s} {p1.get(key, 0):>10} -> {peak:>10} B  {growth:6.1f} B/row (bound {bound})")
        if growth >= bound:
            over[key] = f"{growth:.1f} B/row >= {bound} ({p1.get(key)} -> {peak} B)"
    assert not over, over


@pytest.mark.slow
def test_the_orchestrator_holds_at_most_its_stated_bytes_per_row_and_no_growing_objects(two_sizes):
    small, large = two_sizes
    over = {}
    for step in small["chain"]:
        a, b = small["steps"][step], large["steps"][step]
        growth = (b["orchestrator_traced_peak"] - a["orchestrator_traced_peak"]) / N
        print(f"{step:14s} orchestrator {a['orchestrator_traced_peak']:>10} -> {b['orchestrator_traced_peak']:>10} B "
              f"{growth:6.1f} B/row; retained blocks {a['retained_blocks']} -> {b['retained_blocks']}, bytes "
              f"{a['retained_bytes']} -> {b['retained_bytes']}")
        if growth >= ORCH_BOUNDS.get(step, ORCH_BOUND):
            over[step] = f"peak {growth:.1f} B/row >= {ORCH_BOUNDS.get(step, ORCH_BOUND)}"
        # what a step leaves allocated: no O(N) Python objects or arrays kept (caches, lists of ids)
        if b["retained_blocks"] - a["retained_blocks"] >= RETAINED_BLOCKS:
            over[f"{step} blocks"] = (a["retained_blocks"], b["retained_blocks"])
        if b["retained_bytes"] - a["retained_bytes"] >= RETAINED_BYTES * N:
            over[f"{step} bytes"] = (a["retained_bytes"], b["retained_bytes"])
    assert not over, over
    # decisions do not depend on W (the same planted pool at 4N with W=1 is test_scale_steps' check); here the
    # counts add up at both sizes
    for res, n in ((small, N), (large, 4 * N)):
        assert res["counts"]["input"] == n
