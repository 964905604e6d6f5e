"""The report step of the chain (curation.pipeline runs it): its numbers made by W tasks over the step arrays
(curation.report.tasks), its plots and summary.md by one more task in a process of its own (curation.report.plots), so
the orchestrating process holds nothing per row of the pool and never imports matplotlib (its import, its figure
buffers and the contact sheet's decoded images were the report's orchestrator heap: 40-70 MB whatever the pool)."""

from __future__ import annotations

import json
import os

from curation.report.tasks import ReportStats, report_stats, report_tasks
from curation.core.stepfiles import load_step
from curation.core.runner import launch_alone, run_step
from curation.core.layout import RunLayout


def make_report(out_dir: str, sources, params: dict, n_examples: int = 8, tasks=None,
                num_tasks: int | None = None, eval_sources=None) -> str:
    """Write ``out_dir/report/`` and return the path of its summary.md.

    ``params``: dedup_threshold, decontam_threshold, hash_max_distance, hash_enabled, k,
    rebalance_mode, embed_model (what the run used; the CLI passes its resolved config).
    The numbers are made by W tasks over the step arrays (:func:`report_stats`; ``num_tasks``, else the ``tasks``
    config's plan, as every other step), and the plots and the summary by one more task in a process of its own
    (:func:`report_figures_task`), so this process holds nothing per row of the pool and never imports matplotlib.
    """
    with open(RunLayout(out_dir).manifest) as f:
        manifest = json.load(f)
    balance = {}
    rb_path = RunLayout(out_dir).steps("rebalance_report.json")
    if os.path.exists(rb_path):
        with open(rb_path) as f:
            balance = json.load(f)
    counts = manifest["counts"]  # the one source of every count in the plots and the summary
    for step, key in (("dedup", "hash_duplicates"), ("dedup", "copy_duplicates"), ("decontaminate", "decontaminated")):
        logged = (manifest.get("steps", {}).get(step) or {}).get(key)
        if logged is not None and logged != counts[key]:  # a bug, never a user error
            raise AssertionError(f"the {step} step logged {key}={logged} but the manifest counts {counts[key]}")
    w, launcher = report_tasks(tasks, len(load_step(out_dir, "dedup", keys=("nn_sim",), mmap=True)["nn_sim"]))
    w = num_tasks if num_tasks is not None else w
    st = report_stats(out_dir, params["dedup_threshold"], params["decontam_threshold"], n_examples, w, launcher)
    got = run_step(report_figures_task, 1, **launch_alone(launcher, w), out_dir=out_dir, sources=sources, params=params, stats=st,
                   balance=balance, eval_sources=eval_sources)
    return got[0]["result"]["path"]


def report_figures_task(t: int, w: int, out_dir: str, sources, params: dict, stats: ReportStats,
                        balance: dict, eval_sources=None) -> dict:
    """The report's plots and summary.md, the one task (curation.report.plots.write_report)."""
    from curation.report.plots import write_report

    return {"path": write_report(out_dir, sources, params, stats, balance, eval_sources)}
