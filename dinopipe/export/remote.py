"""A checkpoint, run folder or export in a bucket, for :func:`dinopipe.load`, ``dinopipe export --model`` and
``dinopipe eval --model``: the objects that reading needs are copied to a local cache folder, then read by the
same safe readers as a local path (safetensors, ``torch.load(weights_only=True)``, DCP through the restricted
unpickler: nothing is unpickled).

What is copied, from one listing of the prefix: a single object when the URL names one; a DCP checkpoint folder
(``.metadata``) whole; a run folder's ``export/`` and ``config.yaml`` (and, when it has no export or a raw student
is asked for, ``checkpoints/latest`` and the checkpoint it names); any other prefix (a Hugging Face or timm
folder) whole. The cache folder is named by the URL and the listed names, sizes and ETags, so a changed object is
fetched again; it is filled under a temporary name and renamed when whole (a half-fetched folder is never read).
Faults follow the store rule (dinopipe/utils/storage.py): retried for the budget, then 75; a refusal 2; a prefix
with nothing under it is a ``CheckpointError`` (2) naming the URL.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Optional

from ..utils import storage
from ..utils.safe_load import CheckpointError


def cache_root() -> Path:
    return Path(os.environ.get("DINOPIPE_CACHE") or os.path.expanduser("~/.cache/dinopipe")) / "remote"


def _listing(url: str) -> tuple[str, list[tuple[str, int, Optional[str]]], bool]:
    """(prefix, [(name under it, size, ETag)], whether the URL names one object)."""
    parent, _, base = url.rstrip("/").rpartition("/")
    if base and "." in base and base not in (".metadata",):  # a file name: look for that one object first
        one = [(rel, size, etag) for rel, size, etag in storage.iter_prefix(parent, recursive=False) if rel == base]
        if one:
            return parent, one, True
    return url.rstrip("/"), list(storage.iter_prefix(url)), False


def _wanted(objects: list[tuple[str, int, Optional[str]]], url: str, which: Optional[str]) -> list:
    names = {rel for rel, _, _ in objects}
    if ".metadata" in names or not any(n.startswith(("export/", "checkpoints/")) for n in names):
        return objects  # a DCP folder, an export / HF / timm folder: all of it
    wants_student = bool(which) and (which == "student" or which.startswith("student."))
    keep = {"config.yaml"}
    prefixes = ["export/"]
    if "checkpoints/latest" in names and (wants_student or not any(n.startswith("export/") for n in names)):
        latest = storage.join(url, "checkpoints/latest")
        fs, path = storage.filesystem(latest)
        name = storage.call(lambda: fs.cat_file(path), latest).decode(errors="replace").strip()
        if "/" in name or name in ("", ".", ".."):
            raise CheckpointError(f"{latest}: names '{name}', not a checkpoint folder next to it")
        keep.add("checkpoints/latest")
        prefixes.append(f"checkpoints/{name}/")
    return [o for o in objects if o[0] in keep or o[0].startswith(tuple(prefixes))]


def fetch(url: str, which: Optional[str] = None) -> Path:
    """The local path to read for ``url`` (a file, or a folder laid out as the prefix is)."""
    prefix, objects, single = _listing(url)
    if not objects:
        raise CheckpointError(f"'{url}': no object there (nothing under the prefix)")
    wanted = _wanted(objects, prefix, which) if not single else objects
    key = hashlib.blake2b(repr((url, which, sorted(wanted))).encode(), digest_size=10).hexdigest()
    local = cache_root() / key
    if not local.is_dir():
        partial = Path(f"{local}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            for rel, _, _ in wanted:
                src = storage.join(prefix, rel)
                dst = partial / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                fs, path = storage.filesystem(src)
                storage.call(lambda: fs.get_file(path, str(dst)), src)
            partial.mkdir(parents=True, exist_ok=True)
            os.replace(partial, local)  # whole or not at all
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return local / wanted[0][0] if single else local


__all__ = ["fetch", "cache_root"]
