"""The pool's path table: every listed input's id string in one memory-mapped bytes blob, in sorted order.

An image's *input id* is an int64: its rank among the string ids (``<source>/<path>``) of every listed
input, readable or not. The string of id ``i`` is ``blob[offsets[i]:offsets[i + 1]]`` (utf-8), so the
pool's names cost one byte array and one int64 array on disk and nothing per image in memory. Sorting
by input id is sorting by string id, which is the *canonical row order*: embedding rows, step arrays and
``decisions`` parts follow it whatever number of tasks embedded or searched the pool.

Built once from the embedding parts (:func:`build_table`, called by ``open_embeddings``), after every
embedding task has finished; the build sorts fixed-width numpy byte strings (N x longest id bytes, no
Python object per image) and is redone only when the parts change.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os

import numpy as np

from dinopipe.config import InputError
from dinopipe.utils.io import atomic_open, atomic_write_json

TABLE_DIR = "table"
_VERSION = 1


class PathTable:
    """Sorted strings in a bytes blob + offsets (both memory-mapped). ``table[i] -> str``."""

    def __init__(self, blob: np.ndarray, offsets: np.ndarray):
        self.blob, self.offsets = blob, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"id {i} outside the table of {len(self)}")
        return bytes(self.blob[self.offsets[i]:self.offsets[i + 1]]).decode()

    def strings(self, idx) -> list[str]:
        """The strings of ``idx`` (a chunk of ids: callers stream in chunks)."""
        return [self[i] for i in np.asarray(idx, np.int64)]

    def find(self, s: str) -> int:
        """Id of string ``s`` (binary search over the sorted table), -1 if absent."""
        key = s.encode()
        i = bisect.bisect_left(_Keys(self), key)
        return i if i < len(self) and bytes(self.blob[self.offsets[i]:self.offsets[i + 1]]) == key else -1

    def lookup(self, strings) -> np.ndarray:
        """Ids of ``strings`` (-1 where absent), each found by binary search: log N reads apiece."""
        return np.array([self.find(s) for s in strings], np.int64)


class _Keys:
    """A sequence view of the table's keys as bytes, for :mod:`bisect`."""

    def __init__(self, t: PathTable):
        self.t = t

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, i: int) -> bytes:
        return bytes(self.t.blob[self.t.offsets[i]:self.t.offsets[i + 1]])


def pack_strings(fixed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blob uint8, offsets int64) of a fixed-width numpy bytes array (``'S<w>'``), vectorised."""
    n = len(fixed)
    width = fixed.dtype.itemsize
    lens = np.char.str_len(fixed).astype(np.int64) if n else np.zeros(0, np.int64)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    if n == 0 or width == 0:
        return np.zeros(0, np.uint8), offsets
    u8 = np.ascontiguousarray(fixed).view(np.uint8).reshape(n, width)
    blob = u8[np.arange(width)[None, :] < lens[:, None]]  # row-major: the strings one after another
    return blob, offsets


def _encode(strings: list[str]) -> np.ndarray:
    return np.array([s.encode() for s in strings], dtype="S") if strings else np.zeros(0, "S1")


def _save(d: str, name: str, a: np.ndarray) -> None:
    with atomic_open(os.path.join(d, f"{name}.npy"), "wb") as f:
        np.save(f, np.ascontiguousarray(a))


def _load(d: str, name: str) -> np.ndarray:
    return np.load(os.path.join(d, f"{name}.npy"), mmap_mode="r")


def parts_digest(meta_paths: list[str]) -> str:
    """What the table was built from: the part files' names, sizes and modification times."""
    h = hashlib.sha1()
    for p in meta_paths:
        st = os.stat(p)
        h.update(f"{os.path.basename(p)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def build_table(emb_dir: str, meta_paths: list[str], part_rows: list[int]) -> str:
    """Write ``<emb_dir>/table/`` from the parts' ``.ids.json`` (``part_rows``: rows of each part)."""
    d = os.path.join(emb_dir, TABLE_DIR)
    os.makedirs(d, exist_ok=True)
    names: dict[str, int] = {}
    reasons: dict[str, int] = {}
    keys, src, is_row, reason, hashes, loc_str, loc_span = [], [], [], [], [], [], []
    for meta_path, n_rows in zip(meta_paths, part_rows):
        with open(meta_path) as f:
            meta = json.load(f)
        ids, unread = meta["ids"], meta["unreadable"]
        if len(ids) != n_rows:
            raise InputError(f"{meta_path}: {len(ids)} ids but {n_rows} embeddings; delete this shard "
                             f"pair and rerun the embed step to recompute it")
        keys.append(_encode(ids + [u[0] for u in unread]))
        codes = [names.setdefault(s, len(names)) for s in meta["sources"]]
        codes += [names.setdefault(u[1], len(names)) for u in unread]
        src.append(np.asarray(codes, np.int32))
        is_row.append(np.r_[np.ones(len(ids), bool), np.zeros(len(unread), bool)])
        reason.append(np.asarray([-1] * len(ids) + [reasons.setdefault(u[2], len(reasons)) for u in unread],
                                 np.int16))
        hashes.append(np.asarray([int(h, 16) for h in meta["hashes"]], np.uint64))
        locs = meta.get("locs") or [None] * len(ids)  # parts written before locations were recorded: none
        loc_str.append(_encode([_loc_path(x) for x in locs]))
        loc_span.append(np.asarray([_loc_span(x) for x in locs], np.int64).reshape(-1, 2))
    key = np.concatenate(keys) if keys else np.zeros(0, "S1")
    is_row, reason = np.concatenate(is_row), np.concatenate(reason)
    order = np.argsort(key, kind="stable")  # canonical order: by string id
    skey = key[order]
    dup = np.flatnonzero(skey[1:] == skey[:-1])
    if len(dup):
        raise InputError(f"{emb_dir}: image id {skey[dup[0]].decode()!r} is in two embedding parts (parts of "
                         f"two different runs in one folder?); use a fresh output folder")
    blob, offsets = pack_strings(skey)
    row_of_input = np.cumsum(is_row) - 1  # concatenated-input position -> concatenated-row position
    readable = is_row[order]
    perm = row_of_input[order[readable]]  # canonical row r -> concatenated row
    loc_blob, loc_off = pack_strings((np.concatenate(loc_str) if loc_str else np.zeros(0, "S1"))[perm])
    _save(d, "ids_blob", blob)
    _save(d, "ids_offsets", offsets)
    _save(d, "input_source", np.concatenate(src)[order] if src else np.zeros(0, np.int32))
    _save(d, "input_reason", reason[order])
    _save(d, "row_id", np.flatnonzero(readable).astype(np.int64))
    _save(d, "row_perm", perm.astype(np.int64))
    _save(d, "row_hash", np.concatenate(hashes)[perm] if hashes else np.zeros(0, np.uint64))
    _save(d, "loc_blob", loc_blob)
    _save(d, "loc_offsets", loc_off)
    _save(d, "loc_span", np.concatenate(loc_span)[perm] if loc_span else np.zeros((0, 2), np.int64))
    digest = hashlib.sha1(np.ascontiguousarray(blob).tobytes()).hexdigest()[:16]
    atomic_write_json(os.path.join(d, "meta.json"), {  # last: marks a complete table
        "version": _VERSION, "parts": parts_digest(meta_paths), "ids": digest, "n_inputs": len(key),
        "n_rows": int(is_row.sum()), "sources": list(names), "reasons": list(reasons)})
    return d


def _loc_path(loc) -> str:
    if loc is None:
        return ""
    return loc if isinstance(loc, str) else loc[0]


def _loc_span(loc) -> tuple[int, int]:
    return (-1, -1) if loc is None or isinstance(loc, str) else (int(loc[1]), int(loc[2]))


def open_table(emb_dir: str, meta_paths: list[str], part_rows: list[int]) -> dict:
    """The table's arrays (memory-mapped) and meta, built first when missing or stale."""
    d = os.path.join(emb_dir, TABLE_DIR)
    meta_file = os.path.join(d, "meta.json")
    meta = None
    if os.path.exists(meta_file):
        with open(meta_file) as f:
            meta = json.load(f)
    if meta is None or meta.get("version") != _VERSION or meta["parts"] != parts_digest(meta_paths):
        build_table(emb_dir, meta_paths, part_rows)
        with open(meta_file) as f:
            meta = json.load(f)
    arrays = {name: _load(d, name) for name in (
        "ids_blob", "ids_offsets", "input_source", "input_reason", "row_id", "row_perm", "row_hash",
        "loc_blob", "loc_offsets", "loc_span")}
    return {"meta": meta, **arrays}
