"""Reading files a user hands over without running anything they contain.

Unpickling runs code: a pickle can name any importable callable and call it (``os.system`` is the classic
one). Every file dinopipe reads from a user-given path therefore goes through one of three readers here:

- ``read_safetensors``: the preferred format; a lying header (offsets past the end, a header length of
  gigabytes, wrong dtype sizes) is refused by the safetensors parser and reported with the file's name.
- ``torch_load``: ``torch.load(weights_only=True)`` (tensors, numbers, strings, containers), memory-mapped when
  the file allows it so a released ``.pth`` is not copied whole into every process.
- ``read_dcp_metadata``: a torch.distributed.checkpoint ``.metadata`` file (a pickle DCP writes with plain
  ``pickle.dump``) through a restricted unpickler that admits only the checkpoint metadata classes, torch's
  dtype/size/layout/memory-format values and plain builtins. Anything else is refused before it is built.

A refusal raises :class:`UnsafeCheckpointError` (a ``ValueError``, so command-line entries exit 2) naming the
file and the object it wanted.

Two formats a user may hand over *are* code: a ``torch.export`` archive (``.pt2``: ``torch.export.load`` falls
back to ``torch.load(weights_only=False)`` when its weights-only load fails) and a TorchScript file
(``torch.jit.load`` runs its code). :func:`read_archive_file` reads a named file out of such a zip archive (the
``.pt2``'s ``extra/`` metadata) without loading the archive; running one is refused by :func:`require_trust`
unless the user opted in (``dedup.trust_code: true``, ``program_runner(..., trust_code=True)``), with an
:class:`UntrustedCodeError` naming the switch and the file.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import IO, Any, Optional

# (module, name) pairs a DCP .metadata may reference. Found by recording ``find_class`` while unpickling the
# metadata of pretraining and distillation checkpoints written by torch 2.14.1 (tests/test_no_unpickle.py keeps
# the list honest: a genuine checkpoint must load); the classes exist under the same names since torch 2.4.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a dict lookup by name ("torch.strided")
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"dict", "list", "tuple", "set", "frozenset", "str", "bytes", "bytearray", "int",
                           "float", "bool", "complex", "slice"}),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file, says why and what to do."""


class UnsafeCheckpointError(CheckpointError):
    """A file that would need arbitrary objects to be built (code to run) to be read; refused."""


class UntrustedCodeError(UnsafeCheckpointError):
    """A file that is a program (TorchScript, ``torch.export``), run without the user's explicit opt-in."""


def require_trust(path: str | Path, what: str, trusted: bool, switch: str) -> None:
    """Refuse to run the program ``path`` (``what``: what it is) unless ``trusted``; the message names the
    ``switch`` that opts in (a config key or a flag) and the file."""
    if not trusted:
        raise UntrustedCodeError(
            f"{path}: refusing to load {what}: loading it runs code the file contains (and can fall back to "
            f"unpickling). Set {switch} only if you trust whoever made this file")


MAX_ARCHIVE_ENTRY = 1 << 20
"""Bytes of a metadata file read out of a user's zip archive (a dinopipe.json is ~200 B)."""


def read_archive_file(path: str | Path, name: str, limit: int = MAX_ARCHIVE_ENTRY) -> Optional[bytes]:
    """The bytes of the member ``*/extra/<name>`` (or ``extra/<name>``) of the zip archive ``path`` (a ``.pt2``),
    None when it has none; nothing else of the archive is read or loaded. A member larger than ``limit`` or an
    archive zipfile cannot read is a :class:`CheckpointError` naming the file."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            hits = [i for i in z.infolist() if i.filename == f"extra/{name}" or i.filename.endswith(f"/extra/{name}")]
            if not hits:
                return None
            if hits[0].file_size > limit:
                raise CheckpointError(f"{path}: its {hits[0].filename} claims {hits[0].file_size} bytes (more than "
                                      f"{limit}); not metadata dinopipe wrote")
            with z.open(hits[0]) as f:
                data = f.read(limit + 1)
            if len(data) > limit:
                raise CheckpointError(f"{path}: its {hits[0].filename} holds more than {limit} bytes")
            return data
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
        raise CheckpointError(f"{path}: not a readable .pt2 archive ({type(exc).__name__}: {str(exc)[:200]})") from None


def _torch_value(name: str) -> Any:
    """``torch.<name>`` when it is a plain value a checkpoint may record (a dtype, layout, memory format, Size)."""
    import torch

    obj = getattr(torch, name, None)
    if name == "Size" or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
        return obj
    return None


MAX_UNPICKLED_BYTES = 64 << 20
"""Bytes one restricted unpickle may build with ``bytes(n)`` / ``bytearray(n)`` in all (DCP metadata builds
none; without a cap, ``bytes(10**12)`` in a forged ``.metadata`` would allocate a terabyte)."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` admits only :data:`ALLOWED_GLOBALS` and torch's plain values;
    ``bytes`` and ``bytearray`` build at most :data:`MAX_UNPICKLED_BYTES` in all."""

    def __init__(self, file: IO[bytes], where: str | Path, max_bytes: int = MAX_UNPICKLED_BYTES) -> None:
        super().__init__(file)
        self.where = where
        self.bytes_left = max_bytes

    def _capped(self, kind: type) -> Any:
        def build(*args: Any) -> Any:
            n = args[0] if args and isinstance(args[0], int) else (len(args[0]) if args and hasattr(args[0], "__len__")
                                                                   else 0)
            if n > self.bytes_left:
                raise UnsafeCheckpointError(
                    f"{self.where}: refusing a pickle that builds a {kind.__name__} of {n} bytes (more than the "
                    f"{MAX_UNPICKLED_BYTES} a checkpoint's metadata may build in all)")
            self.bytes_left -= max(n, 0)
            return kind(*args)

        return build

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and _torch_value(name) is not None:
            return _torch_value(name)
        if module == "builtins" and name in ("bytes", "bytearray"):
            return self._capped(bytes if name == "bytes" else bytearray)
        if name in ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.where}: refusing to unpickle '{module}.{name}': a checkpoint's metadata holds only "
            f"torch.distributed.checkpoint metadata and plain values, and building other objects can run code. "
            f"This file was not written by torch.distributed.checkpoint.save; do not load it")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.where}: refusing a pickle with persistent ids (not DCP metadata)")


def restricted_loads(data: bytes, where: str | Path) -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler`; a malformed pickle is a :class:`CheckpointError`."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # truncated or corrupt: the pickle machinery raises many kinds
        raise CheckpointError(f"{where}: not a readable checkpoint metadata file ({type(exc).__name__}: "
                              f"{str(exc)[:200]})") from None


def _check_metadata(md: Any, where: Path) -> None:
    """The unpickled object is DCP metadata whose data files all lie inside the checkpoint folder."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(f"{where}: not torch.distributed.checkpoint metadata (it holds a {type(md).__name__})")
    for key, item in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(item, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{where}: malformed entry {key!r} in the checkpoint metadata")
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", -1), getattr(info, "length", -1)
        if not isinstance(rel, str) or Path(rel).name != rel or rel in ("", ".", "..") or "\\" in rel:
            raise UnsafeCheckpointError(f"{where}: a data file named {rel!r} is outside the checkpoint folder; "
                                        f"refused (DCP writes plain file names next to .metadata)")
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise CheckpointError(f"{where}: malformed storage entry for {rel} (offset {offset}, length {length})")


def read_dcp_metadata(folder: str | Path, rank: Optional[int] = None) -> Any:
    """The ``Metadata`` of a DCP checkpoint folder, read with the restricted unpickler and checked."""
    folder = Path(folder)
    path = folder / (".metadata" if rank is None else f"__{rank}.metadata")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint metadata ({exc.strerror or exc})") from None
    return dcp_metadata_from_bytes(data, path)


def dcp_metadata_from_bytes(data: bytes, where: Any) -> Any:
    """A DCP ``.metadata`` file's bytes (read from anywhere: a bucket too) through the restricted unpickler."""
    md = restricted_loads(data, where)
    _check_metadata(md, where)
    return md


def torch_load(file: str | Path | IO[bytes], where: Optional[str | Path] = None, mmap: bool = True) -> Any:
    """``torch.load(weights_only=True)`` on CPU, memory-mapped when the file is a zip checkpoint (every
    ``torch.save`` since 1.6); a file that needs other objects is an :class:`UnsafeCheckpointError`."""
    import torch

    where = where if where is not None else file
    try:
        if mmap and isinstance(file, (str, Path)):
            try:
                return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:  # a legacy (non-zip) file cannot be mapped: read it plainly
                if "mmap" not in str(exc):
                    raise
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{where}: refusing to load a checkpoint that needs arbitrary pickled objects (unpickling can run "
            f"code). If you trust the file, re-save only its tensors: torch.save(ckpt['model'], 'weights.pth'). "
            f"Detail: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, IndexError, TypeError) as exc:
        raise CheckpointError(f"{where}: not a readable torch checkpoint ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None


def read_safetensors(path: str | Path) -> tuple[dict, dict[str, str]]:
    """(tensors, string metadata) of a ``.safetensors`` file; a malformed header is a :class:`CheckpointError`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:  # checks the header (names, dtypes, offsets in the file)
            meta = f.metadata() or {}
        mapped = _mmap_safetensors(Path(path))
        return (mapped if mapped is not None else load_file(str(path))), meta
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(exc).__name__}: "
                              f"{str(exc)[:200]})") from None


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _mmap_safetensors(path: Path) -> Optional[dict]:
    """The tensors of a (header-checked) ``.safetensors`` file as views of one private memory map of it: nothing
    is read until used, so a process that copies a slice of each tensor (its shard) touches only those pages.
    Writes stay in the process (copy-on-write). None when a tensor's dtype or alignment does not allow a view
    (the caller then reads the file whole)."""
    import json
    import struct

    import torch

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    size = path.stat().st_size
    if size == 0:
        return None
    data = torch.empty(0, dtype=torch.uint8, device="cpu").set_(torch.UntypedStorage.from_file(str(path), False, size))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = getattr(torch, _ST_DTYPES.get(info["dtype"], ""), None)
        begin, end = (8 + n + o for o in info["data_offsets"])
        if not isinstance(dtype, torch.dtype) or begin % dtype.itemsize:
            return None
        out[name] = data[begin:end].view(dtype).view(info["shape"])
    return out


def read_safetensors_header(path: str | Path) -> dict[str, str]:
    """The string metadata of a ``.safetensors`` file, after checking its header (tensor names, dtypes, offsets
    that fit the file) without reading the tensors; a malformed header is a :class:`CheckpointError`."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
            return f.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(exc).__name__}: "
                              f"{str(exc)[:200]})") from None


__all__ = ["ALLOWED_GLOBALS", "CheckpointError", "UnsafeCheckpointError", "UntrustedCodeError", "require_trust",
           "read_archive_file", "RestrictedUnpickler", "restricted_loads",
           "read_dcp_metadata", "torch_load", "read_safetensors",
           "read_safetensors_header"]
