"""The pool's path table: every listed input's id string in one memory-mapped bytes blob, in sorted order.

An image's *input id* is an int64: its rank among the string ids (``<source>/<path>``) of every listed
input, readable or not. The string of id ``i`` is ``blob[offsets[i]:offsets[i + 1]]`` (utf-8), so the
pool's names cost one byte array and one int64 array on disk and nothing per image in memory. Sorting
by input id is sorting by string id, which is the *canonical row order*: embedding rows, step arrays and
``decisions`` parts follow it whatever number of tasks embedded or searched the pool.

Built once from the embedding parts by :func:`build_table` after every embedding task has finished -- by the
chain right after embedding as ``tasks.count`` W tasks (curation.embed.step.build_tables), else by
``open_embeddings`` on first use (W = 1, in this process) -- and redone only when the parts change. The build
is W tasks of each of three kinds (curation.core.table), merged on disk, none holding more than its N/W
inputs: *run* tasks sort their share of the parts into runs on disk; *rank* tasks give each entry its input
id (the sum over the runs of ``searchsorted(run_keys, key)``, the runs memory-mapped) and row id, and write
its fields at those positions into preallocated memory-mapped arrays; one streaming pass (a chunk in
memory) turns the string lengths into offsets; *copy* tasks put the strings' bytes into the blobs. The files
are byte for byte those of one process sorting everything (source and reason codes in first-appearance order
of the parts), whatever W; a rerun skips the finished tasks (work files in ``table/work/`` until complete).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import os
import shutil

import numpy as np

from dinopipe.config import InputError
from dinopipe.utils.io import atomic_open, atomic_write_json

TABLE_DIR = "table"
_VERSION = 1
_CHUNK = 1 << 16  # entries per chunk of the single-process passes


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


def _load(d: str, name: str) -> np.ndarray:
    return np.load(os.path.join(d, f"{name}.npy"), mmap_mode="r")


def parts_digest(meta_paths: list[str]) -> str:
    """What the table was built from: the part files' names, sizes and modification times."""
    h = hashlib.sha1()
    for p in meta_paths:
        st = os.stat(p)
        h.update(f"{os.path.basename(p)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


OUTPUTS = {  # name -> (dtype, shape: "n" inputs, "r" readable rows, "r,2"; offsets and blobs made later)
    "input_source": (np.int32, "n"), "input_reason": (np.int16, "n"), "row_id": (np.int64, "r"),
    "row_perm": (np.int64, "r"), "row_hash": (np.uint64, "r"), "loc_span": (np.int64, "r,2"),
    "ids_len": (np.int64, "n"), "loc_len": (np.int64, "r")}
_FINAL = ("ids_blob", "ids_offsets", "input_source", "input_reason", "row_id", "row_perm", "row_hash",
          "loc_blob", "loc_offsets", "loc_span")


def build_table(emb_dir: str, meta_paths: list[str], part_rows: list[int], num_tasks: int = 1,
                launcher: str = "inline") -> dict:
    """Write ``<emb_dir>/table/`` from the parts' ``.ids.json`` (``part_rows``: rows of each part) as
    ``num_tasks`` W tasks of each kind (curation.core.table; ``launcher``: inline, one after another in this
    process, local, W fresh processes, or srun, W srun tasks of the job's nodes: their writes placed by
    the owner of each output slice, curation.core.table_owned). Work files go to ``table/work/`` (kept for a
    rerun until the table is complete: finished tasks are skipped). Returns ``{"tasks": W, "reports": [...]}``
    (each task's peak)."""
    d = os.path.join(emb_dir, TABLE_DIR)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, ".lock"), "a") as lock:
        # another process building this table (ranks of `curate kmeans` opening a fresh folder): wait, reuse it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if fresh_meta(emb_dir, meta_paths) is not None:
            return {"tasks": 0, "reports": []}
        return _build(emb_dir, meta_paths, part_rows, int(num_tasks), launcher)


def _build(emb_dir: str, meta_paths: list[str], part_rows: list[int], w: int, launcher: str) -> dict:
    from curation.core import table as tt
    from curation.core.runner import launch, run_step
    from curation.core.table_owned import place_task

    d = os.path.join(emb_dir, TABLE_DIR)
    work = os.path.join(d, "work")
    digest = parts_digest(meta_paths)
    # srun tasks on several nodes write each output slice through its owner (table_owned); other launchers write
    # in place: the work files of one layout are not the other's, so a change of launcher starts over too
    owned = launcher == "srun" and w > 1
    plan = {"parts": digest, "tasks": w, "owned": owned}
    if _read_json(os.path.join(work, "plan.json")) != plan:  # other parts, another W or layout: start over
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        atomic_write_json(os.path.join(work, "plan.json"), plan)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(d, "meta.json"))  # not a complete table until the end

    def run(fn, **kw):
        return run_step(fn, w, **launch(launcher, w), **kw)

    reports = run(tt.run_task, work=work, meta_paths=list(meta_paths), part_rows=[int(r) for r in part_rows])
    names = [_read_json(os.path.join(tt.run_dir(work, t), "names.json")) for t in range(w)]
    sources = list(dict.fromkeys(s for x in names for s in x["sources"]))  # first appearance, part order
    reasons = list(dict.fromkeys(s for x in names for s in x["reasons"]))
    n, r = sum(x["n"] for x in names), sum(x["rows"] for x in names)
    out = {name: os.path.join(work, f"{name}.npy") for name in (*OUTPUTS, *_FINAL)}
    if not os.path.exists(os.path.join(work, "alloc.json")):
        for name, (dtype, shape) in OUTPUTS.items():
            _alloc(out[name], dtype, {"n": (n,), "r": (r,), "r,2": (r, 2)}[shape])
        atomic_write_json(os.path.join(work, "alloc.json"), {"n": n, "rows": r})
    src_of, reason_of = {s: i for i, s in enumerate(sources)}, {s: i for i, s in enumerate(reasons)}
    src_codes = [[src_of[s] for s in x["sources"]] for x in names]  # run code -> global code
    reason_codes = [[reason_of[s] for s in x["reasons"]] for x in names]
    # srun tasks may run on several nodes: each output slice written by one owner (curation.core.table_owned)
    reports += run(tt.rank_task, work=work, out=out, source_codes=src_codes, reason_codes=reason_codes, owned=owned)
    dups = [k for t in range(w) for k in tt.read_dup(work, t, w)]
    if dups:
        raise InputError(f"{emb_dir}: image id {min(dups).decode()!r} is in two embedding parts (parts of "
                         f"two different runs in one folder?); use a fresh output folder")
    if owned:
        reports += run(place_task, work=work, out=out, kind="rank")
    if not os.path.exists(os.path.join(work, "offsets.json")):
        sizes = {"ids": _cumsum(out["ids_len"], out["ids_offsets"]),
                 "loc": _cumsum(out["loc_len"], out["loc_offsets"])}
        _alloc(out["ids_blob"], np.uint8, (sizes["ids"],))
        _alloc(out["loc_blob"], np.uint8, (sizes["loc"],))
        atomic_write_json(os.path.join(work, "offsets.json"), sizes)
    reports += run(tt.copy_task, work=work, out=out, owned=owned)
    if owned:
        reports += run(place_task, work=work, out=out, kind="copy")
    for name in _FINAL:  # (a rerun after a kill half-way through: the rest)
        if os.path.exists(out[name]):
            os.replace(out[name], os.path.join(d, f"{name}.npy"))
    ids_digest = _sha1(os.path.join(d, "ids_blob.npy"))
    atomic_write_json(os.path.join(d, "meta.json"), {  # last: marks a complete table
        "version": _VERSION, "parts": digest, "ids": ids_digest, "n_inputs": n, "n_rows": r,
        "sources": sources, "reasons": reasons})
    shutil.rmtree(work, ignore_errors=True)
    return {"tasks": w, "reports": reports}


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _alloc(path: str, dtype, shape: tuple[int, ...]) -> None:
    """A ``.npy`` of ``shape`` (zeros, sparse on disk) with np.save's header, to be filled through a mapping."""
    shape = tuple(int(x) for x in shape)
    if int(np.prod(shape)) == 0:  # an empty file cannot be mapped
        with atomic_open(path, "wb") as f:
            np.save(f, np.zeros(shape, dtype))
        return
    m = np.lib.format.open_memmap(path + ".tmp", mode="w+", dtype=dtype, shape=shape)
    m.flush()
    del m
    os.replace(path + ".tmp", path)


def _cumsum(lens_path: str, offsets_path: str) -> int:
    """offsets = [0, cumsum(lens)], streamed in chunks (8 B per entry on disk, a chunk in memory)."""
    lens = np.load(lens_path, mmap_mode="r")
    _alloc(offsets_path, np.int64, (len(lens) + 1,))
    off = np.load(offsets_path, mmap_mode="r+")
    total = 0
    for c0 in range(0, len(lens), _CHUNK):
        c = np.cumsum(lens[c0:c0 + _CHUNK], dtype=np.int64) + total
        off[c0 + 1:c0 + 1 + len(c)] = c
        total = int(c[-1])
    if isinstance(off, np.memmap):
        off.flush()
    return total


def _sha1(path: str) -> str:
    """The first 16 hex digits of the sha1 of a uint8 ``.npy``'s data, streamed."""
    h = hashlib.sha1()
    m = np.load(path, mmap_mode="r")
    step = _CHUNK * 64
    for c0 in range(0, len(m), step):
        h.update(np.ascontiguousarray(m[c0:c0 + step]).tobytes())
    return h.hexdigest()[:16]


def fresh_meta(emb_dir: str, meta_paths: list[str]) -> dict | None:
    """The table's meta.json when the table is complete and built from these parts, else None."""
    meta = _read_json(os.path.join(emb_dir, TABLE_DIR, "meta.json"))
    if meta is None or meta.get("version") != _VERSION or meta["parts"] != parts_digest(meta_paths):
        return None
    return meta


def open_table(emb_dir: str, meta_paths: list[str], part_rows: list[int]) -> dict:
    """The table's arrays (memory-mapped) and meta, built first (one task, in this process) when missing or
    stale; the chain builds it as W tasks right after embedding (curation.pipeline)."""
    d = os.path.join(emb_dir, TABLE_DIR)
    meta = fresh_meta(emb_dir, meta_paths)
    if meta is None:
        build_table(emb_dir, meta_paths, part_rows)
        meta = _read_json(os.path.join(d, "meta.json"))
    arrays = {name: _load(d, name) for name in _FINAL}
    return {"meta": meta, **arrays}
