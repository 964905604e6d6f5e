"""Compact listings of image references (issue 40): a task's own rows as arrays, not one Python object per row.

An :class:`~dinopipe.data.sources.ImageRef` with its id and location strings costs ~420 B on the heap; at 10^8 listed
paths a task of 4 held ~10 GB of them. :class:`PathRefs` keeps a file list's own paths as one UTF-8 byte array and
an int64 end offset per row (8 B a row beyond the path's bytes; 16 B at the peak of listing, issue 49) and builds an
``ImageRef`` only when a row is asked for, so a consumer that walks the rows in bounded batches (the embedder's
shards) holds the arrays and one batch. :class:`MemberRefs` does the same for tar shards' members.
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
    ``id = <name>/<path without a leading '/'>`` and ``loc`` the path (absolute or a URL) or ``root/path``.

    Held per row: the path's bytes and one int64 end offset. A path listed twice is kept once, at its first place:
    ``drops`` (sorted) are the raw rows skipped, few, so a row's raw position is found by a search in them."""

    def __init__(self, blob: np.ndarray, ends: np.ndarray, name: str, root: str, ref_cls, is_url,
                 drops: np.ndarray | None = None) -> None:
        self.blob, self.ends = blob, ends
        drops = np.zeros(0, np.int64) if drops is None else np.asarray(drops, np.int64)
        # the visible row at which each dropped raw row would have been: raw(i) = i + #(shifted <= i)
        self.drops, self._shifted = drops, drops - np.arange(len(drops), dtype=np.int64)
        self.name, self.root, self.ref_cls, self.is_url = name, root, ref_cls, is_url

    def __len__(self) -> int:
        return len(self.ends) - len(self.drops)

    def raw(self, i: int) -> int:
        return i + int(np.searchsorted(self._shifted, i, side="right")) if len(self.drops) else i

    def path(self, i: int) -> str:
        j = self.raw(i)
        return self.blob[(int(self.ends[j - 1]) if j else 0):int(self.ends[j])].tobytes().decode("utf-8")

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

    def nbytes(self) -> int:
        """Bytes of the arrays held (the path bytes, 8 per row, 16 per dropped repeat)."""
        return self.blob.nbytes + self.ends.nbytes + self.drops.nbytes + self._shifted.nbytes


_BLOCK = 1 << 20  # rows per block of the repeat search: its temporaries stay a few MB at any list size


def collect_paths(paths: Iterable[tuple[bytes, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(utf-8 path, 64-bit key)`` pairs in list order -> (blob, ends, drops): the paths' bytes, each row's end
    offset, and the sorted rows that repeat an earlier row's path (kept once, at its first place). ``key`` is a
    hash of the row's id: equal paths have equal keys. Held per row while collecting: the bytes, the int64 end and
    a 32-bit piece of the key (its high half: the low bits carry the task split); the repeats are found by sorting
    a copy of those pieces -- 16 B a row at the peak -- and comparing paths only within a run of equal pieces."""
    buf, ends, keys = bytearray(), array("q"), array("I")
    for path, key in paths:
        buf += path
        ends.append(len(buf))
        keys.append(key >> 32)
    # views, not copies: nothing is appended any more
    blob = np.frombuffer(buf, np.uint8) if buf else np.zeros(0, np.uint8)
    ends_a = np.frombuffer(ends, np.int64) if len(ends) else np.zeros(0, np.int64)
    keys_a = np.frombuffer(keys, np.uint32) if len(keys) else np.zeros(0, np.uint32)
    return blob, ends_a, _repeats(blob, ends_a, keys_a)


def _repeats(blob: np.ndarray, ends: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Sorted rows whose path equals an earlier row's. Temporaries beyond a 4-byte sorted copy of ``keys``: a block
    of rows at a time, and arrays over the candidate rows (those sharing their key piece with another row)."""
    n = len(keys)
    if n < 2:
        return np.zeros(0, np.int64)
    ordered = np.sort(keys)
    dup = []
    for s in range(0, n - 1, _BLOCK):
        e = min(s + _BLOCK, n - 1)
        lo, hi = ordered[s:e], ordered[s + 1:e + 1]
        dup.append(np.unique(hi[hi == lo]))
    del ordered
    dup_keys = np.unique(np.concatenate(dup))
    if not len(dup_keys):
        return np.zeros(0, np.int64)
    cand = []
    for s in range(0, n, _BLOCK):
        block = keys[s:s + _BLOCK]
        at = np.minimum(np.searchsorted(dup_keys, block), len(dup_keys) - 1)
        cand.append(s + np.flatnonzero(dup_keys[at] == block))
    rows = np.concatenate(cand)
    rows = rows[np.lexsort((rows, keys[rows]))]  # by key piece, then list order
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(keys[rows])) + 1, [len(rows)]])
    drops = array("q")
    for c in range(0, len(bounds) - 1, 1 << 16):  # runs of one key piece, 64k runs (Python ints) at a time
        b = bounds[c:c + (1 << 16) + 1]
        chunk = rows[b[0]:b[-1]].tolist()
        for start, stop in zip((b[:-1] - b[0]).tolist(), (b[1:] - b[0]).tolist()):
            seen: set[bytes] = set()  # a run: one path's repeats, or rarely a 32-bit collision of two paths
            for r in chunk[start:stop]:
                p = blob[(int(ends[r - 1]) if r else 0):int(ends[r])].tobytes()
                if p in seen:
                    drops.append(r)
                seen.add(p)
    return np.sort(np.frombuffer(drops, np.int64)) if len(drops) else np.zeros(0, np.int64)


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
