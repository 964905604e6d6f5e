"""The path table's writes when its tasks run on several nodes (``tasks.launcher=srun``).

Inline and in local processes, the rank and copy tasks (curation.core.table) write their entries straight into
the preallocated outputs through a shared memory mapping: disjoint positions, but scattered, so two tasks dirty
the same pages. One node's page cache merges them; a network file system written from two nodes may write a
whole page back over another node's bytes. So across nodes every output is split into W contiguous slices, each
with one owner:

* a rank or copy task keeps its writes as parts, one per owner (``owned/<kind>-TTTTT-to-UUUUU.npz``: the
  positions in that owner's slice and their values) -- what it held anyway;
* :func:`place_task` ``u`` reads the W parts addressed to it, fills its slice in memory and writes it with one
  ``pwrite`` per output: byte ranges of different owners never share a byte, and no task maps the outputs.

The bytes written are the same as the mapped writes' (the table does not depend on W or the launcher).
"""

from __future__ import annotations

import os

import numpy as np

from dinopipe.utils.io import atomic_write_json

from curation.core.runner import part_done, read_part, write_part


def _dir(work: str) -> str:
    return os.path.join(work, "owned")


def part(work: str, kind: str, t: int, u: int) -> str:
    return os.path.join(_dir(work), f"{kind}-{t:05d}-to-{u:05d}.npz")


def bounds(length: int, w: int) -> np.ndarray:
    """Owner ``u``'s slice of an output of ``length`` entries: ``[b[u], b[u + 1])``."""
    return np.asarray([length * u // w for u in range(w + 1)], np.int64)


def _length(path: str) -> int:
    return int(np.load(path, mmap_mode="r").shape[0])


def save_by_owner(work: str, kind: str, t: int, w: int, writes: dict, lengths: dict) -> None:
    """Task ``t``'s ``writes`` (output name -> (positions, values)) as one part per owner. ``lengths``:
    output name -> the length its positions index (its owners' slices)."""
    owner = {name: np.searchsorted(bounds(lengths[name], w), np.asarray(at, np.int64), "right") - 1
             for name, (at, _) in writes.items()}
    for u in range(w):
        got = {}
        for name, (at, values) in writes.items():
            mine = owner[name] == u
            got[f"{name}.at"] = np.asarray(at, np.int64)[mine]
            got[f"{name}.values"] = np.asarray(values)[mine] if np.ndim(values) else np.zeros(0)
        write_part(part(work, kind, t, u), **got)


def _data_offset(path: str) -> int:
    """Where a ``.npy`` file's data start (after its header)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        read(f)
        return f.tell()


def pwrite(path: str, start: int, block: np.ndarray) -> None:
    """``block`` into the ``.npy`` at ``path`` from entry ``start`` on (its rows' bytes only), then flushed."""
    block = np.ascontiguousarray(block)
    if not block.size:
        return
    row = block.itemsize * (int(np.prod(block.shape[1:])) if block.ndim > 1 else 1)
    fd = os.open(path, os.O_WRONLY)
    try:
        data, at = memoryview(block.reshape(-1).view(np.uint8)), _data_offset(path) + start * row
        while len(data):
            done = os.pwrite(fd, data, at)
            data, at = data[done:], at + done
        os.fsync(fd)
    finally:
        os.close(fd)


def scatter_strings(blob: np.ndarray, offsets: np.ndarray, at: np.ndarray, strings: np.ndarray,
             chunk: int = 1 << 16) -> None:
    """``blob[offsets[at[i]]:...] = strings[i]`` for every ``i``, ``chunk / 8`` strings at a time (a byte's
    destination is an int64: 16 B per byte of a chunk)."""
    step = max(1, chunk // 8)
    for c0 in range(0, len(at), step):
        s = np.ascontiguousarray(strings[c0:c0 + step])
        width = s.dtype.itemsize
        lens = np.char.str_len(s).astype(np.int64)
        total = int(lens.sum())
        if not total:
            continue
        u8 = s.view(np.uint8).reshape(len(s), width)
        src = u8[np.arange(width)[None, :] < lens[:, None]]  # the strings one after another
        starts = np.asarray(offsets[at[c0:c0 + step]], np.int64)
        local = np.cumsum(lens) - lens
        blob[np.repeat(starts - local, lens) + np.arange(total, dtype=np.int64)] = src


def place_task(u: int, w: int, work: str, out: dict[str, str], kind: str) -> dict:
    """Owner ``u``: its slice of every output the ``kind`` tasks wrote (rank: the fixed-width arrays, copy: the
    two string blobs, whose slices are the byte ranges of the owner's entries), from the W parts addressed to
    it. Rerun-safe: a finished owner's mark is there."""
    mark = os.path.join(_dir(work), f"placed-{kind}-{u:05d}.json")
    if part_done(mark):
        return {"skipped": True}
    got = [read_part(part(work, kind, t, u)) for t in range(w)]
    names = sorted({k[: -len(".at")] for g in got for k in g if k.endswith(".at")})
    n = 0
    for name in names:
        if kind == "copy":
            n += _place_strings(out, name, u, w, got)
            continue
        path = out[name]
        m = np.load(path, mmap_mode="r")
        lo, hi = bounds(len(m), w)[u:u + 2]
        block = np.zeros((int(hi - lo),) + m.shape[1:], m.dtype)
        del m
        for g in got:
            block[g[f"{name}.at"] - lo] = g[f"{name}.values"]
        pwrite(path, int(lo), block)
        n += len(block)
    atomic_write_json(mark, {"entries": int(n)})
    return {"entries": int(n)}


def _place_strings(out: dict[str, str], name: str, u: int, w: int, got: list[dict]) -> int:
    """Blob ``name`` (ids_blob / loc_blob): the strings of owner ``u``'s entries, one contiguous byte range."""
    offsets = np.load(out[name.replace("_blob", "_offsets")], mmap_mode="r")
    lo, hi = bounds(len(offsets) - 1, w)[u:u + 2]
    b0, b1 = int(offsets[lo]), int(offsets[hi])
    local = np.asarray(offsets[lo:hi + 1], np.int64) - b0
    buf = np.zeros(b1 - b0, np.uint8)
    for g in got:
        at = g[f"{name}.at"]
        if len(at):
            scatter_strings(buf, local, at - lo, g[f"{name}.values"])
    pwrite(out[name], b0, buf)
    return int(hi - lo)
