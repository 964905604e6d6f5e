"""Compact listings of image references (issue 40): a task's own rows as arrays, not one Python object per row.

An :class:`~dinopipe.data.sources.ImageRef` with its id and location strings costs ~420 B on the heap; at 10^8 listed
paths a task of 4 held ~10 GB of them. :class:`PathRefs` keeps a file list's own paths as one UTF-8 byte array and
an int64 end offset per row (8 B a row beyond the path's bytes; 12 B at the peak of listing, issue 49) and builds an
``ImageRef`` only when a row is asked for, so a consumer that walks the rows in bounded batches (the embedder's
shards) holds the arrays and one batch. :class:`MemberRefs` does the same for tar shards' members.
:class:`ConcatRefs` chains several sources' listings (a MultiSource) the same way.

This module does not import :mod:`dinopipe.data.sources` (which uses it): the ref class is handed in.
"""

from __future__ import annotations

import bisect
import os
import zlib
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


class _RefRows(Sequence):
    """Rows held as arrays, an ``ImageRef`` made only for the row asked (``_ref``)."""

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._ref(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        return self._ref(i % n)


class PathRefs(_RefRows):
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

    def nbytes(self) -> int:
        """Bytes of the arrays held (the path bytes, 8 per row, 16 per dropped repeat)."""
        return self.blob.nbytes + self.ends.nbytes + self.drops.nbytes + self._shifted.nbytes


_BLOCK = 1 << 20  # rows per block of the repeat search: its temporaries stay a few MB at any list size


def collect_paths(paths: Iterable[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """utf-8 paths in list order -> (blob, ends, drops): the paths' bytes, each row's end offset, and the sorted rows
    that repeat an earlier row's path (kept once, at its first place). Held per row while collecting: the bytes,
    the int64 end and a CRC-32 of the path (12 B); the repeats are found by sorting the CRCs in place (no copy)
    and then comparing only the paths whose CRC is shared (the CRCs of those recomputed a block at a time)."""
    buf, ends, crcs = bytearray(), array("q"), array("I")
    for path in paths:
        buf += path
        ends.append(len(buf))
        crcs.append(zlib.crc32(path))
    # views, not copies: nothing is appended any more
    blob = np.frombuffer(buf, np.uint8) if buf else np.zeros(0, np.uint8)
    ends_a = np.frombuffer(ends, np.int64) if len(ends) else np.zeros(0, np.int64)
    if len(crcs) < 2:
        return blob, ends_a, np.zeros(0, np.int64)
    ordered = np.frombuffer(crcs, np.uint32)
    ordered.sort()  # in place: the CRCs' row order is not needed again
    pieces = []
    for s in range(0, len(ordered) - 1, _BLOCK):  # the CRCs that occur twice or more, a block at a time
        e = min(s + _BLOCK, len(ordered) - 1)
        lo, hi = ordered[s:e], ordered[s + 1:e + 1]
        pieces.append(np.unique(hi[hi == lo]))
    shared = np.unique(np.concatenate(pieces))
    del ordered, crcs
    return blob, ends_a, _repeats(buf, ends_a, shared)


def _repeats(buf: bytearray, ends: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """Sorted rows whose path equals an earlier row's, among the rows whose CRC is in ``shared`` (sorted). Held
    beyond the arrays: ~20 B per such row (its position and CRC), and a block of 64k rows' CRCs."""
    if not len(shared):
        return np.zeros(0, np.int64)
    view, block = memoryview(buf), 1 << 16
    rows, row_crcs = array("q"), array("I")

    def span(r: int) -> slice:
        return slice(int(ends[r - 1]) if r else 0, int(ends[r]))

    for s in range(0, len(ends), block):
        stops = ends[s:s + block]
        starts = np.concatenate([[int(ends[s - 1]) if s else 0], stops[:-1]])
        c = np.fromiter((zlib.crc32(view[a:b]) for a, b in zip(starts.tolist(), stops.tolist())), np.uint32,
                        len(stops))
        hit = np.flatnonzero(shared[np.minimum(np.searchsorted(shared, c), len(shared) - 1)] == c)
        rows.extend((s + hit).tolist())
        row_crcs.extend(c[hit].tolist())
    cand = np.frombuffer(rows, np.int64)
    crc = np.frombuffer(row_crcs, np.uint32)
    order = np.lexsort((cand, crc))  # by CRC, then list order: the first of equal paths is kept
    cand, crc = cand[order], crc[order]
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(crc)) + 1, [len(cand)]])
    drops = array("q")
    for c0 in range(0, len(bounds) - 1, block):  # runs of one CRC, 64k runs (Python ints) at a time
        b = bounds[c0:c0 + block + 1]
        chunk = cand[b[0]:b[-1]].tolist()
        for lo, hi in zip((b[:-1] - b[0]).tolist(), (b[1:] - b[0]).tolist()):
            seen: set[bytes] = set()  # one path's repeats, or rarely a CRC shared by two paths
            for r in chunk[lo:hi]:
                p = bytes(view[span(r)])
                if p in seen:
                    drops.append(r)
                seen.add(p)
    view.release()
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


class MemberRefs(_RefRows):
    """The members of a task's tar shards as arrays: per row the member name's bytes and an int64 end, data offset
    and size (24 B beyond the name); per shard its name, where it is (a path, or a URL with its ETag and size) and
    its first row. Row ``i`` is ``ref_cls(<source>/<shard>/<member>, source, loc)`` with the loc the shard walk
    gave: ``(path, offset, size)``, or ``(url, offset, size, etag, object size)`` for a shard in object storage;
    a placeholder row (a damaged or refused member) has offset -1 and size 0. Built by :class:`MemberCollector`."""

    def __init__(self, source: str, ref_cls, shards: list, first: np.ndarray, blob: np.ndarray, ends: np.ndarray,
                 offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.source, self.ref_cls, self.shards, self.first = source, ref_cls, shards, first
        self.blob, self.ends, self.offsets, self.sizes = blob, ends, offsets, sizes

    def __len__(self) -> int:
        return len(self.ends)

    def _ref(self, i: int):
        k = int(np.searchsorted(self.first, i, side="right")) - 1
        shard_name, head = self.shards[k]
        member = self.blob[(int(self.ends[i - 1]) if i else 0):int(self.ends[i])].tobytes().decode("utf-8")
        off, size = int(self.offsets[i]), int(self.sizes[i])
        if isinstance(head, tuple):  # (url, etag, object size)
            url, etag, object_size = head
            loc = (url, off, size, etag, object_size) if off >= 0 else (url, -1, 0, None, -1)
        else:
            loc = (head, off, size)
        return self.ref_cls(f"{self.source}/{shard_name}/{member}", self.source, loc)

    def nbytes(self) -> int:
        return self.blob.nbytes + self.ends.nbytes + self.offsets.nbytes + self.sizes.nbytes + self.first.nbytes


class MemberCollector:
    """Fills a :class:`MemberRefs` a shard at a time from that shard's refs (a bounded list, dropped after)."""

    def __init__(self, source: str, ref_cls) -> None:
        self.source, self.ref_cls = source, ref_cls
        self.shards: list = []
        self._first, self._blob, self._ends = array("q", [0]), bytearray(), array("q")
        self._offsets, self._sizes = array("q"), array("q")

    def add(self, shard_name: str, head, refs: Iterable) -> None:
        """One shard's refs, in the order they are to be read; ``head``: the shard's path, or (url, etag, size)."""
        cut = len(f"{self.source}/{shard_name}/")
        for r in refs:
            self._blob += r.id[cut:].encode("utf-8")
            self._ends.append(len(self._blob))
            self._offsets.append(int(r.loc[1]))
            self._sizes.append(int(r.loc[2]))
        self.shards.append((shard_name, head))
        self._first.append(len(self._ends))

    def done(self) -> MemberRefs:
        def view(buf, dtype):
            return np.frombuffer(buf, dtype) if len(buf) else np.zeros(0, dtype)

        return MemberRefs(self.source, self.ref_cls, self.shards, view(self._first, np.int64),
                          view(self._blob, np.uint8), view(self._ends, np.int64), view(self._offsets, np.int64),
                          view(self._sizes, np.int64))
