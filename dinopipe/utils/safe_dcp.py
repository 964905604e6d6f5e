"""torch.distributed.checkpoint reads that unpickle nothing a checkpoint folder can choose.

DCP's own ``FileSystemReader.read_metadata`` is ``pickle.load`` and its default planner reads non-tensor
entries ("bytes": optimizer hyper-parameters, strings) with ``torch.load(weights_only=False)``: a crafted
checkpoint folder runs code through either. :class:`SafeFileSystemReader` reads the metadata with the
restricted unpickler of :mod:`dinopipe.utils.safe_load`, and :class:`SafeLoadPlanner` (or
:class:`SafeKeysPlanner`) reads bytes entries with ``weights_only=True``. Tensor data is already read with
``weights_only=True`` by DCP. Used by resuming (``train/checkpoint.py``) and by ``dinopipe.load`` of a DCP folder.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from . import storage
from .safe_load import CheckpointError, dcp_metadata_from_bytes, read_dcp_metadata, torch_load
from .torch_compat import dcp_fsspec_classes, dcp_set_element


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose metadata comes from the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return _with_load_id(read_dcp_metadata(Path(self.path), kwargs.get("rank")), self)


def _with_load_id(md: Any, reader: Any) -> Any:
    """The metadata as DCP's own ``read_metadata`` returns it: ``storage_meta.load_id`` set to the reader's."""
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    md.storage_meta.load_id = getattr(reader, "load_id", None)
    return md


def _bytes_value(value: io.BytesIO, where: str) -> Any:
    return torch_load(value, where=where, mmap=False)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that bytes entries are read with ``torch.load(weights_only=True)``."""

    def __init__(self, *args: Any, where: str = "checkpoint", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.where = where

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = _bytes_value(value, f"{self.where} (entry {fqn})")
        if self.flatten_state_dict:
            dcp_set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _url_metadata(url: str) -> Any:
    where = storage.join(url, ".metadata")
    fs, p = storage.filesystem(where)
    try:
        data = storage.call(lambda: fs.cat_file(p), where)
    except storage.Unreadable as exc:
        raise CheckpointError(f"{where}: cannot read the checkpoint metadata ({exc.reason})") from None
    return dcp_metadata_from_bytes(data, where)


def safe_fsspec_reader(url: str) -> Any:
    """DCP's fsspec reader (a checkpoint in object storage) with the metadata from the restricted unpickler."""
    _, reader_cls = dcp_fsspec_classes()

    class SafeFsspecReader(reader_cls):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return _with_load_id(_url_metadata(url), self)

    return SafeFsspecReader(url, **storage.fsspec_options(url))


def load(states: dict[str, Any], path: str | Path, no_dist: bool) -> None:
    """``dcp.load`` of ``path`` into ``states`` in place, through the safe reader and planner (``path`` may be an
    fsspec URL: a checkpoint in a bucket)."""
    if storage.is_url(str(path)):
        url = str(path)
        _url_metadata(url)  # refused here, on every rank, before DCP's collectives start
        try:
            dcp.load(states, storage_reader=safe_fsspec_reader(url), planner=SafeLoadPlanner(where=url),
                     no_dist=no_dist)
        except CheckpointException as exc:
            _raise_refusal(exc)
            raise
        return
    path = Path(path)
    read_dcp_metadata(path)  # refuse a crafted folder here, on every rank, before DCP's collectives start
    try:
        dcp.load(states, storage_reader=SafeFileSystemReader(str(path)),
                 planner=SafeLoadPlanner(where=str(path)), no_dist=no_dist)
    except CheckpointException as exc:
        _raise_refusal(exc)
        raise


def _raise_refusal(exc: BaseException) -> None:
    """DCP collects each rank's error into a ``CheckpointException``; re-raise a refusal of ours as itself."""
    for inner in getattr(exc, "failures", {}).values():
        inner = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback) in recent torch
        if isinstance(inner, CheckpointError):
            raise inner from None


def _data_bytes(path: Path, md: Any) -> int:
    files = {info.relative_path for info in (md.storage_data or {}).values()}
    return sum((path / f).stat().st_size for f in files if (path / f).is_file())


def _checked_entries(path: Path, md: Any, keys: set[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (shape, dtype)} of tensor entries, refusing sizes the data files cannot hold (a lying size would
    otherwise allocate terabytes before anything is read)."""
    entries: Mapping[str, Any] = md.state_dict_metadata
    out = {}
    want = 0
    for k in sorted(keys):
        m = entries.get(k)
        if not isinstance(m, TensorStorageMetadata):
            raise CheckpointError(f"{path}: '{k}' is not a tensor in this checkpoint")
        dtype = m.properties.dtype if m.properties is not None else torch.float32
        if not isinstance(dtype, torch.dtype) or any(not isinstance(s, int) or s < 0 for s in m.size):
            raise CheckpointError(f"{path}: malformed tensor entry '{k}' ({m.size}, {dtype})")
        want += torch.Size(m.size).numel() * torch.empty((), dtype=dtype).element_size()
        out[k] = (tuple(m.size), dtype)
    compressed = any(getattr(i, "transform_descriptors", None) for i in (md.storage_data or {}).values())
    have = _data_bytes(path, md)
    if want > have * (64 if compressed else 1):
        raise CheckpointError(f"{path}: the metadata claims {want} bytes of tensors but the data files hold {have}; "
                              f"a truncated or forged checkpoint")
    return out


class _KnownMetadataReader(SafeFileSystemReader):
    """A safe reader that reuses metadata already read (a lazy tensor reads its rows many times)."""

    def __init__(self, path: Path, md: Any) -> None:
        super().__init__(str(path))
        self._md = md

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self._md


class _RowsPlanner(SafeLoadPlanner):
    """Loads rows ``[start, start + len)`` of one tensor into a buffer of that size (DCP's resharding reads only
    the saved chunks that overlap them)."""

    def __init__(self, fqn: str, start: int, where: str) -> None:
        super().__init__(where=where)
        self.fqn, self.start = fqn, start

    def create_local_plan(self) -> LoadPlan:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        buf = self.state_dict[self.fqn]
        chunk = ChunkStorageMetadata(offsets=torch.Size([self.start] + [0] * (buf.dim() - 1)), sizes=buf.shape)
        return LoadPlan(create_read_items_for_chunk_list(self.fqn, self.metadata.state_dict_metadata[self.fqn],
                                                         [chunk]))

    def lookup_tensor(self, index: Any) -> torch.Tensor:
        return self.state_dict[index.fqn]


def _dcp_read(out: dict[str, torch.Tensor], path: Path, reader: Any, planner: Any) -> None:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")  # exactly what we want here
            dcp.load(out, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps reader errors (a BaseException); corrupt data
        _raise_refusal(exc)
        raise CheckpointError(f"{path}: cannot read the checkpoint data ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:300] if str(exc) else ''})") from None


def read_tensors(path: str | Path, keys: Optional[set[str]] = None, md: Optional[Any] = None) -> dict[str, torch.Tensor]:
    """The tensors named ``keys`` (default: all) of a DCP folder, in this process, without a process group.

    Buffers are allocated from the metadata's sizes only after checking that the data files can hold them."""
    path = Path(path)
    md = md if md is not None else read_dcp_metadata(path)
    entries = _checked_entries(path, md, set(md.state_dict_metadata) if keys is None else keys)
    out = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in entries.items()}
    _dcp_read(out, path, SafeFileSystemReader(str(path)), SafeLoadPlanner(where=str(path)))
    return out


# tensors at least this big are read lazily by ``lazy_tensors`` (smaller ones together, in one read)
LAZY_MIN_BYTES = 1 << 20


def lazy_tensors(path: str | Path, keys: Optional[set[str]] = None, md: Optional[Any] = None,
                 min_bytes: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Like :func:`read_tensors`, but a tensor of at least ``min_bytes`` (default :data:`LAZY_MIN_BYTES`) is a
    :class:`~dinopipe.utils.lazy_rows.LazyRows` whose rows are read from the folder when sliced: a rank that
    copies its shard of it reads (and holds) only that, nothing is allocated in full on every rank."""
    from .lazy_rows import LazyRows

    path = Path(path)
    md = md if md is not None else read_dcp_metadata(path)
    entries = _checked_entries(path, md, set(md.state_dict_metadata) if keys is None else keys)
    limit = LAZY_MIN_BYTES if min_bytes is None else min_bytes
    big = {k for k, (shape, dtype) in entries.items()
           if shape and torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() >= limit}
    out: dict[str, torch.Tensor] = read_tensors(path, set(entries) - big, md=md) if set(entries) - big else {}
    reader = _KnownMetadataReader(path, md)

    def rows(fqn: str, shape: tuple, dtype: torch.dtype, a: int, b: int) -> torch.Tensor:
        buf = torch.empty((b - a, *shape[1:]), dtype=dtype)
        if b > a:
            _dcp_read({fqn: buf}, path, reader, _RowsPlanner(fqn, a, str(path)))
        return buf

    for k in sorted(big):
        shape, dtype = entries[k]
        out[k] = LazyRows(shape, dtype, lambda a, b, k=k, shape=shape, dtype=dtype: rows(k, shape, dtype, a, b))
    return out


__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "load", "read_tensors", "lazy_tensors", "LAZY_MIN_BYTES"]
