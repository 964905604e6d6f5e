"""The report's decontamination section (curation.report.plots.write_report, in the report's own task): per eval set,
the candidates (pool images whose nearest eval image passed the cosine), the verified ones, and a contact sheet
of the closest rejected and the weakest accepted pairs, so that the verification threshold can be judged by eye.

Reads the decontaminate step's ``eval_score`` / ``eval_nearest`` arrays (written when candidates were verified on
pixels) a block at a time.
"""

from __future__ import annotations

import os

import numpy as np

from curation.core.stepfiles import blocks, load_step
from curation.core.layout import RunLayout


def _candidates(out_dir: str):
    """(pool rows, eval positions, scores) of every verified-or-refused candidate, or None without them."""
    try:
        d = load_step(out_dir, "decontaminate", keys=("eval_score", "eval_nearest"), mmap=True)
    except (KeyError, FileNotFoundError):
        return None
    if "eval_score" not in d:
        return None
    rows, near, score = [], [], []
    for s, t in blocks(len(d["eval_score"])):
        sc = np.asarray(d["eval_score"][s:t])
        hit = np.flatnonzero(np.isfinite(sc))
        rows.append(s + hit)
        near.append(np.asarray(d["eval_nearest"][s:t])[hit])
        score.append(sc[hit])
    return np.concatenate(rows), np.concatenate(near), np.concatenate(score)


def decontam_section(out_dir: str, sources, eval_sources, threshold: float, path: str, n: int = 6):
    """(markdown lines, contact sheet path or None)."""
    got = _candidates(out_dir)
    if got is None:
        return [], None
    from curation.core.embstore import open_embeddings

    rows, near, score = got
    ev = open_embeddings(RunLayout(out_dir).embeddings("eval"))
    set_of = np.array([ev.ref(int(p)).source if ev.ref(int(p)) is not None else "?" for p in near], dtype=object)
    lines = ["## Decontamination", "",
             f"Candidates: pool images whose nearest eval image passed the cosine; verified: their pixels match "
             f"(score > {threshold}: a view of the eval image -- crop, resize, mirror, rotation, border, colour). "
             "Only verified ones are removed (with their copy groups).", "",
             "| eval set | candidates | verified |", "|---|---:|---:|"]
    for name in sorted(set(set_of)):
        m = set_of == name
        lines.append(f"| {name} | {int(m.sum())} | {int((score[m] > threshold).sum())} |")
    if not len(rows) or not eval_sources:  # no pixels of the eval set to show (e.g. report run on its own)
        return lines + [""], None
    acc = np.flatnonzero(score > threshold)
    rej = np.flatnonzero(score <= threshold)
    show = [("weakest accepted", acc[np.argsort(score[acc], kind="stable")[:n]]),
            ("closest rejected", rej[np.argsort(-score[rej], kind="stable")[:n]])]
    sheet = _sheet(out_dir, sources, eval_sources, ev, rows, near, score, show, path)
    return lines + ["", f"Contact sheet: `{os.path.relpath(sheet, out_dir)}` (pool image | eval image, score)", ""], sheet


def _sheet(out_dir, sources, eval_sources, ev, rows, near, score, show, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dinopipe.data.decode import safe_decode
    from dinopipe.data.sources import as_multi

    from curation.core.embstore import open_embeddings

    pool = open_embeddings(RunLayout(out_dir).embeddings("descriptor"))
    src_p, src_e = as_multi(sources), as_multi(eval_sources)
    n = max(1, max(len(idx) for _, idx in show))
    fig, axes = plt.subplots(2 * len(show), n, figsize=(2.0 * n, 4.4 * len(show)), squeeze=False)
    for ax in axes.ravel():
        ax.set_axis_off()
    for r, (title, idx) in enumerate(show):
        for c, j in enumerate(idx):
            for k, (emb, src, pos) in enumerate(((pool, src_p, rows[j]), (ev, src_e, near[j]))):
                ref = emb.ref(int(pos))
                img = safe_decode(src.read(ref))[0] if ref is not None and ref.source in src.by_name else None
                ax = axes[2 * r + k, c]
                if img is not None:
                    img.thumbnail((160, 160))
                    ax.imshow(np.asarray(img.convert("RGB")))
                if k == 0:
                    ax.set_title(f"{title}\nscore {score[j]:.2f}", fontsize=7)
    fig.suptitle("decontamination: pool image (top) above its eval image (bottom)", fontsize=9)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path
