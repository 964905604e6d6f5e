"""Every step of the chain `curate simulate` runs (= `curate run`'s steps after embedding: the same
pipeline.run_steps) at N rows with W=1 and at 4N rows with W=4, tasks inline, each task under tracemalloc
(curation/core/runner.py, CURATE_TRACE_TASKS=1). A task owns the same rows at both sizes, so a task holding h
bytes per row of the whole pool grows by 3N x h: the test asserts ``peak(4N, W=4) - peak(N, W=1) < 3 x h x N``
with h the bytes per row a task (or the orchestrating process) may hold.

The general bounds are tight; the steps that still hold O(N) state have their own h, the figure measured here
(2026-11-27, W=1 at 20k rows vs W=4 at 80k, dim 32, blocks and kNN chunks of 2,048 rows, so a chunk-sized buffer
is the same size at both N) plus a margin for the small pool's run-to-run noise (up to ~50 kB: 0.8 B per row of
h), and a comment naming the structure (docs/curation-scale.md, "Per-step memory at two pool sizes").
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


pytestmark = pytest.mark.memory  # measured in a session of its own (`make test`'s second pytest run)

ROOT = Path(__file__).resolve().parents[2]
N, DIM, BLOCK = 20_000, 32, 2048

TASK_HELD = 2
"""bytes per row of the pool a task may hold (measured <= 0.8; with the noise, a whole int8 or bool array (1) is
not told apart; an int32 (4), an int64 (8) or a Python object per row (>= 50) is)."""
TASK_HELD_MEASURED = {
    # owned_pairs() sorts the first image of every pair of the call in every task (curation/core/runner.py), and
    # the planted verifier gathers the whole planted truth (curation/simulate/chain.py:truth). measured 2.0
    ("dedup", "verify_arrays_task"): 3,
    # inline, the k-means tree runs as ONE rank over all rows (W ranks need W processes: steps/kmeans_tree.py);
    # its per-rank memory at W local processes: test_run_tasks.py::test_kmeans_tree_task_memory_... measured 5.1
    # (9.2 with the int32 source_codes)
    ("rebalance", "tree_task"): 8,
    # the IVF add runs as W tasks only when W > 1 (W = 1 builds the index in the orchestrator), so its whole
    # peak at 4N counts here: one chunk of rows and its codes (O(chunk), not O(N)), and since the exact coarse
    # assignment (exact_coarse.ExactCoarse) its float64 recomputation of 1,024 rows (three 1,024 x 32 float64 arrays
    # here: ~0.4 MB, the same at any N). measured 13.1 before it, 19.9 with it
    ("dedup", "add_task"): 24,
}

ORCH_HELD = 4
"""bytes per row the orchestrating process may hold (the issue allows 8; the write step streams its selection and
digests a block at a time over the mapped status array: measured 1.7-2.2 with the int32 source_codes that
open_embeddings used to materialise; EmbeddingSet.source_codes now reads the table on demand)."""
ORCH_HELD_MEASURED = {
    # dedup_step.step_dedup writes status / component / nn_sim in place (mapped, a block at a time) and the grouping
    # no longer sorts ids already in canonical order (unionfind.id_ranks) nor reads the kNN's nn_idx back; the hash
    # step's group / keep are mapped (hash_step._load), the survivors' ids read a block at a time (Gathered) and the
    # star grouping's arrays are per image with a copy, not per row. Left per survivor: its position, root /
    # component (int64 each), nn_sim (float32), keep (bool). The 20k run (W = 1) builds the IVF in this process,
    # the 80k run (W = 4) in tasks, so this difference is now negative (-6.9): its large-pool peak fell from
    # 5.64 MB (23.4 B/row, the hash result held and the grouping per row) to 3.60 MB. Then: the hash grouping's
    # union-find compressed in place with no rank arrays for rows in canonical order, the survivors' positions
    # mapped, nn_sim read a chunk at a time, the star grouping's sizes over the images with a copy, keep a block
    # at a time: 2.25 MB (-26.8 here; between 80k and 320k rows at W = 4, 37.9 -> 18.4 B/row). Then the hash
    # grouping's union-find and the star grouping's roots held for the images with a pair only
    # (unionfind.SparseRoots; keep = its RootMask) and the hash result written a block at a time: 80k -> 320k
    # rows at W = 4, 18.4 -> 0.5 B/row. Bound: the general one.
    "dedup": ORCH_HELD,
    # decontaminate_step.step_decontaminate maps its inputs (dedup's status and components), its scratch (the alive rows'
    # positions) and its outputs (status, eval_sim), read and written a block at a time, the kNN chunks one at a
    # time; left: the blocks. measured 4.7 (8.8 with the int32 source_codes; 62 when it built whole arrays)
    "decontaminate": 7,
    # rebalance_step.step_rebalance maps rebalance_rows (alive, rows_idx), its outputs (status, cluster, nearest_seed,
    # seed_sim) and the k-means tree's per-row arrays (dist_kmeans.load_tree); the selection's "none" columns
    # (nearest_seed, seed_sim without seeds) are broadcast views and the top-level labels the smallest integer
    # type; left per kept row: selected (bool), the picks (int64 per picked row) and their labels in the balance
    # report. measured 12.9 (14.6 with int64 / float32 "none" columns; 68 when built whole); then the blocks of the
    # rows' digest, the label counts and the top-level labels (made a block at a time, no int64 index per row) sized
    # by the step block (so this test sees them per row: at 20k / 80k rows a fixed 65k-row block looked like 16 B per
    # row), the pick's labels written and its picks read back a block at a time (mapped): measured 3.9. Left: the
    # selection (bool) and the top-level labels (smallest type) per kept row
    "rebalance": 6,
}
RETAINED_BLOCKS = 1000
"""allocation blocks a step may leave alive beyond the small pool's (measured growth <= 430)."""
RETAINED_HELD = 1
"""bytes per row a step may leave allocated (measured <= 0.6; an int32 per row is 4)."""


def _simulate(work: Path, n: int, w: int, mode: str = "rebalance.mode=hierarchical", processes: int | None = 0) -> dict:
    code = ("import json, sys; from curation.simulate.run import simulate; "
            f"r = simulate({str(work)!r}, {n}, dim={DIM}, tasks={w}, n_clusters=50, n_eval=1000, overlap=100, "
            f"levels=(64, 8), nlist=32, chunk_size={BLOCK}, processes={processes}, "
            # the settings these bounds were measured with (the simulation's before it ran the defaults): few
            # candidate pairs per row. At the defaults (k=64, cosine 0.45) nearly every neighbour of this generated
            # pool is a candidate pair (issue 40's report: dedup's orchestrator then holds ~6 kB per row)
            f"k=4, threshold=0.9, nprobe=8, overrides=[{mode!r}, 'rebalance.n_clusters=50']); print(json.dumps(r))")
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
            if "task_traced_peaks" not in run:  # a single-process phase (runner.phase: index merge, grouping):
                continue  # the orchestrator's own work, bounded with it below
            if run["fn"] == "index_train":  # one task over a sample whose size the IVF sets (nlist, train_size),
                continue  # not the pool's rows: the large run's IVF (the small pool's index is flat) trains on it
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
            continue  # the planted pool, not the product's chain (its tasks are within TASK_HELD anyway)
        bound = TASK_HELD_MEASURED.get((step, fn), TASK_HELD)
        held = (peak - p1.get(key, 0)) / (3 * N)
        print(f"{step:14s} {fn:22s} {p1.get(key, 0):>10} -> {peak:>10} B  holds {held:5.2f} B/row (bound {bound})")
        if held >= bound:
            over[key] = f"{held:.2f} B/row >= {bound} ({p1.get(key)} -> {peak} B)"
    assert not over, over


@pytest.mark.slow
def test_the_orchestrator_holds_at_most_its_stated_bytes_per_row_and_no_growing_objects(two_sizes):
    small, large = two_sizes
    over = {}
    for step in small["chain"]:
        a, b = small["steps"][step], large["steps"][step]
        held = (b["orchestrator_traced_peak"] - a["orchestrator_traced_peak"]) / (3 * N)
        print(f"{step:14s} orchestrator {a['orchestrator_traced_peak']:>10} -> {b['orchestrator_traced_peak']:>10} B "
              f"holds {held:5.1f} B/row; retained blocks {a['retained_blocks']} -> {b['retained_blocks']}, bytes "
              f"{a['retained_bytes']} -> {b['retained_bytes']}")
        if held >= ORCH_HELD_MEASURED.get(step, ORCH_HELD):
            over[step] = f"peak {held:.1f} B/row >= {ORCH_HELD_MEASURED.get(step, ORCH_HELD)}"
        # what a step leaves allocated: no O(N) Python objects or arrays kept (caches, lists of ids)
        if b["retained_blocks"] - a["retained_blocks"] >= RETAINED_BLOCKS:
            over[f"{step} blocks"] = (a["retained_blocks"], b["retained_blocks"])
        if b["retained_bytes"] - a["retained_bytes"] >= RETAINED_HELD * 3 * N:
            over[f"{step} bytes"] = (a["retained_bytes"], b["retained_bytes"])
    assert not over, over
    for res, n in ((small, N), (large, 4 * N)):
        assert res["counts"]["input"] == n


@pytest.mark.slow
def test_the_retrieval_modes_orchestrator_holds_no_column_per_row(tmp_path):
    """rebalance.mode=cluster around seed images (the simulation's generated seeds), W = 4 local processes at N and
    4N rows: the selection, the nearest seed and its cosine are memory-mapped files in the step's folder, the picks
    and the tasks' parts are read a block at a time, the balance report counts through the mask -- so the
    orchestrator's traced peak grows by a few bytes per row. measured 9.0 B/row (24.2 when the columns were arrays
    and the parts read whole: the pool grows 60k rows and the selection 52.6k here)."""
    runs = [_simulate(tmp_path / f"c{n}", n, 4, "rebalance.mode=cluster", processes=None) for n in (N, 4 * N)]
    a, b = (r["steps"]["rebalance"]["orchestrator_traced_peak"] for r in runs)
    held = (b - a) / (3 * N)
    assert held < 14, f"{a} -> {b} B: {held:.1f} B/row"
    assert runs[1]["counts"]["not_selected"] > 0 and runs[1]["counts"]["kept"] > runs[0]["counts"]["kept"]
