"""A generated file list of N paths read by W tasks (FileListSource.ref_seq, as each Slurm array task of the embed
step reads it): per task its rows, wall time and peak RSS above its start (runner.PeakMemory: VmHWM reset at the
task's start), against one process reading a list of N / W paths alone (W = 1) -- the cost of a task's own rows.
The difference is what a task pays for the rest of the list (issue 40's goal: <= 64 MB at N = 10^8, W = 4); issue 49's:
a task's peak at most 16 B per own row beyond its paths' bytes, and at most 64 MB beyond the arrays it keeps.

    nice -n 5 python bench/bench_file_list.py --n 10000000 --tasks 4 --work /tmp/fl --json fl.json

Every task runs in its own fresh process (curation.core.runner.run_step, launcher local). Printed and written,
never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.run_meta import run_meta  # noqa: E402
from curation.core.runner import run_step  # noqa: E402
from dinopipe.data.sources import FileListSource  # noqa: E402


def generate(path: str, n: int) -> None:
    """n relative paths, ~40 bytes each (two levels of folders), a 1% of them listed twice; streamed."""
    with open(path, "w") as f:
        for s in range(0, n, 100_000):
            lines = [f"part{i // 1_000_000:04d}/d{i % 997:03d}/img{i:010d}.jpg\n" for i in range(s, min(n, s + 100_000))]
            f.writelines(lines)
            f.writelines(lines[::100])


def read_task(t: int, w: int, list_path: str) -> dict:
    refs = FileListSource(list_path, name="pool").ref_seq(t, w)  # what an embed task lists and holds
    return {"rows": len(refs), "path_bytes": int(refs.blob.nbytes), "arrays_bytes": int(refs.nbytes())}


def _mb(x: float) -> float:
    return round(x / 2 ** 20, 1)


def measure(work: str, n: int, w: int) -> dict:
    os.makedirs(work, exist_ok=True)
    full, own = os.path.join(work, f"list-{n}.txt"), os.path.join(work, f"list-{n // w}.txt")
    for p, k in ((full, n), (own, n // w)):
        if not os.path.exists(p):
            generate(p, k)
    res = {}
    for name, path, tasks in (("w_tasks", full, w), ("alone", own, 1)):
        reports = run_step(read_task, tasks, launcher="local", processes=None, list_path=path)
        res[name] = [{"task": r["task"], "rows": r["result"]["rows"], "wall_s": round(r["wall_s"], 2),
                      "rss_added_mb": _mb(r["peak_rss"] - r["start_rss"]), "heap_mb": _mb(r["peak_anon"] - r["start_anon"]),
                      "path_mb": _mb(r["result"]["path_bytes"]), "arrays_mb": _mb(r["result"]["arrays_bytes"]),
                      # issue 49's goals: <= 16 B a row beyond the path bytes; <= 64 MB beyond the arrays kept
                      "peak_b_per_row_beyond_paths": round((r["peak_rss"] - r["start_rss"] - r["result"]["path_bytes"])
                                                           / max(r["result"]["rows"], 1), 1),
                      "peak_beyond_arrays_mb": _mb(r["peak_rss"] - r["start_rss"] - r["result"]["arrays_bytes"]),
                      "hwm_reset": r["hwm_reset"]} for r in reports]
    alone = res["alone"][0]
    per_row = alone["rss_added_mb"] / max(alone["rows"], 1)
    res["beyond_own_rows_mb"] = [round(r["rss_added_mb"] - per_row * r["rows"], 1) for r in res["w_tasks"]]
    return {"n": n, "tasks": w, "list_bytes": os.path.getsize(full), **res}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--work", default="/tmp/bench_file_list")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the generated lists (default: delete them after)")
    a = ap.parse_args(argv)
    try:
        out = {"meta": run_meta(), **measure(a.work, a.n, a.tasks)}
    finally:
        if not a.keep:
            for p in (f"list-{a.n}.txt", f"list-{a.n // a.tasks}.txt"):
                if os.path.exists(os.path.join(a.work, p)):
                    os.remove(os.path.join(a.work, p))
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
