"""Row helpers every engine shares: a stable random key per row (the same for any number of tasks) and
a subset of an array read a block at a time."""

from __future__ import annotations

import numpy as np


def row_keys(rows: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 of (row, seed): the random order rows are picked in, independent of W."""
    with np.errstate(over="ignore"):
        z = np.asarray(rows, np.uint64) + np.uint64(seed * 0x9E3779B97F4A7C15 % (1 << 64))
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class Gathered:
    """``base[index]`` read a block at a time (for :func:`rows_digest`, :func:`curation.core.unionfind.id_ranks`): the
    ids of a subset of rows without a whole gathered copy; ``np.asarray`` gathers it whole where one is needed."""

    def __init__(self, base: np.ndarray, index: np.ndarray) -> None:
        self.base, self.index, self.dtype = base, index, base.dtype

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, sl: slice) -> np.ndarray:
        return self.base[self.index[sl]]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.base[self.index]
        return out if dtype is None else out.astype(dtype)
