"""The report's numbers as W tasks over the memory-mapped step arrays (issue 40): nothing per row of the pool
in the process that draws the plots.

The report used to run over all N rows in one process: ``np.unique`` of the component array (copy-group sizes,
the largest groups), of the cluster labels, and the whole similarity arrays for the histograms. Here each number
is a sum over rows, made by the task that owns the rows (:func:`curation.core.runner.task_rows`) and merged:

1. :func:`report_scan_task` -- per task over its rows: the similarity counts (finite, minimum, each side of the
   threshold, near it), the pool images per cluster before / after rebalancing (by cluster label), and its rows'
   copy groups as (root row, images) -- written as a part, ordered by the task that will own each root
   (:func:`root_owner`, a hash: the roots of big groups are their smallest rows, which a split by row range
   would give mostly to the first task), since a group's images can be in any task;
2. :func:`report_group_task` -- per task: the similarity histograms on the bins the merged minimum fixes, and
   the sizes of the copy groups whose root it owns (summed from its slice of every task's part: a hash
   partition by root): the histogram of group sizes and its ``n_top`` largest groups;
3. :func:`report_members_task` -- per task: its rows that belong to the merged ``n_top`` largest groups (the
   contact sheet and the summary's table show them).

Every merged number equals the single-process one exactly (integer sums; the histograms' bins and the
clusters' order do not depend on W), so the report is the same whatever W.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import numpy as np

from curation.core.stepfiles import load_step
from curation.core.status import KEPT, NOT_SELECTED
from curation.core.runner import BLOCK, launch, run_step, task_blocks
from curation.core.layout import RunLayout

HIST_BINS = 61  # edges of the similarity histograms (60 bins from min(-0.2, smallest value) to 1)
NEAR = 0.05  # the summary counts the nearest-neighbour similarities within this of the dedup threshold


@dataclass
class SimStats:
    """One similarity array against a threshold: finite values (``n``), their minimum, how many are at or below
    the threshold (``n_lo``) and above it (``n_hi``), how many lie within ``NEAR`` of it, and (pass 2) the
    histograms of each side on :meth:`bins`."""

    n: int = 0
    vmin: float = float("inf")
    n_lo: int = 0
    n_hi: int = 0
    near: int = 0
    hist_lo: np.ndarray = field(default_factory=lambda: np.zeros(HIST_BINS - 1, np.int64))
    hist_hi: np.ndarray = field(default_factory=lambda: np.zeros(HIST_BINS - 1, np.int64))

    def add(self, values: np.ndarray, threshold: float) -> None:
        v = values[np.isfinite(values)]
        self.n += len(v)
        if len(v):
            self.vmin = min(self.vmin, float(v.min()))
        lo = int((v <= threshold).sum())
        self.n_lo, self.n_hi = self.n_lo + lo, self.n_hi + len(v) - lo
        self.near += int(((v > threshold - NEAR) & (v <= threshold + NEAR)).sum())

    def add_hist(self, values: np.ndarray, threshold: float, bins: np.ndarray) -> None:
        v = values[np.isfinite(values)]
        self.hist_lo += np.histogram(v[v <= threshold], bins=bins)[0]
        self.hist_hi += np.histogram(v[v > threshold], bins=bins)[0]

    def bins(self) -> np.ndarray:
        return np.linspace(min(-0.2, self.vmin) if self.n else -0.2, 1.0, HIST_BINS)

    def merge(self, other: "SimStats") -> "SimStats":
        return SimStats(self.n + other.n, min(self.vmin, other.vmin), self.n_lo + other.n_lo,
                        self.n_hi + other.n_hi, self.near + other.near, self.hist_lo + other.hist_lo,
                        self.hist_hi + other.hist_hi)


def of_arrays(values: np.ndarray, threshold: float) -> SimStats:
    """:class:`SimStats` of a whole array at once (tests, small pools): what W tasks merge to."""
    s = SimStats()
    s.add(np.asarray(values), threshold)
    s.add_hist(np.asarray(values), threshold, s.bins())
    return s


@dataclass
class ReportStats:
    """Everything the report draws, merged over the tasks: small, whatever the pool's size."""

    nn: SimStats
    eval: SimStats
    cluster_ids: np.ndarray  # the pool's cluster labels, ascending
    cluster_before: np.ndarray  # pool images per cluster, before rebalancing
    cluster_after: np.ndarray  # ... and kept after it
    group_sizes: np.ndarray  # distinct copy-group sizes, ascending (1: images without copies)
    group_counts: np.ndarray  # groups of each size
    groups: list  # the largest copy groups (> 1 image): rows, the root (kept) first, then ascending


FAN_IN = 8
"""Runs of root counts merged at a time in a report scan task (:func:`report_scan_task`)."""


def _merge_counts(keys: list[np.ndarray], counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(unique keys ascending, summed counts) of several (keys, counts) pairs."""
    k = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    c = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    u, inv = np.unique(k, return_inverse=True)
    # summed as float64, exact below 2^53 (a count is at most the rows); np.add.at is ~10x slower
    return u, np.bincount(inv.ravel(), weights=c, minlength=len(u)).astype(np.int64)


def _merge_clusters(ids: list, before: list, after: list) -> tuple[list, list, list]:
    u, b = _merge_counts(ids, before)
    return [u], [b], [_merge_counts(ids, after)[1]]


def _arrays(out_dir: str) -> dict:
    dd = load_step(out_dir, "dedup", keys=("nn_sim", "component"), mmap=True)
    dc = load_step(out_dir, "decontaminate", keys=("eval_sim",), mmap=True)
    rb = load_step(out_dir, "rebalance", keys=("cluster", "status"), mmap=True)
    return {"nn_sim": dd["nn_sim"], "component": dd["component"], "eval_sim": dc["eval_sim"],
            "cluster": rb["cluster"], "status": rb["status"]}


def _roots_path(parts: str, t: int, w: int, what: str) -> str:
    return os.path.join(parts, f"roots-{t:05d}-of-{w:05d}.{what}.npy")


def root_owner(roots: np.ndarray, w: int) -> np.ndarray:
    """The task of ``w`` that sums the copy group rooted at each of ``roots`` (a multiplicative hash: spreads
    the small root rows of big groups evenly)."""
    h = (np.asarray(roots).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(33)
    return (h % np.uint64(w)).astype(np.int64)


def report_scan_task(t: int, w: int, out_dir: str, parts: str, t_dup: float, t_dec: float, block: int) -> dict:
    """Pass 1 over this task's rows (see the module docstring)."""
    a = _arrays(out_dir)
    nn, ev = SimStats(), SimStats()
    ck, cb, ca, gk, gc, gl = [], [], [], [], [], []
    for s, e in task_blocks(len(a["nn_sim"]), t, w, block):
        nn.add(np.asarray(a["nn_sim"][s:e]), t_dup)
        ev.add(np.asarray(a["eval_sim"][s:e]), t_dec)
        cluster, status = np.asarray(a["cluster"][s:e]), np.asarray(a["status"][s:e])
        pool = (cluster >= 0) & ((status == KEPT) | (status == NOT_SELECTED))
        u, inv = np.unique(cluster[pool], return_inverse=True)
        ck.append(u)
        cb.append(np.bincount(inv.ravel(), minlength=len(u)))
        ca.append(np.bincount(inv.ravel(), weights=status[pool] == KEPT, minlength=len(u)).astype(np.int64))
        roots, n = np.unique(np.asarray(a["component"][s:e]), return_counts=True)
        gk.append(roots)
        gc.append(n)
        gl.append(0)
        # the running root counts as runs of levels, 8 runs of one level merged into one of the next (an LSM tree
        # of fan-out 8): each root is re-sorted log8(R / block) times over the task's R rows, where folding every 8
        # blocks into one running sum re-sorted all the roots seen so far (R^2 / 524k sorts: hours for a task of
        # 10^9 rows); the runs hold the task's distinct roots about once (a root in several blocks: once per run)
        while len(gl) >= FAN_IN and gl[-FAN_IN:] == [gl[-1]] * FAN_IN:
            k2, c2 = _merge_counts(gk[-FAN_IN:], gc[-FAN_IN:])
            gk[-FAN_IN:], gc[-FAN_IN:], gl[-FAN_IN:] = [k2], [c2], [gl[-1] + 1]
        if len(ck) > 8:  # clusters: at most rebalance's cluster count, whatever the rows
            ck, cb, ca = _merge_clusters(ck, cb, ca)
    clusters, before, after = (x[0] for x in _merge_clusters(ck, cb, ca))
    roots, sizes = _merge_counts(gk, gc)
    owner = root_owner(roots, w)
    order = np.argsort(owner, kind="stable")  # by owner, ascending roots within each
    starts = np.searchsorted(owner[order], np.arange(w + 1))
    for what, arr in (("roots", roots[order]), ("sizes", sizes[order]), ("starts", starts)):
        path = _roots_path(parts, t, w, what)
        tmp = f"{path}.tmp-{os.getpid()}.npy"
        np.save(tmp, arr)
        os.replace(tmp, path)
    return {"nn": nn, "eval": ev, "clusters": (clusters, before, after)}


def report_group_task(t: int, w: int, out_dir: str, parts: str, t_dup: float, t_dec: float, bins_nn: np.ndarray,
                      bins_eval: np.ndarray, n_top: int, block: int) -> dict:
    """Pass 2 (see the module docstring): the histograms over this task's rows; the copy groups whose root is one
    of its rows, from every task's pass-1 part (each part's roots are sorted: one slice of each)."""
    a = _arrays(out_dir)
    n = len(a["nn_sim"])
    nn, ev = SimStats(), SimStats()
    for s, e in task_blocks(n, t, w, block):
        nn.add_hist(np.asarray(a["nn_sim"][s:e]), t_dup, bins_nn)
        ev.add_hist(np.asarray(a["eval_sim"][s:e]), t_dec, bins_eval)
    keys, counts = [], []
    for p in range(w):
        i, j = np.load(_roots_path(parts, p, w, "starts"))[t:t + 2]
        keys.append(np.array(np.load(_roots_path(parts, p, w, "roots"), mmap_mode="r")[i:j]))
        counts.append(np.array(np.load(_roots_path(parts, p, w, "sizes"), mmap_mode="r")[i:j]))
    roots, sizes = _merge_counts(keys, counts)
    size_vals, size_counts = np.unique(sizes, return_counts=True)
    multi = np.flatnonzero(sizes > 1)
    top = multi[np.lexsort((roots[multi], -sizes[multi]))[:n_top]]
    return {"nn_hist": (nn.hist_lo, nn.hist_hi), "eval_hist": (ev.hist_lo, ev.hist_hi),
            "sizes": (size_vals, size_counts.astype(np.int64)), "top": (roots[top], sizes[top])}


def report_members_task(t: int, w: int, out_dir: str, roots: np.ndarray, block: int) -> dict:
    """Pass 3: this task's rows in the copy groups ``roots`` (and which group each is in)."""
    component = load_step(out_dir, "dedup", keys=("component",), mmap=True)["component"]
    rows, groups = [], []
    for s, e in task_blocks(len(component), t, w, block):
        c = np.asarray(component[s:e])
        hit = np.flatnonzero(np.isin(c, roots))
        rows.append(hit + s)
        groups.append(c[hit])
    return {"rows": np.concatenate(rows) if rows else np.zeros(0, np.int64),
            "groups": np.concatenate(groups) if groups else np.zeros(0, np.int64)}


def report_stats(out_dir: str, t_dup: float, t_dec: float, n_top: int, num_tasks: int = 1,
                 launcher: str = "inline", block: int | None = None) -> ReportStats:
    """The report's :class:`ReportStats` as ``num_tasks`` tasks of each pass, launched as the plan says
    (``launcher``: tasks.launcher; curation.core.runner.launch)."""
    block = block or BLOCK
    w, how = int(num_tasks), launch(launcher, int(num_tasks))
    parts = RunLayout(out_dir).steps("report")
    shutil.rmtree(parts, ignore_errors=True)  # an earlier report's parts describe older step arrays
    os.makedirs(parts)
    kw = {"out_dir": out_dir, "parts": parts, "t_dup": t_dup, "t_dec": t_dec, "block": block}
    scan = [r["result"] for r in run_step(report_scan_task, w, **how, **kw)]
    nn, ev = SimStats(), SimStats()
    for r in scan:
        nn, ev = nn.merge(r["nn"]), ev.merge(r["eval"])
    ids, before, after = (x[0] for x in _merge_clusters(*([r["clusters"][k] for r in scan] for k in range(3))))
    grouped = [r["result"] for r in run_step(report_group_task, w, **how, **kw, bins_nn=nn.bins(),
                                               bins_eval=ev.bins(), n_top=n_top)]
    for r in grouped:
        nn.hist_lo, nn.hist_hi = nn.hist_lo + r["nn_hist"][0], nn.hist_hi + r["nn_hist"][1]
        ev.hist_lo, ev.hist_hi = ev.hist_lo + r["eval_hist"][0], ev.hist_hi + r["eval_hist"][1]
    size_vals, size_counts = _merge_counts([r["sizes"][0] for r in grouped], [r["sizes"][1] for r in grouped])
    top_roots = np.concatenate([r["top"][0] for r in grouped]).astype(np.int64)
    top_sizes = np.concatenate([r["top"][1] for r in grouped]).astype(np.int64)
    order = np.lexsort((top_roots, -top_sizes))[:n_top]  # largest first, ties: the smaller root (id) first
    top_roots = top_roots[order]
    groups = []
    if len(top_roots):
        found = [r["result"] for r in run_step(report_members_task, w, **how, out_dir=out_dir, roots=top_roots,
                                               block=block)]
        rows = np.concatenate([f["rows"] for f in found])
        of = np.concatenate([f["groups"] for f in found])
        for root in top_roots:
            members = np.sort(rows[of == root])
            groups.append(np.concatenate([[root], members[members != root]]).astype(np.int64))
    shutil.rmtree(parts, ignore_errors=True)
    return ReportStats(nn, ev, ids, before, after, size_vals, size_counts, groups)


def report_tasks(tasks, n: int) -> tuple[int, str]:
    """(W, launcher) of the report for ``n`` rows under ``tasks`` (a TasksConfig; None: the defaults)."""
    from curation.config import TasksConfig, task_plan

    plan = task_plan(tasks or TasksConfig(), n)
    return int(plan["tasks"]), str(plan["launcher"])
