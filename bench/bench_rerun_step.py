"""One step of a kept `curate simulate` / growth-bench folder run again, measured as the simulation measures it
(the orchestrator's RssAnon sampled above the step's start, each runner call's tasks): a step's memory at a
size this box took ~an hour to reach, after a change to that step alone, without running the chain before it.

    python bench/bench_curation_scale.py --sizes 10000000 --tasks 1 --dim 128 --keep --work W ...
    python bench/bench_rerun_step.py --work W/n10000000-w1 --step decontaminate [--json J] [key=value ...]

The step is `curate run`'s own (curation.pipeline.run_steps on the folder's resolved config.yaml, with the
simulation's generated inputs: embedded eval and seed sets). Its saved searches are reused when their inputs
match, as a rerun of `curate run` reuses them, so what is measured is the step's own work on top of them.
Not the dedup step as a whole (its verifier is the simulation's planted truth, made by `curate simulate` itself);
``--step verify`` runs its verification tasks alone (curation.verify.tasks.verify_candidates_task with that planted
verifier, over the kept kNN chunks) at ``--tasks`` W = 1 and 4, each task a process of the curation runner's (measured
as the chain measures its tasks), and prints each one's heap: the per-task figure of a change to the verification,
W = 1 against W = 4 on the same pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.run_meta import run_meta  # noqa: E402
from curation.simulate.run import _row, retrieval  # noqa: E402

STEPS = ("decontaminate", "rebalance", "write", "report", "verify")


def verify_tasks(work: str, rows: int, w: int) -> list[dict]:
    """The verification's ``w`` tasks on the kept folder of a ``rows``-row pool, run and measured by the curation
    runner as the chain runs them (local processes, one at a time: each task's heap is its own)."""
    import functools
    import tempfile

    from curation.simulate.chain import planted_verifier_of
    from curation.core.runner import BLOCK, run_step
    from curation.verify.tasks import verify_candidates_task

    with open(os.path.join(work, "knn", "pool", "meta.json")) as f:
        n = json.load(f)["n"]
    with open(os.path.join(work, "steps", "dedup.json")) as f:
        threshold = json.load(f)["threshold"]
    factory = functools.partial(planted_verifier_of, work, os.path.join(work, "steps", "verify_rows.npy"),
                                rows, BLOCK)
    with tempfile.TemporaryDirectory() as parts:
        got = run_step(verify_candidates_task, w, launcher="local", processes=1, out_dir=work, n=n,
                       threshold=float(threshold), parts_dir=parts, digest="rerun", factory=factory)
    return [{"task": g["task"], "tasks": w, "heap_mb": round(max(g["peak_anon"] - g["start_anon"], 0) / 2**20, 1),
             **g["result"]} for g in got]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="a kept simulation folder (it holds config.yaml)")
    p.add_argument("--step", required=True, choices=STEPS)
    p.add_argument("--json", default=None)
    p.add_argument("--rows", type=int, default=None, help="--step verify: the pool's rows (the planted truth's)")
    p.add_argument("--tasks", type=int, nargs="+", default=[1, 4], help="--step verify: the W to run")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied over the folder's config")
    a = p.parse_args(argv)
    if a.step == "verify":
        return _verify(a)
    from curation.config import CurationConfig
    from curation.pipeline import ChainInputs, run_steps
    from curation.core import runner
    from dinopipe.config import load_config

    path = os.path.join(a.work, "config.yaml")
    if not os.path.isfile(path):
        print(f"error: {path}: no such file (--work: a folder `curate simulate` kept)", file=sys.stderr)
        return 2
    cfg = load_config(CurationConfig, path, [f"output.dir={a.work}", *a.overrides])
    inputs = ChainInputs(eval_embedded=True, seeds_embedded=retrieval(cfg))
    t0 = time.perf_counter()
    with runner.recording() as rec, runner.PeakMemory() as mem:
        result = run_steps(cfg, [a.step], None, "simulate", inputs=inputs)[a.step]
    row = _row(rec, time.perf_counter() - t0, mem)
    print(f"{a.step}: wall {row['wall_s']:.1f} s, orchestrator heap {row['orchestrator_heap_mb']:.1f} MB "
          f"(RssAnon sampled above the step's start)")
    for r in row["runs"]:
        print(f"  {r['fn']:24s} {r['tasks']} task(s){' inline' if r['inline'] else ''}: {r['task_s']:.1f} s, "
              f"heap {r['task_heap_mb']:.1f} MB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"work": a.work, "step": a.step, "overrides": a.overrides, "row": row,
                       "result": result if isinstance(result, dict) else str(result), "meta": run_meta()}, f,
                      indent=1)
    return 0


def _verify(a) -> int:
    if a.rows is None:
        print("error: --step verify needs --rows (the pool's rows)", file=sys.stderr)
        return 2
    got = []
    for w in a.tasks:
        got += verify_tasks(a.work, a.rows, w)
    for g in got:
        print(f"verify task {g['task']} of {g['tasks']}: {g['candidates']:,} candidate pairs, {g['edges']:,} edges, "
              f"heap {g['heap_mb']:.1f} MB")
    top = {w: max(g["heap_mb"] for g in got if g["tasks"] == w) for w in a.tasks}
    if 1 in top and len(top) > 1:
        w = max(top)
        print(f"largest task's heap W = {w} / W = 1: {top[w] / top[1]:.2f} ({top[w]} / {top[1]} MB)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"work": a.work, "step": "verify", "rows": a.rows, "tasks": got, "meta": run_meta()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
