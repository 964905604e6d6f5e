"""Tar shards as image sources: :class:`TarShardSource` (webdataset shards on disk), :class:`RemoteSource` (shards,
image folders and single objects in object storage, read by ranged GETs) and :class:`TarWalk`, the one tar walker
(training pool, curation sources, eval shards), which refuses links and unsafe member names.

Members are read by offset, so shards must be uncompressed ``.tar`` (the webdataset convention); compressed shards
are refused with a hint."""

from __future__ import annotations

import functools
import os
import tarfile
from pathlib import Path
from typing import Iterator, Sequence

from ..utils import storage
from .reflist import MemberCollector, MemberRefs
from .source_base import IMAGE_EXTENSIONS, ImageRef, ImageSource, _warn, extension_of, in_split, own_path_refs


class TarShardSource(ImageSource):
    """Webdataset-style tar shards: members with an image extension are images.

    ``shards`` are paths, folders (all ``*.tar`` inside, sorted) or glob patterns. Companion
    members (``.json``, ``.cls`` ...) are ignored. The split over tasks is per *shard*, so an
    array task only opens its own shards. A shard that is cut short yields the images before the
    damage plus one unreadable placeholder sample, so the loss is counted, not silent.
    """

    def __init__(self, shards: str | os.PathLike | Sequence[str | os.PathLike],
                 name: str | None = None):
        self.shards = _expand_shards(shards)
        if not self.shards:
            raise FileNotFoundError(f"no .tar shards found for {shards!r}")
        for p in self.shards:
            if str(p).endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")):
                raise ValueError(
                    f"{p}: compressed tar shards cannot be read by offset; decompress them "
                    f"(e.g. `gunzip`) — webdataset shards are normally plain .tar"
                )
        self.name = name or Path(self.shards[0]).parent.name or "shards"

    def refs(self, task_index: int = 0, num_tasks: int = 1) -> list[ImageRef]:
        return list(self.ref_seq(task_index, num_tasks))

    def ref_seq(self, task_index: int = 0, num_tasks: int = 1) -> MemberRefs:
        """This task's shards' images (the split is per shard), in shard and member order, as arrays
        (:class:`~dinopipe.data.reflist.MemberRefs`): a shard's ImageRefs are made while it is walked, then dropped."""
        out = MemberCollector(self.name, ImageRef)
        for shard in self.shards:
            shard_name = Path(shard).name
            if in_split(f"{self.name}/{shard_name}", task_index, num_tasks):
                out.add(shard_name, shard, self._shard_refs(shard, shard_name))
        return out.done()

    def iter_refs(self) -> Iterator[ImageRef]:
        for shard in self.shards:  # a shard's refs at a time
            yield from self._shard_refs(shard, Path(shard).name)

    def _shard_refs(self, shard: str, shard_name: str) -> list[ImageRef]:
        out, walk = [], TarWalk(shard)
        for member in walk:
            if extension_of(member.name) in IMAGE_EXTENSIONS:
                image_id = f"{self.name}/{shard_name}/{member.name}"
                out.append(ImageRef(image_id, self.name, (shard, member.offset_data, member.size)))
        problem = walk.error or ("the file is cut off" if walk.cut_off else None)
        if problem:
            # Keep what was listed and add one placeholder so the damage shows in the manifest
            # (the images after the damage cannot be counted: their headers are gone).
            bad_id = f"{self.name}/{shard_name}/#damaged-after-{len(out)}-images"
            out.append(ImageRef(bad_id, self.name, (shard, -1, 0)))
            _warn(f"tar shard {shard} is damaged after {len(out) - 1} images ({problem}); "
                  f"re-create or re-download it")
        refused = [(n, why) for n, why in walk.refused if extension_of(n) in IMAGE_EXTENSIONS]
        for k, (member_name, why) in enumerate(refused):  # counted as unreadable, under an id of our making
            out.append(ImageRef(f"{self.name}/{shard_name}/#refused-{why}-{k}", self.name, (shard, -1, 0)))
        if refused:
            _warn(f"tar shard {shard}: {len(refused)} image member(s) refused, never read "
                  f"({', '.join(sorted({why for _, why in refused}))}; e.g. {refused[0][0]!r})")
        return out

    def read(self, ref: ImageRef) -> bytes | None:
        shard, offset, size = ref.loc
        if offset < 0:
            return None
        try:
            with open(shard, "rb") as f:
                f.seek(offset)
                data = f.read(size)
            return data  # a short read decodes as 'truncated', which is what it is
        except OSError:
            return None


LINK = "link"  # a symbolic or hard link member: never followed
UNSAFE_NAME = "unsafe_name"  # an absolute name or one with '..' components


def member_refusal(member: tarfile.TarInfo) -> str | None:
    """Why a tar member must not be read (None when it may)."""
    if member.issym() or member.islnk():
        return LINK
    name = member.name.replace("\\", "/")
    if name.startswith("/") or ".." in name.split("/") or "\x00" in name or (len(name) > 1 and name[1] == ":"):
        return UNSAFE_NAME
    return None


class TarWalk:
    """The regular-file members of one uncompressed tar shard, reading headers only (iterating a tarfile
    seeks over the data), each with ``offset_data`` and ``size`` for reading it later by offset. The one
    tar walker of the package (training pool, curation sources, labelled eval shards).

    A damaged shard does not raise: the walk stops at the damage and says so — ``error`` (the tarfile or
    OS error's text) or ``cut_off`` (a member's data runs past the end of the file, which tarfile itself
    treats as a normal end). ``read(member)`` returns a small member's bytes during the walk (labels).

    Nothing is ever extracted (members are read by offset from the shard itself), and a member that is a
    symbolic or hard link, or whose name is absolute or climbs out with ``..``, is not yielded at all: it is
    listed in ``refused`` with the reason (``link`` | ``unsafe_name``), so a crafted shard can neither point
    a reader at another file nor make an id that aliases another source's."""

    def __init__(self, shard: str, size: int | None = None, open_fn=None) -> None:
        self.shard = shard
        self.size, self.open_fn = size, open_fn  # a remote shard: its listed size and a seekable file opener
        self.exc: BaseException | None = None  # the error behind ``error`` (the remote walk retries transient ones)
        self.error: str | None = None
        self.cut_off = False
        self.refused: list[tuple[str, str]] = []  # (member name, reason): links and unsafe names, never read
        self._tar: tarfile.TarFile | None = None

    def __iter__(self) -> Iterator[tarfile.TarInfo]:
        self.refused = []
        try:
            size = os.path.getsize(self.shard) if self.size is None else self.size
            opened = (tarfile.open(self.shard, mode="r:") if self.open_fn is None
                      else tarfile.open(fileobj=self.open_fn(), mode="r:"))
            with opened as self._tar:
                for member in self._tar:
                    self.cut_off |= member.offset_data + member.size > size
                    reason = member_refusal(member)
                    if reason:
                        self.refused.append((member.name, reason))
                    elif member.isfile():
                        yield member
        except Exception as e:  # noqa: BLE001 - tar, OS and (remote) client errors all end the walk, named
            if not isinstance(e, (tarfile.TarError, OSError)) and self.open_fn is None:
                raise
            self.error, self.exc = str(e) or type(e).__name__, e
        finally:
            self._tar = None

    def read(self, member: tarfile.TarInfo) -> bytes | None:
        """The member's bytes (during the walk); None, with ``error`` set, when they cannot be read."""
        try:
            f = self._tar.extractfile(member) if self._tar is not None else None
            return None if f is None else f.read()
        except (tarfile.TarError, OSError) as e:
            self.error = self.error or str(e) or type(e).__name__
            return None


class RemoteSource(ImageSource):
    """Images in object storage (``s3://bucket/prefix``, ``gs://...``, any fsspec URL), streamed, never copied.

    A URL ending in ``.tar`` is one shard; a prefix whose direct children include ``.tar`` objects is a shard
    folder (the children that end in ``.tar``); any other prefix is a folder of images (recursive). The listing
    is paged into arrays (:func:`~dinopipe.utils.storage.list_prefix`) with each object's size and ETag. Ids are
    those of the same data on disk (``<name>/<shard>/<member>``, ``<name>/<path under the prefix>``; ``name``:
    the prefix's last component), so a pool decides and trains the same from a bucket as from a folder.
    Shards are walked by their headers through ranged reads; members are read with ``If-Match`` on the listed
    ETag (:func:`~dinopipe.utils.storage.read_range`), so a shard replaced after the listing is caught.
    """

    def __init__(self, url: str, name: str | None = None) -> None:
        self.url = url.rstrip("/")
        if self.url.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")):
            raise ValueError(f"{url}: compressed tar shards cannot be read by offset; decompress them")
        if self.url.lower().endswith(".tar"):
            parent, _, base = self.url.rpartition("/")
            listing = storage.list_prefix(parent, recursive=False, suffixes=(".tar",))
            keep = [i for i in range(len(listing)) if listing.name(i) == base]
            if not keep:
                raise FileNotFoundError(f"tar shard {url} does not exist")
            self.root, self.kind = parent, "tar"
            self.listing = storage.Listing(parent)
            self.listing.add(base, listing.size_of(keep[0]), listing.etag_of(keep[0]))
        else:
            shards = storage.list_prefix(self.url, recursive=False, suffixes=(".tar",))
            self.root, self.kind = self.url, "tar" if len(shards) else "folder"
            if len(shards):
                self.listing = shards
            elif next(self._images(), None) is None:  # a folder of images: listed whole only when asked (listing)
                raise FileNotFoundError(f"no .tar shards or images found under {url}")
        self.name = name or self.root.rstrip("/").rsplit("/", 1)[-1] or "shards"

    @functools.cached_property
    def listing(self) -> storage.Listing:
        """The shards (set when opened) or a folder's images, the latter listed whole on first use (its length,
        the training pool index); a curation task lists only its own images (:meth:`ref_seq`)."""
        listing = storage.Listing(self.url)
        for rel, size, etag in self._images():
            listing.add(rel, size, etag)
        return listing

    def _images(self) -> Iterator[tuple[str, int, str | None]]:
        """(name under the prefix, size, ETag) of every image under the prefix, streamed a page at a time."""
        return ((rel, size, etag) for rel, size, etag in storage.iter_prefix(self.url, recursive=True)
                if extension_of(rel) in IMAGE_EXTENSIONS)

    def __len__(self) -> int:
        return len(self.listing)  # shards (kind 'tar') or images (kind 'folder'); no per-object Python list kept

    def walk(self, i: int) -> tuple[list[ImageRef], TarWalk]:
        """Shard ``i``'s image members (TarShardSource's rules: damage and refused members are placeholders).

        A walk cut by a transient error (a dropped or reset connection, throttling, a 5xx) is retried for the store's
        budget and counted, then raises StoreUnavailable: a transient failure is never turned into a
        ``#damaged-after-N`` placeholder (which the pool index would keep). A tar error is damage only when a second
        walk stops at the same member with the same error: a body cut by the network stops somewhere else or not at
        all (the tar reader sees a short read as a broken tar)."""
        url, size = storage.join(self.root, self.listing.name(i)), self.listing.size_of(i)
        fs, path = storage.filesystem(url)
        last: list = [None]

        def once() -> tuple[list[ImageRef], TarWalk]:
            walk = TarWalk(url, size=size, open_fn=lambda: fs.open(path, "rb", block_size=1 << 20,
                                                                  cache_type="readahead"))
            refs = _walk_refs(self, walk, i, mark_damage=False)
            if isinstance(walk.exc, tarfile.TarError):
                seen, last[0] = last[0], (walk.error, len(refs))
                if seen != last[0]:
                    raise _CutBody(walk.error)  # not yet shown to be the object's own bytes: walk again
            elif walk.exc is not None:
                kind, transient = storage.classify(walk.exc)
                if transient or kind in storage.REFUSED_KINDS:
                    raise walk.exc  # retried (or refused) by retry_transient, never persisted
            _mark_damage(self, walk, refs)
            return refs, walk

        return storage.retry_transient(once, url)
    def refs(self, task_index: int = 0, num_tasks: int = 1) -> list[ImageRef]:
        return list(self.ref_seq(task_index, num_tasks))

    def ref_seq(self, task_index: int = 0, num_tasks: int = 1) -> Sequence[ImageRef]:
        """This task's images, sorted by id, as arrays (no task holds the whole listing, nor an ImageRef per own
        image). A folder of images: the listing streamed a page at a time and an image kept only when its id hashes
        to this task; the key order is the id order. Shards (split per shard): each own shard walked, its refs
        sorted, put in :class:`~dinopipe.data.reflist.MemberRefs`; the shards taken in the order of ``<name>/``,
        so the rows are in id order."""
        if self.kind == "folder":
            return own_path_refs(self.name, self.root, (rel for rel, _, _ in self._images()), task_index, num_tasks)
        out = MemberCollector(self.name, ImageRef)
        own = [i for i in range(len(self.listing)) if in_split(f"{self.name}/{self.listing.name(i)}", task_index,
                                                                num_tasks)]
        for i in sorted(own, key=lambda i: self.listing.name(i) + "/"):
            url = storage.join(self.root, self.listing.name(i))
            out.add(self.listing.name(i), (url, self.listing.etag_of(i), self.listing.size_of(i)),
                    sorted(self.walk(i)[0], key=lambda r: r.id))
        return out.done()

    def read(self, ref: ImageRef) -> bytes | None:
        # A ref rebuilt from a curation path table carries (url, offset, size) or the url alone: no ETag check then.
        loc = (ref.loc, 0, -1) if isinstance(ref.loc, str) else tuple(ref.loc)
        url, offset, size, etag, object_size = (*loc, None, -1)[:5] if len(loc) == 3 else loc
        if offset < 0 and isinstance(ref.loc, str):
            offset, size = 0, -1
        if offset < 0:
            return None
        try:
            return storage.read_range(url, offset, size, etag=etag, object_size=object_size if object_size >= 0
                                      else None)
        except storage.Unreadable:
            return None


class _CutBody(ConnectionError):
    """A remote tar walk that stopped on a tar error not seen at the same place before: retried like a dropped
    connection (storage.classify calls a ConnectionError transient)."""


def _walk_refs(source: RemoteSource, walk: TarWalk, i: int, mark_damage: bool = True) -> list[ImageRef]:
    url, shard_name = walk.shard, source.listing.name(i)
    etag, size = source.listing.etag_of(i), source.listing.size_of(i)
    out = []
    for member in walk:
        if extension_of(member.name) in IMAGE_EXTENSIONS:
            out.append(ImageRef(f"{source.name}/{shard_name}/{member.name}", source.name,
                                (url, member.offset_data, member.size, etag, size)))
    if mark_damage:
        _mark_damage(source, walk, out)
    return out


def _mark_damage(source: RemoteSource, walk: TarWalk, out: list[ImageRef]) -> None:
    """Append the placeholders of a walk's damage and refused members to its refs (``out``), in place."""
    url, shard_name = walk.shard, walk.shard.rsplit("/", 1)[-1]
    if walk.error or walk.cut_off:
        out.append(ImageRef(f"{source.name}/{shard_name}/#damaged-after-{len(out)}-images", source.name,
                            (url, -1, 0, None, -1)))
        _warn(f"tar shard {url} is damaged after {len(out) - 1} images "
              f"({walk.error or 'the object is cut off'})")
    for k, (_, why) in enumerate((n, w) for n, w in walk.refused if extension_of(n) in IMAGE_EXTENSIONS):
        out.append(ImageRef(f"{source.name}/{shard_name}/#refused-{why}-{k}", source.name, (url, -1, 0, None, -1)))


def _expand_shards(shards) -> list[str]:
    import glob

    items = [shards] if isinstance(shards, (str, os.PathLike)) else list(shards)
    out = []
    for item in items:
        s = str(item)
        if os.path.isdir(s):
            out.extend(sorted(glob.glob(os.path.join(s, "*.tar"))))
        elif any(c in s for c in "*?["):
            out.extend(sorted(glob.glob(s)))
        else:
            if not os.path.exists(s):
                raise FileNotFoundError(f"tar shard {s} does not exist")
            out.append(s)
    return out
