"""The pipeline's one report: ``RUN/report/report.md`` with loss curves, the curation plots, the kNN table
(each accuracy with its standard error, and each model's gain over a random init with the SE of that
difference) and where every artefact is."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

from ..train.knn_probe import read_knn
from ..train.metrics import read_metrics
from ..utils.run_layout import TrainLayout


def _phase_lines(ax, rows: list[dict]) -> None:
    phases = [(r["step"], r.get("phase")) for r in rows]
    for (s0, a), (s1, b) in zip(phases, phases[1:]):
        if a != b:
            ax.axvline(s1, color="grey", ls="--", lw=0.8)
            ax.text(s1, ax.get_ylim()[1], f" {b}", va="top", fontsize=7, color="grey")


def _loss_plot(run_dir: Path, keys: list[str], out: Path, title: str, knn: Optional[list[dict]] = None) -> list[str]:
    """Loss curves (and, when given, the teacher's kNN top-1 at its points in a panel beside them); legends sit
    outside the axes, off the data. Returns the names of the series drawn (empty: nothing to plot)."""
    rows = read_metrics(run_dir)
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if knn:
        fig, (ax, kx) = plt.subplots(1, 2, figsize=(11, 3.5), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(7.5, 3.5), dpi=110)
    drawn = []
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts), label=key)
            drawn.append(key)
    _phase_lines(ax, rows)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside, off the curves
    if knn:
        steps, top1 = [r["step"] for r in knn], [r["top1"] for r in knn]
        se = [binomial_se(r["top1"], int(r["queries"])) for r in knn]
        kx.errorbar(steps, top1, yerr=se, marker="o", capsize=3, label="teacher kNN top-1 ± SE")
        kx.axhline(1.0 / max(1, int(knn[0]["classes"])), color="grey", ls=":", lw=0.8, label="chance")
        x0, x1 = ax.get_xlim()  # one step axis for both panels (the last point is after the last logged step)
        pad = 0.05 * max(x1 - x0, max(steps) - min(steps), 1)
        lo, hi = min(x0, min(steps) - pad), max(x1, max(steps) + pad)
        ax.set_xlim(lo, hi)
        kx.set_xlim(lo, hi)
        kx.set_ylim(0, 1)
        kx.set_xlabel("step")
        kx.set_ylabel(f"kNN top-1 (k={knn[-1]['k']})")
        kx.set_title(f"teacher kNN, {knn[-1]['queries']} held-out queries")
        kx.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, borderaxespad=0)  # below
        drawn.append("knn_top1")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return drawn


def binomial_se(p: float, n: int) -> float:
    """Standard error of a top-1 accuracy ``p`` measured on ``n`` queries: sqrt(p (1 - p) / n)."""
    return math.sqrt(p * (1.0 - p) / n) if n > 0 else float("nan")


def diff_se(se_a: float, se_b: float) -> float:
    """SE of a difference of two accuracies, treated as independent: sqrt(se_a^2 + se_b^2). Both models answer
    the same queries, so their errors are positively correlated and this overstates the paired SE: a
    difference of two of these SEs or more is real, not held-out-set noise."""
    return math.sqrt(se_a ** 2 + se_b ** 2)


RANDOM_TEACHER = "random init (teacher arch)"


def baseline_of(name: str, names) -> str | None:
    """The random init a model is compared with: a student with its own architecture, else the teacher's."""
    if name.startswith("random init"):
        return None
    if name.startswith("student "):
        own = f"random init ({name} arch)"
        if own in names:
            return own
    return RANDOM_TEACHER if RANDOM_TEACHER in names else None


def knn_rows(ev: dict, k: int | str) -> list[dict]:
    """One row per model at ``k``: top-1, its SE, and (not for the random inits) the gain over its random
    baseline with the SE of that difference. ``ev`` is eval_results.json."""
    k, n, accs = str(k), int(ev["val"]), ev["knn_top1"]
    rows = []
    for name, v in accs.items():
        p = v[k]
        row = {"model": name, "top1": p, "se": binomial_se(p, n)}
        base = baseline_of(name, accs)
        if base is not None:
            q = accs[base][k]
            row.update(baseline=base, gain=p - q, gain_se=diff_se(row["se"], binomial_se(q, n)))
        rows.append(row)
    return rows


def summary_lines(ev: dict, k: int | str) -> list[str]:
    """The pipeline's printed kNN summary at ``k`` (plain text, one line per model)."""
    head = (f"kNN top-1 at k={k} on {ev['val']} held-out queries ({ev['classes']} classes, {ev['train']} gallery); "
            "± one standard error")
    out = [head]
    for r in knn_rows(ev, k):
        line = f"  {r['model']:34s} {r['top1']:.3f} ± {r['se']:.3f}"
        if "gain" in r:
            line += f"   {r['gain']:+.3f} ± {r['gain_se']:.3f} over {r['baseline']}"
        out.append(line)
    return out


def _rel(path: Path, start: Path) -> str:
    """Links relative to the report, so the run folder can be moved or copied and still render."""
    return os.path.relpath(path.resolve(), start.resolve())


# What a healthy run looks like, one sentence per curve (the report prints them under the plots).
HEALTHY = {
    "loss": "loss (the weighted sum): follows its parts below; it may rise early on while the DINO loss does, "
            "and what matters is that it settles and does not blow up.",
    "dino_loss": "dino_loss: rises during the teacher-temperature warm-up and while the centre settles (the teacher's "
                 "targets sharpen, so matching them gets harder), then flattens or falls slowly; a rise is not a "
                 "failure, a collapse to ~0 is (the student copies one constant prototype).",
    "ibot_loss": "ibot_loss: the same shape as the DINO loss, on the masked patch tokens.",
    "koleo_loss": "koleo_loss: falls while the batch's embeddings spread out (it is minus the log of each "
                  "embedding's distance to its nearest neighbour, so its sign says nothing); rising again means they "
                  "bunch together.",
    "distill": "each student's loss: falls quickly, then slowly; a flat curve means the student cannot follow.",
    "knn_curve": "teacher kNN top-1 (right panel, the first point is the random init): rises above the first "
                 "point by more than its error bars while the losses still climb; flat at the first point, or "
                 "falling to chance, means the backbone is not learning whatever the losses do.",
    "knn": "the kNN accuracy on the held-out set (table below), not the loss, shows whether the backbone learnt: "
           "each trained model should beat the random init of its own architecture by more than the standard error.",
}


def write_report(p, timings: dict) -> Path:
    out = Path(p.report)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# dinopipe pipeline report", ""]
    manifest = p.curated / "manifest.json"
    if manifest.is_file():
        m = json.loads(manifest.read_text())
        counts = m.get("counts", m)
        lines += ["## Curation", "", "| | images |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in counts.items() if isinstance(v, int)]
        lines += ["", f"Curation report: `{p.curated / 'report' / 'summary.md'}`", ""]
        for png in sorted((p.curated / "report").glob("*.png")):
            lines.append(f"![{png.stem}]({_rel(png, out)})")
        lines.append("")
    lines += ["## Training", ""]
    knn = read_knn(p.pretrain)
    drawn = _loss_plot(p.pretrain, ["loss", "dino_loss", "ibot_loss", "koleo_loss"], out / "pretrain_loss.png",
                       "pretraining", knn=knn)
    if drawn:
        lines += ["![pretraining loss and the teacher's kNN](pretrain_loss.png)", "", "What a healthy run looks like:",
                  ""]
        keys = [k for k in ("loss", "dino_loss", "ibot_loss", "koleo_loss") if k in drawn]
        lines += [f"- {HEALTHY[k]}" for k in keys + (["knn_curve"] if knn else []) + ["knn"]] + [""]
    if knn:
        first = knn[0]
        lines += [f"Teacher kNN during pretraining (k={first['k']}, {first['queries']} queries, {first['classes']} "
                  f"classes, {first['gallery']} gallery): "
                  + ", ".join(f"step {r['step']} {r['top1']:.3f} ± {binomial_se(r['top1'], int(r['queries'])):.3f}"
                              for r in knn), ""]
    rows = read_metrics(p.distill)
    if rows and _loss_plot(p.distill, sorted(k for k in rows[0] if k.endswith("/loss")), out / "distill_loss.png",
                           "distillation"):
        lines += ["![distillation loss](distill_loss.png)", "", f"- {HEALTHY['distill']}", ""]
    if p.eval.is_file():
        ev = json.loads(p.eval.read_text())
        ks = list(next(iter(ev["knn_top1"].values())))
        rows = {k: knn_rows(ev, k) for k in ks}
        lines += [f"## kNN on the held-out set ({ev['classes']} classes, {ev['train']} gallery / {ev['val']} queries)",
                  "", ("Top-1 ± one standard error (binomial, sqrt(p(1-p)/n)); gain = top-1 minus the random init "
                       "of the same architecture, ± the SE of that difference (sqrt(se1² + se2²))."), "",
                  "| model | " + " | ".join(f"top-1 k={k} | gain k={k}" for k in ks) + " |",
                  "|---" * (2 * len(ks) + 1) + "|"]
        for i, name in enumerate(ev["knn_top1"]):
            cells = []
            for k in ks:
                r = rows[k][i]
                cells += [f"{r['top1']:.3f} ± {r['se']:.3f}",
                          f"{r['gain']:+.3f} ± {r['gain_se']:.3f}" if "gain" in r else "—"]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Artefacts", "", "| what | where |", "|---|---|",
              f"| curated shards | `{p.curated / 'shards'}` |", f"| manifest | `{manifest}` |",
              f"| teacher (dinopipe.load) | `{p.pretrain}` |"]
    exp = TrainLayout(p.distill).export()
    for d in sorted(exp.iterdir()) if exp.is_dir() else []:
        lines.append(f"| student {d.name} | `{d}` |")
    lines += [f"| kNN results | `{p.eval}` |", ""]
    if timings:
        lines += ["Stage wall time this invocation: " + ", ".join(f"{k} {v} s" for k, v in timings.items()), ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report
