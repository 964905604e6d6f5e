"""The path table's old single-process build (before issue 30), kept as the reference the task-built table
must equal byte for byte, and whose heap the tasks' heap is measured against (tests and bench only)."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from curation.core.pathtable import _VERSION, parts_digest
from curation.core.table import _loc_path, _loc_span, read_meta  # the same reading of a part
from dinopipe.config import InputError
from dinopipe.utils.io import atomic_open, atomic_write_json


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


def build_whole(emb_dir: str, meta_paths: list[str], part_rows: list[int], d: str) -> str:
    """The table as one process built it before issue 30 (into folder ``d``): every id, location and hash of
    the pool and an argsort of all N in one heap."""
    os.makedirs(d, exist_ok=True)
    names: dict[str, int] = {}
    reasons: dict[str, int] = {}
    keys, src, is_row, reason, hashes, loc_str, loc_span = [], [], [], [], [], [], []
    for meta_path, n_rows in zip(meta_paths, part_rows):
        meta, ids, unread = read_meta(meta_path, n_rows)
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
