"""Image sources: recursive folders, file lists and (uncompressed) webdataset tar shards.

Every image gets a stable id, ``<source name>/<path inside the source>``:
folder ``photos`` holding ``a/b.jpg`` gives ``photos/a/b.jpg``; tar shard ``pool-000.tar`` of
source ``web`` holding member ``000123.jpg`` gives ``web/pool-000.tar/000123.jpg``. Ids never
depend on the machine (absolute paths) or on how the pool was split, so outputs of different
Slurm array tasks and of reruns line up.

A source first *lists* lightweight references (cheap: directory walks, tar headers) and reads bytes
only on demand, which gives random access for a map-style DataLoader and lets the writer re-read
the original bytes of selected images by id. Tar members are read by offset, so shards must be
uncompressed ``.tar`` (the webdataset convention); compressed shards are refused with a hint.
"""

from __future__ import annotations

import hashlib
import os
import time
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Sequence

from ..utils import storage
from .reflist import ConcatRefs, PathRefs, collect_paths
from .reflist import under_root as _under

IMAGE_EXTENSIONS = frozenset(
    {"jpg", "jpeg", "png", "bmp", "gif", "tif", "tiff", "webp", "ppm", "pgm", "pbm", "jp2", "npy"}
)


class Sample(NamedTuple):
    """One image as read from a source; ``data`` is None when the bytes could not be read."""

    id: str
    data: bytes | None
    source: str


@dataclass(frozen=True)
class ImageRef:
    """Where one image lives, without its bytes. ``loc`` is a path, or (shard path, offset, size)."""

    id: str
    source: str
    loc: object

    @property
    def ext(self) -> str:
        return extension_of(self.id)


def extension_of(name: str) -> str:
    """Lower-case extension without the dot ('' when there is none)."""
    base = name.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[-1].lower() if "." in base else ""


def stable_hash(text: str) -> int:
    """A hash that is the same in every process and Python version (unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def in_split(key: str, task_index: int, num_tasks: int) -> bool:
    """True if ``key`` belongs to task ``task_index`` of ``num_tasks`` (stable hash split)."""
    check_split(task_index, num_tasks)
    return num_tasks == 1 or stable_hash(key) % num_tasks == task_index


def check_split(task_index: int, num_tasks: int) -> None:
    if num_tasks < 1 or not 0 <= task_index < num_tasks:
        raise ValueError(
            f"task_index={task_index}, num_tasks={num_tasks}: need num_tasks >= 1 and "
            f"0 <= task_index < num_tasks (for a Slurm array use SLURM_ARRAY_TASK_ID and "
            f"SLURM_ARRAY_TASK_COUNT)"
        )


def _read_file(path: str) -> bytes | None:
    if storage.is_url(path):  # a file list of URLs: one whole-object GET, retried and counted
        try:
            return storage.read_range(path, 0, -1)
        except storage.Unreadable:
            return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


class ImageSource:
    """Base class. Subclasses implement :meth:`refs` and :meth:`read`."""

    name: str

    def refs(self, task_index: int = 0, num_tasks: int = 1) -> list[ImageRef]:
        raise NotImplementedError

    def read(self, ref: ImageRef) -> bytes | None:
        raise NotImplementedError

    def iter_refs(self) -> Iterator[ImageRef]:
        """All refs one at a time, for a pass that keeps few of them (the descriptor's sample): file lists and
        shards are read as they stream, not listed whole; a path a file list names twice may come twice."""
        yield from self.refs()

    def ref_seq(self, task_index: int = 0, num_tasks: int = 1) -> Sequence[ImageRef]:
        """:meth:`refs` as an indexable sequence; a source with a compact form (a file list) overrides it."""
        return self.refs(task_index, num_tasks)

    def __iter__(self) -> Iterator[Sample]:
        return self.samples()

    def samples(self, task_index: int = 0, num_tasks: int = 1) -> Iterator[Sample]:
        for ref in self.refs(task_index, num_tasks):
            yield Sample(ref.id, self.read(ref), self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FolderSource(ImageSource):
    """All image files under ``root`` (recursive, sorted, symlinked dirs not followed).

    Files are recognised by extension (case-insensitive); other files are not images and are
    ignored. The split over tasks is per file.
    """

    def __init__(self, root: str | os.PathLike, name: str | None = None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder {self.root} does not exist or is not a folder")
        self.name = name or self.root.resolve().name

    def refs(self, task_index: int = 0, num_tasks: int = 1) -> list[ImageRef]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel_dir = os.path.relpath(dirpath, self.root)
            for fn in sorted(filenames):
                if extension_of(fn) not in IMAGE_EXTENSIONS:
                    continue
                rel = fn if rel_dir == "." else f"{rel_dir}/{fn}".replace(os.sep, "/")
                image_id = f"{self.name}/{rel}"
                if in_split(image_id, task_index, num_tasks):
                    out.append(ImageRef(image_id, self.name, os.path.join(dirpath, fn)))
        out.sort(key=lambda r: r.id)  # walk order puts a folder's files before its subfolders'
        return out

    def read(self, ref: ImageRef) -> bytes | None:
        return _read_file(ref.loc)


class FileListSource(ImageSource):
    """A text file with one image path per line (blank lines and ``#`` comments skipped).

    Relative paths are relative to ``root`` (default: the list file's folder). A listed file that
    is missing is *not* dropped: it becomes a sample without bytes, counted as unreadable.
    The id is ``<name>/<path as written in the list>``.
    """

    def __init__(self, list_path: str | os.PathLike, name: str | None = None,
                 root: str | os.PathLike | None = None):
        self.list_path = Path(list_path)
        if not self.list_path.is_file():
            raise FileNotFoundError(f"file list {self.list_path} does not exist")
        self.root = Path(root) if root is not None else self.list_path.parent
        self.name = name or self.list_path.stem

    def refs(self, task_index: int = 0, num_tasks: int = 1) -> list[ImageRef]:
        """This task's images, in list order (see :meth:`ref_seq`; this is the same as a list)."""
        return list(self.ref_seq(task_index, num_tasks))

    def ref_seq(self, task_index: int = 0, num_tasks: int = 1) -> PathRefs:
        """This task's images, in list order, as arrays (:class:`~dinopipe.data.reflist.PathRefs`, ~50 B per
        40-byte path, not ~420 B per ImageRef). The list is streamed and a line kept only when its id hashes to
        this task: nothing is held per line of the whole list. A path listed twice is one image: both copies hash
        to the same task (a hash partition), so the task's own rows find it."""
        check_split(task_index, num_tasks)

        def own():
            for path in self._paths():
                key = stable_hash(f"{self.name}/{path.lstrip('/')}")
                if num_tasks == 1 or key % num_tasks == task_index:
                    yield path, key

        blob, ends, starts = collect_paths(own())
        return PathRefs(blob, ends, self.name, str(self.root), ImageRef, storage.is_url, starts)

    def iter_refs(self) -> Iterator[ImageRef]:
        for path in self._paths():
            full = path if os.path.isabs(path) or storage.is_url(path) else _under(self.root, path)
            yield ImageRef(f"{self.name}/{path.lstrip('/')}", self.name, full)

    def _paths(self) -> Iterator[str]:
        """The listed paths, a line at a time (blank lines and # comments skipped)."""
        with open(self.list_path, encoding="utf-8") as f:
            for line in f:
                path = line.strip()
                if path and not path.startswith("#"):
                    yield path

    def read(self, ref: ImageRef) -> bytes | None:
        return _read_file(ref.loc)


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
        out = []
        for shard in self.shards:
            shard_name = Path(shard).name
            if not in_split(f"{self.name}/{shard_name}", task_index, num_tasks):
                continue
            out.extend(self._shard_refs(shard, shard_name))
        return out

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
            self.listing = shards if len(shards) else storage.list_prefix(self.url, recursive=True)
            if self.kind == "folder":
                images = storage.Listing(self.url)
                for i in range(len(self.listing)):
                    if extension_of(self.listing.name(i)) in IMAGE_EXTENSIONS:
                        images.add(self.listing.name(i), self.listing.size_of(i), self.listing.etag_of(i))
                self.listing = images
            if not len(self.listing):
                raise FileNotFoundError(f"no .tar shards or images found under {url}")
        self.name = name or self.root.rstrip("/").rsplit("/", 1)[-1] or "shards"

    def __len__(self) -> int:
        return len(self.listing)  # shards (kind 'tar') or images (kind 'folder'); no per-object Python list kept

    def walk(self, i: int) -> tuple[list[ImageRef], TarWalk]:
        """Shard ``i``'s image members (TarShardSource's rules: damage and refused members are placeholders);
        a walk cut by a transient error (a dropped connection, throttling) is retried and counted."""
        url, size = storage.join(self.root, self.listing.name(i)), self.listing.size_of(i)
        fs, path = storage.filesystem(url)
        policy = storage.RetryPolicy.from_env()
        for attempt in range(policy.attempts):
            walk = TarWalk(url, size=size, open_fn=lambda: fs.open(path, "rb", block_size=1 << 20,
                                                                  cache_type="readahead"))
            refs = _walk_refs(self, walk, i)
            kind, transient = storage.classify(walk.exc) if walk.exc is not None else ("", False)
            if not transient:
                return refs, walk
            storage.count(f"retry/{kind}")
            time.sleep(policy.wait(attempt))
        return refs, walk

    def refs(self, task_index: int = 0, num_tasks: int = 1) -> list[ImageRef]:
        out = []
        for i in range(len(self.listing)):
            rel = self.listing.name(i)
            if self.kind == "folder":
                image_id = f"{self.name}/{rel}"
                if in_split(image_id, task_index, num_tasks):
                    out.append(ImageRef(image_id, self.name, (storage.join(self.root, rel), 0, -1, None, -1)))
            elif in_split(f"{self.name}/{rel}", task_index, num_tasks):
                out.extend(self.walk(i)[0])
        out.sort(key=lambda r: r.id)
        return out

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


def _walk_refs(source: RemoteSource, walk: TarWalk, i: int) -> list[ImageRef]:
    url, shard_name = walk.shard, source.listing.name(i)
    etag, size = source.listing.etag_of(i), source.listing.size_of(i)
    out = []
    for member in walk:
        if extension_of(member.name) in IMAGE_EXTENSIONS:
            out.append(ImageRef(f"{source.name}/{shard_name}/{member.name}", source.name,
                                (url, member.offset_data, member.size, etag, size)))
    if walk.error or walk.cut_off:
        out.append(ImageRef(f"{source.name}/{shard_name}/#damaged-after-{len(out)}-images", source.name,
                            (url, -1, 0, None, -1)))
        _warn(f"tar shard {url} is damaged after {len(out) - 1} images "
              f"({walk.error or 'the object is cut off'})")
    for k, (_, why) in enumerate((n, w) for n, w in walk.refused if extension_of(n) in IMAGE_EXTENSIONS):
        out.append(ImageRef(f"{source.name}/{shard_name}/#refused-{why}-{k}", source.name, (url, -1, 0, None, -1)))
    return out


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


def _warn(msg: str) -> None:
    import warnings

    warnings.warn(msg, stacklevel=3)


def open_source(spec: str | os.PathLike | ImageSource, name: str | None = None) -> ImageSource:
    """Guess the source kind from a path: folder, ``.tar`` / glob of shards, or a file list.

    A folder holding ``.tar`` files and no images is treated as a shard folder.
    """
    if isinstance(spec, ImageSource):
        return spec
    if storage.is_url(spec):
        return RemoteSource(spec, name=name)
    s = str(spec)
    if any(c in s for c in "*?[") or s.endswith(".tar"):
        return TarShardSource(s, name=name)
    p = Path(s)
    if p.is_dir():
        has_tar = any(p.glob("*.tar"))
        has_img = any(extension_of(f.name) in IMAGE_EXTENSIONS for f in p.rglob("*") if f.is_file())
        if has_tar and not has_img:
            return TarShardSource(p, name=name or p.resolve().name)
        return FolderSource(p, name=name)
    if p.is_file():
        return FileListSource(p, name=name)
    raise FileNotFoundError(
        f"input {s!r} is not a folder, a .tar shard (or glob of shards) or a file list"
    )


class MultiSource(ImageSource):
    """Several sources at once; ids stay unique because they start with each source's name."""

    def __init__(self, sources: Iterable[str | os.PathLike | ImageSource]):
        self.sources = [open_source(s) for s in sources]
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(
                f"two input sources share the name(s) {dup}; ids would collide. Give each a "
                f"distinct name (e.g. FolderSource(path, name='...'))"
            )
        self.by_name = {s.name: s for s in self.sources}
        self.name = "+".join(names)

    def refs(self, task_index: int = 0, num_tasks: int = 1) -> list[ImageRef]:
        return [r for s in self.sources for r in s.refs(task_index, num_tasks)]

    def iter_refs(self) -> Iterator[ImageRef]:
        for s in self.sources:
            yield from s.iter_refs()

    def ref_seq(self, task_index: int = 0, num_tasks: int = 1) -> ConcatRefs:
        """:meth:`refs` as an indexable sequence that keeps each source's compact form (a file list's rows as
        arrays); the others' refs are lists."""
        return ConcatRefs([s.ref_seq(task_index, num_tasks) for s in self.sources])

    def read(self, ref: ImageRef) -> bytes | None:
        return self.by_name[ref.source].read(ref)

    def ref_index(self) -> dict[str, ImageRef]:
        """id -> ref over the whole pool, to re-read selected images by id."""
        return {r.id: r for r in self.refs()}


def as_multi(sources) -> MultiSource:
    """Accept one source/path, a list of them, or a MultiSource."""
    if isinstance(sources, MultiSource):
        return sources
    if isinstance(sources, (str, os.PathLike, ImageSource)):
        sources = [sources]
    return MultiSource(sources)
