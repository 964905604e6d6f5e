"""The write step's tasks: shard writing and the decisions parts, each owning its rows of memory-mapped step arrays.

:func:`write_selection` (once, in the orchestrator, ``write_step.step_write``) streams the status array a block at a
time: the kept count, the digest naming the selection and the kept rows per block (:class:`Selection`). A write
task finds the kept rows of its shards from the running sum of those counts (:meth:`Selection.rows`), reading
only the blocks that hold them; a decisions task reads its inputs' rows (curation.core.decisions). No task lists
the kept rows of the whole pool or loads a step array whole.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from dinopipe.config import InputError
from dinopipe.data.sources import as_multi

from curation.core.decisions import decisions_task
from curation.core.embstore import open_embeddings
from curation.core.stepfiles import load_step, step_path
from curation.core.status import KEPT
from curation.write.shards import write_shard_task
from curation.core.runner import BLOCK
from curation.core.layout import RunLayout


def _write_shards_task(t: int, w: int, out_dir: str, sources, shard_size: int, progress: bool = False,
                       selection: Selection | None = None) -> dict:
    """Runner task ``t`` of ``w`` of the shard writing (:func:`write_task`)."""
    return write_task(out_dir, sources, shard_size, t, w, progress, selection)


def _decisions_part_task(t: int, w: int, out_dir: str, failed: np.ndarray, digest: str) -> dict:
    """Runner task ``t`` of ``w`` of the decisions table: its inputs' rows of decisions/part-*.tsv (maps the two
    step arrays it needs and reads only its inputs' rows of them)."""
    emb = open_embeddings(RunLayout(out_dir).embeddings("descriptor"))
    status = load_step(out_dir, "rebalance", keys=("status",), mmap=True)["status"]
    component = load_step(out_dir, "dedup", keys=("component",), mmap=True)["component"]
    out = decisions_task(out_dir, emb, status, component, failed, t, w, digest)
    return {"inputs": out["inputs"]}


def write_inputs(out_dir: str):
    """(embeddings, the rebalance step's arrays, the dedup step's component and nn_sim), memory-mapped."""
    emb = open_embeddings(RunLayout(out_dir).embeddings("descriptor"))
    rb = load_step(out_dir, "rebalance", mmap=True)
    dd = load_step(out_dir, "dedup", keys=("component", "nn_sim"), mmap=True)
    if rb["nearest_seed"].dtype.kind not in "iu":  # strings: a folder written before the seeds became row numbers
        raise InputError(f"{step_path(out_dir, 'rebalance')} was written by an older version (seed names "
                         f"instead of rows): rerun `curate rebalance` on this output folder, then write")
    return emb, rb, dd


@dataclass(frozen=True)
class Selection:
    """The kept rows of the write step, without listing them: their count, the digest that names them (with
    the shard size) and how many of each ``block`` rows of the status array are kept (a task finds the kept
    rows of its shards from the running sum, mapping only those blocks)."""

    n_kept: int
    digest: str
    block: int
    block_kept: np.ndarray  # (ceil(N / block),) int64
    has_seeds: bool  # some row has a nearest seed (the seeds' path table is then opened)

    def rows(self, status: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Rows of the kept images ``start .. stop-1`` (in canonical order): a scan of the blocks holding them."""
        if stop <= start:
            return np.zeros(0, np.int64)
        cum = np.concatenate([[0], np.cumsum(self.block_kept)])
        b0 = int(np.searchsorted(cum, start, side="right")) - 1
        b1 = int(np.searchsorted(cum, stop - 1, side="right")) - 1
        lo = b0 * self.block
        rows = np.flatnonzero(np.asarray(status[lo:(b1 + 1) * self.block]) == KEPT) + lo
        return rows[start - cum[b0]:stop - cum[b0]].astype(np.int64)


def write_selection(out_dir: str, shard_size: int, block: int | None = None) -> Selection:
    """The write step's :class:`Selection`, streamed over the mapped status array ``block`` rows at a time
    (memory: one block; the digest is the one a whole-array hash of the kept ids gives)."""
    block = block or BLOCK
    emb, rb, _ = write_inputs(out_dir)
    status, seed = rb["status"], rb["nearest_seed"]
    h = hashlib.sha1(emb.digest.encode())
    counts = np.zeros(-(-len(status) // block), np.int64)
    has_seeds = False
    for b, lo in enumerate(range(0, len(status), block)):
        keep = np.flatnonzero(np.asarray(status[lo:lo + block]) == KEPT) + lo
        h.update(np.ascontiguousarray(emb.ids[keep]).tobytes())
        counts[b] = len(keep)
        has_seeds = has_seeds or bool((np.asarray(seed[lo:lo + block]) >= 0).any())
    h.update(str(shard_size).encode())
    return Selection(int(counts.sum()), h.hexdigest()[:16], block, counts, has_seeds)


def write_task(out_dir: str, sources, shard_size: int, task_index: int = 0, num_tasks: int = 1,
               progress: bool = False, selection: Selection | None = None) -> dict:
    """Shard-writing task ``task_index`` of ``num_tasks``: its block of shards (curation.write.shards.write_shard_task),
    each image read through the path table (no listing of the pool, no per-image dict). ``selection``: the
    orchestrator's (:func:`write_selection`); None: computed here (a streamed pass over the status array)."""
    src = as_multi(sources)
    emb, rb, dd = write_inputs(out_dir)
    sel = selection if selection is not None else write_selection(out_dir, shard_size)
    status, component = rb["status"], dd["component"]
    seed_dir = RunLayout(out_dir).embeddings("seeds")
    seeds = open_embeddings(seed_dir) if os.path.isdir(seed_dir) and sel.has_seeds else None

    def seed_name(k: int) -> str | None:
        return None if k < 0 or seeds is None else seeds.id_strings(np.array([k]))[0]

    def items_of(start: int, stop: int):
        rows = sel.rows(status, start, stop)
        names, groups = emb.id_strings(rows), emb.id_strings(component[rows])
        cluster, nearest, seed_sim, nn_sim = (np.asarray(rb["cluster"][rows]), np.asarray(rb["nearest_seed"][rows]),
                                              np.asarray(rb["seed_sim"][rows]), np.asarray(dd["nn_sim"][rows]))
        for k, (i, name, group) in enumerate(zip(rows, names, groups)):
            meta = {"id": name, "source": emb.source_names[emb.source_codes[i]], "component": group,
                    "cluster": int(cluster[k]), "nearest_seed": seed_name(int(nearest[k])),
                    "seed_similarity": _num(seed_sim[k]), "nn_similarity": _num(nn_sim[k])}
            yield f"{start + k:09d}", name, (lambda i=i: _read_row(src, emb, i)), meta

    return write_shard_task(out_dir, RunLayout(out_dir).shards(), sel.n_kept, shard_size, items_of, sel.digest, task_index,
                            num_tasks, progress)


def _read_row(src, emb, pos: int) -> bytes | None:
    ref = emb.ref(pos)
    if ref is None or ref.source not in src.by_name:
        return None
    return src.read(ref)


def _num(x) -> float | None:
    return None if not np.isfinite(x) else round(float(x), 5)
