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
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Sequence

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
        """This task's images, in list order. The list is streamed a line at a time and a line is kept only
        when its id hashes to this task, so a task holds its own rows and nothing per line of the whole list
        (10^9 listed paths are ~100 GB as one set). A path listed twice is one image, not a duplicate to count:
        both copies hash to the same task (a hash partition), so the task's own set of paths finds it."""
        check_split(task_index, num_tasks)
        out, seen = [], set()
        with open(self.list_path, encoding="utf-8") as f:
            for line in f:
                path = line.strip()
                if not path or path.startswith("#"):
                    continue
                image_id = f"{self.name}/{path.lstrip('/')}"
                if num_tasks > 1 and stable_hash(image_id) % num_tasks != task_index:
                    continue
                if path in seen:
                    continue
                seen.add(path)
                out.append(ImageRef(image_id, self.name, path if os.path.isabs(path) else str(self.root / path)))
        return out

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

    def __init__(self, shard: str) -> None:
        self.shard = shard
        self.error: str | None = None
        self.cut_off = False
        self.refused: list[tuple[str, str]] = []  # (member name, reason): links and unsafe names, never read
        self._tar: tarfile.TarFile | None = None

    def __iter__(self) -> Iterator[tarfile.TarInfo]:
        self.refused = []
        try:
            size = os.path.getsize(self.shard)
            with tarfile.open(self.shard, mode="r:") as self._tar:
                for member in self._tar:
                    self.cut_off |= member.offset_data + member.size > size
                    reason = member_refusal(member)
                    if reason:
                        self.refused.append((member.name, reason))
                    elif member.isfile():
                        yield member
        except (tarfile.TarError, OSError) as e:
            self.error = str(e) or type(e).__name__
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
