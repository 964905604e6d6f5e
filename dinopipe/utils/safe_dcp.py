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

from .safe_load import CheckpointError, read_dcp_metadata, torch_load
from .torch_compat import dcp_set_element


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose metadata comes from the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        md = read_dcp_metadata(Path(self.path), kwargs.get("rank"))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = getattr(self, "load_id", None)
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


def load(states: dict[str, Any], path: str | Path, no_dist: bool) -> None:
    """``dcp.load`` of ``path`` into ``states`` in place, through the safe reader and planner."""
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


def read_tensors(path: str | Path, keys: Optional[set[str]] = None, md: Optional[Any] = None) -> dict[str, torch.Tensor]:
    """The tensors named ``keys`` (default: all) of a DCP folder, in this process, without a process group.

    Buffers are allocated from the metadata's sizes only after checking that the data files can hold them
    (a lying size would otherwise allocate terabytes before anything is read)."""
    path = Path(path)
    md = md if md is not None else read_dcp_metadata(path)
    entries: Mapping[str, Any] = md.state_dict_metadata
    keys = set(entries) if keys is None else keys
    out: dict[str, torch.Tensor] = {}
    want = 0
    for k in sorted(keys):
        m = entries.get(k)
        if not isinstance(m, TensorStorageMetadata):
            raise CheckpointError(f"{path}: '{k}' is not a tensor in this checkpoint")
        dtype = m.properties.dtype if m.properties is not None else torch.float32
        if not isinstance(dtype, torch.dtype) or any(not isinstance(s, int) or s < 0 for s in m.size):
            raise CheckpointError(f"{path}: malformed tensor entry '{k}' ({m.size}, {dtype})")
        want += torch.Size(m.size).numel() * torch.empty((), dtype=dtype).element_size()
    compressed = any(getattr(i, "transform_descriptors", None) for i in (md.storage_data or {}).values())
    have = _data_bytes(path, md)
    if want > have * (64 if compressed else 1):
        raise CheckpointError(f"{path}: the metadata claims {want} bytes of tensors but the data files hold {have}; "
                              f"a truncated or forged checkpoint")
    for k in sorted(keys):
        m = entries[k]
        out[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype if m.properties is not None else torch.float32)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")  # exactly what we want here
            dcp.load(out, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(where=str(path)),
                     no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps reader errors (a BaseException); corrupt data
        _raise_refusal(exc)
        raise CheckpointError(f"{path}: cannot read the checkpoint data ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:300] if str(exc) else ''})") from None
    return out


__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "load", "read_tensors"]
