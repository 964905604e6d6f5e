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
import json
import os
import tarfile
from collections import Counter, defaultdict
from typing import Sequence

import numpy as np
from dinopipe.utils.progress import progress as reporter

from dinopipe.config import InputError
from dinopipe.data.pool_index import INDEX_NAME, member_locations, tar_index, write_index, write_tar_index
from dinopipe.data.sources import MultiSource, extension_of
from dinopipe.utils.io import atomic_path, atomic_write_json

from curation.core.status import STATUSES
from curation.core.layout import RunLayout


def write_shards(source: MultiSource, ids: Sequence[str], metadata: Sequence[dict], out_dir: str,
                 shard_size: int = 1000, prefix: str = "shard", progress: bool = False) -> dict:
    """Write images ``ids`` (re-read from ``source``) with their ``metadata`` into tar shards.

    A helper for small selections given as string ids (tests, tools); the curation pipeline writes
    through :func:`write_shard_task` from the path table instead. Returns ``{"shards": [paths],
    "written": n, "failed": [(id, reason)]}``; an image whose bytes can no longer be read is
    reported in ``failed``, not written.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    os.makedirs(out_dir, exist_ok=True)
    index_path = os.path.join(out_dir, INDEX_NAME)
    if os.path.exists(index_path):
        os.remove(index_path)  # it describes the shards about to be replaced (a stale one would not validate)
    wanted = set(ids)
    refs = {r.id: r for r in source.refs() if r.id in wanted}
    shards, failed, members = [], [], []
    items = [(f"{k:09d}", image_id, (lambda r=refs.get(image_id): source.read(r) if r is not None else None), meta)
             for k, (image_id, meta) in enumerate(zip(ids, metadata))]
    for start in reporter(range(0, len(items), shard_size), desc="write shards", disable=not progress):
        path = os.path.join(out_dir, f"{prefix}-{len(shards):06d}.tar")
        m, f = write_one_shard(path, items[start:start + shard_size])
        members.append(m)
        failed.extend(f)
        shards.append(path)
    _finish_shards(out_dir, shards, members, prefix)
    return {"shards": shards, "written": sum(len(m) for m in members), "failed": failed}


def write_one_shard(path: str, items) -> tuple[list, list]:
    """One tar shard from ``items`` = [(key, id, read() -> bytes | None, metadata)], written to a temporary
    name and renamed. Streamed: one image's bytes in memory at a time. Returns (members [(name, offset,
    size)], failed [(id, 'read_error')]); a shard whose images all failed is not written."""
    members, failed = [], []
    with atomic_path(path) as tmp:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
            for key, image_id, read, meta in items:
                data = read()
                if not data:
                    failed.append((image_id, "read_error"))
                    continue
                ext = extension_of(image_id) or "bin"
                members.append((f"{key}.{ext}", _add(tf, f"{key}.{ext}", data), len(data)))
                _add(tf, f"{key}.json", json.dumps({"key": key, **meta}, sort_keys=True).encode())
    if not members:
        os.remove(path)
    return members, failed


def _finish_shards(out_dir: str, shards: list[str], members: list[list], prefix: str = "shard") -> None:
    """Remove shards of an earlier, larger selection (training would read them) and write the pool index."""
    index_path = os.path.join(out_dir, INDEX_NAME)
    present = [(s, m) for s, m in zip(shards, members) if m]
    if _remove_stale_shards(out_dir, [s for s, _ in present], prefix):
        header, arrays = tar_index([s for s, _ in present], [member_locations(m) for _, m in present], root=None)
        write_index(index_path, header, arrays)
    elif os.path.exists(index_path):
        os.remove(index_path)


def shard_range(n_shards: int, task_index: int, num_tasks: int) -> range:
    """The shards task ``task_index`` of ``num_tasks`` writes: a contiguous block (names do not depend on W)."""
    return range(task_index * n_shards // num_tasks, (task_index + 1) * n_shards // num_tasks)


def write_shard_task(out_dir: str, shards_dir: str, n_images: int, shard_size: int, items_of, selection: str,
                     task_index: int = 0, num_tasks: int = 1, progress: bool = False) -> dict:
    """Task ``task_index`` of ``num_tasks``: write its block of the ``ceil(n_images / shard_size)`` shards.

    Shard ``j`` holds the kept images ``j * shard_size ...`` in canonical order and is named
    ``shard-<j>.tar`` whatever the number of tasks. ``items_of(start, stop)`` gives those images' items
    (see :func:`write_one_shard`). Each finished shard leaves its part of the pool index,
    ``<out_dir>/steps/write/shard-<j>.loc.npy`` (its members' [offset, size], in name order), then its record
    ``shard-<j>.json`` (the member count, its failed reads and the ``selection`` digest); a rerun skips shards
    whose record matches the selection, so a killed task redoes only the shard it was writing."""
    n_shards = -(-n_images // shard_size)
    rec_dir = RunLayout(out_dir).steps("write")
    os.makedirs(rec_dir, exist_ok=True)
    os.makedirs(shards_dir, exist_ok=True)
    done = skipped = 0
    for j in shard_range(n_shards, task_index, num_tasks):
        rec_path, loc_path = _record_paths(rec_dir, j)
        path = os.path.join(shards_dir, f"shard-{j:06d}.tar")
        rec = _read_json(rec_path)
        if (rec is not None and rec["selection"] == selection and "n_members" in rec
                and (not rec["n_members"] or (os.path.exists(path) and os.path.exists(loc_path)))):
            skipped += 1
            continue
        members, failed = write_one_shard(path, items_of(j * shard_size, min(n_images, (j + 1) * shard_size)))
        with atomic_path(loc_path, suffix=".npy") as tmp:
            np.save(tmp, member_locations(members))
        atomic_write_json(rec_path, {"selection": selection, "n_members": len(members), "failed": failed})
        done += 1
    return {"task_index": task_index, "num_tasks": num_tasks, "shards_written": done, "shards_skipped": skipped}


def _record_paths(rec_dir: str, j: int) -> tuple[str, str]:
    return os.path.join(rec_dir, f"shard-{j:06d}.json"), os.path.join(rec_dir, f"shard-{j:06d}.loc.npy")


def finish_shard_tasks(out_dir: str, shards_dir: str, n_images: int, shard_size: int, selection: str) -> dict:
    """After every write task: check each shard's record, remove stale shards, write the pool index.
    Returns {"shards": [paths], "written": n, "failed": [(id, reason)]} (failed: images unreadable now).

    Per kept image nothing is held here: a record gives its shard's member count, and the pool index is written
    a shard at a time from the shards' location parts (:func:`dinopipe.data.pool_index.write_tar_index`)."""
    n_shards = -(-n_images // shard_size)
    rec_dir = RunLayout(out_dir).steps("write")
    counts, failed, missing = np.zeros(n_shards, np.int64), [], []
    for j in range(n_shards):
        rec = _read_json(_record_paths(rec_dir, j)[0])
        if rec is None or rec["selection"] != selection or "n_members" not in rec:
            missing.append(j)
            continue
        counts[j] = rec["n_members"]
        failed.extend(tuple(f) for f in rec["failed"])
    if missing:
        raise InputError(f"shards {missing[:10]}{'...' if len(missing) > 10 else ''} of {n_shards} are not "
                           f"written yet: rerun the write tasks (finished shards are skipped)")
    present = np.flatnonzero(counts)
    shards = [os.path.join(shards_dir, f"shard-{j:06d}.tar") for j in present]
    index_path = os.path.join(shards_dir, INDEX_NAME)
    if _remove_stale_shards(shards_dir, shards, "shard"):
        write_tar_index(index_path, shards, counts[present],
                        lambda k: np.load(_record_paths(rec_dir, int(present[k]))[1]), root=None)
    elif os.path.exists(index_path):
        os.remove(index_path)
    return {"shards": shards, "written": int(counts.sum()), "failed": failed}


def _remove_stale_shards(out_dir: str, present: list[str], prefix: str) -> bool:
    """Remove ``<prefix>-*.tar`` shards of an earlier, larger selection (training would read them); True when the
    folder then holds exactly ``present`` (non-empty): that is what a trainer pointed at it reads, so an index
    of them is valid."""
    keep = set(present)
    for old in glob.glob(os.path.join(out_dir, f"{prefix}-*.tar")):
        if old not in keep:
            os.remove(old)
    return bool(present) and set(glob.glob(os.path.join(out_dir, "*.tar"))) == keep


def _read_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


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
    """Counts per status, overall and per source, from one status per input id (small pools, tests;
    the pipeline sums the counts of its decisions parts with :func:`manifest_from_counts`).

    ``statuses``: id -> one of :data:`STATUSES`; ``sources``: id -> source name;
    ``unreadable_reasons``: id -> reason for the unreadable ones.
    """
    per_source: dict[str, Counter] = defaultdict(Counter)
    reasons: dict[str, Counter] = defaultdict(Counter)
    for image_id, status in statuses.items():
        per_source[sources[image_id]][status] += 1
        if status == "unreadable":
            reasons[sources[image_id]][unreadable_reasons.get(image_id, "unknown")] += 1
    return manifest_from_counts(per_source, reasons, extra)


def manifest_from_counts(per_source: dict[str, dict], reasons: dict[str, dict], extra: dict | None = None) -> dict:
    """The manifest from ``{source: {status: n}}`` and ``{source: {unreadable reason: n}}`` (e.g. summed
    over the decisions parts). Raises if a status is unknown or the counts do not add up."""
    bad = {s for c in per_source.values() for s, n in c.items() if n and s not in STATUSES}
    if bad:
        raise ValueError(f"unknown statuses {sorted(bad)}; expected one of {STATUSES}")
    total, all_reasons = Counter(), Counter()
    for c in per_source.values():
        total.update(c)
    for c in reasons.values():
        all_reasons.update(c)

    def counts(c) -> dict:
        return {"input": int(sum(c.values())), **{s: int(c.get(s, 0)) for s in STATUSES}}

    manifest = {
        "counts": counts(total),
        "unreadable_reasons": dict(sorted((k, int(v)) for k, v in all_reasons.items() if v)),
        "per_source": {
            name: {**counts(c), "unreadable_reasons": dict(sorted((k, int(v)) for k, v in
                                                               reasons.get(name, {}).items() if v))}
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


