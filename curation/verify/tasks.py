"""Copy dedup's verification as W tasks that read their own candidate pairs from the kNN chunk files.

Before (issue 40), the orchestrator read every chunk into one int64 key per candidate pair (~27 pairs per row at
the default k = 64 / cosine 0.45), split them into (lo, hi) and handed them to the verification tasks through a
file: ~1.7 kB per row held while they ran, although only a few candidates are copies (2,932 of 8.28M at 300k).
Here each task streams the chunk files itself (``KnnJob(out_dir, 'pool').iter``), keeps the unordered pairs above
the threshold that it owns, verifies them with its own verifier (``factory()``: one feature cache per task) and
writes a part: its verified edges and its candidate count. The orchestrator reads only the edges.

Ownership: pair (lo, hi) (positions, which are ranks: the rows are in canonical id order) belongs to task
``(lo // OWN_BLOCK) % W`` -- whole blocks of first images dealt round-robin, so every pair of an image as the
smaller end is in one task (its decode is cached once) and the tasks get about as many pairs each (a range split
would give task 0 most pairs: row r is the smaller end of its pairs with rows after it). The candidates are the
ones ``knn_shards.pair_keys`` keeps (the float32 comparison, self and -1 pairs dropped), each verified once,
in key order within the task: the union over the tasks is the orchestrator's old candidate set, so the decisions
are the same for any W.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from typing import Callable

import numpy as np

from dinopipe.utils.exits import UnfinishedError

from curation.knn.shards import KnnJob, pair_keys
from curation.core.runner import launch, part_path, read_part, run_step, write_part

OWN_BLOCK = 1024
"""First images (ranks) per ownership block; blocks go to the tasks round-robin."""
VERIFY_SLICE = 1 << 17
"""Pairs handed to the verifier at a time: a multiple of PixelVerifier's ``batch_pairs`` (512), so its batches are
the ones one call over all the task's pairs makes (and its feature cache carries over between the calls). A slice's
temporaries are the task's constant, ~56 B per pair with the simulation's planted verifier: 59 MB at 1 << 20 pairs,
which more tasks cannot shrink (at 10M rows with 1% querying it was most of a verification task's heap)."""
PART = "cand-part"


def owner(lo: np.ndarray, num_tasks: int) -> np.ndarray:
    """The task owning each pair with smaller end ``lo``."""
    return (np.asarray(lo, np.int64) // OWN_BLOCK) % num_tasks


def own_keys(chunks, n: int, threshold: float, task_index: int, num_tasks: int) -> np.ndarray:
    """Sorted unique keys ``lo * n + hi`` of this task's candidate pairs in ``chunks`` (``KnnJob.iter``): the
    subset of ``knn_shards.pair_keys``' keys whose ``lo`` the task owns (the same tests, the cosine compared as
    float32). 8 B per own pair held."""
    return pair_keys(chunks, n, threshold, own=lambda lo: owner(lo, num_tasks) == task_index)


def verifier_key(factory: Callable) -> str:
    """What of the verifier a part's digest covers: the factory's function and what it is built from -- plain
    arguments (sizes, thresholds) as they are, a file argument (a row file) with its content's sha1, an object
    that says which of its settings matter (``digest_key()``, e.g. a PixelVerifier) by those, a nested partial
    likewise -- so a rerun with another verification setting, or other rows, verifies again. Anything else (a
    source, a per-row array) by its type alone: walking it held O(pool) bytes in the orchestrator
    (tests/curation/test_step_memory.py)."""
    return json.dumps(_stable(factory), sort_keys=True)


def _stable(x, depth: int = 0):
    if x is None or isinstance(x, (bool, int, float)):
        return x
    if isinstance(x, (str, os.PathLike)):
        x = os.fspath(x)
        return [x, _file_sha1(x)] if os.path.isfile(x) else x
    if isinstance(x, np.generic):
        return x.item()
    if depth < 4 and isinstance(x, functools.partial):
        return ["partial", _stable(x.func, depth + 1), [_stable(v, depth + 1) for v in x.args],
                {str(k): _stable(v, depth + 1) for k, v in sorted(x.keywords.items())}]
    if depth < 4 and callable(getattr(x, "digest_key", None)):  # an object that says which settings matter
        return [f"{type(x).__module__}.{type(x).__qualname__}", _stable(x.digest_key(), depth + 1)]
    if depth < 4 and dataclasses.is_dataclass(x) and not isinstance(x, type):  # a config section
        return [type(x).__qualname__, {f.name: _stable(getattr(x, f.name), depth + 1) for f in dataclasses.fields(x)}]
    if depth < 4 and isinstance(x, dict) and len(x) <= 64:
        return {str(k): _stable(v, depth + 1) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if depth < 4 and isinstance(x, (list, tuple)) and len(x) <= 64:
        return [_stable(v, depth + 1) for v in x]
    if callable(x) and hasattr(x, "__qualname__"):
        return f"{getattr(x, '__module__', '')}.{x.__qualname__}"
    # any other object: its type and its plain public settings (numbers, strings), never its containers
    public = vars(x) if hasattr(x, "__dict__") else {}
    plain = {k: _stable(v, depth + 1) for k, v in sorted(public.items())
             if not k.startswith("_") and (v is None or isinstance(v, (bool, int, float, str)))}
    return [f"{type(x).__module__}.{type(x).__qualname__}", plain]


def _file_sha1(path: str) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):  # a small buffer: the file is O(pool)
            h.update(chunk)
    return h.hexdigest()[:16]


def part_digest(params: dict, n: int, threshold: float, num_tasks: int, vkey: str) -> str:
    """Everything a part depends on: the kNN job's parameters (rows, k, index, ...), n, the threshold, W, the
    ownership and the verifier."""
    blob = json.dumps([params, int(n), float(threshold), int(num_tasks), OWN_BLOCK, vkey], sort_keys=True,
                      default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def verify_candidates_task(t: int, w: int, out_dir: str, n: int, threshold: float, parts_dir: str, digest: str,
                           factory: Callable) -> dict:
    """Task ``t`` of ``w``: its candidate pairs from the chunk files, verified by ``factory()``'s verifier (over
    positions, smaller id first), written as ``<parts_dir>/cand-part-TTTTT-of-WWWWW.npz`` (lo, hi of the verified
    edges, the candidate count, the digest) atomically. A part with the same digest is kept (a rerun skips it)."""
    path = part_path(parts_dir, PART, t, w)
    if os.path.exists(path):
        with np.load(path, allow_pickle=False) as z:
            if str(z["digest"]) == digest:
                return {"candidates": int(z["candidates"]), "edges": int(len(z["lo"])), "computed": 0,
                        "seconds": 0.0}
    keys = own_keys(KnnJob(out_dir, "pool").iter(n), n, threshold, t, w)
    n_cand, los, his = len(keys), [], []
    t0 = time.perf_counter()
    verify = factory() if n_cand else None
    for s in range(0, n_cand, VERIFY_SLICE):  # (lo, hi) a slice at a time, not two more int64 per pair
        lo, hi = np.divmod(keys[s:s + VERIFY_SLICE], n)
        ok = np.asarray(verify(lo, hi), bool)
        los.append(lo[ok])
        his.append(hi[ok])
    del keys
    lo = np.concatenate(los) if los else np.zeros(0, np.int64)
    hi = np.concatenate(his) if his else np.zeros(0, np.int64)
    seconds = time.perf_counter() - t0
    write_part(path, lo=lo, hi=hi, candidates=np.int64(n_cand), digest=np.array(digest))
    return {"candidates": n_cand, "edges": int(len(lo)), "computed": 1, "seconds": seconds}


def verified_edges(out_dir: str, n: int, threshold: float, parts_dir: str, num_tasks: int, launcher: str,
                   factory: Callable):
    """(lo, hi, candidates, seconds, task reports): the verified edges of every task's part, sorted by key (rank
    space: the rows in canonical order), the candidate count (the sum of the parts') and the tasks' verification
    seconds. ``launcher``: the plan's (curation.core.runner.launch: inline -> the tasks in this process, each
    building its verifier with ``factory``; local / srun -> W processes; slurm / dist -> this process's task)."""
    job = KnnJob(out_dir, "pool")
    digest = part_digest(job.meta()["params"], n, threshold, num_tasks, verifier_key(factory))
    got = run_step(verify_candidates_task, num_tasks, **launch(launcher, num_tasks), out_dir=out_dir, n=n,
                   threshold=float(threshold), parts_dir=parts_dir, digest=digest, factory=factory)
    los, his, cand, seconds = [], [], 0, 0.0
    for t in range(num_tasks):
        p = read_part(part_path(parts_dir, PART, t, num_tasks))
        if str(p["digest"]) != digest:
            raise UnfinishedError(f"{part_path(parts_dir, PART, t, num_tasks)}: a part of another run "
                                  "(its digest differs): its task did not write it again")
        los.append(p["lo"])
        his.append(p["hi"])
        cand += int(p["candidates"])
    for g in got:
        seconds += float(g["result"].get("seconds", 0.0))
    lo, hi = np.concatenate(los).astype(np.int64), np.concatenate(his).astype(np.int64)
    srt = np.argsort(lo * n + hi, kind="stable")
    return lo[srt], hi[srt], cand, seconds, got
