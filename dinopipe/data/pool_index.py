"""A compact, memory-mapped index of a training pool: where every image's bytes are, in 20 bytes per image.

At LVD-142M scale a list of Python reference objects costs ~374 bytes per image in *every* rank (~50 GB per
rank), and forked DataLoader workers slowly copy those pages just by touching refcounts. Here one file per
source holds numpy arrays that every rank and worker maps read-only from the page cache:

    path table   path_blob (utf-8 bytes), path_start (int64, n_paths + 1)   one entry per shard (or per file)
    per image    image_path (uint32), image_offset (int64), image_size (int64)   = 20 B
    tar only     shard_size, shard_mtime_ns (int64, n_paths)   the fingerprint that validates the index

Reading image ``i`` = open its path, seek to ``image_offset`` and read ``image_size`` bytes (no tar header walk);
``image_size < 0`` reads the whole file (folders, file lists), ``image_offset < 0`` marks a placeholder for a
damaged shard, read as unreadable so the loss is counted. Images are in the order of their ids (exactly the
order of the old ``list_pool``), so a run's batches do not change when it moves to the index.

Where the index comes from (:func:`open_pool`): curation writes ``pool-index.bin`` next to its shards; when it
is present and matches the shards on disk (names, sizes, mtimes) it is used as is. Otherwise the trainer builds
one per source, once per run directory (``<output_dir>/pool_index/``; a bucket's shard walk split over the ranks,
remote_index.walk_split): rank 0 builds it and renames it into place
atomically while the other ranks wait on the process group (alone, without one: the first process to take a file
lock), and every rerun finds it valid and only maps it. Validating an index stats each shard once per *run*,
split over the ranks (O(shards / W) each), and one all-reduce makes every rank take the same decision.

File layout: 8-byte magic, uint64 header length, JSON header (kind, root, counts, fingerprint, and each array's
dtype/shape/offset), then the arrays, each 64-byte aligned, readable with ``np.memmap``.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import struct
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np


from ..utils import storage
from .index_file import MAGIC, VERSION, IndexFile, align, member_locations, path_table, row_dtype, write_index
from .remote_index import build_remote_index, remote_matches, walk_split
from .sources import FileListSource, FolderSource, ImageSource, RemoteSource, TarShardSource, open_source

INDEX_NAME = "pool-index.bin"  # the curation-written index, next to the shards it describes


class PoolIndexError(ValueError):
    """An index file that is not one, is cut short, or no longer matches its source."""


class Location(NamedTuple):
    """Where one image's bytes are: read ``size`` bytes at ``offset`` (size < 0: the whole file; offset < 0: none).
    A remote object also carries its listed ETag and size, checked on every read (``read_range``)."""

    path: str
    offset: int
    size: int
    etag: Optional[str] = None
    object_size: int = -1


# --------------------------------------------------------------------------------------------------- writing
def _dir_fingerprint(root: str) -> str:
    """Changes when a file is added, removed or renamed anywhere under ``root`` (directory mtimes)."""
    h = hashlib.blake2b(digest_size=16)
    for dirpath, dirnames, _ in os.walk(root):
        dirnames.sort()
        h.update(f"{os.path.relpath(dirpath, root)}\0{os.stat(dirpath).st_mtime_ns}\0".encode())
    return h.hexdigest()


def _file_fingerprint(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def tar_index(shards: Sequence[str], locations: Sequence[np.ndarray], root: Optional[str]):
    """(header, arrays) for tar ``shards`` with their image members' :func:`member_locations`.

    Order: shards by name (with the ``/`` that follows it in an id), members by name — the order of the ids
    ``<source>/<shard>/<member>`` that ``list_pool`` sorts by. ``root=None`` stores bare shard names, found in
    the index file's own folder (curation output stays valid when the folder moves), else paths under ``root``.
    """
    order = sorted(range(len(shards)), key=lambda k: os.path.basename(shards[k]) + "/")
    rels = [os.path.basename(shards[k]) if root is None else os.path.relpath(shards[k], root) for k in order]
    blob, start = path_table(rels)
    stats = [os.stat(shards[k]) for k in order]
    idx = [np.full(len(locations[k]), new, dtype=row_dtype(len(rels))) for new, k in enumerate(order)]
    loc = np.concatenate([locations[k] for k in order]) if order else np.zeros((0, 2), dtype=np.int64)
    arrays = {"path_blob": blob, "path_start": start,
              "image_path": np.concatenate(idx) if idx else np.zeros(0, dtype=np.uint32),
              "image_offset": loc[:, 0], "image_size": loc[:, 1],
              "shard_size": np.asarray([st.st_size for st in stats], dtype=np.int64),
              "shard_mtime_ns": np.asarray([st.st_mtime_ns for st in stats], dtype=np.int64)}
    return {"kind": "tar", "root": root, "n_images": len(loc), "n_paths": len(rels)}, arrays


def write_tar_index(path: str, shards: Sequence[str], counts: Sequence[int],
                    locations_of: Callable[[int], np.ndarray], root: Optional[str] = None) -> int:
    """Write :func:`tar_index`'s index of ``shards`` to ``path`` (the same bytes), a shard at a time:
    ``locations_of(k)`` gives shard ``k``'s :func:`member_locations` (``counts[k]`` rows) when its rows are written,
    so the writer holds one shard's members, never the whole pool's (curation's write finish at 10^8 kept images).
    Returns the number of images."""
    order = sorted(range(len(shards)), key=lambda k: os.path.basename(shards[k]) + "/")
    rels = [os.path.basename(shards[k]) if root is None else os.path.relpath(shards[k], root) for k in order]
    blob, start = path_table(rels)
    sizes, mtimes = np.zeros(len(order), np.int64), np.zeros(len(order), np.int64)  # no stat object per shard
    for new, k in enumerate(order):
        st = os.stat(shards[k])
        sizes[new], mtimes[new] = st.st_size, st.st_mtime_ns
    n, rows = int(sum(int(counts[k]) for k in order)), row_dtype(len(rels))
    specs = {"path_blob": (blob.dtype, blob.shape), "path_start": (start.dtype, start.shape),
             "image_path": (rows, (n,)), "image_offset": (np.int64, (n,)), "image_size": (np.int64, (n,)),
             "shard_size": (np.int64, (len(rels),)), "shard_mtime_ns": (np.int64, (len(rels),))}
    header = {"kind": "tar", "root": root, "n_images": n, "n_paths": len(rels)}
    with IndexFile(path, header, specs) as f:
        f.put("path_blob", 0, blob)
        f.put("path_start", 0, start)
        f.put("shard_size", 0, sizes)
        f.put("shard_mtime_ns", 0, mtimes)
        at = 0
        for new, k in enumerate(order):
            loc = np.asarray(locations_of(k), dtype=np.int64).reshape(-1, 2)
            if len(loc) != int(counts[k]):
                raise ValueError(f"{shards[k]}: {len(loc)} member locations, its record says {int(counts[k])}")
            f.put("image_path", at, np.full(len(loc), new, dtype=rows))
            f.put("image_offset", at, loc[:, 0])
            f.put("image_size", at, loc[:, 1])
            at += len(loc)
    return n


def build_index(source: ImageSource):
    """(header, arrays) for one source. Tar shards: one header walk; folders / file lists: one listing."""
    if isinstance(source, RemoteSource):
        return build_remote_index(source)
    if isinstance(source, TarShardSource):
        shards = [os.path.abspath(s) for s in source.shards]
        locations = []
        for shard in shards:
            refs = source._shard_refs(shard, os.path.basename(shard))  # one shard's objects at a time
            prefix = len(source.name) + len(os.path.basename(shard)) + 2
            # Straight to 16 B per image: building holds compact arrays, not an object per image.
            locations.append(member_locations([(r.id[prefix:], r.loc[1], r.loc[2]) for r in refs]))
        return tar_index(shards, locations, root=os.path.commonpath([os.path.dirname(s) for s in shards]))
    refs = sorted(source.refs(), key=lambda r: r.id)
    n = len(refs)
    if isinstance(source, FolderSource):
        root = os.path.abspath(source.root)
        rels = [r.id[len(source.name) + 1:] for r in refs]  # the id is <name>/<path under root>
        header = {"kind": "folder", "root": root, "fingerprint": _dir_fingerprint(root)}
    elif isinstance(source, FileListSource):
        rels, root = [r.loc if storage.is_url(r.loc) else os.path.abspath(r.loc) for r in refs], ""
        header = {"kind": "filelist", "root": root, "list": os.path.abspath(source.list_path),
                  "fingerprint": _file_fingerprint(source.list_path)}
    else:
        raise TypeError(f"cannot index a {type(source).__name__}")
    blob, start = path_table(rels)
    arrays = {"path_blob": blob, "path_start": start, "image_path": np.arange(n, dtype=row_dtype(n)),
              "image_offset": np.zeros(n, dtype=np.int64), "image_size": np.full(n, -1, dtype=np.int64)}
    return {**header, "n_images": n, "n_paths": n}, arrays


# --------------------------------------------------------------------------------------------------- reading
class PoolIndex:
    """One source's index, memory-mapped. Pickles as its file name (workers started by spawn re-map it)."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        try:
            with open(self.path, "rb") as f:
                magic, (hlen,) = f.read(len(MAGIC)), struct.unpack("<Q", f.read(8) or b"\0" * 8)
                if magic != MAGIC:
                    raise PoolIndexError(f"{path} is not a dinopipe pool index")
                self.header = json.loads(f.read(hlen))
            size = os.path.getsize(self.path)
        except (OSError, ValueError, struct.error) as e:
            raise PoolIndexError(f"cannot read pool index {path}: {e}") from None
        if self.header.get("version") != VERSION:
            raise PoolIndexError(f"{path}: index version {self.header.get('version')}, this code reads {VERSION}")
        data_start = align(len(MAGIC) + 8 + hlen)
        # One read-only shared mapping of the whole file; every array is a view of it (no copy, no per-image
        # Python object), so forked workers share its pages with the rank instead of copying them.
        buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.arrays = {}
        for name, m in self.header["arrays"].items():
            dt, shape = np.dtype(m["dtype"]), tuple(m["shape"])
            begin = data_start + m["offset"]
            end = begin + dt.itemsize * int(np.prod(shape))
            if end > size:
                raise PoolIndexError(f"{path} is cut short (array {name} ends at byte {end}, file has {size})")
            self.arrays[name] = buf[begin:end].view(dt).reshape(shape)
        self.n = int(self.header["n_images"])
        if any(len(self.arrays[k]) != self.n for k in ("image_path", "image_offset", "image_size")):
            raise PoolIndexError(f"{path}: per-image arrays do not have {self.n} entries")
        root = self.header.get("root")
        self.root = os.path.dirname(self.path) if root is None else root
        self.remote = bool(self.header.get("remote"))
        if self.remote:  # per path: the listed size and ETag every read is checked against
            self._obj_size, self._etag = self.arrays["shard_size"], self.arrays["shard_etag"]
            self._etag_parts = self.arrays["shard_etag_parts"]
        self._image_path, self._offset = self.arrays["image_path"], self.arrays["image_offset"]
        self._size, self._blob, self._start = self.arrays["image_size"], self.arrays["path_blob"], self.arrays["path_start"]

    def __len__(self) -> int:
        return self.n

    def path_of(self, p: int) -> str:
        rel = bytes(self._blob[self._start[p] : self._start[p + 1]]).decode()
        return storage.join(self.root, rel)

    def paths(self) -> list[str]:
        return [self.path_of(p) for p in range(len(self._start) - 1)]

    def __getitem__(self, i: int) -> Location:
        p = int(self._image_path[i])
        if self.remote:
            etag = storage.etag_unpack(bytes(self._etag[p]), int(self._etag_parts[p]))
            return Location(self.path_of(p), int(self._offset[i]), int(self._size[i]), etag, int(self._obj_size[p]))
        return Location(self.path_of(p), int(self._offset[i]), int(self._size[i]))

    def nbytes_per_image(self) -> float:
        """Bytes of all arrays divided by the number of images (the index's memory cost once fully paged in)."""
        return sum(a.nbytes for a in self.arrays.values()) / max(self.n, 1)

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state) -> None:
        self.__init__(state["path"])

    def matches(self, source: ImageSource, rank: int = 0, world: int = 1) -> Optional[str]:
        """None if this index describes ``source`` as it is on disk now, else why not. With ``world`` > 1 only every
        ``world``-th shard from ``rank`` on is stat'ed (each rank checks its share; the caller combines them)."""
        h = self.header
        if isinstance(source, RemoteSource):
            return remote_matches(self, source)
        if isinstance(source, TarShardSource):
            if h["kind"] != "tar":
                return f"it indexes a {h['kind']}, not tar shards"
            want = sorted((os.path.abspath(s) for s in source.shards), key=lambda s: os.path.basename(s) + "/")
            if self.paths() != want:
                return "the set of shards differs"
            share = slice(rank, None, max(1, world))
            try:
                stats = [os.stat(s) for s in want[share]]
            except OSError as e:
                return f"a shard cannot be read: {e}"
            if (not np.array_equal([st.st_size for st in stats], self.arrays["shard_size"][share])
                    or not np.array_equal([st.st_mtime_ns for st in stats], self.arrays["shard_mtime_ns"][share])):
                return "a shard changed since the index was written (size or mtime)"
            return None
        if isinstance(source, FolderSource):
            if h["kind"] != "folder" or h["root"] != os.path.abspath(source.root):
                return "it indexes another folder"
            return None if h["fingerprint"] == _dir_fingerprint(h["root"]) else "files were added or removed"
        if isinstance(source, FileListSource):
            if h["kind"] != "filelist" or h["list"] != os.path.abspath(source.list_path):
                return "it indexes another file list"
            return None if h["fingerprint"] == _file_fingerprint(source.list_path) else "the file list changed"
        return f"cannot index a {type(source).__name__}"


class Pool:
    """The training pool: sources' indexes concatenated in id order. ``pool[i]`` -> Location, ``pool.read(loc)``.

    ``read`` keeps up to ``max_open`` (256) shards open per process (least recently used closed first) and reads
    members with ``os.pread``: one open per shard per data worker instead of one per sample, and no shared
    file offset between forked processes. Files of folders / file lists (one image each) are opened per read."""

    max_open = 256  # per process; well under the usual 1024 open files of a process

    def __init__(self, parts: Sequence[PoolIndex]) -> None:
        self.parts = list(parts)
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self._fds: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> Location:
        if not 0 <= i < len(self):
            raise IndexError(f"image {i} of a pool of {len(self)}")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k][i - int(self.starts[k])]

    def __getstate__(self):
        return {"parts": self.parts}

    def __setstate__(self, state) -> None:
        self.__init__(state["parts"])

    def _fd(self, path: str) -> int:
        if self._pid != os.getpid():  # a forked worker: its parent's descriptors are not its own to manage
            self._fds, self._pid = collections.OrderedDict(), os.getpid()
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        fd = os.open(path, os.O_RDONLY)
        self._fds[path] = fd
        while len(self._fds) > self.max_open:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def read(self, loc: Location) -> Optional[bytes]:
        if loc.offset < 0:
            return None  # the placeholder of a damaged shard: counted as unreadable
        if storage.is_url(loc.path):  # ranged GET, retried; raises storage.Unreadable with its reason
            return storage.read_range(loc.path, loc.offset, loc.size, etag=loc.etag,
                                      object_size=loc.object_size if loc.object_size >= 0 else None)
        try:
            if loc.size < 0:
                with open(loc.path, "rb") as f:
                    return f.read()
            return os.pread(self._fd(loc.path), loc.size, loc.offset)  # short read: decodes as 'truncated'
        except OSError:
            self.close_files()  # a shard replaced under us: reopen next time
            return None

    def close_files(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fds = collections.OrderedDict()

    def nbytes_per_image(self) -> float:
        return sum(sum(a.nbytes for a in p.arrays.values()) for p in self.parts) / max(len(self), 1)


# ------------------------------------------------------------------------------------------- find or build
def curation_index_path(source: TarShardSource) -> Optional[str]:
    dirs = {os.path.dirname(os.path.abspath(s)) for s in source.shards}
    return os.path.join(dirs.pop(), INDEX_NAME) if len(dirs) == 1 else None


class Ranks(NamedTuple):
    """How the processes of a run open the pool together (the train layer fills it from its process group):
    ``any_rank(flag)`` is True on every rank when it is True on one; ``barrier()`` waits for every rank."""

    rank: int = 0
    world: int = 1
    any_rank: Optional[Callable[[bool], bool]] = None
    barrier: Optional[Callable[[], None]] = None

    @property
    def collective(self) -> bool:
        return self.world > 1 and self.any_rank is not None and self.barrier is not None


def _try_open(path: Optional[str], source: ImageSource, warn: bool, ranks: Ranks = Ranks()) -> Optional[PoolIndex]:
    """The index at ``path`` if it describes ``source``. Collectively, each rank stats only its share of the
    shards (O(shards / W) per rank) and one all-reduce makes every rank take the same decision."""
    idx, why = None, "missing"
    if path is not None and os.path.exists(path):
        try:
            idx = PoolIndex(path)
            why = idx.matches(source, ranks.rank, ranks.world) if ranks.collective else idx.matches(source)
        except (PoolIndexError, KeyError, OSError) as e:
            why = str(e)
    if ranks.collective and ranks.any_rank(why is not None) and why is None:
        why = "another rank found it out of date"
    if why is None:
        return idx
    if warn and why != "missing":
        import warnings

        warnings.warn(f"pool index {path} is not used: {why}; building one for this run", stacklevel=3)
    return None


def write_source_index(source: ImageSource, path: str, walked: Optional[dict] = None) -> PoolIndex:
    header, arrays = build_remote_index(source, walked) if walked is not None else build_index(source)
    write_index(path, header, arrays)
    return PoolIndex(path)


def _cached_index(source: ImageSource, cache_dir: str, ranks: Ranks = Ranks()) -> PoolIndex:
    """The run directory's index of ``source``: map it if valid, else build it once. Collectively rank 0 builds
    it while the others wait on the process group (no file lock needed); alone, under a file lock where the
    filesystem has one."""
    spec = ([source.url] if isinstance(source, RemoteSource) else source.shards if isinstance(source, TarShardSource)
            else [source.list_path, source.root] if isinstance(source, FileListSource) else [source.root])
    spec = [s if storage.is_url(s) else os.path.abspath(s) for s in spec]
    key = hashlib.blake2b(json.dumps([type(source).__name__, spec]).encode(), digest_size=6).hexdigest()
    path = os.path.join(cache_dir, f"{source.name}-{key}.bin")
    idx = _try_open(path, source, warn=False, ranks=ranks)
    if idx is not None:
        return idx  # the common case for every rerun: no lock, no build
    os.makedirs(cache_dir, exist_ok=True)
    if ranks.collective:
        failed, walked = None, None
        if isinstance(source, RemoteSource) and source.kind == "tar":  # the header walk, split over the ranks
            failed, walked = walk_split(source, path, ranks)
            if failed is not None:
                raise failed
        if ranks.rank == 0:
            try:
                write_source_index(source, path, walked)
            except Exception as e:  # still reach the barrier, so the others do not wait forever
                failed = e
        ranks.barrier()
        if ranks.any_rank(failed is not None):
            raise failed if failed is not None else PoolIndexError(f"rank 0 could not build the pool index {path}")
        return PoolIndex(path)
    with open(path + ".lock", "a") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)  # other processes of a run without a process group wait here
        except (ImportError, OSError):
            pass  # no locking on this filesystem: each process builds and renames atomically, same bytes
        idx = _try_open(path, source, warn=False)
        return idx if idx is not None else write_source_index(source, path)


def open_pool(paths: Sequence[str | os.PathLike], cache_dir: str, ranks: Ranks = Ranks()) -> Pool:
    """Open the training pool of ``paths`` (folders, file lists, tar shards / globs) through compact indexes.

    ``ranks``: the run's processes open it together (validation split over ranks, rank 0 builds a missing index);
    every rank must call this with the same paths. Raises FileNotFoundError / ValueError for a missing path or an
    empty pool (callers turn them into config errors).
    """
    sources = [open_source(p) for p in paths]
    names = [s.name for s in sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"two input sources share the name(s) {dup}; image ids would collide")
    created = [d for d in (os.path.dirname(os.path.abspath(cache_dir)), cache_dir) if not os.path.exists(d)]
    parts = []
    for source in sorted(sources, key=lambda s: s.name + "/"):  # id order: ids start with '<name>/'
        idx = None
        if isinstance(source, TarShardSource):
            idx = _try_open(curation_index_path(source), source, warn=True, ranks=ranks)
        parts.append(idx if idx is not None else _cached_index(source, cache_dir, ranks))
    pool = Pool(parts)
    if len(pool) == 0:
        for d in reversed(created):  # an empty pool is a config error: leave no run directory behind
            shutil.rmtree(d, ignore_errors=True)
        raise ValueError(f"no images found in {[str(p) for p in paths]}")
    return pool


def main(argv=None) -> int:
    """``python -m dinopipe.data.pool_index PATH``: print an index's header and its size per image."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("index")
    idx = PoolIndex(p.parse_args(argv).index)
    head = {k: v for k, v in idx.header.items() if k != "arrays"}
    print(json.dumps({**head, "bytes_per_image": round(idx.nbytes_per_image(), 2)}, indent=1))
    return 0


__all__ = ["Location", "Pool", "Ranks", "PoolIndex", "PoolIndexError", "INDEX_NAME", "open_pool", "build_index",
           "member_locations", "tar_index", "write_index", "write_source_index"]

if __name__ == "__main__":
    raise SystemExit(main())
