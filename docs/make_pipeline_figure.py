"""Draws docs/pipeline.png, the pipeline at a glance in README.md: python docs/make_pipeline_figure.py"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

STAGES = [
    ("your images", "folders, file lists,\ntar shards", "#eeeeee"),
    ("curate", "embed, dedup,\ndecontaminate, rebalance", "#cfe2f3"),
    ("pretrain", "DINOv2 / DINOv3 SSL,\nFSDP2, 224 -> 518 px", "#d9ead3"),
    ("distill", "smaller students\nfrom the teacher", "#fff2cc"),
    ("eval + report", "kNN / linear / dense,\nplots, report.md", "#f4cccc"),
    ("use it", "dinopipe.load, hub,\ntimm, HF, ONNX", "#eeeeee"),
]
COMMANDS = ["", "curate run", "dinopipe pretrain", "dinopipe distill", "dinopipe eval", "dinopipe export"]


def main(out: Path = Path(__file__).with_name("pipeline.png")) -> None:
    fig, ax = plt.subplots(figsize=(13, 2.6))
    w, gap = 1.9, 0.35
    for i, ((name, what, color), cmd) in enumerate(zip(STAGES, COMMANDS)):
        x = i * (w + gap)
        ax.add_patch(FancyBboxPatch((x, 0), w, 1.3, boxstyle="round,pad=0.05", fc=color, ec="#555555"))
        ax.text(x + w / 2, 1.0, name, ha="center", va="center", fontsize=12, weight="bold")
        ax.text(x + w / 2, 0.5, what, ha="center", va="center", fontsize=8.5)
        if cmd:
            ax.text(x + w / 2, -0.3, cmd, ha="center", va="center", fontsize=8.5, family="monospace",
                    color="#333333")
        if i < len(STAGES) - 1:
            ax.annotate("", xy=(x + w + gap - 0.02, 0.65), xytext=(x + w + 0.07, 0.65),
                        arrowprops=dict(arrowstyle="->", lw=1.5))
    total = len(STAGES) * (w + gap) - gap
    ax.annotate("", xy=(total - w - gap / 2 - 0.2, 1.65), xytext=(w + gap / 2 + 0.2, 1.65),
                arrowprops=dict(arrowstyle="-", lw=1, ls="--", color="#777777"))
    ax.text(total / 2, 1.8, "dinopipe pipeline --config configs/pipeline/quickstart.yaml  (all stages, resumable)",
            ha="center", fontsize=9.5, family="monospace")
    ax.set_xlim(-0.2, total + 0.2)
    ax.set_ylim(-0.55, 2.05)
    ax.axis("off")
    fig.savefig(out, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
