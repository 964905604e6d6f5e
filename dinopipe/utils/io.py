"""Atomic file writes: a reader (or a rerun after a kill) sees the old file or the new one, never half.

Every file a later step, a resumed run or another array task trusts by its presence (checkpoint
``latest``, embedding shards, kNN chunks, step decisions, manifests, exports) is written here: to a
temporary name in the same folder (same filesystem, so the rename is atomic), then ``os.replace``-d
onto the real name. The pid in the temporary name keeps Slurm array tasks that race on one file
(the resolved config) from sharing a temporary.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Union

PathLike = Union[str, "os.PathLike[str]"]


@contextmanager
def atomic_path(path: PathLike, suffix: str = "") -> Iterator[str]:
    """Yield a temporary name next to ``path`` for a writer that takes a file name; rename it onto
    ``path`` when the block ends, delete it when the block raises. ``suffix``: the extension a writer
    insists on appending (``np.savez`` adds ``.npz``), so the temporary name is the one it writes."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}{suffix}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


@contextmanager
def atomic_open(path: PathLike, mode: str = "w", **open_kwargs: Any) -> Iterator[IO]:
    """``open(path, mode)`` whose contents appear at ``path`` only once the block ends without error."""
    if not mode.startswith("w"):
        raise ValueError(f"atomic_open writes a whole new file: mode must be 'w' or 'wb', got '{mode}'")
    with atomic_path(path) as tmp, open(tmp, mode, **open_kwargs) as f:
        yield f


def atomic_write(path: PathLike, data: Union[str, bytes]) -> Path:
    """Write text or bytes to ``path`` atomically; returns ``path`` as a Path."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return Path(path)


def atomic_write_json(path: PathLike, obj: Any, **dumps_kwargs: Any) -> Path:
    """``json.dump`` to ``path`` atomically (``indent=1`` unless given)."""
    dumps_kwargs.setdefault("indent", 1)
    return atomic_write(path, json.dumps(obj, **dumps_kwargs))


__all__ = ["atomic_path", "atomic_open", "atomic_write", "atomic_write_json"]
