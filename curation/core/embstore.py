"""Embedding storage: fp16 shards + ids, memory-mapped and read in canonical order (no torch here, so the
curation step tasks that only read embeddings -- hash pairs, index add, searches, sampling, decisions -- start
without importing it; the embedding runner that writes it is curation.embed.embeddings).

Layout of an embeddings folder::

    part-TTTTT-SSSSS.npy        (n, D) float16, L2-normalised rows, one per readable image
    part-TTTTT-SSSSS.ids.json   {"ids", "sources", "hashes", "locs", "unreadable": [[id, source, reason]]}
    task-TTTTT-of-NNNNN.json    written when array task T of N has finished all its shards
    table/                      the path table (curation.core.pathtable): ids sorted, rows in canonical order

T is the array task, S the shard within it. The ``.ids.json`` is written last (both files via
tmp + rename), so its presence marks a complete shard; a rerun skips complete shards and, because
shard contents follow the sorted input listing, recomputes exactly the missing ones.
The reader memory-maps the ``.npy`` files and hands out fp32 only one batch at a time, with rows in
the canonical order (by input id, :mod:`curation.core.pathtable`) whatever number of tasks wrote the parts.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from dinopipe.config import InputError
from dinopipe.utils.exits import UnfinishedError
from dinopipe.data.sources import ImageRef
from dinopipe.utils.io import atomic_open, atomic_write_json

from curation.core.pathtable import PathTable, build_table, fresh_meta, open_table

_PART_RE = re.compile(r"part-(\d{5})-(\d{5})\.ids\.json$")


def shard_stem(task_index: int, shard_index: int) -> str:
    return f"part-{task_index:05d}-{shard_index:05d}"


def save_shard(out_dir: str, stem: str, emb: np.ndarray, meta: dict) -> None:
    """Write one shard atomically: the embeddings first, the ids json (the completion mark) last."""
    os.makedirs(out_dir, exist_ok=True)
    with atomic_open(os.path.join(out_dir, f"{stem}.npy"), "wb") as f:
        np.save(f, np.ascontiguousarray(emb, dtype=np.float16))
    atomic_write_json(os.path.join(out_dir, f"{stem}.ids.json"), meta, indent=None)


def l2_normalise_fp16(x) -> np.ndarray:
    """Normalise in fp32 (fp16 sums of squares overflow) and store as fp16 (a torch tensor or an array)."""
    x = x.detach().float().cpu().numpy() if hasattr(x, "detach") else np.asarray(x, np.float32)
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float16)


# ----------------------------------------------------------------------------- reader


@dataclass
class EmbeddingSet:
    """All shards of an embeddings folder, memory-mapped, rows in canonical order (by input id).

    Every per-image field is a numpy array or a memory-mapped file (see :mod:`curation.core.pathtable`):
    ``ids[i]`` is row i's int64 input id, its string is ``table[ids[i]]``; inputs that could not be
    read have an id too (``unreadable_ids``) but no row."""

    ids: np.ndarray  # (N,) int64 input ids, increasing
    table: PathTable  # string id of every listed input (readable or not), sorted
    source_names: list[str]
    source_codes: "SourceCodes"  # row -> int32 index into source_names (read through the table, not held)
    hashes: np.ndarray  # (N,) uint64 perceptual hashes (0 when not computed)
    input_source: np.ndarray  # (N_inputs,) int32 source of every input
    input_reason: np.ndarray  # (N_inputs,) int16 index into reason_names; -1 for readable inputs
    reason_names: list[str]
    locations: PathTable  # (N,) where row i's bytes are: a file path, or a tar shard ...
    spans: np.ndarray  # (N, 2) int64 ... with (offset, size) of the member (-1 for files)
    digest: str  # of the sorted id strings: two sets with the same digest number their inputs alike
    parts: list[np.ndarray] = field(repr=False)  # memmapped (n_i, D) float16
    offsets: np.ndarray = field(repr=False)  # (P + 1,) row offsets of the parts (concatenated order)
    perm: np.ndarray = field(repr=False)  # (N,) canonical row -> concatenated row

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        return next((p.shape[1] for p in self.parts if p.ndim == 2 and p.shape[1] > 0), 0)

    @property
    def n_inputs(self) -> int:
        return len(self.table)

    @property
    def unreadable_ids(self) -> np.ndarray:
        return np.flatnonzero(np.asarray(self.input_reason) >= 0)

    @property
    def unreadable(self) -> list[tuple[str, str, str]]:
        """(id, source, reason) of the unreadable inputs (a list: for people and small pools)."""
        return [(self.table[i], self.source_names[self.input_source[i]], self.reason_names[self.input_reason[i]])
                for i in self.unreadable_ids]

    def id_strings(self, positions) -> list[str]:
        """String ids of rows ``positions`` (a chunk at a time)."""
        return self.table.strings(self.ids[np.asarray(positions, np.int64)])

    def positions_of(self, strings) -> np.ndarray:
        """Row positions of string ids (-1 where absent or unreadable)."""
        found = self.table.lookup(strings)
        pos = np.searchsorted(self.ids, found)
        ok = (found >= 0) & (pos < len(self.ids))
        ok[ok] = self.ids[pos[ok]] == found[ok]
        return np.where(ok, pos, -1)

    def ref(self, pos: int) -> ImageRef | None:
        """Where row ``pos`` lives (None for parts written without locations)."""
        pos = int(pos)
        loc = self.locations[pos]
        if not loc:
            return None
        off, size = (int(x) for x in self.spans[pos])
        return ImageRef(self.table[self.ids[pos]], self.source_names[self.source_codes[pos]],
                        loc if off < 0 else (loc, off, size))

    def batches(self, batch_size: int = 65536, indices: np.ndarray | None = None
                ) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(start, fp32 rows)``; over ``indices`` (positions) if given, else all rows."""
        if indices is None:
            for start in range(0, len(self), batch_size):
                yield start, self.rows(np.arange(start, min(start + batch_size, len(self))))
        else:
            for start in range(0, len(indices), batch_size):
                yield start, self.rows(indices[start:start + batch_size])

    def rows(self, indices) -> np.ndarray:
        """Gather rows (any order) as float32 (B, D)."""
        indices = np.asarray(self.perm[np.asarray(indices, dtype=np.int64)], np.int64)
        out = np.empty((len(indices), self.dim), np.float32)
        part = np.searchsorted(self.offsets, indices, side="right") - 1
        for p in np.unique(part):
            sel = part == p
            out[sel] = self.parts[p][indices[sel] - self.offsets[p]]
        return out


class SourceCodes:
    """``codes[pos]`` = the source code of row(s) ``pos``: ``input_source[ids[pos]]``, read from the memory-mapped
    table on demand (a materialised int32 per row was 4 B per row of the whole pool in every process that opened
    the embeddings: tests/curation/test_step_memory.py)."""

    def __init__(self, input_source: np.ndarray, ids: np.ndarray) -> None:
        self.input_source, self.ids = input_source, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, pos):
        return self.input_source[self.ids[pos]]


def open_embeddings(emb_dir: str, require_complete: bool = True) -> EmbeddingSet:
    """Open every complete shard in ``emb_dir`` (building its path table on first use).

    With ``require_complete`` (the default), a folder where some array task has not finished is
    refused with the missing task numbers, instead of silently curating part of the pool.
    """
    metas, parts = _list_parts(emb_dir, require_complete)
    dims = {p.shape[1] for p in parts if len(p)}
    if len(dims) > 1:
        raise InputError(f"{emb_dir} mixes embedding dimensions {sorted(dims)}: embeddings from "
                         f"different models; use one output folder per model")
    t = open_table(emb_dir, metas, [len(p) for p in parts])
    offsets = np.zeros(len(parts) + 1, np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    meta = t["meta"]
    ids = t["row_id"]
    return EmbeddingSet(ids, PathTable(t["ids_blob"], t["ids_offsets"]), meta["sources"],
                        SourceCodes(t["input_source"], ids),
                        t["row_hash"], t["input_source"], t["input_reason"], meta["reasons"],
                        PathTable(t["loc_blob"], t["loc_offsets"]), t["loc_span"], meta["ids"],
                        parts, offsets, t["row_perm"])


def _list_parts(emb_dir: str, require_complete: bool = True) -> tuple[list[str], list[np.ndarray]]:
    """The complete shards' ``.ids.json`` files (sorted) and their embeddings (memory-mapped)."""
    metas = sorted(p for p in glob.glob(os.path.join(emb_dir, "part-*.ids.json"))
                   if _PART_RE.search(p))
    if not metas:
        raise FileNotFoundError(
            f"no embeddings in {emb_dir}: run the embed step first (curate embed ...)"
        )
    if require_complete:
        _check_tasks_done(emb_dir)
    return metas, [np.load(m[: -len(".ids.json")] + ".npy", mmap_mode="r") for m in metas]


def build_path_table(emb_dir: str, plan: Callable[[int], dict]) -> int:
    """Build ``emb_dir``'s path table unless it is complete and current, as the W tasks ``plan(rows)`` gives
    (``{"tasks": W, "launcher": "inline" | "local"}``, curation.config.task_plan; curation.core.pathtable.build_table);
    returns W (0: the table was there)."""
    metas, parts = _list_parts(emb_dir)
    if fresh_meta(emb_dir, metas) is not None:
        return 0
    rows = [len(p) for p in parts]
    p = plan(sum(rows))
    w = max(1, int(p["tasks"]))
    launcher = p["launcher"] if p["launcher"] in ("inline", "srun") else "local"  # W = 1 local: isolate
    # srun: W srun tasks, as every other step; their outputs are written a slice per owner (no two nodes
    # write one page: curation.core.table_owned)
    return build_table(emb_dir, metas, rows, w, launcher)["tasks"]


def _check_tasks_done(emb_dir: str) -> None:
    done = glob.glob(os.path.join(emb_dir, "task-*-of-*.json"))
    if not done:
        raise UnfinishedError(f"{emb_dir}: no task has finished embedding yet")
    totals = {int(re.search(r"-of-(\d+)", p).group(1)) for p in done}
    if len(totals) > 1:
        raise InputError(f"{emb_dir} holds runs split into {sorted(totals)} tasks; use a fresh "
                         f"folder when changing num_tasks")
    total = totals.pop()
    have = {int(re.search(r"task-(\d+)-of", p).group(1)) for p in done}
    missing = sorted(set(range(total)) - have)
    if missing:
        raise UnfinishedError(  # a killed or not yet run array task: exit 75, not the user's mistake
            f"{emb_dir}: embedding tasks {missing} of {total} have not finished; rerun them "
            f"(completed shards are skipped) before deduplicating"
        )


def mark_task_done(out_dir, task_index, num_tasks, counts) -> None:
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_json(os.path.join(out_dir, f"task-{task_index:05d}-of-{num_tasks:05d}.json"), counts)
