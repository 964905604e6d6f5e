"""The rates `curate plan` uses, from the benches' JSON: rows/s per task of every chain step the growth bench
measures, pixel pairs/s per core from the verification bench, each with its source (bench, date, machine,
command, run).

    python bench/tools/rates_from_bench.py --scale bench/results/scale_1m.json [more scale JSON ...] \\
        [--verify verify.json] --out curation/plan_rates.json
    python bench/tools/rates_from_bench.py --scale old.json --stamp date=2026-11-27 machine="..." command="..."

Per step, from ``bench/bench_curation_scale.py``'s runs (``{"runs": [{"n", "tasks", "steps": {step: {"runs":
[{"fn", "tasks", "task_s", ...}]}}, "step_results", "meta"}]}``; several files are merged): the run with the
most rows, of those the one with the fewest tasks (W = 1: one task with the whole machine), and its runner
calls of the step's task function; rate = (rows the step sees / W) / the slowest task's seconds. Rows: the
hash dedup and the decisions parts every row, the index add, the copy search and the decontamination the hash
survivors, the k-means tree and the sampling the rows rebalanced. The pixel verification of the growth bench
is a planted-truth verifier (no pixels), so its rate comes from ``bench/bench_verify.py --json`` only.
A rate no JSON gives stays ASSUMED in the plan (curation/plan_rates.py: DEFAULTS).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# rate name -> (step in the scale JSON, runner functions summed, the rows they see, unit)
SCALE_STEPS = {
    "hash_dedup": ("dedup", ("pairs_task",), "all", "rows/s per task"),
    "index_add": ("dedup", ("add_task",), "survivors", "rows/s per task"),
    "search": ("dedup", ("search_task",), "survivors", "rows/s per task"),
    "decontaminate": ("decontaminate", ("search_task",), "survivors", "rows/s per task"),
    "kmeans": ("rebalance", ("tree_task",), "rebalanced", "rows/s per task (every level)"),
    "sampling": ("rebalance", ("hist_task", "boundary_task", "select_task"), "rebalanced", "rows/s per task"),
    "decisions": ("write", ("_decisions_part_task",), "all", "rows/s per task"),
    # single-process phases (curation.core.runner.phase), in the JSON of runs made after 2026-11-27
    "grouping": ("dedup", ("grouping",), "survivors", "rows/s (one process)"),
    "hash_grouping": ("dedup", ("hash_grouping",), "all", "rows/s (one process)"),
    "index_train": ("dedup", ("index_train",), "survivors", "rows/s (one process)"),
    "index_merge": ("dedup", ("index_merge",), "survivors", "rows/s (one process)"),
}


def _rows(run: dict, which: str) -> int:
    n = int(run["n"])
    if which == "all":
        return n
    if which == "survivors":
        return n - int(run["step_results"]["dedup"]["hash_duplicates"])
    return int(run["step_results"]["rebalance"]["n_pool"])


def _pick(runs: list[dict], step: str, fns: tuple[str, ...]) -> dict | None:
    """The run with the most rows, then the fewest tasks, that has the step's task functions."""
    have = [r for r in runs if any(c["fn"] in fns for c in r["steps"].get(step, {}).get("runs", []))]
    return min(have, key=lambda r: (-int(r["n"]), int(r["tasks"]))) if have else None


def scale_rates(runs: list[dict]) -> dict:
    out = {}
    for name, (step, fns, which, unit) in SCALE_STEPS.items():
        run = _pick(runs, step, fns)
        if run is None:
            continue
        calls = [c for c in run["steps"][step]["runs"] if c["fn"] in fns]
        w = int(calls[0]["tasks"])
        seconds = sum(float(c["task_s"]) for c in calls)
        rows = _rows(run, which)
        if name == "search":  # a query fraction F < 1 (curate simulate --query-fraction): F of the rows queried
            rows = int(rows * float(run.get("query_fraction", 1.0)))
        if seconds <= 0 or rows <= 0:
            continue
        meta = run.get("meta") or {}
        out[name] = {"value": round(rows / w / seconds, 1), "unit": unit, "source": {
            "bench": "bench/bench_curation_scale.py (" + os.path.basename(run["_file"]) + ")",
            "date": meta.get("date", "not recorded"), "machine": meta.get("machine", "not recorded"),
            "command": meta.get("command", "not recorded"),
            "label": f"N={int(run['n']):,} W={w}",
            "run": f"N={int(run['n']):,} W={w}, {'+'.join(fns)} {seconds:.1f} s over {rows:,} rows, "
                   f"D={run.get('dim', '?')}, query fraction {float(run.get('query_fraction', 1.0)):g}"}}
    return out


def verify_rate(doc: dict, path: str) -> dict:
    meta = doc.get("meta") or {}
    return {"verification": {"value": round(float(doc["pairs_per_s_per_core"]), 1), "unit": "pairs/s per core",
                             "source": {"bench": "bench/bench_verify.py (" + os.path.basename(path) + ")",
                                        "date": meta.get("date", "not recorded"),
                                        "machine": meta.get("machine", "not recorded"),
                                        "command": meta.get("command", "not recorded"),
                                        "run": f"{doc.get('pairs', '?')} pairs of {doc.get('images', '?')} images, "
                                               f"{doc.get('threads', '?')} thread(s), {doc.get('device', 'cpu')}"}}}


def load_runs(paths: list[str]) -> list[dict]:
    """The runs of every file, one per (N, W): a bench resumed from an earlier JSON copies its runs, so the same
    measurement (same total seconds) met again is kept once (the first copy that has a ``meta``); a different
    measurement of the same (N, W) in a later file replaces the earlier one."""
    runs: dict[tuple[int, int], dict] = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for r in doc["runs"]:
            key, new = (int(r["n"]), int(r["tasks"])), {**r, "_file": path}
            old = runs.get(key)
            if old is not None and old.get("total_s") == r.get("total_s") and (old.get("meta") or not r.get("meta")):
                continue  # the same run copied: the first copy with a meta stays
            runs[key] = new
    return list(runs.values())


def stamp(path: str, pairs: list[str]) -> int:
    """Add ``meta`` (date=..., machine=..., command=...) to the runs of ``path`` that have none (runs made before
    the benches recorded it); returns how many were stamped."""
    meta = dict(p.split("=", 1) for p in pairs)
    unknown = set(meta) - {"date", "time", "machine", "command"}
    if unknown or not meta:
        raise ValueError(f"--stamp takes date=, time=, machine=, command=; got {sorted(unknown) or 'nothing'}")
    with open(path) as f:
        doc = json.load(f)
    n = 0
    for r in doc["runs"]:
        if not r.get("meta"):
            r["meta"], n = {**meta, "added": "by hand (bench/tools/rates_from_bench.py --stamp)"}, n + 1
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return n


def build(scale: list[str], verify: str | None = None) -> dict:
    rates = scale_rates(load_runs(scale))
    if verify:
        with open(verify) as f:
            rates.update(verify_rate(json.load(f), verify))
    return {"generated_by": "python bench/tools/rates_from_bench.py " + " ".join(
                [f"--scale {' '.join(scale)}"] + ([f"--verify {verify}"] if verify else [])),
            "generated": time.strftime("%Y-%m-%d", time.gmtime()),
            "note": "rows/s of one task; a rate missing here is ASSUMED in `curate plan` (curation/plan_rates.py)",
            "rates": dict(sorted(rates.items()))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", nargs="+", required=True, help="JSON of bench/bench_curation_scale.py --json")
    p.add_argument("--stamp", nargs="+", default=None, metavar="KEY=VALUE",
                   help="only add meta (date=, machine=, command=) to the --scale file's runs that have none")
    p.add_argument("--verify", default=None, help="JSON of bench/bench_verify.py --json")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                                 "curation", "plan_rates.json"))
    a = p.parse_args(argv)
    if a.stamp:
        try:
            print(f"stamped {stamp(a.scale[0], a.stamp)} run(s) of {a.scale[0]}")
        except (OSError, ValueError, KeyError) as e:
            print(f"rates_from_bench: error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        doc = build(a.scale, a.verify)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"rates_from_bench: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    for name, r in doc["rates"].items():
        print(f"{name}: {r['value']:,.1f} {r['unit']} ({r['source']['run']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
