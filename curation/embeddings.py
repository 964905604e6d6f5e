"""Embedding storage (fp16 shards + ids) and the resumable, task-split embedding runner.

Layout of an embeddings folder::

    part-TTTTT-SSSSS.npy        (n, D) float16, L2-normalised rows, one per readable image
    part-TTTTT-SSSSS.ids.json   {"ids", "sources", "hashes", "locs", "unreadable": [[id, source, reason]]}
    task-TTTTT-of-NNNNN.json    written when array task T of N has finished all its shards
    table/                      the path table (curation.pathtable): ids sorted, rows in canonical order

T is the array task, S the shard within it. The ``.ids.json`` is written last (both files via
tmp + rename), so its presence marks a complete shard; a rerun skips complete shards and, because
shard contents follow the sorted input listing, recomputes exactly the missing ones.
The reader memory-maps the ``.npy`` files and hands out fp32 only one batch at a time, with rows in
the canonical order (by input id, :mod:`curation.pathtable`) whatever number of tasks wrote the parts.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from dinopipe.config import InputError
from dinopipe.data.channels import decode_channels
from dinopipe.data.decode import DEFAULT_MAX_PIXELS, safe_decode
from dinopipe.data.sources import ImageRef, MultiSource, as_multi, check_split
from dinopipe.data.transforms import eval_transform
from dinopipe.utils.io import atomic_open, atomic_write_json
from dinopipe.utils.proc import usable_cores

from .descriptor import HASHES
from .pathtable import PathTable, build_table, fresh_meta, open_table

_PART_RE = re.compile(r"part-(\d{5})-(\d{5})\.ids\.json$")


def shard_stem(task_index: int, shard_index: int) -> str:
    return f"part-{task_index:05d}-{shard_index:05d}"


def save_shard(out_dir: str, stem: str, emb: np.ndarray, meta: dict) -> None:
    """Write one shard atomically: the embeddings first, the ids json (the completion mark) last."""
    os.makedirs(out_dir, exist_ok=True)
    with atomic_open(os.path.join(out_dir, f"{stem}.npy"), "wb") as f:
        np.save(f, np.ascontiguousarray(emb, dtype=np.float16))
    atomic_write_json(os.path.join(out_dir, f"{stem}.ids.json"), meta, indent=None)


def l2_normalise_fp16(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """Normalise in fp32 (fp16 sums of squares overflow) and store as fp16."""
    x = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float32)
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float16)


# ----------------------------------------------------------------------------- reader


@dataclass
class EmbeddingSet:
    """All shards of an embeddings folder, memory-mapped, rows in canonical order (by input id).

    Every per-image field is a numpy array or a memory-mapped file (see :mod:`curation.pathtable`):
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
    (``{"tasks": W, "launcher": "inline" | "local"}``, curation.config.task_plan; curation.pathtable.build_table);
    returns W (0: the table was there)."""
    metas, parts = _list_parts(emb_dir)
    if fresh_meta(emb_dir, metas) is not None:
        return 0
    rows = [len(p) for p in parts]
    p = plan(sum(rows))
    w = max(1, int(p["tasks"]))
    if p["launcher"] not in ("inline", "local"):
        # srun / slurm / dist: local processes of this node instead, at most one per core. The rank and copy
        # tasks write disjoint positions of shared memory-mapped files: safe in one node's page cache, not
        # promised by every network file system across nodes (the bytes are the same for any W)
        w = max(1, min(w, usable_cores()))
    launcher = "inline" if w == 1 or p["launcher"] == "inline" else "local"
    return build_table(emb_dir, metas, rows, w, launcher)["tasks"]


def _check_tasks_done(emb_dir: str) -> None:
    done = glob.glob(os.path.join(emb_dir, "task-*-of-*.json"))
    if not done:
        raise FileNotFoundError(f"{emb_dir}: no task has finished embedding yet")
    totals = {int(re.search(r"-of-(\d+)", p).group(1)) for p in done}
    if len(totals) > 1:
        raise InputError(f"{emb_dir} holds runs split into {sorted(totals)} tasks; use a fresh "
                         f"folder when changing num_tasks")
    total = totals.pop()
    have = {int(re.search(r"task-(\d+)-of", p).group(1)) for p in done}
    missing = sorted(set(range(total)) - have)
    if missing:
        raise InputError(
            f"{emb_dir}: embedding tasks {missing} of {total} have not finished; rerun them "
            f"(completed shards are skipped) before deduplicating"
        )


# ----------------------------------------------------------------------------- runner


class _DecodeDataset(torch.utils.data.Dataset):
    """Read + decode one ref once, then apply every target's transform (and hash); unreadable files come
    back with their reason."""

    def __init__(self, source: MultiSource, refs: list[ImageRef], transforms: list, hash_names: list,
                 max_pixels: int):
        self.source, self.refs, self.transforms = source, refs, transforms
        self.hash_names = hash_names
        self.max_pixels = max_pixels
        wanted = {int(tf.channels) for tf in transforms if getattr(tf, "channels", None)}
        if len(wanted) > 1:
            raise ValueError(f"embedding targets want different channel counts {sorted(wanted)}")
        self.channels = wanted.pop() if wanted else None

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i: int):
        ref = self.refs[i]
        data = self.source.read(ref)
        img, reason = safe_decode(data, max_pixels=self.max_pixels)  # N channels: the 3-channel rendering
        if img is None:
            return i, None, reason, None
        arr = None
        if self.channels:  # an N-channel backbone: its transform takes the (C, H, W) array, the rest the rendering
            arr, reason = decode_channels(data, self.channels, self.max_pixels)
            if arr is None:
                return i, None, reason, None
        try:
            done: dict[str, int] = {}
            for name in self.hash_names:
                if name and name not in done:
                    done[name] = HASHES[name](img)
            hashes = [done[name] if name else 0 for name in self.hash_names]
            return i, [tf(arr) if getattr(tf, "channels", None) else tf(img) for tf in self.transforms], None, hashes
        except Exception as e:  # e.g. a 1x1 image a transform cannot crop: count, don't crash
            return i, None, f"transform_error:{type(e).__name__}", None


def _collate(items):
    ok = [(i, xs, h) for i, xs, r, h in items if r is None]
    bad = [(i, r) for i, xs, r, h in items if r is not None]
    n_targets = len(ok[0][1]) if ok else 0
    batches = [torch.stack([xs[j] for _, xs, _ in ok]) for j in range(n_targets)]
    return [i for i, _, _ in ok], batches, [h for _, _, h in ok], bad


@dataclass
class EmbedTarget:
    """One embedding output of :func:`embed_pool_multi`: ``embed_fn`` on ``transform``-ed images into
    ``out_dir``, with a perceptual hash per image when ``hash_name`` is set."""

    embed_fn: Callable[[torch.Tensor], torch.Tensor]
    out_dir: str
    transform: Callable | None = None
    hash_name: str | None = None


@torch.no_grad()
def embed_pool(sources, embed_fn: Callable[[torch.Tensor], torch.Tensor], out_dir: str,
               shard_size: int = 10000, batch_size: int = 64, num_workers: int = 4,
               task_index: int = 0, num_tasks: int = 1, transform=None,
               hash_name: str | None = "phash", max_pixels: int = DEFAULT_MAX_PIXELS,
               progress: bool = True) -> dict:
    """Embed this task's share of the pool into ``out_dir``; returns counts for this task.

    ``embed_fn`` maps a (B, C, H, W) batch to (B, D) embeddings (the model's CLS embedding, or
    :class:`curation.descriptor.PCADescriptor`); it is called only for shards not yet complete.
    ``transform`` maps a PIL RGB image to a tensor (default: :func:`eval_transform`). A perceptual
    hash (``hash_name``: 'phash', 'dhash' or None) is computed from the same decoded image.
    """
    return embed_pool_multi(sources, [EmbedTarget(embed_fn, out_dir, transform, hash_name)], shard_size,
                            batch_size, num_workers, task_index, num_tasks, max_pixels, progress)[0]


@torch.no_grad()
def embed_pool_multi(sources, targets: list[EmbedTarget], shard_size: int = 10000, batch_size: int = 64,
                     num_workers: int = 4, task_index: int = 0, num_tasks: int = 1,
                     max_pixels: int = DEFAULT_MAX_PIXELS, progress: bool = True) -> list[dict]:
    """:func:`embed_pool` for several outputs at once (e.g. the copy descriptor and a backbone): every
    image is read and decoded once and feeds every target that still lacks its shard. Each target
    resumes on its own (its complete shards are skipped); returns one counts dict per target."""
    check_split(task_index, num_tasks)
    src = as_multi(sources)
    refs = src.refs(task_index, num_tasks)
    n_shards = max(1, -(-len(refs) // shard_size))
    todo = [[s for s in range(n_shards)
             if not _shard_complete(t.out_dir, shard_stem(task_index, s), refs, s, shard_size)] for t in targets]
    union = sorted(set().union(*map(set, todo)))
    counts = [{"task_index": task_index, "num_tasks": num_tasks, "images": len(refs), "shards": n_shards,
               "shards_skipped": n_shards - len(td), "shards_written": 0} for td in todo]
    todo_refs = [r for s in union for r in refs[s * shard_size:(s + 1) * shard_size]]
    shard_of = np.array([s for s in union for _ in refs[s * shard_size:(s + 1) * shard_size]], np.int64)
    # union to-do position -> position in the target's own to-do list (-1: the target has that shard)
    pos_maps = []
    for td in todo:
        need = np.isin(shard_of, td)
        m = np.full(len(shard_of), -1, np.int64)
        m[need] = np.arange(int(need.sum()))
        pos_maps.append(m)
    loader = torch.utils.data.DataLoader(
        _DecodeDataset(src, todo_refs, [t.transform or eval_transform() for t in targets],
                       [t.hash_name for t in targets], max_pixels),
        batch_size=batch_size, num_workers=num_workers, collate_fn=_collate,
        persistent_workers=False, prefetch_factor=4 if num_workers > 0 else None,
    )
    buffers = [_ShardBuffer(td, shard_size, len(refs)) for td in todo]
    bar = _progress(len(todo_refs), f"embed task {task_index}/{num_tasks}", progress)
    for idx, batches, hashes, bad in loader:
        for j, (t, m, buf) in enumerate(zip(targets, pos_maps, buffers)):
            sel = [k for k, i in enumerate(idx) if m[i] >= 0]
            emb = None
            if sel:
                x = batches[j] if len(sel) == len(idx) else batches[j][sel]
                emb = l2_normalise_fp16(t.embed_fn(x))
            buf.add([int(m[idx[k]]) for k in sel], emb, [hashes[k][j] for k in sel],
                    [(int(m[i]), r) for i, r in bad if m[i] >= 0])
            for shard, rows in buf.pop_complete():
                _write_shard(t.out_dir, task_index, shard, refs, shard_size, rows)
                counts[j]["shards_written"] += 1
        bar.update(len(idx) + len(bad))
    bar.close()
    for t, buf, c in zip(targets, buffers, counts):
        for shard, rows in buf.pop_complete():  # an empty task still writes its (empty) shard
            _write_shard(t.out_dir, task_index, shard, refs, shard_size, rows)
            c["shards_written"] += 1
        if buf.shards:
            raise RuntimeError(f"embedding {t.out_dir} stopped before shards {buf.shards} were complete")
        _mark_task_done(t.out_dir, task_index, num_tasks, c)
    return counts


class _ShardBuffer:
    """Collects loader outputs until a shard's last image has arrived (the loader keeps order)."""

    def __init__(self, shards: list[int], shard_size: int, n_refs: int):
        self.shards, self.shard_size, self.n_refs = list(shards), shard_size, n_refs
        self.rows: dict[int, tuple] = {}  # position in the to-do list -> (emb, hash, reason)
        self.base = 0  # to-do position where the first pending shard starts

    def add(self, idx, emb, hashes, bad) -> None:
        for j, i in enumerate(idx):
            self.rows[i] = (emb[j], hashes[j], None)
        for i, reason in bad:
            self.rows[i] = (None, 0, reason)

    def pop_complete(self):
        while self.shards:
            s = self.shards[0]
            n = max(0, min(self.shard_size, self.n_refs - s * self.shard_size))
            if n and (self.base + n - 1) not in self.rows:
                return
            rows = [self.rows.pop(self.base + j) for j in range(n)]
            self.base += n
            self.shards.pop(0)
            yield s, rows


def _write_shard(out_dir, task_index, shard, refs, shard_size, rows) -> None:
    shard_refs = refs[shard * shard_size:(shard + 1) * shard_size]
    ok = [(ref, row) for ref, row in zip(shard_refs, rows) if row[2] is None]
    dim = len(ok[0][1][0]) if ok else 0
    emb = np.stack([row[0] for _, row in ok]) if ok else np.zeros((0, dim), np.float16)
    meta = {
        "ids": [ref.id for ref, _ in ok],
        "sources": [ref.source for ref, _ in ok],
        "hashes": [f"{row[1]:016x}" for _, row in ok],
        "locs": [_abs_loc(ref.loc) for ref, _ in ok],  # where the writer and the verifier re-read the bytes
        "unreadable": [[ref.id, ref.source, row[2]] for ref, row in zip(shard_refs, rows)
                       if row[2] is not None],
        "n_listed": len(shard_refs),
    }
    save_shard(out_dir, shard_stem(task_index, shard), emb, meta)


def _abs_loc(loc):
    return os.path.abspath(loc) if isinstance(loc, str) else [os.path.abspath(loc[0]), int(loc[1]), int(loc[2])]


def _shard_complete(out_dir, stem, refs, shard, shard_size) -> bool:
    meta_path = os.path.join(out_dir, f"{stem}.ids.json")
    if not (os.path.exists(meta_path) and os.path.exists(os.path.join(out_dir, f"{stem}.npy"))):
        return False
    with open(meta_path) as f:
        meta = json.load(f)
    expected = {r.id for r in refs[shard * shard_size:(shard + 1) * shard_size]}
    stored = set(meta["ids"]) | {u[0] for u in meta["unreadable"]}
    if stored != expected:
        raise InputError(
            f"{meta_path} was written for a different input listing (images added, removed or "
            f"a different shard_size/num_tasks). Use a fresh output folder for a changed pool."
        )
    return True


def _mark_task_done(out_dir, task_index, num_tasks, counts) -> None:
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_json(os.path.join(out_dir, f"task-{task_index:05d}-of-{num_tasks:05d}.json"), counts)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="img", disable=not enabled, mininterval=2.0)


def embed_arrays(images, embed_fn, transform, batch_size: int = 64) -> np.ndarray:
    """Embed in-memory PIL images (e.g. a small eval or seed set) -> (N, D) float32, L2-normed."""
    out = []
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            batch = torch.stack([transform(im) for im in images[i:i + batch_size]])
            out.append(l2_normalise_fp16(embed_fn(batch)).astype(np.float32))
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)
