"""The pool index's file layout, writing side: a JSON header and 64-byte aligned arrays after a magic and its length
(read by :class:`.pool_index.PoolIndex`). A leaf: both :mod:`.pool_index` and :mod:`.remote_index` write with it."""

from __future__ import annotations

import json
import struct
from typing import Sequence

import numpy as np

from ..utils.io import atomic_open

MAGIC = b"DPPOOL\x00\x01"
VERSION = 1
_ALIGN = 64


def align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def write_index(path: str, header: dict, arrays: dict[str, np.ndarray]) -> None:
    """Write header + arrays to ``path`` atomically (temporary name, then rename)."""
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    with IndexFile(path, header, {name: (a.dtype, a.shape) for name, a in arrays.items()}) as f:
        for name, a in arrays.items():
            f.put(name, 0, a)


class IndexFile:
    """An index file being written: the layout (header, 64-byte aligned arrays) from each array's dtype and shape
    known up front; :meth:`put` writes rows ``[at, at + len(values))`` of one array, in any order, so an index
    can be written a piece at a time (:func:`write_tar_index`). Atomic: the file appears when the block ends."""

    def __init__(self, path: str, header: dict, specs: dict[str, tuple]) -> None:
        self.meta, rel = {}, 0
        for name, (dtype, shape) in specs.items():
            dt = np.dtype(dtype)
            self.meta[name] = {"dtype": dt.str, "shape": [int(x) for x in shape], "offset": rel}
            rel = align(rel + dt.itemsize * int(np.prod(shape, dtype=np.int64)))
        self.head = json.dumps({**header, "format": "dinopipe-pool-index", "version": VERSION,
                                "arrays": self.meta}).encode()
        self.data_start = align(len(MAGIC) + 8 + len(self.head))
        self.end = self.data_start + rel
        self._cm = atomic_open(path, "wb")

    def __enter__(self) -> "IndexFile":
        self.f = self._cm.__enter__()
        self.f.write(MAGIC + struct.pack("<Q", len(self.head)) + self.head)
        return self

    def put(self, name: str, at: int, values: np.ndarray) -> None:
        m = self.meta[name]
        values = np.ascontiguousarray(values, dtype=np.dtype(m["dtype"]))
        row = values.dtype.itemsize * int(np.prod(m["shape"][1:], dtype=np.int64))
        if values.size:
            self.f.seek(self.data_start + m["offset"] + at * row)
            self.f.write(values.tobytes())

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.f.truncate(self.end)
        self._cm.__exit__(*exc)


def path_table(paths: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The path table: the paths' utf-8 bytes in one blob + int64 starts (``start[i]:start[i + 1]``)."""
    encoded = [p.encode() for p in paths]
    start = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=start[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), start


def row_dtype(n_paths: int):
    return np.uint32 if n_paths < 2**32 else np.uint64  # 4 B per image up to 4.29 billion shards / files


def member_locations(members: Sequence[tuple[str, int, int]]) -> np.ndarray:
    """(m, 2) int64 [offset, size] of one shard's image members [(name, offset, size), ...], in name order."""
    ms = sorted(members, key=lambda m: m[0])
    return np.asarray([(o, s) for _, o, s in ms], dtype=np.int64).reshape(-1, 2)
