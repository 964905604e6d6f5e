"""Per-task memory of the rebalance k-means tasks (``rebalance.mode=cluster`` and ``balance_clusters``:
:func:`curation.rebalance.tasks.flat_kmeans`, the one sharded level ``curate run`` runs) at pool sizes
N and 4N, W = 1 and W = 4 fresh local processes: each task's heap (RssAnon sampled above its start), RSS added
(VmHWM, incl. the mapped embeddings' pages) and tracemalloc peak, and the ratios that tell a per-row cost from a
per-block constant:

* growth: the W = 1 task at 4N against N (a task holding the pool grows ~4x; a block-bound one stays);
* split: the largest W = 4 task at 4N against the W = 1 task at 4N.

The rows are synthetic (L2-normalised fp16 rows around 500 Gaussian centres, written as an embedding store);
the k-means is the product's, only the inputs differ.

    CURATE_TRACE_TASKS=1 OMP_NUM_THREADS=1 python bench/bench_kmeans_tasks.py --n 50000 --k 1000 --dim 384 \\
        --work /tmp/kmb --json bench/results/kmeans_tasks.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from curation.core.embstore import mark_task_done, save_shard, shard_stem
from curation.core import runner  # noqa: E402
from curation.rebalance.tasks import flat_kmeans  # noqa: E402

SHARD = 65536


def write_rows(path: str, n: int, dim: int, seed: int = 0) -> None:
    """``n`` fp16 unit rows around 500 centres, as an embedding store at ``path`` (kept when already there)."""
    if os.path.isdir(path):
        return
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((500, dim)).astype(np.float32)
    for i, s in enumerate(range(0, n, SHARD)):
        m = min(s + SHARD, n) - s
        x = centres[rng.integers(0, len(centres), m)] + 0.7 * rng.standard_normal((m, dim)).astype(np.float32)
        x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)
        ids = [f"r{j:010d}" for j in range(s, s + m)]
        save_shard(path, shard_stem(0, i), x, {"ids": ids, "sources": ["synthetic"] * m, "hashes": ["0"] * m,
                                               "unreadable": []})
    mark_task_done(path, 0, 1, {"n": n})


def measure(work: str, n: int, w: int, k: int, dim: int, niter: int) -> dict:
    emb = os.path.join(work, f"emb{n}_d{dim}")
    write_rows(emb, n, dim)
    out = os.path.join(work, f"km{n}_w{w}")
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    level, reports = flat_kmeans(out, emb, np.arange(n), k, 0, {"niter": niter}, w, "local")
    wall = time.perf_counter() - t0
    labels_sha = hashlib.sha256(np.asarray(level.labels).tobytes()).hexdigest()
    shutil.rmtree(out, ignore_errors=True)
    return {"n": n, "tasks": w, "k": k, "dim": dim, "niter": niter, "wall_s": round(wall, 1),
            "labels_sha256": labels_sha,
            "per_task": [{**runner.task_record(r), "traced_peak_mb": round(r.get("traced_peak", 0) / 2 ** 20, 1),
                          "centroid_mb": round(r["result"]["centroid_bytes_per_rank"] / 2 ** 20, 2)}
                         for r in reports]}


def _heap(run: dict) -> float:
    return max(t["heap_mb"] for t in run["per_task"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50000, help="N: the runs are at N and 4N rows")
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--niter", type=int, default=3)
    ap.add_argument("--work", required=True)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    runs = [measure(a.work, n, w, a.k, a.dim, a.niter) for n, w in ((a.n, 1), (4 * a.n, 1), (4 * a.n, 4))]
    small, big1, big4 = runs
    print(f"{'rows':>9} {'W':>2} {'task heap MB (RssAnon)':>24} {'traced MB':>10} {'centroids MB':>13} {'wall s':>7}")
    for r in runs:
        print(f"{r['n']:>9} {r['tasks']:>2} {' / '.join(str(t['heap_mb']) for t in r['per_task']):>24} "
              f"{max(t['traced_peak_mb'] for t in r['per_task']):>10} {r['per_task'][0]['centroid_mb']:>13} "
              f"{r['wall_s']:>7}")
    ratios = {"growth_w1_4n_over_n": round(_heap(big1) / _heap(small), 3),
              "split_w4_over_w1_at_4n": round(_heap(big4) / _heap(big1), 3),
              "labels_identical_w1_w4": big1["labels_sha256"] == big4["labels_sha256"]}
    print(json.dumps(ratios))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "ratios": ratios, "meta": runner_meta()}, f, indent=1)
    return 0


def runner_meta() -> dict:
    import platform

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "omp": os.environ.get("OMP_NUM_THREADS"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


if __name__ == "__main__":
    sys.exit(main())
