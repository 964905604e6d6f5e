"""The report's numbers as W tasks (curation.report.tasks, issue 40): what W tasks merge is exactly what the whole
arrays give in one process (histograms, counts, cluster sizes, copy-group sizes and the largest groups with their
members), whatever W, and the process that merges them holds nothing per row of the pool."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from curation.pipeline import _params, run_curation
from curation.report.plots import cluster_counts, duplicate_groups
from curation.report.step import make_report
from curation.report.tasks import of_arrays, report_stats
from curation.core.stepfiles import _save_step
from curation.core.status import COPY_DUP, DECONTAM, KEPT, NOT_SELECTED
from curation.core.runner import recording
from tests.curation.test_pipeline import _config

T_DUP, T_DEC, BLOCK = 0.9, 0.45, 512


def _pool(out: str, n: int, seed: int = 0) -> dict:
    """Step arrays of n rows: copy groups of 2..40 images (roots: their first row, the first and last block
    included), NaN similarities, clusters with gaps in the labels and unclustered (-1) rows."""
    rng = np.random.default_rng(seed)
    component = np.arange(n, dtype=np.int64)
    for _ in range(n // 50):
        size = int(rng.choice([2, 2, 3, 5, 40]))
        members = np.unique(rng.integers(0, n, size))  # (not choice without replacement: O(n) a call)
        component[members] = component[members[0]]
    component[[1, 7, n - 1]] = 0  # a group spanning the first and last task
    nn_sim = rng.uniform(-0.4, 1.0, n).astype(np.float32)
    nn_sim[rng.random(n) < 0.1] = np.nan
    eval_sim = rng.uniform(-0.1, 0.6, n).astype(np.float32)
    eval_sim[rng.random(n) < 0.5] = np.nan
    cluster = (rng.integers(0, 60, n) * 3).astype(np.int32)
    cluster[rng.random(n) < 0.05] = -1
    status = rng.choice([KEPT, NOT_SELECTED, COPY_DUP, DECONTAM], n, p=[0.5, 0.3, 0.1, 0.1]).astype(np.int8)
    _save_step(out, "dedup", nn_sim=nn_sim, component=component)
    _save_step(out, "decontaminate", eval_sim=eval_sim)
    _save_step(out, "rebalance", cluster=cluster, status=status)
    return {"component": component, "nn_sim": nn_sim, "eval_sim": eval_sim, "cluster": cluster, "status": status}


def _same_sim(a, b):
    assert (a.n, a.vmin, a.n_lo, a.n_hi, a.near) == (b.n, b.vmin, b.n_lo, b.n_hi, b.near)
    assert np.array_equal(a.hist_lo, b.hist_lo) and np.array_equal(a.hist_hi, b.hist_hi)


@pytest.mark.parametrize("w, blocks", [(1, 7), (3, 7), (5, 7), (1, 70), (2, 140)])
def test_w_tasks_give_exactly_the_whole_array_numbers(tmp_path, w, blocks):
    # 70 blocks a task: the scan's runs of root counts merged at two levels (report_tasks.FAN_IN = 8)
    n = blocks * BLOCK + 100
    a = _pool(str(tmp_path), n)
    st = report_stats(str(tmp_path), T_DUP, T_DEC, n_top=6, num_tasks=w, launcher="inline", block=BLOCK)
    _same_sim(st.nn, of_arrays(a["nn_sim"], T_DUP))
    _same_sim(st.eval, of_arrays(a["eval_sim"], T_DEC))
    assert st.nn.n_lo > 0 and st.nn.n_hi > 0 and st.nn.vmin < -0.2  # the bins move with the smallest value
    before, after = cluster_counts(a["cluster"], a["status"])
    assert np.array_equal(st.cluster_before, before) and np.array_equal(st.cluster_after, after)
    sizes = np.bincount(np.unique(a["component"], return_inverse=True)[1].ravel())
    vals, counts = np.unique(sizes, return_counts=True)
    assert np.array_equal(st.group_sizes, vals) and np.array_equal(st.group_counts, counts)
    want = duplicate_groups(None, a["component"], 6)
    assert len(want) == 6 and len(st.groups) == 6
    for g, h in zip(st.groups, want):
        assert np.array_equal(g, h)
    assert not (tmp_path / "steps" / "report").exists()  # the parts are scratch


def _peak(out: str, n: int, w: int) -> int:
    _pool(out, n)
    tracemalloc.start()
    try:
        report_stats(out, T_DUP, T_DEC, n_top=8, num_tasks=w, launcher="inline", block=BLOCK)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_report_holds_its_tasks_rows_not_the_pool(tmp_path):
    """N rows as 1 task vs 4N rows as 4 tasks (inline: one after another in this process, so the peak is the
    largest task's plus what the merging holds): each task owns the same rows at both sizes, so a process holding
    h bytes per row of the pool grows by 3N x h. Measured 1.4 (what the merging keeps of 3 more tasks' results, not
    per row: the figure halves when N doubles); the old report (np.unique over all rows, whole
    similarity arrays) holds > 30."""
    n = 32 * BLOCK
    small, large = _peak(str(tmp_path / "s"), n, 1), _peak(str(tmp_path / "l"), 4 * n, 4)
    held = (large - small) / (3 * n)
    print(f"report: {small} -> {large} B, {held:.2f} B per row")
    assert held < 3, f"the report holds {held:.1f} B per row of the pool ({small} -> {large} B)"


def _rss_added(out: str, w: int) -> int:
    with recording() as rec:
        report_stats(out, T_DUP, T_DEC, n_top=8, num_tasks=w, launcher="local", block=65536)
    reports = [x for r in rec for x in r["reports"]]
    assert len(reports) == 3 * w and all(x["hwm_reset"] for x in reports)
    return max(x["peak_rss"] - x["start_rss"] for x in reports)


def test_each_report_task_process_peak_rss_follows_its_rows(tmp_path):
    """Peak RSS above each task process's start (the kernel's high-water mark, reset when the task starts: native
    and mapped pages too, which tracemalloc does not see), 1.2M rows as 1 local task and as 4: the largest of the
    4 tasks peaks at < 0.5 x the one task (a cost per row of the pool would keep them equal). Measured 0.35-0.4
    (each task's own rows: its copy-group roots, ~90 B per own row with the mapped pages; the rest of the RSS
    is allocator noise of a few MB between tasks of the same size)."""
    out = str(tmp_path / "pool")
    _pool(out, 1_200_000)
    one, four = _rss_added(out, 1), _rss_added(out, 4)
    print(f"report task RSS added: W = 1 {one / 2**20:.1f} MB, W = 4 {four / 2**20:.1f} MB ({four / one:.2f})")
    assert four < 0.5 * one, f"a report task's peak RSS at W = 4 is {four / one:.2f} x W = 1's ({four} vs {one} B)"


def test_curate_runs_report_is_the_same_as_three_tasks(pool_dir, tmp_path):
    """`curate run`'s report (its tasks planned as every step's) and the same report as 3 tasks: the same
    summary.md, byte for byte (counts, thresholds, the largest copy groups, the balance)."""
    out = tmp_path / "out"
    cfg = _config([str(pool_dir[0])], out, embed={"num_workers": 0},
                  rebalance={"mode": "hierarchical", "levels": [6, 3], "target_size": 20})
    cfg.report.enabled = True
    run_curation(cfg)
    one = (out / "report" / "summary.md").read_text()
    assert "## Largest copy groups" in one and "## Balance" in one
    params = _params(cfg, str(out))  # the thresholds the steps used (steps/<step>.json), as the run's report
    three = open(make_report(str(out), [str(pool_dir[0])], params, cfg.report.n_examples, num_tasks=3)).read()
    assert three == one


def test_the_report_draws_in_a_task_of_its_own_and_the_orchestrator_never_imports_matplotlib(pool_dir, tmp_path):
    """The plots and summary.md are one task of the step runner: with the local launcher it runs in a fresh process,
    so matplotlib's import (~25 MB), its figure buffers and the contact sheet's decoded images (40-70 MB of the
    report's orchestrator heap before) are that task's; the orchestrating process never imports matplotlib, and the
    summary is the one the default launcher wrote."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "out"
    cfg = _config([str(pool_dir[0])], out, embed={"num_workers": 0},
                  rebalance={"mode": "hierarchical", "levels": [6, 3], "target_size": 20})
    cfg.report.enabled = False
    run_curation(cfg)
    params = _params(cfg, str(out))
    with recording() as rec:
        first = open(make_report(str(out), [str(pool_dir[0])], params, cfg.report.n_examples, num_tasks=2,
                                  tasks=None)).read()
    assert [r["fn"] for r in rec][-1] == "report_figures_task"
    code = ("import json, sys\nfrom curation.config import TasksConfig\nfrom curation.report.step import make_report\n"
            "from curation.core.runner import recording\n"
            "if __name__ == '__main__':\n"
            f"    with recording() as rec:\n"
            f"        path = make_report({str(out)!r}, [{str(pool_dir[0])!r}], json.loads(sys.argv[1]), "
            f"{cfg.report.n_examples}, tasks=TasksConfig(count=2, launcher='local'))\n"
            "    print(json.dumps({'mpl': 'matplotlib' in sys.modules, 'path': path, "
            "'figures': [r['inline'] for r in rec if r['fn'] == 'report_figures_task']}))\n")
    script = tmp_path / "report.py"
    script.write_text(code)
    root = Path(__file__).resolve().parents[2]
    got = subprocess.run([sys.executable, str(script), json.dumps(params)], capture_output=True, text=True,
                         cwd=root, env={**__import__("os").environ, "PYTHONPATH": str(root)}, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    res = json.loads(got.stdout.strip().splitlines()[-1])
    assert res["figures"] == [False] and not res["mpl"]  # drawn in a fresh process; never imported here
    assert open(res["path"]).read() == first
    assert all((out / "report" / f).stat().st_size > 0 for f in ("similarity.png", "duplicates.png"))


def test_the_manifest_records_the_decontamination_threshold_the_step_used(tmp_path):
    """An eval set without pixels (given as embeddings) is decided at cosine 0.45, not the verified candidate 0.2:
    the manifest and the report must say 0.45, the value in the step's summary, not the config's default."""
    import json

    cfg = _config([str(tmp_path / "pool")], tmp_path / "out")
    assert cfg.decontaminate.threshold is None and cfg.decontaminate.verify
    assert _params(cfg)["decontam_threshold"] == 0.2  # nothing run yet: what the config implies
    steps = tmp_path / "out" / "steps"
    steps.mkdir(parents=True)
    (steps / "decontaminate.json").write_text(json.dumps({"decontaminated": 3, "threshold": 0.45, "verify": False}))
    used = _params(cfg, str(tmp_path / "out"))
    assert used["decontam_threshold"] == 0.45 and used["decontam_verify"] is False
