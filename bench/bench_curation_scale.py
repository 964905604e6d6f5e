"""Growth of every curation step after embedding, on the chain `curate run` ships (`curate simulate`: the
steps of curation.pipeline.run_steps on generated embeddings, hashes and planted truth), W=1 and W=4 tasks.
The config is `curate run`'s (its defaults, or --config and key=value overrides): write shards and report
included.

    nice -n 10 python bench/bench_curation_scale.py --sizes 1000000 3000000 10000000 --work /tmp/scale \\
        --json scale.json

For each N (one after another, W=1 then W=4, the scratch folder deleted between runs; every task in a fresh
process, W=1's too -- tasks.isolate -- so each task's peak is its own, unless --processes 0) it prints per step
the wall time, the tasks each of its runner calls ran, the peak heap a task allocated (sampled RssAnon above
the task's start) and the orchestrating process's own peak heap during the step; then the log-log slope of
the slowest tasks' time against N per step, the W=4 / W=1 per-task peak ratio at the largest N, whether
decisions.tsv is identical for W=1 and W=4 (and which step arrays are not bit-identical: a float that moved in the
last bit shows there before it flips a decision at a larger N), and the planted recall. Goals (issue 30): slope <= 1.15 for every
step but the kNN's, peak per task at W=4 <= 0.3 x W=1, identical decisions. Printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.run_meta import run_meta  # noqa: E402
from bench.tools.render_tables import slope  # noqa: E402  (the growth exponent the docs' tables print)
from curation.simulate.run import differing, render, simulate  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 3_000_000, 10_000_000])
    p.add_argument("--tasks", type=int, nargs="+", default=[1, 4])
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--work", required=True)
    p.add_argument("--json", default=None)
    p.add_argument("--processes", type=int, default=None, help="local task processes at a time (0: inline)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folders")
    p.add_argument("--config", default=None, help="the YAML `curate run --config` takes (default: its defaults)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, as `curate run` takes them (curate simulate runs that config)")
    p.add_argument("--query-fraction", nargs="+", default=[], metavar="N=F",
                   help="per size, the fraction of rows that query the copy search (every row is indexed; "
                        "e.g. 10000000=0.01); default 1")
    a = p.parse_intermixed_args(argv)
    fractions = {int(x.split("=")[0]): float(x.split("=")[1]) for x in a.query_fraction}
    results = []
    if a.json and os.path.exists(a.json):
        with open(a.json) as f:
            results = json.load(f)["runs"]  # resume: sizes already measured are not run again
    for n in a.sizes:
        for w in a.tasks:
            if any(r["n"] == n and r["tasks"] == w for r in results):
                continue
            work = os.path.join(a.work, f"n{n}-w{w}")
            t0 = time.perf_counter()
            res = simulate(work, n, a.dim, w, processes=a.processes, query_fraction=fractions.get(n, 1.0),
                           isolate=a.processes != 0,  # W = 1 in a fresh process too: its peak is its own
                           overrides=a.overrides, config=a.config,
                           progress=(a.json or os.path.join(a.work, "bench")) + f".n{n}-w{w}.progress.jsonl")
            res["total_s"] = time.perf_counter() - t0
            res["meta"] = run_meta(argv)  # date, machine, command: what bench/tools/rates_from_bench.py cites
            print(render(res), flush=True)
            results.append(res)
            if not a.keep:
                shutil.rmtree(work, ignore_errors=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"runs": results}, f, indent=1)
    print(summary(results))
    return 0


def summary(results: list[dict]) -> str:
    lines = []
    for w in sorted({r["tasks"] for r in results}):
        runs = sorted((r for r in results if r["tasks"] == w), key=lambda r: r["n"])
        if len(runs) < 2:
            continue
        ns = [r["n"] for r in runs]
        for step in runs[0]["steps"]:
            ts = [r["steps"][step]["task_s"] for r in runs]  # the slowest task of each runner call, summed
            lines.append(f"slope W={w} {step}: {slope(ns, ts):.2f}  ({' / '.join(f'{t:.2f}s' for t in ts)} at "
                         f"{' / '.join(f'{n:,}' for n in ns)})")
    big = max((r["n"] for r in results), default=0)
    one = next((r for r in results if r["n"] == big and r["tasks"] == 1), None)
    for r in results:
        if one is not None and r["n"] == big and r["tasks"] > 1:
            for step in r["steps"]:
                a1, aw = one["steps"][step]["task_heap_mb"], r["steps"][step]["task_heap_mb"]
                o1, ow = one["steps"][step]["orchestrator_heap_mb"], r["steps"][step]["orchestrator_heap_mb"]
                lines.append(f"peak heap per task W={r['tasks']} / W=1 at N={big:,} {step}: "
                             f"{aw / max(a1, 1e-9):.2f} ({aw:.0f} / {a1:.0f} MB); orchestrator {ow:.0f} / {o1:.0f} MB")
    for n in sorted({r["n"] for r in results}):
        digests = {r["tasks"]: r["decisions_sha256"] for r in results if r["n"] == n}
        lines.append(f"decisions identical for W={sorted(digests)} at N={n:,}: {len(set(digests.values())) == 1}")
        arrays = [r["arrays_sha256"] for r in results if r["n"] == n and "arrays_sha256" in r]
        if len(arrays) > 1:
            diff = differing(arrays)
            lines.append(f"step arrays bit-identical across W at N={n:,}: {len(arrays[0]) - len(diff)} of "
                         f"{len(arrays[0])}" + (f"; differing: {', '.join(diff)}" if diff else ""))
    for r in results:
        lines.append(f"recall N={r['n']:,} W={r['tasks']}: " + ", ".join(f"{k} {v:.4f}" for k, v in r["recall"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
