"""The curation report: PNG plots and ``report/summary.md`` from an output folder's step files.

* ``similarity.png``   nearest-neighbour cosine of every pool image (copy descriptor) with the dedup
                       and decontamination thresholds marked, log counts, so the few copies show
                       next to the many distinct images; the similarity to eval images beside it.
                       Whether the threshold falls in a gap between the two is the check that the
                       embedder's similarities mean something.
* ``components.png``   how many copy groups have each size.
* ``clusters.png``     cluster sizes (sorted) before and after rebalancing, log scale.
* ``duplicates.png``   a contact sheet: some duplicate groups, one per row, the kept image first.
"""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")  # files only, no display (clusters, CI)
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

from dinopipe.data.decode import safe_decode  # noqa: E402
from dinopipe.data.sources import as_multi  # noqa: E402
from dinopipe.utils.io import atomic_write  # noqa: E402

from curation.core.embstore import open_embeddings  # noqa: E402
from curation.report.decontam import decontam_section  # noqa: E402
from curation.report.tasks import ReportStats, SimStats, of_arrays  # noqa: E402
from curation.core.status import KEPT, NOT_SELECTED, STATUS_NAMES, STATUSES  # noqa: E402
from curation.core.stepfiles import load_step  # noqa: E402
from curation.core.layout import RunLayout

_RED, _BLUE, _GREEN, _ORANGE = "#c0392b", "#2e86c1", "#1e8449", "#e67e22"


def write_report(out_dir: str, sources, params: dict, st: ReportStats, balance: dict, eval_sources=None) -> str:
    """The plots and ``report/summary.md`` from the merged numbers ``st`` (curation.report.step.make_report runs
    this as one task of its own: matplotlib, its figure buffers and the contact sheet's decoded images are that
    task's memory, not the orchestrator's) -> the summary's path."""
    rep = RunLayout(out_dir).report()
    os.makedirs(rep, exist_ok=True)
    with open(RunLayout(out_dir).manifest) as f:
        manifest = json.load(f)
    counts = manifest["counts"]
    emb = open_embeddings(RunLayout(out_dir).embeddings("descriptor"))
    dd, rb = (load_step(out_dir, s, mmap=True) for s in ("dedup", "rebalance"))
    names = _IdNames(emb)
    plots = {
        "similarity": plot_similarity(st.nn, st.eval, counts, params, os.path.join(rep, "similarity.png")),
        "components": plot_components(st, counts, os.path.join(rep, "components.png")),
        "clusters": plot_clusters(st, params.get("rebalance_mode"), os.path.join(rep, "clusters.png")),
        "duplicates": contact_sheet(names, st.groups, rb["status"], dd["nn_sim"],
                                    sources, os.path.join(rep, "duplicates.png"), emb),
    }
    groups = group_lines(names, st.groups)
    dec_lines, dec_png = decontam_section(out_dir, sources, eval_sources, params.get("decontam_verify_threshold", 0.5),
                                          os.path.join(rep, "decontamination.png"))
    if dec_png:
        plots["decontamination"] = dec_png
    groups = groups + dec_lines
    balance["clusters"] = balance_of_counts(st.cluster_before, st.cluster_after)
    path = os.path.join(rep, "summary.md")
    atomic_write(path, summary_markdown(manifest, params, balance, st.nn, plots, out_dir, groups))
    return path


class _IdNames:
    """``names[pos]`` -> string id of embedding row ``pos`` (through the path table, one at a time)."""

    def __init__(self, emb):
        self.emb = emb

    def __getitem__(self, pos) -> str:
        return self.emb.table[self.emb.ids[int(pos)]]


def cluster_counts(cluster, status) -> tuple[np.ndarray, np.ndarray]:
    """Pool images per cluster (ascending labels) before and after rebalancing, of whole arrays at once (what the
    report's tasks merge to: curation.report.tasks)."""
    pool = (cluster >= 0) & ((status == KEPT) | (status == NOT_SELECTED))
    labels = np.unique(cluster[pool], return_inverse=True)[1].ravel()
    k = int(labels.max()) + 1 if len(labels) else 0
    return np.bincount(labels, minlength=k), np.bincount(labels[status[pool] == KEPT], minlength=k)


def n_clusters(cluster, status) -> int:
    """Clusters holding pool images (those rebalancing chose from): the count the plot and summary print."""
    return len(cluster_counts(cluster, status)[0])


def cluster_balance(cluster, status) -> dict:
    """Entropy of cluster sizes before / after rebalancing, over the clusters of ``rebalance``'s labels."""
    return balance_of_counts(*cluster_counts(cluster, status))


def balance_of_counts(before: np.ndarray, after: np.ndarray) -> dict:
    """:func:`cluster_balance` from the pool images per cluster before / after rebalancing."""
    k = len(before)
    if not k:
        return {}

    def stats(c):
        c = np.asarray(c).astype(np.float64)
        p = c[c > 0] / max(c.sum(), 1)
        h = float(-(p * np.log(p)).sum()) if len(p) else 0.0
        return {"n": int(c.sum()), "entropy": h, "normalised_entropy": h / np.log(k) if k > 1 else 1.0,
                "largest_share": float(c.max() / max(c.sum(), 1))}

    return {"clusters": k, "before": stats(before), "after": stats(after)}


# ----------------------------------------------------------------------------- plots


def _log_y(ax) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _save(fig, path: str) -> str:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _split_hist(ax, s: SimStats, label_lo, label_hi, title):
    """The stacked histogram of each side of the threshold, drawn from the tasks' bin counts (each bin's left
    edge weighted by its count: the bars a histogram of the values themselves draws)."""
    bins = s.bins()
    ax.hist([bins[:-1], bins[:-1]], bins=bins, weights=[s.hist_lo, s.hist_hi], stacked=True, color=[_BLUE, _RED],
            label=[f"{label_lo} ({s.n_lo})", f"{label_hi} ({s.n_hi})"])
    _log_y(ax)
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("images (log)")
    ax.set_title(title, fontsize=10)


def plot_similarity(nn_sim, eval_sim, counts: dict, params: dict, path: str) -> str:
    """Counts in the legends are the manifest's (``counts``); the histograms show the similarities.
    ``nn_sim`` / ``eval_sim``: the tasks' :class:`SimStats` (or whole arrays: small pools, tests)."""
    t_dup, t_dec = params["dedup_threshold"], params["decontam_threshold"]
    nn = nn_sim if isinstance(nn_sim, SimStats) else of_arrays(nn_sim, t_dup)
    ev = eval_sim if isinstance(eval_sim, SimStats) else of_arrays(eval_sim, t_dec)
    has_eval = ev.n > 0
    fig, axes = plt.subplots(1, 2 if has_eval else 1, figsize=(12 if has_eval else 7, 4.2),
                             squeeze=False)
    ax = axes[0, 0]
    _split_hist(ax, nn, "distinct: nearest neighbour below threshold",
                "copies: above threshold",
                "nearest-neighbour similarity in the pool (copy descriptor)")
    ax.axvline(t_dup, color=_RED, ls="--", lw=1.5, label=f"dedup threshold {t_dup}")
    ax.axvline(t_dec, color=_ORANGE, ls=":", lw=1.5, label=f"decontamination threshold {t_dec}")
    ax.legend(fontsize=8, loc="upper left",
              title=f"removed: {counts['copy_duplicates']} copy duplicates (verified pairs)\n"
                    f"+ {counts['hash_duplicates']} hash duplicates before kNN", title_fontsize=8)
    if has_eval:
        ax = axes[0, 1]
        _split_hist(ax, ev, "below threshold", "above threshold",
                    "similarity to the nearest eval image")
        ax.axvline(t_dec, color=_ORANGE, ls=":", lw=1.5, label=f"threshold {t_dec}")
        ax.legend(fontsize=8, loc="upper left", title_fontsize=8,
                  title=f"decontaminated: {counts['decontaminated']} images\n(kept images above the "
                        f"threshold and their copy groups)")
    fig.suptitle("Copies should sit right of the threshold with a gap; if the two overlap, the "
                 "embedder cannot tell copies from distinct images", fontsize=9)
    return _save(fig, path)


def plot_components(stats: ReportStats, counts: dict, path: str) -> str:
    """Copy groups per size, from the tasks' merged histogram of group sizes."""
    size_vals, n_groups = stats.group_sizes, stats.group_counts
    fig, ax = plt.subplots(figsize=(7, 4))
    # numeric positions + tick labels: strings that parse as numbers would make matplotlib log
    # "Using categorical units ..." at INFO for every plot
    x = np.arange(len(size_vals))
    ax.bar(x, n_groups, color=[_BLUE if s == 1 else _RED for s in size_vals])
    ax.set_xticks(x, [str(v) for v in size_vals])
    _log_y(ax)
    ax.set_xlabel("images in the copy group (1 = unique image)")
    ax.set_ylabel("groups (log)")
    ax.set_title(f"copy-group sizes: {int(n_groups[size_vals > 1].sum())} groups with copies; removed "
                 f"{counts['copy_duplicates']} copy + {counts['hash_duplicates']} hash duplicates", fontsize=10)
    for xi, c in zip(x, n_groups):
        ax.annotate(str(c), (xi, c), ha="center", va="bottom", fontsize=8)
    return _save(fig, path)


def plot_clusters(stats: ReportStats, mode, path: str) -> str:
    """Cluster sizes before / after, from the tasks' merged pool images per cluster."""
    fig, ax = plt.subplots(figsize=(7, 4))
    k = len(stats.cluster_before)
    if not k:
        ax.text(0.5, 0.5, f"rebalance.mode={mode}: no clustering of the pool\n(use "
                f"mode=hierarchical or cluster to see the balance)", ha="center", va="center")
        ax.set_axis_off()
        return _save(fig, path)
    before, after = np.sort(stats.cluster_before)[::-1], np.sort(stats.cluster_after)[::-1]
    x = np.arange(1, k + 1)
    ax.step(x, np.maximum(before, 0.8), where="mid", color=_BLUE, label=f"before ({before.sum()} images)")
    ax.step(x, np.maximum(after, 0.8), where="mid", color=_GREEN, label=f"after ({after.sum()} images)")
    _log_y(ax)
    ax.set_xlabel("cluster rank (largest first)")
    ax.set_ylabel("images in the cluster (log)")
    ax.set_title(f"cluster sizes before / after rebalancing ({mode}, {k} clusters)", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


LARGE_GROUP = 10  # copy groups this big are flagged: real copies rarely come in such numbers
MIXED_ORIGINS = 3  # ... and groups drawing on this many folders / tar shards


def origin(image_id: str) -> str:
    """Where an image came from: its source plus folder or tar shard (the id minus the file)."""
    return str(image_id).rsplit("/", 1)[0]


def group_flags(ids, members: np.ndarray) -> tuple[int, int, list[str]]:
    """(size, distinct origins, flags) of one copy group: 'large' and/or 'mixed'."""
    n_origins = len({origin(ids[m]) for m in members})
    flags = (["large"] if len(members) >= LARGE_GROUP else []) + (
        ["mixed"] if n_origins >= MIXED_ORIGINS else [])
    return len(members), n_origins, flags


def duplicate_groups(ids, component, n_groups: int) -> list[np.ndarray]:
    """Positions of up to ``n_groups`` copy groups, largest first (ties: kept id); kept first. Of a whole component
    array at once (small pools, tests): the report's tasks find the same groups (curation.report.tasks)."""
    roots, inv, counts = np.unique(component, return_inverse=True, return_counts=True)
    multi = np.flatnonzero(counts > 1)
    multi = sorted(multi, key=lambda g: (-counts[g], roots[g]))[:n_groups]  # rows are in id order
    out = []
    for g in multi:
        members = np.flatnonzero(inv.ravel() == g)
        root = roots[g]
        rest = [m for m in members if m != root]  # positions ascend with ids
        out.append(np.array([root] + rest))
    return out


def contact_sheet(ids, groups: list[np.ndarray], status, nn_sim, sources, path: str, emb=None,
                  max_per_row: int = 6, thumb: int = 160) -> str:
    """``ids[pos]``: string id of row pos; ``groups``: the rows of the copy groups to show (kept first);
    images read through ``emb``'s path table."""
    rows = max(1, len(groups))
    fig, axes = plt.subplots(rows, max_per_row, figsize=(2.2 * max_per_row, 2.6 * rows),
                             squeeze=False, gridspec_kw={"hspace": 0.55})
    for ax in axes.ravel():
        ax.set_axis_off()
    if not groups:
        axes[0, 0].text(0, 0.5, "no duplicate groups found", fontsize=12)
        return _save(fig, path)
    src = as_multi(sources)
    for r, members in enumerate(groups):
        for c, pos in enumerate(members[:max_per_row]):
            ax = axes[r, c]
            ref = emb.ref(pos) if emb is not None else None
            ok = ref is not None and ref.source in src.by_name
            img, _ = safe_decode(src.read(ref)) if ok else (None, "missing")
            if img is not None:
                img.thumbnail((thumb, thumb))
                ax.imshow(np.asarray(img.convert("RGB")))
            ax.set_axis_on()
            ax.set_xticks([])
            ax.set_yticks([])
            kept = c == 0
            for s in ax.spines.values():
                s.set_color(_GREEN if kept else _RED)
                s.set_linewidth(4 if kept else 2)
            name = str(ids[pos]).split("/", 1)[-1]
            name = name if len(name) <= 26 else "..." + name[-23:]
            sim = "" if not np.isfinite(nn_sim[pos]) else f" nn {nn_sim[pos]:.2f}"
            code = int(status[pos])
            label = ("KEPT" if kept else (STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else "?").replace(
                "_", " ")) + sim
            if kept and int(status[pos]) != KEPT:  # the group's representative, later dropped
                label += f", then {STATUS_NAMES[int(status[pos])].replace('_', ' ')}"
            if kept:
                size, n_origins, flags = group_flags(ids, members)
                name += f"\ngroup of {size} from {n_origins} origin{'s' * (n_origins > 1)}"
                if flags:
                    name += " - " + " + ".join(flags).upper() + ": check it"
            ax.set_title(f"{label}\n{name}", fontsize=7, color=_GREEN if kept else _RED)
        if len(members) > max_per_row:
            axes[r, -1].set_xlabel(f"+{len(members) - max_per_row} more", fontsize=7)
    fig.suptitle("duplicate groups: green = the image kept (smallest id), red = removed copies",
                 fontsize=10, y=1.0 if rows > 2 else 1.05)
    return _save(fig, path)


# ----------------------------------------------------------------------------- summary


def group_lines(ids, groups: list[np.ndarray]) -> list[str]:
    """Markdown table of the largest copy groups (``groups``: their rows, kept first), flagging large or mixed ones."""
    if not groups:
        return []
    out = ["## Largest copy groups", "",
           f"Flagged: {LARGE_GROUP}+ images (large) or {MIXED_ORIGINS}+ folders / tar shards "
           f"(mixed): look at them in duplicates.png before trusting the dedup.", "",
           "| kept image | images | origins | flag |", "|---|---:|---:|---|"]
    for members in groups:
        size, n_origins, flags = group_flags(ids, members)
        out.append(f"| {ids[members[0]]} | {size} | {n_origins} | {', '.join(flags) or '-'} |")
    return out + [""]


def summary_markdown(manifest: dict, params: dict, balance: dict, nn_sim, plots: dict,
                     out_dir: str, groups: list[str] | None = None) -> str:
    """``nn_sim``: the tasks' :class:`SimStats` of the nearest-neighbour similarities (or the whole array)."""
    c = manifest["counts"]
    n = max(c["input"], 1)
    lines = ["# Curation report", "", f"Output folder: `{out_dir}`", "", "## Counts", "",
             "| status | images | share |", "|---|---:|---:|",
             f"| input | {c['input']} | 100% |"]
    lines += [f"| {s} | {c[s]} | {100 * c[s] / n:.1f}% |" for s in STATUSES]
    lines += ["", f"input = {' + '.join(STATUSES)}: "
              f"{c['input']} = {' + '.join(str(c[s]) for s in STATUSES)}", "",
              "| source | input | " + " | ".join(STATUSES) + " |",
              "|---|" + "---:|" * (len(STATUSES) + 1)]
    for name, pc in manifest["per_source"].items():
        lines.append(f"| {name} | {pc['input']} | " + " | ".join(str(pc[s]) for s in STATUSES)
                     + " |")
    if manifest.get("unreadable_reasons"):
        lines += ["", "Unreadable: " + ", ".join(f"{k} {v}" for k, v in
                                                  manifest["unreadable_reasons"].items())]
    t = params["dedup_threshold"]
    nn = nn_sim if isinstance(nn_sim, SimStats) else of_arrays(nn_sim, t)
    lines += ["", "## Thresholds", "",
              f"- hash pre-dedup: {'on' if params.get('hash_enabled', True) else 'off'}, "
              f"pHash Hamming distance <= {params['hash_max_distance']}",
              f"- copy dedup: candidates at cosine > {t} on the "
              f"{params.get('copy_model') or 'copy descriptor'}, k = {params['k']}; "
              + (f"each verified on pixels (correlation > {params.get('verify_threshold')}), "
                 if params.get("verify", False) else "not verified (descriptor edges), ")
              + f"{params.get('grouping', 'components')} groups",
              (f"- decontamination: cosine > {params['decontam_threshold']} to the nearest eval image"
               + (f", verified on pixels (score > {params.get('decontam_verify_threshold')})"
                  if params.get("decontam_verify") else "") + " (the image's whole copy group is removed)")
              if params.get("decontam_eval", True) else "- decontamination: no eval set (input.eval_paths is empty), "
              "nothing removed",
              f"- embedder for rebalancing: {params.get('embed_model') or 'copy descriptor'}",
              f"- nearest-neighbour similarities within ±0.05 of the dedup threshold: {nn.near} of "
              f"{nn.n} (few means the threshold sits in a gap)", ""]
    lines += groups or []
    lines += _balance_lines(balance, params.get("rebalance_mode"))
    lines += ["", "## Plots", ""]
    lines += [f"- {k}: `{os.path.relpath(p, out_dir)}`" for k, p in plots.items()]
    return "\n".join(lines) + "\n"


def _balance_lines(balance: dict, mode) -> list[str]:
    out = ["## Balance", "", f"rebalance mode: {mode}"]
    if balance.get("selection"):
        out += ["", balance["selection"]]
    b = balance.get("clusters") or {}
    if b.get("before"):
        bb, ba = b["before"], b["after"]
        out += ["", f"Entropy of cluster sizes over {b['clusters']} clusters (nats; normalised by "
                f"log k, 1 = uniform):", "",
                "| | images | entropy | normalised | largest cluster share |", "|---|---:|---:|---:|---:|",
                f"| before | {bb['n']} | {abs(bb['entropy']):.3f} | {abs(bb['normalised_entropy']):.3f} | "
                f"{bb['largest_share']:.3f} |",
                f"| after | {ba['n']} | {abs(ba['entropy']):.3f} | {abs(ba['normalised_entropy']):.3f} | "
                f"{ba['largest_share']:.3f} |"]
    return out


__all__ = ["write_report", "plot_similarity", "plot_components", "plot_clusters", "cluster_balance",
           "balance_of_counts", "contact_sheet", "duplicate_groups", "group_flags", "summary_markdown"]
