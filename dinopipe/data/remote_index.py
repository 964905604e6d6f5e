"""The pool index of a bucket: the paged listing and every shard's members, written once as arrays.

The same file layout as a local pool index (:mod:`.pool_index`), with ``"remote": true`` in the header, the
prefix URL as ``root`` and, per shard (or per image object of a folder-like prefix), the listed size and ETag
(``shard_size`` int64, ``shard_etag`` (n, 16) uint8, ``shard_etag_parts`` int32): about 36 bytes + the name per
object, memory-mapped by every rank, which reads only the rows of its own slice. Reads check each object against
these (``If-Match`` on S3), so a shard replaced after the listing is refused and named, never mixed in.

Building walks the tar headers of every shard through ranged reads, several shards at once (threads: the time is
spent waiting on the store). In a run with a process group the walk is split over the ranks (each walks every
W-th shard and leaves its members' offsets in a part file; rank 0 writes the index from the parts), once per
run directory; a rerun only re-lists the prefix (pages of 1,000 keys) to check that nothing changed.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

import numpy as np

from .index_file import member_locations, path_table, row_dtype
from .sources import RemoteSource

if TYPE_CHECKING:
    from .pool_index import PoolIndex

WALK_THREADS = int(os.environ.get("DINOPIPE_REMOTE_WALK_THREADS", "8"))


def _order(source: RemoteSource) -> list[int]:
    """Listing rows in id order: a shard's ids are ``<shard>/<member>``, so shards sort by name + '/'."""
    names = [source.listing.name(i) for i in range(len(source.listing))]
    return sorted(range(len(names)), key=lambda k: names[k] + ("/" if source.kind == "tar" else ""))


def _locations(source: RemoteSource, k: int) -> np.ndarray:
    refs, _ = source.walk(k)
    prefix = len(source.name) + len(source.listing.name(k)) + 2
    return member_locations([(r.id[prefix:], r.loc[1], r.loc[2]) for r in refs])


def walk_shards(source: RemoteSource, rows: list[int]) -> dict[int, np.ndarray]:
    """{listing row: (m, 2) member [offset, size]} of the shards ``rows``, walked ``WALK_THREADS`` at a time."""
    with ThreadPoolExecutor(max_workers=max(1, WALK_THREADS)) as pool:
        return dict(zip(rows, pool.map(lambda k: _locations(source, k), rows)))


def walk_split(source: RemoteSource, path: str, ranks) -> tuple[Optional[BaseException], Optional[dict]]:
    """Collectively: every rank walks its share of the shards (every ``world``-th in id order, from ``rank``) into
    ``<path>.walk-<rank>-of-<world>.npz``; after a barrier rank 0 gets every shard's members (the others None).
    Returns (the error to raise on every rank if any rank failed, the walked members)."""
    order = _order(source)
    part = f"{path}.walk-{{}}-of-{ranks.world}.npz"
    failed: Optional[BaseException] = None
    try:
        walked = walk_shards(source, order[ranks.rank::ranks.world])
        rows = np.asarray(list(walked), dtype=np.int64)
        counts = np.asarray([len(v) for v in walked.values()], dtype=np.int64)
        loc = np.concatenate(list(walked.values())) if walked else np.zeros((0, 2), dtype=np.int64)
        tmp = part.format(ranks.rank) + ".tmp.npz"
        np.savez(tmp, rows=rows, counts=counts, loc=loc)
        os.replace(tmp, part.format(ranks.rank))
    except Exception as e:  # noqa: BLE001 - still reach the barrier, so the others do not wait forever
        failed = e
    ranks.barrier()
    if ranks.any_rank(failed is not None):
        return failed or RuntimeError(f"another rank could not walk its shards for {path}"), None
    if ranks.rank != 0:
        return None, None
    out: dict[int, np.ndarray] = {}
    for r in range(ranks.world):
        with np.load(part.format(r)) as z:
            for k, piece in zip(z["rows"].tolist(), np.split(z["loc"], np.cumsum(z["counts"])[:-1])):
                out[int(k)] = piece.reshape(-1, 2)
        os.remove(part.format(r))
    return None, out


def build_remote_index(source: RemoteSource, walked: Optional[dict] = None) -> tuple[dict, dict]:
    """(header, arrays) of a remote source, in the order of its ids (the order of the same data on disk).
    ``walked``: every shard's members already walked (:func:`walk_split`), else walked here."""
    order = _order(source)
    listed = source.listing.arrays()
    names = [source.listing.name(k) for k in order]
    blob, start = path_table(names)
    per_path = {"shard_size": listed["size"][order], "shard_etag": listed["etag"][order],
                "shard_etag_parts": listed["etag_parts"][order]}
    n_paths = len(order)
    if source.kind == "folder":
        arrays = {"path_blob": blob, "path_start": start, "image_path": np.arange(n_paths, dtype=row_dtype(n_paths)),
                  "image_offset": np.zeros(n_paths, dtype=np.int64), "image_size": np.full(n_paths, -1, np.int64),
                  **per_path}
        return {"kind": "folder", "root": source.url, "remote": True, "n_images": n_paths, "n_paths": n_paths}, arrays

    walked = walked if walked is not None else walk_shards(source, order)
    locs = [walked[k] for k in order]
    idx = [np.full(len(loc), new, dtype=row_dtype(n_paths)) for new, loc in enumerate(locs)]
    loc = np.concatenate(locs) if locs else np.zeros((0, 2), dtype=np.int64)
    arrays = {"path_blob": blob, "path_start": start,
              "image_path": np.concatenate(idx) if idx else np.zeros(0, dtype=np.uint32),
              "image_offset": loc[:, 0], "image_size": loc[:, 1], **per_path}
    return {"kind": "tar", "root": source.url, "remote": True, "n_images": len(loc), "n_paths": n_paths}, arrays


def remote_matches(index: "PoolIndex", source: RemoteSource) -> Optional[str]:
    """None if ``index`` describes the objects now under the source's prefix (names, sizes, ETags), else why not."""
    h = index.header
    if not h.get("remote") or h.get("root") != source.url or h.get("kind") != source.kind:
        return "it indexes another location"
    order = _order(source)
    listed = source.listing.arrays()
    if len(order) != len(index.arrays["path_start"]) - 1:
        return "objects were added or removed"
    if [source.listing.name(k) for k in order] != [bytes(index._blob[index._start[p]:index._start[p + 1]]).decode()
                                                    for p in range(len(order))]:
        return "objects were added, removed or renamed"
    if (not np.array_equal(listed["size"][order], index.arrays["shard_size"])
            or not np.array_equal(listed["etag"][order], index.arrays["shard_etag"])):
        return "an object changed since the index was written (size or ETag)"
    return None


__all__ = ["build_remote_index", "remote_matches", "walk_shards", "walk_split"]
