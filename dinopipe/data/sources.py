"""Image sources: recursive folders, file lists and (uncompressed) webdataset tar shards.

This module holds the folder and file-list sources, :func:`open_source` and :class:`MultiSource`, and is where
callers import every source name from; the shared base is :mod:`dinopipe.data.source_base`, the tar shards (on disk
and in object storage) :mod:`dinopipe.data.tar_sources`.

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

import os
from pathlib import Path
from typing import Iterable, Iterator

from ..utils import storage
from .reflist import ConcatRefs, PathRefs
from .reflist import under_root as _under
# the names every caller imports from here: the shared base and the tar sources live in their own modules
from .source_base import (IMAGE_EXTENSIONS, ImageRef, ImageSource, Sample, _read_file, _warn, check_split,  # noqa: F401
                          extension_of, in_split, own_path_refs, stable_hash)
from .tar_sources import LINK, UNSAFE_NAME, RemoteSource, TarShardSource, TarWalk, member_refusal  # noqa: F401


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
        """This task's images, sorted by id (see :meth:`ref_seq`; this is the same as a list)."""
        return list(self.ref_seq(task_index, num_tasks))

    def ref_seq(self, task_index: int = 0, num_tasks: int = 1) -> PathRefs:
        """This task's images, sorted by id, as arrays (:class:`~dinopipe.data.reflist.PathRefs`, as a file list's):
        the folder is walked in id order a directory at a time and a file kept only when its id hashes to this
        task, so nothing is held per file of the whole folder, nor an ImageRef per own file."""
        return own_path_refs(self.name, self.root, self._walk(), task_index, num_tasks)

    def iter_refs(self) -> Iterator[ImageRef]:
        for rel in self._walk():
            yield ImageRef(f"{self.name}/{rel}", self.name, _under(self.root, rel))

    def _walk(self) -> Iterator[str]:
        """The images' paths under the root ('/'-separated), in the order of their ids. A directory's entries
        are sorted by name, a subdirectory's name followed by '/', which is the order of the whole paths (every
        path under ``d`` starts with ``d/``); symlinked directories are not entered (as :func:`os.walk`), and an
        unreadable directory is skipped."""

        def walk(path: str, rel: str) -> Iterator[str]:
            try:
                with os.scandir(path) as it:
                    entries = list(it)
            except OSError:
                return
            keyed = []
            for e in entries:
                try:
                    is_dir = e.is_dir()
                except OSError:
                    is_dir = False
                if is_dir:
                    if not e.is_symlink():
                        keyed.append((e.name + "/", e.path))
                elif extension_of(e.name) in IMAGE_EXTENSIONS:
                    keyed.append((e.name, None))
            del entries
            for key, sub in sorted(keyed):
                if sub is None:
                    yield rel + key
                else:
                    yield from walk(sub, rel + key)

        yield from walk(str(self.root), "")

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
        """This task's images, in list order, as arrays (:class:`~dinopipe.data.reflist.PathRefs`: the path's bytes
        and 8 B per row, 12 at the listing's peak; not ~420 B per ImageRef). The list is streamed and a line kept
        only when its id hashes to this task: nothing is held per line of the whole list. A path listed twice is one
        image: both copies hash to the same task (a hash partition), so the task's own rows find it."""
        return own_path_refs(self.name, self.root, self._paths(), task_index, num_tasks)

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


def as_multi(sources) -> MultiSource:
    """Accept one source/path, a list of them, or a MultiSource."""
    if isinstance(sources, MultiSource):
        return sources
    if isinstance(sources, (str, os.PathLike, ImageSource)):
        sources = [sources]
    return MultiSource(sources)
