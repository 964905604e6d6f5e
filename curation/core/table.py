"""The path table's tasks (curation.core.pathtable.build_table runs them with the step runner).

Three task functions of the runner's shape ``fn(t, w, **kw)``, each rerun-safe (a finished task's mark is
there: it returns at once), and each holding only its own share of the inputs:

* :func:`run_task`: the embedding parts ``[P t / W, P (t + 1) / W)`` (part order) -> a sorted *run* on
  disk: ``run-TTTTT/`` with keys (fixed-width ``'S'`` of the run's own width), source and reason codes
  (the run's own, listed in first-appearance order in ``names.json``: concatenated in task order and
  deduplicated they are the codes one process assigns), readable flags as a running count, hashes,
  location strings and spans, and each entry's position among the concatenated rows;
* :func:`rank_task`: each entry's input id = its rank among all string ids = the sum over the runs of
  ``searchsorted(run_keys, key)`` (the other runs memory-mapped and walked in chunks), its row id the same
  sum over the readable entries; writes its entries' fields at those positions into the preallocated,
  memory-mapped outputs (disjoint positions) and the string lengths; a duplicate id is reported, not
  written;
* :func:`copy_task`: after the offsets (one streaming cumsum): its strings' bytes into the two blobs.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil

import numpy as np

from dinopipe.config import InputError
from dinopipe.utils.io import atomic_write_json

from curation.core.runner import part_done, read_part, write_part
from curation.core.table_owned import scatter_strings, save_by_owner

CHUNK = 1 << 16
"""Entries per chunk wherever a task walks another run or scatters bytes (a constant, not a share of N)."""


def run_dir(work: str, t: int) -> str:
    return os.path.join(work, f"run-{t:05d}")


def rank_part(work: str, t: int, w: int) -> str:
    return os.path.join(work, f"rank-{t:05d}-of-{w:05d}.npz")


def copy_mark(work: str, t: int, w: int) -> str:
    return os.path.join(work, f"copy-{t:05d}-of-{w:05d}.json")


def _encode(strings: list[str]) -> np.ndarray:
    return np.array([s.encode() for s in strings], dtype="S") if strings else np.zeros(0, "S1")


def read_meta(meta_path: str, n_rows: int) -> tuple[dict, list, list]:
    """(meta, ids, unreadable) of an embedding part's ``.ids.json``, its ids checked against its ``n_rows``."""
    with open(meta_path) as f:
        meta = json.load(f)
    ids, unread = meta["ids"], meta["unreadable"]
    if len(ids) != n_rows:
        raise InputError(f"{meta_path}: {len(ids)} ids but {n_rows} embeddings; delete this shard "
                         f"pair and rerun the embed step to recompute it")
    return meta, ids, unread


def _loc_path(loc) -> str:
    if loc is None:
        return ""
    return loc if isinstance(loc, str) else loc[0]


def _loc_span(loc) -> tuple[int, int]:
    return (-1, -1) if loc is None or isinstance(loc, str) else (int(loc[1]), int(loc[2]))


def open_rw(path: str) -> np.ndarray:
    """A preallocated ``.npy`` memory-mapped for writing (an empty array where it holds nothing)."""
    m = np.load(path, mmap_mode="r")
    if m.size == 0:
        return np.zeros(m.shape, m.dtype)
    return np.load(path, mmap_mode="r+")


def put(path: str, at: np.ndarray, values) -> None:
    """``out[at] = values`` into the preallocated ``path``, flushed (another node may read it next)."""
    m = open_rw(path)
    m[at] = values
    if isinstance(m, np.memmap):
        m.flush()


def run_task(t: int, w: int, work: str, meta_paths: list[str], part_rows: list[int]) -> dict:
    """Run ``t`` of ``w``: this task's parts as one run sorted by string id (see the module docstring)."""
    out = run_dir(work, t)
    if os.path.isdir(out):
        return {"parts": 0, "skipped": True}
    p0, p1 = len(meta_paths) * t // w, len(meta_paths) * (t + 1) // w
    row0 = int(np.sum(part_rows[:p0], dtype=np.int64))  # rows of the parts before this task's
    names: dict[str, int] = {}
    reasons: dict[str, int] = {}
    keys, src, is_row, reason, hashes, loc_str, loc_span, row_pos = [], [], [], [], [], [], [], []
    for meta_path, n_rows in zip(meta_paths[p0:p1], part_rows[p0:p1]):
        meta, ids, unread = read_meta(meta_path, n_rows)
        n_un = len(unread)
        keys.append(_encode(ids + [u[0] for u in unread]))
        codes = [names.setdefault(s, len(names)) for s in meta["sources"]]
        codes += [names.setdefault(u[1], len(names)) for u in unread]
        src.append(np.asarray(codes, np.int32))
        is_row.append(np.r_[np.ones(len(ids), bool), np.zeros(n_un, bool)])
        reason.append(np.asarray([-1] * len(ids) + [reasons.setdefault(u[2], len(reasons)) for u in unread],
                                 np.int16))
        hashes.append(np.r_[np.asarray([int(h, 16) for h in meta["hashes"]], np.uint64), np.zeros(n_un, np.uint64)])
        locs = meta.get("locs") or [None] * len(ids)  # parts written before locations were recorded: none
        loc_str.append(_encode([_loc_path(x) for x in locs] + [""] * n_un))
        loc_span.append(np.asarray([_loc_span(x) for x in locs] + [(-1, -1)] * n_un, np.int64).reshape(-1, 2))
        row_pos.append(np.r_[np.arange(row0, row0 + len(ids), dtype=np.int64), np.full(n_un, -1, np.int64)])
        row0 += len(ids)
        del meta, ids, unread, locs
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    key = np.concatenate(keys) if keys else np.zeros(0, "S1")
    keys.clear()
    order = np.argsort(key, kind="stable")
    n = len(key)
    np.save(os.path.join(tmp, "keys.npy"), key[order])
    del key
    empty = {"src": np.zeros(0, np.int32), "reason": np.zeros(0, np.int16), "hash": np.zeros(0, np.uint64),
             "loc": np.zeros(0, "S1"), "span": np.zeros((0, 2), np.int64), "row_pos": np.zeros(0, np.int64),
             "is_row": np.zeros(0, bool)}
    fields = {"src": src, "reason": reason, "hash": hashes, "loc": loc_str, "span": loc_span, "row_pos": row_pos,
              "is_row": is_row}
    for name, pieces in fields.items():  # one field at a time: the pieces, the field and its sorted copy
        a = np.concatenate(pieces)[order] if pieces else empty[name]
        pieces.clear()
        if name == "is_row":  # readable entries before each position: a run's rows below a key in one lookup
            n_rows = int(a.sum())
            name, a = "row_cum", np.r_[np.zeros(1, np.int64), np.cumsum(a, dtype=np.int64)]
        np.save(os.path.join(tmp, f"{name}.npy"), np.ascontiguousarray(a))
        del a
    atomic_write_json(os.path.join(tmp, "names.json"), {"sources": list(names), "reasons": list(reasons),
                                                       "n": int(n), "rows": n_rows})
    os.replace(tmp, out)  # the whole run or nothing
    return {"parts": p1 - p0, "inputs": int(n)}


def _bisect(a: np.ndarray, x: bytes, side: str) -> int:
    # Python's bisect over the mapped keys: log n element reads, no copy of the run
    return (bisect.bisect_left if side == "left" else bisect.bisect_right)(a, x)


def count_below(a: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(searchsorted(a, v), v is in a)`` for sorted ``a`` (memory-mapped, any width) and sorted ``v``,
    walking only the stretches of ``a`` between ``v``'s chunks, ``CHUNK`` entries at a time: numpy's own
    searchsorted would copy all of ``a`` to a common width."""
    below, found = np.zeros(len(v), np.int64), np.zeros(len(v), bool)
    if not len(a) or not len(v):
        return below, found
    for v0 in range(0, len(v), CHUNK):
        vc = v[v0:v0 + CHUNK]
        lo, hi = _bisect(a, vc[0], "left"), _bisect(a, vc[-1], "right")
        below[v0:v0 + len(vc)] = lo  # a[:lo] < vc[0]; a[hi:] > vc[-1]
        for a0 in range(lo, hi, CHUNK):
            ac = np.asarray(a[a0:min(a0 + CHUNK, hi)])
            width = max(ac.dtype.itemsize, vc.dtype.itemsize)
            ac, vw = ac.astype(f"S{width}"), vc.astype(f"S{width}")
            pos = np.searchsorted(ac, vw)
            below[v0:v0 + len(vc)] += pos
            inside = pos < len(ac)
            found[v0:v0 + len(vc)][inside] |= ac[pos[inside]] == vw[inside]
    return below, found


def _run(work: str, u: int, name: str, mmap: bool = True) -> np.ndarray:
    return np.load(os.path.join(run_dir(work, u), f"{name}.npy"), mmap_mode="r" if mmap else None)


def rank_task(t: int, w: int, work: str, out: dict[str, str], source_codes: list[list[int]],
              reason_codes: list[list[int]], owned: bool = False) -> dict:
    """Ranks of run ``t``'s entries among all runs; its fields written at them (see the module docstring).
    ``out``: name -> preallocated ``.npy``; ``source_codes[t]`` / ``reason_codes[t]``: run code -> global code.
    ``owned`` (tasks on several nodes): the writes kept as parts per owner, placed by
    curation.core.table_owned.place_task."""
    part = rank_part(work, t, w)
    if part_done(part):
        return {"skipped": True}
    key = _run(work, t, "keys", mmap=False)
    rank, row = np.zeros(len(key), np.int64), np.zeros(len(key), np.int64)
    dup = np.zeros(len(key), bool)
    if len(key) > 1:  # within the run: equal neighbours
        same = key[1:] == key[:-1]
        dup[1:] |= same
        dup[:-1] |= same
    for u in range(w):
        below, found = count_below(key if u == t else _run(work, u, "keys"), key)
        rank += below
        row += _run(work, u, "row_cum")[below]  # readable entries of run u below each key
        if u != t:
            dup |= found
    if dup.any():  # reported to the build, which names the smallest duplicate of all runs
        write_part(part, dup=key[np.flatnonzero(dup)[:1]], rank=rank, row=row)
        return {"duplicate": True}
    writes: dict = {}
    emit = (lambda name, at, values: writes.__setitem__(name, (at, values))) if owned else \
        (lambda name, at, values: put(out[name], at, values))
    readable = _run(work, t, "row_pos", mmap=False) >= 0
    rr, rk = row[readable], rank[readable]
    smap = np.asarray(source_codes[t] or [0], np.int32)
    rmap = np.asarray(reason_codes[t] or [0], np.int16)
    emit("input_source", rank, smap[_run(work, t, "src", mmap=False)])
    reason = _run(work, t, "reason", mmap=False)
    emit("input_reason", rank, np.where(reason >= 0, rmap[np.maximum(reason, 0)], -1).astype(np.int16))
    emit("ids_len", rank, np.char.str_len(key) if len(key) else 0)
    del key, reason
    emit("row_id", rr, rk)
    emit("row_perm", rr, _run(work, t, "row_pos")[readable])
    emit("row_hash", rr, _run(work, t, "hash")[readable])
    emit("loc_span", rr, _run(work, t, "span")[readable])
    emit("loc_len", rr, np.char.str_len(np.asarray(_run(work, t, "loc")[readable])) if len(rr) else 0)
    if owned:
        n_in, n_rows = len(np.load(out["ids_len"], mmap_mode="r")), len(np.load(out["row_id"], mmap_mode="r"))
        save_by_owner(work, "rank", t, w, writes, {k: n_in if k in ("input_source", "input_reason", "ids_len")
                                                   else n_rows for k in writes})
    write_part(part, dup=np.zeros(0, "S1"), rank=rank, row=row)  # after the writes: marks them done
    return {"inputs": int(len(rank))}


def read_dup(work: str, t: int, w: int) -> np.ndarray:
    """The smallest duplicated id of rank task ``t``'s run (empty: none), without loading its ranks."""
    with np.load(rank_part(work, t, w), allow_pickle=False) as z:
        return z["dup"]


def copy_task(t: int, w: int, work: str, out: dict[str, str], owned: bool = False) -> dict:
    """Run ``t``'s id strings into the id blob at their offsets, its readable rows' locations into the
    location blob (``owned``: kept as parts per owner, as :func:`rank_task`'s)."""
    mark = copy_mark(work, t, w)
    if part_done(mark):
        return {"skipped": True}
    r = read_part(rank_part(work, t, w))
    key = _run(work, t, "keys")
    if owned:
        readable = np.flatnonzero(_run(work, t, "row_pos") >= 0)
        writes = {"ids_blob": (r["rank"], np.asarray(key)),
                  "loc_blob": (r["row"][readable], np.asarray(_run(work, t, "loc")[readable]))}
        save_by_owner(work, "copy", t, w, writes, {k: len(np.load(out[k.replace("_blob", "_offsets")],
                                                                  mmap_mode="r")) - 1 for k in writes})
    elif len(key):
        blob = open_rw(out["ids_blob"])
        scatter_strings(blob, np.load(out["ids_offsets"], mmap_mode="r"), r["rank"], key, CHUNK)
        readable = np.flatnonzero(_run(work, t, "row_pos") >= 0)
        locs = open_rw(out["loc_blob"])
        scatter_strings(locs, np.load(out["loc_offsets"], mmap_mode="r"), r["row"][readable],
                 np.asarray(_run(work, t, "loc")[readable]), CHUNK)
        for m in (blob, locs):
            if isinstance(m, np.memmap):
                m.flush()
    atomic_write_json(mark, {"inputs": int(len(key))})
    return {"inputs": int(len(key))}
