"""The curation tables of docs/curation-scale.md and docs/benchmarks.md, generated, not typed: the growth table from the
JSON of bench/bench_curation_scale.py, the planner's worked examples from `curate plan`'s output.

    python bench/tools/render_tables.py --scale bench/results/scale_1m.json [more JSON ...] [--rates curation/plan_rates.json]

Each table is written between its marker comments (``<!-- begin: NAME -->`` ... ``<!-- end: NAME -->``), so a
rerun replaces it and leaves the rest of the page as it is; a page without its markers is an error. The output
depends only on the inputs (no clock): the same JSON gives the same bytes. `make curation-tables` runs this
after bench/tools/rates_from_bench.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.tools.rates_from_bench import load_runs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "curation-scale.md")
README = os.path.join(ROOT, "docs", "benchmarks.md")  # the short form (README.md links to it)

# the worked examples of docs/curation-scale.md "The planner": (title, `curate plan` arguments)
EXAMPLES = [
    ("DINOv2's LVD-142M from 1.2B images on 20 nodes x 8 V100, no pixel verification (as DINOv2: "
     "dedup.verify=false, decontaminate.verify=false, decontaminate.views=false), the copy search as a 20-task "
     "Slurm array",
     "--pool 1.2B --dim 1024 --index ivf_pq --pq-m 64 --nodes 20 --gpus-per-node 8 --gpu v100 "
     "--pairs-per-image 0 --search-tasks 20 --eval-views 1"),
    ("DINOv3's hierarchical k-means (10M / 500k / 50k / 10k) on 16 nodes x 8 H100, the k-means as 128 ranks",
     "--pool 1.2B --dim 1024 --index ivf_pq --pq-m 64 --nodes 16 --gpus-per-node 8 --gpu h100 "
     "--pairs-per-image 40 --search-tasks 16 --kmeans-tasks 128 --levels 10M 500k 50k 10k"),
    ("The same 1.2B pool with pixel verification (40 candidate pairs per image, one core per verification task) "
     "and the finishing job as 1,280 srun tasks, e.g. the 20 nodes' 64 cores each (submit_curation.sh "
     "--finish-tasks 1280: tasks.launcher=srun); with the finishing job on one node the verification alone is "
     "~2,800 h; the eval index holds 98 views of each of the 1M eval images (decontaminate.views, the default: "
     "39 h of the total; 3.95 h without views)",
     "--pool 1.2B --dim 1024 --index ivf_pq --pq-m 64 --nodes 20 --gpus-per-node 8 --gpu v100 "
     "--pairs-per-image 40 --search-tasks 20 --finish-tasks 1280"),
    ("A 10M-tile pathology pool on one 8-GPU node (A100), 40 candidate pairs per tile, three k-means levels",
     "--pool 10M --dim 1024 --index ivf_sq8 --nodes 1 --gpus-per-node 8 --gpu a100 --cpus-per-task 64 "
     "--pairs-per-image 40 --levels 100k 10k 1k --eval 100k"),
]

STEP_LABELS = {"pool_task": "generate", "pairs_task": "hash pairs", "add_task": "index add",
               "search_task": "search", "verify_arrays_task": "verification (planted)",
               "verify_pairs_task": "verification (planted)", "verify_candidates_task": "verification (planted)",
               "tree_task": "k-means tree (every level)",
               "hist_task": "sampling: histogram", "boundary_task": "sampling: boundary",
               "select_task": "sampling: select", "_decisions_part_task": "decisions parts",
               "index_train": "index train (one process)", "index_merge": "index merge (one process)",
               "hash_grouping": "hash grouping (one process)", "grouping": "copy grouping (one process)",
               "run_task": "path table: runs", "rank_task": "path table: ranks", "copy_task": "path table: strings"}


def _label(step: str, fn: str) -> str:
    """A runner call's row label: STEP_LABELS, the searches by step, and decontaminate's path-table calls named the
    eval set's (its small table, built where the step first opens it; the pool's is built under generate)."""
    if fn == "search_task":
        return {"decontaminate": "eval search", "dedup": "copy search"}.get(step, STEP_LABELS[fn])
    label = STEP_LABELS.get(fn, fn)
    return "eval " + label if step == "decontaminate" and label.startswith("path table") else label


def replace_region(text: str, name: str, content: str) -> str:
    """``text`` with what lies between ``<!-- begin: name -->`` and ``<!-- end: name -->`` replaced by
    ``content`` (the markers kept); a missing or repeated marker is an error."""
    begin, end = f"<!-- begin: {name} -->", f"<!-- end: {name} -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"expected one '{begin}' followed by one '{end}'")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{content.strip()}\n{end}{tail}"


def slope(ns, ts) -> float:
    """Least-squares slope of log t against log N (nan with fewer than two sizes)."""
    pts = [(math.log(n), math.log(max(t, 1e-3))) for n, t in zip(ns, ts)]
    if len({x for x, _ in pts}) < 2:
        return float("nan")
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def _n(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}k" if n >= 1e3 else str(n)


def _rows(run: dict) -> dict:
    """(step, label) -> (task s, task heap MB) of one run: each step's total, then its runner calls."""
    out = {}
    for step, r in run["steps"].items():
        out[(step, "")] = (float(r["task_s"]), float(r["task_heap_mb"]), float(r["wall_s"]))
        seen = {}
        for c in r["runs"]:
            label = _label(step, c["fn"])
            s, h = seen.get(label, (0.0, 0.0))
            seen[label] = (s + float(c["task_s"]), max(h, float(c["task_heap_mb"])))
        if len(seen) > 1:
            for label, (s, h) in seen.items():
                out[(step, label)] = (s, h, None)
    return out


def _inline_calls(run: dict) -> set:
    """The (step, label) keys of :func:`_rows` whose runner calls ran inline (in the orchestrator's process: a run
    without ``tasks.isolate`` at W = 1), where a task's heap is what it added to the orchestrator's."""
    out = set()
    for step, r in run["steps"].items():
        for c in r["runs"]:
            if c.get("inline", True) and c["fn"] not in ONE_PROCESS:
                out |= {(step, _label(step, c["fn"])), (step, "")}
    return out


def growth_table(runs: list[dict]) -> str:
    """Markdown: per step and runner call, the slowest task's s / the largest task's heap at every (N, W),
    the log-log slope of task s over N per W, the W_max / W = 1 heap ratio at the largest N, then recall,
    the decisions digests and whether they agree across W, and the total wall time."""
    runs = sorted(runs, key=lambda r: (int(r["n"]), int(r["tasks"])))
    cols = [(int(r["n"]), int(r["tasks"])) for r in runs]
    by = {c: _rows(r) for c, r in zip(cols, runs)}
    ws = sorted({w for _, w in cols})
    ns = sorted({n for n, _ in cols})
    big, wmax = ns[-1], ws[-1]
    slope_ws = [w for w in ws if len([n for n, ww in cols if ww == w]) > 1]
    ratio = (big, 1) in by and (big, wmax) in by and wmax > 1
    head = ["step"] + [f"N={_n(n)} W={w}" for n, w in cols] + [f"slope W={w}" for w in slope_ws]
    head += [f"heap W={wmax} / W=1 at {_n(big)}"] if ratio else []
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    keys = []
    for c in cols:
        keys += [k for k in by[c] if k not in keys]
    for key in keys:
        step, label = key
        name = f"**{step}**" if not label else f"&nbsp;&nbsp;{label}"
        cells = []
        for c in cols:
            v = by[c].get(key)
            wall = f" (wall {v[2]:.0f} s)" if v is not None and v[2] is not None else ""
            cells.append("" if v is None else f"{v[0]:.1f} s / {v[1]:,.0f} MB{wall}")
        for w in slope_ws:
            pts = [(n, by[(n, w)][key][0]) for n in ns if (n, w) in by and key in by[(n, w)]]
            s = slope([p[0] for p in pts], [p[1] for p in pts]) if len(pts) > 1 else float("nan")
            cells.append("" if math.isnan(s) else f"{s:.2f}")
        if ratio:
            a, b = by[(big, 1)].get(key), by[(big, wmax)].get(key)
            small = " (small)" if a and b and max(a[1], b[1]) < 64 else ""  # a few MB: noise, not growth
            cells.append(f"{b[1] / a[1]:.2f}{small}" if a and b and a[1] > 0 else "")
        lines.append("| " + " | ".join([name] + cells) + " |")
    extra = len(head) - 1 - len(cols)

    def row(name, vals):
        lines.append("| " + " | ".join([name] + vals + [""] * extra) + " |")

    row("rows: dim / copy-search query fraction", [f"{r.get('dim', '?')} / {r.get('query_fraction', 1.0):g}"
                                                    for r in runs])
    row("total wall", [f"{r['total_s'] / 60:.1f} min" if r.get("total_s") else "" for r in runs])
    row("recall hash / copies / overlap", [" / ".join(f"{v:.3f}" for v in r["recall"].values()) for r in runs])
    row("decisions sha256", [r["decisions_sha256"][:12] for r in runs])
    same = {n: len({r["decisions_sha256"] for r in runs if int(r["n"]) == n}) == 1 for n in ns}
    row("decisions equal across W", ["yes" if same[int(r["n"])] else "**NO**" for r in runs])
    return "\n".join(lines)


def provenance(runs: list[dict]) -> str:
    """Where the runs were measured (the JSON's meta), one line per distinct source."""
    seen: dict[str, list[str]] = {}
    for r in runs:
        m = r.get("meta") or {}
        machine, _, load = m.get("machine", "machine not recorded").partition(", load ")
        line = (f"{os.path.basename(r['_file'])}: {m.get('date', 'date not recorded')}, "
                f"{machine}{{loads}}; `{m.get('command', 'command not recorded')}`")
        seen.setdefault(line, [])
        if load:
            seen[line].append(load)
    return "\n".join("* " + s.replace("{loads}", f", load {' / '.join(ld)} (per run)" if ld else "")
                     for s, ld in seen.items())


def scale_section(runs: list[dict]) -> str:
    return ("Generated by `bench/tools/render_tables.py` from the growth bench's JSON (`make curation-tables`); "
            "cells: the slowest task's s / the largest task's heap (RssAnon above its start); a step's bold row "
            "sums its runner calls' slowest tasks, and its wall time includes the single-process work (index "
            "train, merge, grouping, orchestration); slopes: log-log least squares of task s over N.\n\n"
            + growth_table(runs) + "\n\nMeasured:\n" + provenance(runs))


def default_chain_section(runs: list[dict], option: str = "--default-chain") -> str:
    """The growth and per-task tables of runs of `curate run`'s default config (issue 40: write and report
    included), beside its settings."""
    cfg = (runs[0].get("config") or {}) if runs else {}
    said = ", ".join(f"{k}={v}" for k, v in (("dedup.k", (cfg.get("dedup") or {}).get("k")),
                                              ("dedup.threshold", (cfg.get("dedup") or {}).get("threshold")),
                                              ("rebalance.mode", (cfg.get("rebalance") or {}).get("mode")),
                                              ("write.shard_size", (cfg.get("write") or {}).get("shard_size")),
                                              ("report.enabled", (cfg.get("report") or {}).get("enabled"))))
    return (f"Generated by `bench/tools/render_tables.py {option}` from the growth bench's JSON; `curate simulate` "
            f"with `curate run`'s default config ({said}; chain: {' -> '.join(runs[0]['chain'])}). Cells as in "
            "the table above.\n\n" + growth_table(runs) + "\n\n" + task_memory_table(runs))  # (it says where measured)


def readme_table(runs: list[dict]) -> str:
    """docs/benchmarks.md's short form: the largest N, every W, the runner calls only."""
    big = max(int(r["n"]) for r in runs)
    top = sorted((r for r in runs if int(r["n"]) == big), key=lambda r: int(r["tasks"]))
    rows = [_rows(r) for r in top]
    head = ["step"] + [f"{_n(big)} rows, W = {r['tasks']}" for r in top]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for key in rows[0]:
        if key[1] or all(k[0] != key[0] or not k[1] for k in rows[0]):
            name = key[1] or key[0]
            lines.append("| " + " | ".join([name] + [f"{x[key][0]:.1f} s / {x[key][1]:,.0f} MB" if key in x else ""
                                                    for x in rows]) + " |")
    same = len({r["decisions_sha256"] for r in top}) == 1
    lines.append("| decisions.tsv | " + " | ".join(r["decisions_sha256"][:12] for r in top) + " |")
    return ("\n".join(lines) + f"\n\nDecisions {'identical' if same else 'DIFFERENT'} across W at {big:,} rows "
            "(generated by `make curation-tables` from " + ", ".join(sorted({os.path.basename(r["_file"]) for r in top}))
            + "; the slowest task's s / the largest task's heap).")


TASK_GOAL = 0.3
"""The issue's goal for a step split over W = 4 tasks: the largest task's heap <= 0.3 x its W = 1 heap at 10M rows."""
ROW_GOAL = 8.0
"""...and for a step that runs as one task (or in the orchestrator): at most 8 bytes per row of the pool."""
ORCH_GOAL = 2.0
"""Issue 40's goal for the orchestrating process of every step: at most 2 bytes per row of the pool at 10M rows."""
ONE_PROCESS = ("index_train", "hash_grouping", "grouping", "index_merge")
"""The orchestrator's own phases (curation.core.runner.phase): one process whatever W."""


CONSTANT_GROWTH = 1.25
"""A call whose largest task at W = max holds at most this much more at the largest N than at the smallest (with
N / N_min times the rows per task) holds a per-task working set (a query chunk, a block), not its rows: the issue's
"(N/W rows x bytes per row) + a constant" with no per-row part, which more tasks cannot shrink."""


def task_memory_table(runs: list[dict]) -> str:
    """Markdown: at the largest N, every runner call's largest task heap at W = 1 and W = max, their ratio against
    TASK_GOAL (a call that runs as one task at both W: its bytes per row against ROW_GOAL; one above the ratio whose
    heap at W = max did not grow from the smallest N: CONSTANT_GROWTH), and each step's orchestrator heap in bytes
    per row against ORCH_GOAL."""
    big = max(int(r["n"]) for r in runs)
    top = {int(r["tasks"]): r for r in runs if int(r["n"]) == big}
    w1, wmax = top.get(1), top.get(max(top))
    if w1 is None or wmax is None or wmax is w1:
        raise ValueError(f"the task-memory table needs runs at W = 1 and W > 1 at {big:,} rows")
    a, b = _rows(w1), _rows(wmax)
    inline1 = _inline_calls(w1)
    least = min(int(r["n"]) for r in runs)  # the same W at the smallest N: a per-task constant shows as no growth
    small = next((_rows(r) for r in runs if int(r["n"]) == least < big and int(r["tasks"]) == int(wmax["tasks"])), {})
    head = ["step / call", "W = 1 heap", f"W = {wmax['tasks']} heap", "ratio or B per row", "goal met"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|---|"]
    for key in a:
        if key not in b or not key[1] or key == ("generate", "generate"):  # the simulation's input, not a step
            continue
        h1, h4 = a[key][1], b[key][1]
        one = any(c["fn"] in ONE_PROCESS and STEP_LABELS.get(c["fn"], c["fn"]) == key[1] for c in w1["steps"][key[0]]["runs"])
        if one:
            per_row = max(h1, h4) * 2 ** 20 / big
            met = "yes" if per_row <= ROW_GOAL else "no"
            if key[1].startswith("index train"):
                met += " (one task on a fixed sample: constant in N)"
            goal = f"{per_row:.1f} B/row", met
        elif max(h1, h4) < 64:
            goal = f"{h4 / h1:.2f}" if h1 > 0 else "", "yes (a few MB: noise, not growth)"
        elif h1 < 64 and key in inline1:  # W = 1 inline: an allocation reusing heap an earlier call freed is unseen
            goal = "", f"not measured at W = 1 (inline, {h1:.1f} MB: ran in heap freed by an earlier call)"
        elif h4 <= TASK_GOAL * h1:
            goal = f"{h4 / h1:.2f}", "yes"
        elif key in small and h4 <= CONSTANT_GROWTH * max(small[key][1], 1.0):
            goal = f"{h4 / h1:.2f}", (f"yes: constant per task, not rows ({small[key][1]:,.0f} MB at {least:,} rows, "
                                      f"{big // least}x fewer, same W)")
        else:
            goal = f"{h4 / h1:.2f}", "no"
        lines.append(f"| {key[0]}: {key[1]} | {h1:,.0f} MB | {h4:,.0f} MB | {goal[0]} | {goal[1]} |")
    for step, r in wmax["steps"].items():  # at W = 1 the inline tasks run in the orchestrator's process
        o = float(r["orchestrator_heap_mb"])
        phases = max([float(c["task_heap_mb"]) for c in r["runs"] if c["fn"] in ONE_PROCESS] or [0.0])
        per_row = o * 2 ** 20 / big
        met = ("yes" if per_row <= ORCH_GOAL else
               "its one-process phases (above)" if 0 < phases and o <= phases + 64 else "no")
        lines.append(f"| {step}: orchestrator | | {o:,.0f} MB | {per_row:.1f} B/row | {met} |")
    return ("\n".join(lines) + "\n\nGenerated by `bench/tools/render_tables.py --tasks-memory` from "
            + ", ".join(sorted({os.path.basename(r["_file"]) for r in (w1, wmax)}))
            + f" ({big:,} rows, dim {w1.get('dim', '?')}, copy-search query fraction {w1.get('query_fraction', 1.0):g}); "
            "heap: the largest task's RssAnon above its start (an inline W = 1 call: the orchestrator's process).\n\n"
            "Measured:\n" + provenance([w1, wmax]))


# the planner's steps and the bench's runner calls that measure them
CHECK = [("hash dedup", "dedup", ("pairs_task",)), ("index train", "dedup", ("index_train",)),
         ("index add", "dedup", ("add_task",)), ("index merge", "dedup", ("index_merge",)),
         ("search (dedup)", "dedup", ("search_task",)), ("grouping", "dedup", ("grouping",)),
         ("decontaminate", "decontaminate", ("search_task",)), ("k-means", "rebalance", ("tree_task",)),
         ("sampling", "rebalance", ("hist_task", "boundary_task", "select_task")),
         ("decisions", "write", ("_decisions_part_task",))]
FROM_RATE = {"hash dedup": "hash_dedup", "grouping": "grouping", "sampling": "sampling", "decisions": "decisions"}
"""Steps timed by a rows/s rate: when curation/plan_rates.json took it from the growth bench, model = bench at W = 1."""


def check_table(runs: list[dict], rates: str | None = None) -> str:
    """The planner against the bench: `curate plan` at each run's shape (rows, D, index, W, the machine's cores,
    curate simulate's nprobe / k / eval rows / levels) beside the slowest task's measured seconds."""
    import inspect

    from curation.plan import plan
    from curation.plan_rates import load_rates
    from curation.simulate.run import simulate

    sim = {k: v.default for k, v in inspect.signature(simulate).parameters.items()}
    R = load_rates(rates)
    runs = sorted(runs, key=lambda r: (int(r["n"]), int(r["tasks"])))
    cells = {}
    for r in runs:
        m = re.search(r"(\d+) cores", (r.get("meta") or {}).get("machine", ""))
        cores = int(m.group(1)) if m else 2
        dd = (r.get("config") or {}).get("dedup") or {}  # the run's own config; else simulate's old settings
        levels = r.get("step_results", {}).get("rebalance", {}).get("levels") or [1000, 100, 10]
        steps = plan(int(r["n"]), int(r["dim"]), r["step_results"]["dedup"].get("index", "ivf"), nodes=1,
                     gpus_per_node=0, cpus_per_task=cores, tasks=int(r["tasks"]), nprobe=dd.get("nprobe", 8), k=dd.get("k", 4),
                     n_eval=sim["n_eval"], levels=levels, pairs_per_image=0, rates=R,
                     eval_views=1)  # a simulation embeds no views (no pixels): its eval rows are the index
        for name, step, fns in CHECK:
            model = sum(s.hours * 3600 for s in steps if s.name.startswith(name))
            calls = [c for c in r["steps"].get(step, {}).get("runs", []) if c["fn"] in fns]
            got = sum(float(c["task_s"]) for c in calls) if calls else None
            cells[(name, int(r["n"]), int(r["tasks"]))] = (model, got)
    head = ["step"] + [f"N={_n(int(r['n']))} W={r['tasks']}: model / measured s" for r in runs]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * len(runs) + "|"]
    for name, _, _ in CHECK:
        row = []
        for r in runs:
            model, got = cells[(name, int(r["n"]), int(r["tasks"]))]
            row.append(f"{model:.1f} / not in the JSON" if got is None else
                       f"{model:.1f} / {got:.1f} (x{got / model:.2f})" if model > 0 else f"- / {got:.1f}")
        own = name in FROM_RATE and "bench_curation_scale" in str((R[FROM_RATE[name]].source or {}).get("bench"))
        lines.append("| " + " | ".join([name + (" (rate: this bench)" if own else "")] + row) + " |")
    return "\n".join(lines)


def check_section(runs: list[dict], rates: str | None = None) -> str:
    return ("Generated by `bench/tools/render_tables.py` (`make curation-tables`): `curate plan`'s hours for one CPU "
            "machine at each run's shape (rows, D, index, W, the machine's cores; `curate simulate`'s nprobe, k, eval "
            "rows and levels), in seconds, beside the bench's slowest task (x: measured / model). Steps timed by a "
            "rows/s rate take it from the bench (curation/plan_rates.json), so at W = 1 they agree by construction and at "
            "W > 1 test the model's tasks-on-cores sharing; index add, searches and k-means are the cost model's "
            "op counts over ENVIRONMENT.md's faiss CPU rates.\n\n" + check_table(runs, rates))


def plan_section(rates: str | None = None) -> str:
    from curation.plan import main as plan_main

    out = ["Generated by `bench/tools/render_tables.py` from `curate plan`'s output (`make curation-tables`); every "
           "figure is the model's, each rate marked measured (with its source) or ASSUMED."]
    for i, (title, args) in enumerate(EXAMPLES):
        argv = shlex.split(args) + (["--rates", rates] if rates else [])
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = plan_main(argv)
        if rc != 0:
            raise RuntimeError(f"curate plan {args}: exit {rc}")
        text = buf.getvalue().strip()
        table, _, sources = text.partition("\n\nRates measured:")
        table = re.sub(r"^### .*\n\n", "", table)
        out += ["", f"**{title}**", "", f"    curate plan {args}", "", table]
        if i == len(EXAMPLES) - 1:
            out += ["", "Rates of the examples, measured:" + sources]
    return "\n".join(out)


def render(paths: list[str], rates: str | None = None, doc: str = DOC, readme: str = README,
           check_paths: list[str] | None = None, task_paths: list[str] | None = None,
           chain_paths: list[str] | None = None, chain_large_paths: list[str] | None = None) -> list[str]:
    """Rewrite the marked regions of ``doc`` and ``readme``; returns the files changed. ``check_paths``: the runs
    the plan is checked against (default ``paths``: those the rates file was taken from)."""
    runs = load_runs(paths)
    checked = load_runs(check_paths) if check_paths else runs
    changed = []
    doc_regions = {"scale-table": scale_section(runs), "plan-check": check_section(checked, rates),
                   "plan-tables": plan_section(rates)}
    if task_paths:
        doc_regions["task-memory-table"] = task_memory_table(load_runs(task_paths))
    if chain_paths:
        doc_regions["default-chain-table"] = default_chain_section(load_runs(chain_paths))
    if chain_large_paths:  # runs of another shape (the 10M ones: 128-d, 1% of rows querying), a table of their own
        doc_regions["default-chain-large-table"] = default_chain_section(load_runs(chain_large_paths),
                                                                         "--default-chain-large")
    for path, regions in ((doc, doc_regions),
                          (readme, {"summary-scale-table": readme_table(runs)})):
        with open(path) as f:
            old = f.read()
        new = old
        for name, content in regions.items():
            try:
                new = replace_region(new, name, content)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
        if new != old:
            with open(path, "w") as f:
                f.write(new)
            changed.append(path)
    return changed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", nargs="+", required=True, help="JSON of bench/bench_curation_scale.py --json")
    p.add_argument("--rates", default=None, help="rates file for the plan (default curation/plan_rates.json)")
    p.add_argument("--check", nargs="+", default=None,
                   help="JSON of the runs the plan is checked against (default: --scale; give the files "
                        "curation/plan_rates.json was taken from when --scale holds runs of another dimension)")
    p.add_argument("--tasks-memory", nargs="+", default=None,
                   help="JSON of runs at W = 1 and W > 1 of one N: the per-task heap table (docs region task-memory-table)")
    p.add_argument("--default-chain", nargs="+", default=None,
                   help="JSON of runs of the default config (docs region default-chain-table)")
    p.add_argument("--default-chain-large", nargs="+", default=None,
                   help="JSON of runs of the default config at another shape (docs region default-chain-large-table)")
    p.add_argument("--doc", default=DOC)
    p.add_argument("--readme", default=README)
    a = p.parse_args(argv)
    try:
        changed = render(a.scale, a.rates, a.doc, a.readme, a.check, a.tasks_memory, a.default_chain,
                         a.default_chain_large)
    except (OSError, ValueError, KeyError) as e:
        print(f"render_tables: error: {e}", file=sys.stderr)
        return 2
    print("updated: " + (", ".join(os.path.relpath(c, ROOT) for c in changed) or "nothing (already current)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
