"""Write the curated selection as webdataset tar shards, and the manifest that accounts for all input.

Each kept image becomes two tar members sharing a key: ``<key>.<original extension>`` with the
original bytes (no re-encoding: the training loader decodes them like any web shard) and
``<key>.json`` with where it came from and why it was kept. Keys are zero-padded running numbers
because webdataset splits keys at the first dot, which real file names often contain.
Shards are written to a temporary name and renamed, so a crash never leaves a half shard that
a training job would read; tar headers use a fixed mtime, so identical selections give
byte-identical shards. Next to the shards goes ``pool-index.bin``, the compact memory-mapped index the
trainer maps instead of walking every tar header (member offsets are known while writing, so it costs
nothing to build; see :mod:`dinopipe.data.pool_index`).
"""

from __future__ import annotations

import glob
import io
import itertools
import json
import os
import tarfile
from collections import Counter, defaultdict
from typing import Sequence

from tqdm.auto import tqdm

from dinopipe.data.pool_index import INDEX_NAME, member_locations, tar_index, write_index
from dinopipe.data.sources import MultiSource, extension_of
from dinopipe.utils.io import atomic_path, atomic_write_json

# Every input image ends in exactly one of these (manifest.json counts them).
STATUSES = ("kept", "hash_duplicates", "copy_duplicates", "decontaminated", "unreadable",
            "not_selected")


def write_shards(source: MultiSource, ids: Sequence[str], metadata: Sequence[dict], out_dir: str,
                 shard_size: int = 1000, prefix: str = "shard", progress: bool = False) -> dict:
    """Write images ``ids`` (re-read from ``source``) with their ``metadata`` into tar shards.

    Returns ``{"shards": [paths], "written": n, "failed": [(id, reason)]}``; an image whose bytes
    can no longer be read (deleted since embedding) is reported in ``failed``, not written.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    os.makedirs(out_dir, exist_ok=True)
    index_path = os.path.join(out_dir, INDEX_NAME)
    if os.path.exists(index_path):
        os.remove(index_path)  # it describes the shards about to be replaced (a stale one would not validate)
    refs = source.ref_index()
    shards, failed, written, members = [], [], 0, []
    bar = tqdm(total=len(ids), desc="write shards", unit="img", disable=not progress,
               mininterval=2.0)

    def readable():  # (id, bytes, metadata) of the images still readable; the others go to `failed`
        for image_id, meta in zip(ids, metadata):
            bar.update(1)
            ref = refs.get(image_id)
            data = source.read(ref) if ref is not None else None
            if data:
                yield image_id, data, meta
            else:
                failed.append((image_id, "read_error"))

    images = readable()
    while (first := next(images, None)) is not None:  # streamed: one image's bytes in memory at a time
        path = os.path.join(out_dir, f"{prefix}-{len(shards):06d}.tar")
        members.append([])
        with atomic_path(path) as tmp, tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
            for image_id, data, meta in itertools.chain([first], itertools.islice(images, shard_size - 1)):
                key = f"{written:09d}"
                ext = extension_of(image_id) or "bin"
                members[-1].append((f"{key}.{ext}", _add(tf, f"{key}.{ext}", data), len(data)))
                _add(tf, f"{key}.json", json.dumps({"key": key, **meta}, sort_keys=True).encode())
                written += 1
        shards.append(path)
    bar.close()
    # Shards left over from an earlier, larger selection would be read by training: remove them.
    for old in glob.glob(os.path.join(out_dir, f"{prefix}-*.tar")):
        if old not in shards:
            os.remove(old)
    if shards and sorted(glob.glob(os.path.join(out_dir, "*.tar"))) == sorted(shards):
        # Only when the folder holds exactly these shards: that is what a trainer pointed at it will read.
        header, arrays = tar_index(shards, [member_locations(m) for m in members], root=None)
        write_index(index_path, header, arrays)
    return {"shards": shards, "written": written, "failed": failed}


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> int:
    """Add one member; returns the byte offset of its data in the shard (for the pool index)."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0  # reproducible bytes
    info.mode = 0o644
    tf.addfile(info, io.BytesIO(data))
    # tf.offset is now past the data and its padding to a 512-byte block (PAX headers come before it).
    return tf.offset - -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def build_manifest(statuses: dict[str, str], sources: dict[str, str],
                   unreadable_reasons: dict[str, str], extra: dict | None = None) -> dict:
    """Counts per status, overall and per source, from one status per input id.

    ``statuses``: id -> one of :data:`STATUSES`; ``sources``: id -> source name;
    ``unreadable_reasons``: id -> reason for the unreadable ones.
    """
    bad = {s for s in statuses.values() if s not in STATUSES}
    if bad:
        raise ValueError(f"unknown statuses {sorted(bad)}; expected one of {STATUSES}")
    total = Counter(statuses.values())
    per_source: dict[str, Counter] = defaultdict(Counter)
    reasons: dict[str, Counter] = defaultdict(Counter)
    for image_id, status in statuses.items():
        per_source[sources[image_id]][status] += 1
        if status == "unreadable":
            reasons[sources[image_id]][unreadable_reasons.get(image_id, "unknown")] += 1

    def counts(c: Counter) -> dict:
        return {"input": sum(c.values()), **{s: c.get(s, 0) for s in STATUSES}}

    all_reasons = Counter()
    for c in reasons.values():
        all_reasons.update(c)
    manifest = {
        "counts": counts(total),
        "unreadable_reasons": dict(sorted(all_reasons.items())),
        "per_source": {
            name: {**counts(c), "unreadable_reasons": dict(sorted(reasons[name].items()))}
            for name, c in sorted(per_source.items())
        },
    }
    manifest.update(extra or {})
    check_manifest(manifest)
    return manifest


def check_manifest(manifest: dict) -> None:
    """Raise if the counts do not add up (a bug, never a user error)."""
    for where, c in [("total", manifest["counts"])] + list(manifest["per_source"].items()):
        parts = sum(c[s] for s in STATUSES)
        if parts != c["input"]:
            raise AssertionError(f"manifest counts for {where} do not add up: {c}")
    if sum(manifest["unreadable_reasons"].values()) != manifest["counts"]["unreadable"]:
        raise AssertionError("unreadable reasons do not add up to the unreadable count")


def write_json_atomic(path: str, obj) -> None:
    atomic_write_json(path, obj, default=_json_default)


def _json_default(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
