"""The resumable, task-split embedding runner (decode, embed, write fp16 shards); the storage it writes and
reads (shards, ids, the reader in canonical order) is curation.core.embstore.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from dinopipe.config import InputError
from dinopipe.data.channels import decode_channels
from dinopipe.data.decode import DEFAULT_MAX_PIXELS, safe_decode
from dinopipe.data.sources import ImageRef, MultiSource, as_multi, check_split
from dinopipe.data.transforms import eval_transform

from curation.embed.descriptor import HASHES
from curation.core.embstore import (mark_task_done, l2_normalise_fp16, save_shard,
                                    shard_stem)



# ----------------------------------------------------------------------------- runner


class _DecodeDataset(torch.utils.data.Dataset):
    """Read + decode one ref once, then apply every target's transform (and hash); unreadable files come
    back with their reason."""

    def __init__(self, source: MultiSource, refs: Sequence[ImageRef], rows: Sequence[int], transforms: list,
                 hash_names: list, max_pixels: int):
        self.source, self.refs, self.rows, self.transforms = source, refs, rows, transforms
        self.hash_names = hash_names
        self.max_pixels = max_pixels
        wanted = {int(tf.channels) for tf in transforms if getattr(tf, "channels", None)}
        if len(wanted) > 1:
            raise ValueError(f"embedding targets want different channel counts {sorted(wanted)}")
        self.channels = wanted.pop() if wanted else None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        ref = self.refs[self.rows[i]]
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
    :class:`curation.embed.descriptor.PCADescriptor`); it is called only for shards not yet complete.
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
    # the task's own rows as a compact sequence (a file list's paths as arrays): an ImageRef is built for the
    # images of the batch being read and the shard being written, never one per row for the whole task
    refs = src.ref_seq(task_index, num_tasks)
    n_shards = max(1, -(-len(refs) // shard_size))
    todo = [[s for s in range(n_shards)
             if not _shard_complete(t.out_dir, shard_stem(task_index, s), refs, s, shard_size)] for t in targets]
    union = sorted(set().union(*map(set, todo)))
    counts = [{"task_index": task_index, "num_tasks": num_tasks, "images": len(refs), "shards": n_shards,
               "shards_skipped": n_shards - len(td), "shards_written": 0} for td in todo]
    rows = _TodoRows(union, shard_size, len(refs))
    # a target's to-do position of a union to-do position (-1: the target has that shard), by arithmetic: no array
    # per row (only the pool's last shard is short, and it is the last of any to-do list that holds it)
    ranks = [{sh: k for k, sh in enumerate(td)} for td in todo]

    def pos(j: int, p: int) -> int:
        row = rows[p]
        k = ranks[j].get(row // shard_size)
        return -1 if k is None else k * shard_size + row % shard_size

    loader = torch.utils.data.DataLoader(
        _DecodeDataset(src, refs, rows, [t.transform or eval_transform() for t in targets],
                       [t.hash_name for t in targets], max_pixels),
        batch_size=batch_size, num_workers=num_workers, collate_fn=_collate,
        persistent_workers=False, prefetch_factor=4 if num_workers > 0 else None,
    )
    buffers = [_ShardBuffer(td, shard_size, len(refs)) for td in todo]
    bar = _progress(len(rows), f"embed task {task_index}/{num_tasks}", progress)
    for idx, batches, hashes, bad in loader:
        for j, (t, buf) in enumerate(zip(targets, buffers)):
            at = [pos(j, i) for i in idx]
            sel = [k for k, q in enumerate(at) if q >= 0]
            emb = None
            if sel:
                x = batches[j] if len(sel) == len(idx) else batches[j][sel]
                emb = l2_normalise_fp16(t.embed_fn(x))
            bad_at = [(pos(j, i), r) for i, r in bad]
            buf.add([at[k] for k in sel], emb, [hashes[k][j] for k in sel], [(q, r) for q, r in bad_at if q >= 0])
            for shard, got in buf.pop_complete():
                _write_shard(t.out_dir, task_index, shard, refs, shard_size, got)
                counts[j]["shards_written"] += 1
        bar.update(len(idx) + len(bad))
    bar.close()
    for t, buf, c in zip(targets, buffers, counts):
        for shard, got in buf.pop_complete():  # an empty task still writes its (empty) shard
            _write_shard(t.out_dir, task_index, shard, refs, shard_size, got)
            c["shards_written"] += 1
        if buf.shards:
            raise RuntimeError(f"embedding {t.out_dir} stopped before shards {buf.shards} were complete")
        mark_task_done(t.out_dir, task_index, num_tasks, c)
    return counts


class _TodoRows(Sequence):
    """The task's rows of the shards still to embed, in order: position ``p`` is row
    ``union[p // shard_size] * shard_size + p % shard_size`` (every shard is full but the pool's last)."""

    def __init__(self, union: list[int], shard_size: int, n_rows: int):
        self.union, self.shard_size = union, shard_size
        self.n = sum(max(0, min(shard_size, n_rows - s * shard_size)) for s in union)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, p: int) -> int:
        if not 0 <= p < self.n:
            raise IndexError(p)
        return self.union[p // self.shard_size] * self.shard_size + p % self.shard_size


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
    def where(p: str) -> str:
        return p if "://" in p else os.path.abspath(p)  # an object-store URL stays a URL

    return where(loc) if isinstance(loc, str) else [where(loc[0]), int(loc[1]), int(loc[2])]


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


def _progress(total: int, desc: str, enabled: bool):
    from dinopipe.utils.progress import progress as reporter

    return reporter(total=total, desc=desc, unit="img", disable=not enabled)


def embed_arrays(images, embed_fn, transform, batch_size: int = 64) -> np.ndarray:
    """Embed in-memory PIL images (e.g. a small eval or seed set) -> (N, D) float32, L2-normed."""
    out = []
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            batch = torch.stack([transform(im) for im in images[i:i + batch_size]])
            out.append(l2_normalise_fp16(embed_fn(batch)).astype(np.float32))
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)
