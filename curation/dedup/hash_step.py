"""Hash pre-dedup as a step of the runner shape (curation.core.runner), computed once and saved.

Output (``<out>/steps/hash/``)::

    hash.json                   the parameters it was made for (rows digest, distance, verification)
    hashes.npy                  the pool's perceptual hashes (memory-mapped by the pair tasks)
    parts/pairs-T-of-W.npz      near pairs of the hash buckets task T owns (hashdedup.near_pairs_task)
    verify/call0-part-T-of-W.npz  verdicts of the (kept image, hash duplicate) pairs whose kept image task
                                T owns (curation.verify.pixels.PartedVerifier)
    group.npy, keep.npy         position of each row's group's kept image (int64), kept or not (bool): memory-mapped
                                by every reader (``result.npz`` of older runs is still read)
    result.json                 n_pairs; written last: the step is done

Three task steps: the pairs as W tasks (partitioned by band bucket: ``hashdedup`` module docstring), the
grouping in one task (union-find over sorted pair arrays: ~16 bytes per row), the pixel verification of
every hash duplicate against its group's kept image as W tasks (each owning whole kept images, so a kept
image is decoded once per task: the verifier's feature cache). ``curate index``, every ``curate search``
task and ``curate dedup`` map ``group.npy`` / ``keep.npy``; whichever runs first computes it (parts are atomic, a killed
task is rerun and finished parts are skipped). The groups do not depend on W.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import numpy as np

from dinopipe.utils.io import atomic_path

from curation.dedup.hashdedup import HashDedupResult, group_pairs, merge_pair_parts, near_pairs_task
from curation.config import DEFAULT_MAX_DISTANCE
from curation.core.runner import launch as run_launch
from curation.core.runner import BLOCK, part_done, part_path, parts, phase, read_part, run_step, save_blocks, write_part
from curation.core.unionfind import SparseRoots
from curation.core.layout import RunLayout


def hash_dir(out_dir: str) -> str:
    return RunLayout(out_dir).steps("hash")


def launch(fn, plan: dict | None, **kw) -> list[dict]:
    """``fn`` as the plan's W tasks (curation.config.task_plan): inline, W fresh local processes or W srun tasks."""
    plan = plan or {"tasks": 1, "launcher": "inline"}
    w = max(1, int(plan["tasks"]))
    return run_step(fn, w, **run_launch(plan["launcher"], w), **kw)


def pairs_task(t: int, w: int, folder: str, max_distance: int = DEFAULT_MAX_DISTANCE) -> dict:
    """Task ``t`` of ``w``: the near pairs of its band buckets, from the memory-mapped hashes."""
    out = part_path(os.path.join(folder, "parts"), "pairs", t, w)
    if part_done(out):
        return {"pairs": int(len(read_part(out)["a"])), "skipped": True}
    a, b = near_pairs_task(np.load(os.path.join(folder, "hashes.npy"), mmap_mode="r"), t, w, max_distance)
    write_part(out, a=a, b=b)
    return {"pairs": int(len(a))}


def pixel_verifier_of(sources, emb_dir: str, rows_path: str | None, size: int, threshold: float):
    """A picklable verifier factory's body: the pixel verifier over rows ``rows_path`` (None: all) of the
    embeddings in ``emb_dir``, built inside the task that uses it (curation.verify.pixels.pixel_verifier)."""
    from curation.core.embstore import open_embeddings
    from curation.verify.pixels import pixel_verifier  # torch: only in the tasks that verify pixels

    rows = None if rows_path is None else np.load(rows_path, mmap_mode="r")
    return pixel_verifier(sources, open_embeddings(emb_dir), rows, size, threshold)


def _params(emb, max_distance: int, verify_with) -> dict:
    v = None if verify_with is None else [int(verify_with[1]), float(verify_with[2])]
    return {"rows": emb.digest, "n": len(emb), "max_distance": int(max_distance), "verify": v}


def _load(folder: str, params: dict) -> HashDedupResult | None:
    """The saved result for ``params`` (its arrays memory-mapped), None when there is none."""
    try:
        with open(os.path.join(folder, "hash.json")) as f:
            if json.load(f) != params:
                return None
        if os.path.exists(os.path.join(folder, "result.json")):
            with open(os.path.join(folder, "result.json")) as f:
                n_pairs = int(json.load(f)["n_pairs"])
            return HashDedupResult(np.load(os.path.join(folder, "group.npy"), mmap_mode="r"),
                                   np.load(os.path.join(folder, "keep.npy"), mmap_mode="r"), n_pairs)
        r = read_part(os.path.join(folder, "result.npz"))  # written by an older version: whole arrays
    except (OSError, ValueError, KeyError):
        return None
    return HashDedupResult(r["group"], r["keep"], int(r["n_pairs"]))


def _save(folder: str, group, n_pairs: int, block: int = BLOCK) -> None:
    """``group`` and ``keep`` (= its own root) written a block at a time from ``group`` (an array or a
    unionfind.SparseRoots: no whole array made), atomic each; ``result.json`` last: a killed save leaves no
    result."""
    save_blocks(os.path.join(folder, "group.npy"), group, np.int64, block)
    save_blocks(os.path.join(folder, "keep.npy"), group, bool, block, fn=lambda g, s: g == np.arange(s, s + len(g)))
    _write_json(os.path.join(folder, "result.json"), {"n_pairs": int(n_pairs)})


class OwnGroups:
    """``group`` of the hash step turned off: each row is its own group's kept image -- ``group[s:t]`` is
    ``arange(s, t)``, made per block when read (the step's readers slice it a block at a time)."""

    def __init__(self, n: int) -> None:
        self.n, self.dtype = int(n), np.dtype(np.int64)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, sl: slice) -> np.ndarray:
        start, stop, step = sl.indices(self.n)
        return np.arange(start, stop, step, dtype=np.int64)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.arange(self.n, dtype=dtype or np.int64)


def hash_step(out_dir: str, emb, enabled: bool = True, max_distance: int = DEFAULT_MAX_DISTANCE,
              verify_with: tuple | None = None, plan: dict | None = None) -> tuple[HashDedupResult, dict]:
    """The saved hash dedup of ``out_dir`` (computed here as the plan's W tasks when missing or made for
    other rows or settings) -> (result, {"tasks": W, "reused": bool}).

    ``verify_with=(sources, size, threshold)``: pHash groups chain and smooth images share hashes, so each
    hash duplicate must also verify on pixels against its group's kept image (smallest id); one that does
    not stays in the pool and goes on to the kNN."""
    n = len(emb)
    if not enabled or n == 0:
        # every row its own group, kept: computed per block (no int64 and no bool per row in this process)
        return HashDedupResult(OwnGroups(n), np.broadcast_to(np.True_, (n,)), 0), {"tasks": 0, "reused": False}
    folder = hash_dir(out_dir)
    params = _params(emb, max_distance, verify_with)
    w = max(1, int((plan or {}).get("tasks", 1)))
    got = _load(folder, params)
    if got is not None:
        return got, {"tasks": w, "reused": True}
    if os.path.exists(os.path.join(folder, "hash.json")):  # made for other rows or settings: start again
        with open(os.path.join(folder, "hash.json")) as f:
            stale = json.load(f) != params
        if stale:
            shutil.rmtree(folder)
    os.makedirs(folder, exist_ok=True)
    _write_json(os.path.join(folder, "hash.json"), params)
    hashes_path = os.path.join(folder, "hashes.npy")
    if not os.path.exists(hashes_path):
        save_blocks(hashes_path, emb.hashes, np.uint64)  # a block at a time (the embeddings' hashes are mapped)
    ran = launch(pairs_task, plan, folder=folder, max_distance=max_distance)
    a, b = merge_pair_parts([(r["a"], r["b"]) for r in map(read_part, parts(os.path.join(folder, "parts"),
                                                                                "pairs", w))])
    with phase("hash_grouping"):  # rows in canonical order: stored for the images with a pair only
        group, keep = group_pairs(n, a, b, emb.ids, sparse=True)
    hashes = np.load(hashes_path, mmap_mode="r")
    n_pairs = int(np.count_nonzero(hashes[a] != hashes[b]))
    del a, b
    dup = group.non_roots() if isinstance(group, SparseRoots) else np.flatnonzero(~keep)
    if verify_with is not None and len(dup):
        from curation.verify.pixels import PartedVerifier

        sources, size, threshold = verify_with
        order = np.lexsort((dup, group[dup]))  # by kept image: its pairs come together (decoded once)
        va, vb = group[dup][order], dup[order]
        factory = functools.partial(pixel_verifier_of, sources, RunLayout(out_dir).embeddings("descriptor"),
                                    None, size, threshold)
        ok = PartedVerifier(None, os.path.join(folder, "verify"), w, (plan or {}).get("launcher", "inline"),
                            factory)(va, vb)
        lone = vb[~ok]
        group[lone] = lone  # kept again (keep is written from group)
    _save(folder, group, n_pairs)
    del group, keep  # the readers (and the rest of this step) map the saved arrays
    return _load(folder, params), {"tasks": w, "reused": False, "pair_tasks": [r["result"] for r in ran]}


def _write_json(path: str, obj) -> None:
    with atomic_path(path, suffix=".json") as tmp:
        with open(tmp, "w") as f:
            json.dump(obj, f)
