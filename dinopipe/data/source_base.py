"""What every image source shares: :class:`ImageRef` (an image's stable id and where its bytes are), :class:`Sample`,
the split of a pool over array tasks (:func:`stable_hash`, :func:`in_split`) and the :class:`ImageSource` interface.
The sources themselves: :mod:`dinopipe.data.sources` (folders, file lists, :func:`open_source`) and
:mod:`dinopipe.data.tar_sources` (tar shards on disk and in object storage)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple, Sequence

from ..utils import storage

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


def _warn(msg: str) -> None:
    import warnings

    warnings.warn(msg, stacklevel=3)


def own_path_refs(name: str, root, paths: Iterable[str], task_index: int, num_tasks: int):
    """The paths (streamed; under ``root`` unless absolute or URLs) whose id ``<name>/<path without a leading
    '/'>`` hashes to task ``task_index`` of ``num_tasks``, in their order, as arrays
    (:class:`~dinopipe.data.reflist.PathRefs`; a path given twice: once): a folder's, a file list's or a bucket
    prefix's own images, with nothing held per path of the whole input."""
    from .reflist import PathRefs, collect_paths

    check_split(task_index, num_tasks)
    prefix = f"{name}/".encode()

    def own():  # stable_hash of the id, on bytes (no str per line kept or joined)
        for p in paths:
            b = p.encode("utf-8")
            key = int.from_bytes(hashlib.blake2b(prefix + b.lstrip(b"/"), digest_size=8).digest(), "little")
            if num_tasks == 1 or key % num_tasks == task_index:
                yield b

    blob, ends, drops = collect_paths(own())
    return PathRefs(blob, ends, name, str(root), ImageRef, storage.is_url, drops)
