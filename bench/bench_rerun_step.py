"""One step of a kept `curate simulate` / growth-bench folder run again, measured as the simulation measures it
(the orchestrator's RssAnon sampled above the step's start, each runner call's tasks): a step's memory at a
size this box took ~an hour to reach, after a change to that step alone, without running the chain before it.

    python bench/bench_curation_scale.py --sizes 10000000 --tasks 1 --dim 128 --keep --work W ...
    python bench/bench_rerun_step.py --work W/n10000000-w1 --step decontaminate [--json J] [key=value ...]

The step is `curate run`'s own (curation.pipeline.run_steps on the folder's resolved config.yaml, with the
simulation's generated inputs: embedded eval and seed sets). Its saved searches are reused when their inputs
match, as a rerun of `curate run` reuses them, so what is measured is the step's own work on top of them.
Not the dedup step (its verifier is the simulation's planted truth, made by `curate simulate` itself).
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

STEPS = ("decontaminate", "rebalance", "write", "report")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="a kept simulation folder (it holds config.yaml)")
    p.add_argument("--step", required=True, choices=STEPS)
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied over the folder's config")
    a = p.parse_args(argv)
    from curation.config import CurationConfig
    from curation.pipeline import ChainInputs, run_steps
    from curation.steps import runner
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


if __name__ == "__main__":
    raise SystemExit(main())
