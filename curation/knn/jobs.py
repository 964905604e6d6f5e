"""What the kNN steps share about their jobs: the descriptor folder, the rows a task reopens, a digest of
positions (a change of rows retrains an index), survivors as a memory-mapped position array."""

from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np


from curation.knn.shards import RowSource
from curation.core.stepfiles import positions_where
from curation.core.layout import RunLayout


def descriptor_dir(out_dir: str) -> str:
    return RunLayout(out_dir).embeddings("descriptor")


def row_source(out_dir: str, name: str, emb_dir: str, positions: np.ndarray | None, what: str) -> RowSource:
    """The rows a task process reopens: ``knn/<name>/<what>_rows.npy`` (positions) in ``emb_dir``."""
    return RowSource.save(emb_dir, positions, RunLayout(out_dir).knn(f"{name}-{what}_rows.npy"))


def digest(positions: np.ndarray, block: int = 1 << 16) -> str:
    """sha1 of the int64 bytes of ``positions``, fed a block at a time (no whole copy of a mapped array)."""
    h = hashlib.sha1()
    for s in range(0, len(positions), block):
        h.update(np.ascontiguousarray(positions[s:s + block], np.int64).tobytes())
    return h.hexdigest()[:16]


def mapped_positions(folder: str, keep) -> np.ndarray:
    """``np.flatnonzero(keep)`` as a memory-mapped int64 array written a block at a time: every `curate search`
    array task (and `curate index`) reads the survivors' positions without an int64 per survivor in memory (8 GB at
    10^9 rows). The file is this process's own (a unique name: array tasks on many nodes share the folder) and is
    unlinked once mapped, so nothing is left behind; the mapping lives on until the array is dropped."""
    os.makedirs(folder, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="survivors-", suffix=".scratch.npy", dir=folder)
    os.close(fd)
    try:
        return positions_where(folder, path, keep, lambda b: b)
    finally:
        os.remove(path)
