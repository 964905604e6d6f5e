"""The files of a curation output folder that several steps share: statuses (``steps/<step>/<array>.npy``, one
memory-mappable array per file, ``done.json`` last), the copy space (descriptor or copy model) and the rows
rebalancing clusters.

A leaf of the curation step modules: :mod:`curation.pipeline`, :mod:`curation.dedup.knn`,
:mod:`curation.kmeans.dist` and :mod:`curation.report.plots` import from here, and this module imports none of
them (tests/curation/test_import_graph.py walks every import and fails on a cycle).
"""

from __future__ import annotations

import json
import os

import numpy as np

from dinopipe.config import ConfigError
from dinopipe.utils.io import atomic_path, atomic_write_json

from curation.core.embstore import open_embeddings
from curation.core.runner import BLOCK

from curation.core.status import KEPT
from curation.core.layout import RunLayout


STEP_DONE = "done.json"
"""Written last into ``steps/<step>/``: without it the folder is a step still being written (or killed)."""


def step_dir(out_dir: str, name: str) -> str:
    return RunLayout(out_dir).steps(name)


def _legacy_path(out_dir: str, name: str) -> str:
    return RunLayout(out_dir).steps(f"{name}.npz")  # the format before one .npy per array (still read)


def step_exists(out_dir: str, name: str) -> bool:
    """Whether step ``name`` has finished writing its arrays (either format)."""
    return os.path.exists(os.path.join(step_dir(out_dir, name), STEP_DONE)) or \
        os.path.exists(_legacy_path(out_dir, name))


def step_path(out_dir: str, name: str) -> str:
    """The file or folder a step's arrays are read from (for messages): the folder, else an old ``.npz``."""
    d = step_dir(out_dir, name)
    return d if os.path.exists(os.path.join(d, STEP_DONE)) or not os.path.exists(_legacy_path(out_dir, name)) \
        else _legacy_path(out_dir, name)


def _save_step(out_dir: str, name: str, **arrays) -> None:
    """``steps/<name>/<key>.npy`` per array, each written atomically, then ``done.json`` (names, dtypes,
    shapes) last: a reader sees a finished step or none, and a task can memory-map the rows it owns."""
    d = step_dir(out_dir, name)
    os.makedirs(d, exist_ok=True)
    done = os.path.join(d, STEP_DONE)
    if os.path.exists(done):
        os.remove(done)  # rewriting: unfinished until every array is replaced
    for key, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.hasobject:
            raise TypeError(f"step '{name}' array '{key}' holds Python objects: steps store numeric arrays only")
        with atomic_path(os.path.join(d, f"{key}.npy"), suffix=".npy") as tmp:
            np.save(tmp, a, allow_pickle=False)
    for stale in os.listdir(d):  # arrays of an earlier version of this step
        if stale.endswith(".npy") and stale[:-4] not in arrays:
            os.remove(os.path.join(d, stale))
    atomic_write_json(done, {"arrays": {k: {"dtype": np.asarray(a).dtype.str, "shape": list(np.shape(a))}
                                        for k, a in arrays.items()}})
    legacy = _legacy_path(out_dir, name)
    if os.path.exists(legacy):
        os.remove(legacy)  # the folder replaces it


class StepWriter:
    """A step's arrays written in place, block by block, as memory-mapped ``.npy`` files (so the orchestrating
    process never holds a whole array): :meth:`array` opens ``steps/<name>/<key>.npy`` under a temporary name,
    :meth:`finish` flushes, moves each into place, drops arrays of an earlier version and writes ``done.json``
    last (the same layout and guarantee as :func:`_save_step`: a reader sees a finished step or none)."""

    def __init__(self, out_dir: str, name: str) -> None:
        self.out_dir, self.name, self.dir = out_dir, name, step_dir(out_dir, name)
        os.makedirs(self.dir, exist_ok=True)
        done = os.path.join(self.dir, STEP_DONE)
        if os.path.exists(done):
            os.remove(done)  # rewriting: unfinished until every array is replaced
        self.arrays: dict[str, np.memmap] = {}

    def array(self, key: str, dtype, n: int, fill=None) -> np.ndarray:
        """A writable memory-mapped (n,) array of ``dtype`` (``fill``: set a block at a time)."""
        a = np.lib.format.open_memmap(os.path.join(self.dir, f"{key}.tmp.npy"), mode="w+", dtype=np.dtype(dtype),
                                      shape=(int(n),))
        if fill is not None:
            for s in range(0, len(a), BLOCK_ROWS):
                a[s:s + BLOCK_ROWS] = fill
        self.arrays[key] = a
        return a

    def finish(self) -> None:
        meta = {}
        for key, a in self.arrays.items():
            a.flush()
            meta[key] = {"dtype": a.dtype.str, "shape": list(a.shape)}
            os.replace(os.path.join(self.dir, f"{key}.tmp.npy"), os.path.join(self.dir, f"{key}.npy"))
        self.arrays.clear()
        for stale in os.listdir(self.dir):  # arrays of an earlier version of this step
            if stale.endswith(".npy") and stale[:-4] not in meta:
                os.remove(os.path.join(self.dir, stale))
        atomic_write_json(os.path.join(self.dir, STEP_DONE), {"arrays": meta})
        legacy = _legacy_path(self.out_dir, self.name)
        if os.path.exists(legacy):
            os.remove(legacy)


BLOCK_ROWS = BLOCK
"""rows per block of the orchestrators' passes over whole-pool arrays (a block's temporaries, not the pool's;
curation.core.runner.BLOCK, 65536 unless the curate_block debug hook sets it)."""


def blocks(n: int, size: int = BLOCK_ROWS):
    """(start, stop) of consecutive blocks covering [0, n)."""
    for s in range(0, int(n), size):
        yield s, min(s + size, int(n))


def positions_where(out_dir: str, path: str, a: np.ndarray, pred) -> np.ndarray:
    """``np.flatnonzero(pred(a))`` as a memory-mapped int64 ``.npy`` at ``path``, computed a block at a time
    (two passes: count, fill), so no whole-pool temporary is built."""
    n_true = sum(int(np.count_nonzero(pred(a[s:e]))) for s, e in blocks(len(a)))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.int64, shape=(n_true,))
    at = 0
    for s, e in blocks(len(a)):
        p = np.flatnonzero(pred(a[s:e]))
        out[at:at + len(p)] = p + s
        at += len(p)
    out.flush()
    return np.load(path, mmap_mode="r")


def load_step(out_dir: str, name: str, keys=None, mmap: bool = False) -> dict:
    """The arrays of step ``name`` (``keys``: only these). ``mmap``: memory-mapped read-only arrays, so a task
    touches only the rows it indexes (a folder written before this format, ``steps/<name>.npz``, is read whole)."""
    d = step_dir(out_dir, name)
    done = os.path.join(d, STEP_DONE)
    if os.path.exists(done):
        with open(done) as f:
            names = list(json.load(f)["arrays"])
        return {k: np.load(os.path.join(d, f"{k}.npy"), mmap_mode="r" if mmap else None, allow_pickle=False)
                for k in names if keys is None or k in keys}
    path = _legacy_path(out_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{d} is missing or unfinished (no {STEP_DONE}): run the '{name}' step first")
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files if keys is None or k in keys}


def rebalance_rows(out_dir: str, scratch: str | None = None):
    """What the rebalance step clusters: (embedding folder, its positions of the rows still kept
    after dedup + decontamination, in canonical order, those rows' pool positions, the statuses: memory-mapped).
    Computed a block at a time; ``scratch``: a folder where the two position arrays are written as memory-mapped
    ``alive.scratch.npy`` / ``rows.scratch.npy`` (the caller removes them), else they are in memory."""
    status = load_step(out_dir, "decontaminate", keys=("status",), mmap=True)["status"]
    desc_set = open_embeddings(RunLayout(out_dir).embeddings("descriptor"))
    model_dir = RunLayout(out_dir).embeddings("model")
    space_dir = model_dir if os.path.isdir(model_dir) else RunLayout(out_dir).embeddings("descriptor")
    space = open_embeddings(space_dir)
    if space.digest != desc_set.digest:
        raise ConfigError(f"{space_dir} and the copy descriptors list different inputs: embed both in one "
                         f"`curate embed` run (use a fresh output folder)")
    if scratch is None:
        alive = np.flatnonzero(status == KEPT)
        rows_idx = np.empty(len(alive), np.int64)
    else:
        alive = positions_where(out_dir, os.path.join(scratch, "alive.scratch.npy"), status, lambda b: b == KEPT)
        rows_idx = np.lib.format.open_memmap(os.path.join(scratch, "rows.scratch.npy"), mode="w+", dtype=np.int64,
                                             shape=(len(alive),))
    for s, e in blocks(len(alive)):  # both sorted by input id: one pass, no dict
        want = desc_set.ids[alive[s:e]]
        got = np.searchsorted(space.ids, want)
        if len(got) and (got.max() >= len(space) or (space.ids[got] != want).any()):
            raise ConfigError(f"{space_dir} lacks rows the copy descriptors have: rerun `curate embed`")
        rows_idx[s:e] = got
    return space_dir, rows_idx, alive, status


def write_json_atomic(path: str, obj) -> None:
    atomic_write_json(path, obj, default=_json_default)


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
