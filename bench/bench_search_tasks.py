"""Per-task memory of the kNN search tasks at W = 1 and W = 4, on the work folder of a finished
`curate simulate` (its embeddings, saved indexes and row files): the copy search (knn/pool, 'pairs') and the
decontamination search (knn/eval, 'nearest') are rerun as W fresh local processes into a scratch copy of the
knn folder, each task's heap (RssAnon sampled), RSS added and tracemalloc peak reported.

    CURATE_TRACE_TASKS=1 python bench/bench_search_tasks.py WORK [--tasks 1 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from curation.knn.shards import KnnJob, RowSource, run_search  # noqa: E402
from curation.core import runner  # noqa: E402


def _copy_job(work: str, scratch: str, name: str) -> None:
    """The saved index of ``name`` without its chunks, in ``scratch/knn/name``."""
    src, dst = os.path.join(work, "knn", name), os.path.join(scratch, "knn", name)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("chunks"))  # .ivfdata too: read from the same dir
    for f in os.listdir(os.path.join(work, "knn")):
        if f.endswith(".npy"):
            shutil.copy(os.path.join(work, "knn", f), os.path.join(scratch, "knn", f))


def measure(work: str, w: int) -> dict:
    out = {}
    desc = os.path.join(work, "embeddings", "descriptor")
    for name, mode, q, t in (("pool", "pairs", RowSource(desc, os.path.join(work, "knn", "pool-pool_rows.npy")), None),
                             ("eval", "nearest", RowSource(desc, os.path.join(work, "knn", "eval-query_rows.npy")),
                              RowSource(os.path.join(work, "embeddings", "eval")))):
        if not os.path.exists(os.path.join(work, "knn", name, "meta.json")):
            continue
        scratch = tempfile.mkdtemp(prefix="search-bench-", dir=work)
        try:
            _copy_job(work, scratch, name)
            rows = q.open()
            with runner.recording() as rec:
                run_search(scratch, name, mode, rows, None if t is None else t.open(), False,
                           {"tasks": w, "launcher": "local"}, (q, t))
            reps = rec[-1]["reports"]
            meta = KnnJob(scratch, name).meta()
            out[name] = {"rows": len(rows), "tasks": w, "index_bytes": meta["index_bytes"], "per_task": [
                {**runner.task_record(r), "traced_peak_mb": round(r.get("traced_peak", 0) / 2 ** 20, 1),
                 "chunks": r["result"].get("chunks")} for r in reps]}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work")
    ap.add_argument("--tasks", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = {str(w): measure(a.work, w) for w in a.tasks}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
