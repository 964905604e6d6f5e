"""Compact listings of image references (issue 40): a task's own rows as arrays, not one Python object per row.

An :class:`~dinopipe.data.sources.ImageRef` with its id and location strings costs ~420 B on the heap; at 10^8 listed
paths a task of 4 held ~10 GB of them. :class:`PathRefs` keeps a file list's own paths as one UTF-8 byte array and
an int64 end offset per row (~50 B per 40-byte path) and builds an ``ImageRef`` only when a row is asked for, so a
consumer that walks the rows in bounded batches (the embedder's shards) holds the arrays and one batch.
:class:`ConcatRefs` chains several sources' listings (a MultiSource) the same way.

This module does not import :mod:`dinopipe.data.sources` (which uses it): the ref class is handed in.
"""

from __future__ import annotations

import bisect
import os
from array import array
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np


def under_root(root: str | Path, path: str) -> str:
    """``str(root / path)``; without pathlib when the path needs no normalising: pathlib (Python < 3.12) interns
    every part of every path it parses, which stays in memory for the process's life (~70 B per listed name).
    A URL root (a bucket prefix) is joined as text, as :func:`dinopipe.utils.storage.join` does."""
    if "://" in str(root):
        return f"{str(root).rstrip('/')}/{path.lstrip('/')}"
    if "//" in path or "/./" in path or path.startswith("./") or path.endswith(("/", "/.")) or path == ".":
        return str(Path(root) / path)
    base = str(root)
    return path if base == "." else base.rstrip("/") + "/" + path


class PathRefs(Sequence):
    """The rows of one file list as a byte array of paths; row ``i`` is ``ref_cls(id, name, loc)`` with
    ``id = <name>/<path without a leading '/'>`` and ``loc`` the path (absolute or a URL) or ``root/path``."""

    def __init__(self, blob: np.ndarray, ends: np.ndarray, name: str, root: str, ref_cls, is_url,
                 starts: np.ndarray | None = None) -> None:
        self.blob, self.ends, self.starts = blob, ends, starts  # starts None: each row starts where the last ended
        self.name, self.root, self.ref_cls, self.is_url = name, root, ref_cls, is_url

    def __len__(self) -> int:
        return len(self.ends)

    def path(self, i: int) -> str:
        start = int(self.starts[i]) if self.starts is not None else int(self.ends[i - 1]) if i else 0
        return self.blob[start:int(self.ends[i])].tobytes().decode("utf-8")

    def _ref(self, i: int):
        path = self.path(i)
        full = path if os.path.isabs(path) or self.is_url(path) else under_root(self.root, path)
        return self.ref_cls(f"{self.name}/{path.lstrip('/')}", self.name, full)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._ref(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        return self._ref(i % n)


def collect_paths(paths: Iterable[tuple[str, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(path, key)`` pairs in list order -> (blob, ends, starts) of the paths with a path listed twice kept
    once, at its first place (starts: None when nothing was dropped; else the kept rows' starts, the repeats'
    bytes staying in the blob rather than copying it). ``key`` is a 64-bit hash of the row's id: equal paths
    have equal keys, so the repeats are found by sorting the keys and comparing the paths only within a run of
    equal keys -- no set of strings."""
    buf, ends, keys = bytearray(), array("q"), array("Q")
    for path, key in paths:
        buf += path.encode("utf-8")
        ends.append(len(buf))
        keys.append(key)
    # views, not copies: nothing is appended any more
    blob = np.frombuffer(buf, np.uint8) if buf else np.zeros(0, np.uint8)
    ends_a = np.frombuffer(ends, np.int64) if len(ends) else np.zeros(0, np.int64)
    keep = _first_copies(blob, ends_a, np.frombuffer(keys, np.uint64) if len(keys) else np.zeros(0, np.uint64))
    if keep is None:
        return blob, ends_a, None
    starts = np.concatenate([np.zeros(1, np.int64), ends_a[:-1]])[keep]
    return blob, ends_a[keep], starts


def _first_copies(blob: np.ndarray, ends: np.ndarray, keys: np.ndarray) -> np.ndarray | None:
    """Mask of the rows that are no repeat of an earlier row (None: there is none)."""
    if len(keys) < 2:
        return None
    order = np.argsort(keys, kind="stable")  # a run of equal keys stays in list order
    ordered = keys[order]
    same = ordered[1:] == ordered[:-1]
    del ordered
    if not same.any():
        return None
    keep = np.ones(len(keys), bool)

    def path(i: int) -> bytes:
        return blob[(int(ends[i - 1]) if i else 0):int(ends[i])].tobytes()

    run_starts = np.flatnonzero(same & ~np.concatenate([[False], same[:-1]]))
    for s in run_starts:  # order[s] .. order[e]: one key; rarely more than one distinct path (a hash collision)
        e = s + 1
        while e < len(same) and same[e]:
            e += 1
        seen: set[bytes] = set()
        for r in order[s:e + 1]:
            p = path(int(r))
            if p in seen:
                keep[r] = False
            seen.add(p)
    return keep


class ConcatRefs(Sequence):
    """Several listings one after the other (list or :class:`PathRefs` parts), indexable by row."""

    def __init__(self, parts: Sequence[Sequence]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + len(p))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        i %= n
        k = bisect.bisect_right(self.starts, i) - 1
        return self.parts[k][i - self.starts[k]]
