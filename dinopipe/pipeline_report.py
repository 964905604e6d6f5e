"""The pipeline's one report: ``RUN/report/report.md`` with loss curves, the curation plots, the kNN table
and where every artefact is."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .train.metrics import read_metrics


def _loss_plot(run_dir: Path, keys: list[str], out: Path, title: str) -> bool:
    rows = read_metrics(run_dir)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts), label=key)
    phases = [(r["step"], r.get("phase")) for r in rows]
    for (s0, a), (s1, b) in zip(phases, phases[1:]):
        if a != b:
            ax.axvline(s1, color="grey", ls="--", lw=0.8)
            ax.text(s1, ax.get_ylim()[1], f" {b}", va="top", fontsize=7, color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def _rel(path: Path, start: Path) -> str:
    """Links relative to the report, so the run folder can be moved or copied and still render."""
    return os.path.relpath(path.resolve(), start.resolve())


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
    if _loss_plot(p.pretrain, ["loss", "dino_loss", "ibot_loss", "koleo_loss"], out / "pretrain_loss.png",
                  "pretraining"):
        lines += ["![pretraining loss](pretrain_loss.png)", ""]
    rows = read_metrics(p.distill)
    if rows and _loss_plot(p.distill, sorted(k for k in rows[0] if k.endswith("/loss")), out / "distill_loss.png",
                           "distillation"):
        lines += ["![distillation loss](distill_loss.png)", ""]
    if p.eval.is_file():
        ev = json.loads(p.eval.read_text())
        ks = list(next(iter(ev["knn_top1"].values())))
        lines += [f"## kNN on the held-out set ({ev['classes']} classes, {ev['train']} gallery / {ev['val']} queries)",
                  "", "| model | " + " | ".join(f"top-1 k={k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(f"{v[k]:.3f}" for k in ks) + " |" for name, v in ev["knn_top1"].items()]
        lines.append("")
    lines += ["## Artefacts", "", "| what | where |", "|---|---|",
              f"| curated shards | `{p.curated / 'shards'}` |", f"| manifest | `{manifest}` |",
              f"| teacher (dinopipe.load) | `{p.pretrain}` |"]
    exp = p.distill / "export"
    for d in sorted(exp.iterdir()) if exp.is_dir() else []:
        lines.append(f"| student {d.name} | `{d}` |")
    lines += [f"| kNN results | `{p.eval}` |", ""]
    if timings:
        lines += ["Stage wall time this invocation: " + ", ".join(f"{k} {v} s" for k, v in timings.items()), ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report
