"""Copy dedup's verification tasks read their own candidate pairs from the kNN chunk files
(curation.verify.tasks, issue 40): the orchestrator reads only the verified edges, decides as the keys path
(knn_shards.pair_keys -> dedup.copy_dedup_from_keys) did, for any W, and holds almost nothing per row."""

from __future__ import annotations

import functools
import json
import os
import tracemalloc

import numpy as np
import pytest

from curation.knn import shards as knn_shards
from curation.verify import tasks as verify_tasks
from curation.dedup.copies import copy_dedup_from_edges, copy_dedup_from_keys
from curation.knn.shards import KnnJob, chunk_path, pair_keys
from curation.verify.pixels import PartedVerifier
from curation.verify.tasks import verified_edges

from .test_dedup_pair_keys import THRESHOLD, _chunks

CHUNK = 4096


def rare_verdict(x, y, keep_one_in: int = 3):
    """A deterministic verdict per pair (positions): accepts about one pair in ``keep_one_in``."""
    return (np.asarray(x) * 7 + np.asarray(y) * 13) % keep_one_in == 0


def verdict_factory(keep_one_in: int = 3):
    """Picklable: the verifier each task builds (a fresh process imports this module)."""
    return functools.partial(rare_verdict, keep_one_in=keep_one_in)


def _job(out: str, n: int, per_row: int = 12, chunk: int = CHUNK) -> KnnJob:
    """A pool kNN job folder as the search leaves it: meta.json + an index file + the chunk files."""
    job = KnnJob(out, "pool")
    os.makedirs(job.chunks_dir, exist_ok=True)
    with open(job.index_path, "wb") as f:
        f.write(b"not read here")
    with open(job.meta_path, "w") as f:
        json.dump({"kind": "flat", "params": {"rows": f"n{n}", "k": 64, "threshold": THRESHOLD,
                                              "chunk_size": chunk}}, f)
    for c, (_, d) in enumerate(_chunks(n, per_row, chunk)):
        np.savez(chunk_path(job.chunks_dir, c), a=d["a"], b=d["b"], sim=d["sim"])
    return job


def _old(out: str, n: int, keep_one_in: int, grouping: str = "star", ids=None):
    """Main's path: every candidate key in this process, verified through PartedVerifier."""
    job = KnnJob(out, "pool")
    pv = PartedVerifier(verdict_factory(keep_one_in), os.path.join(out, "old-verify"), 1)
    ids = np.arange(n) if ids is None else ids
    return copy_dedup_from_keys(n, ids, lambda: pair_keys(job.iter(n), n, THRESHOLD), verifier=pv,
                                grouping=grouping)


def _new(out: str, n: int, keep_one_in: int, w: int, launcher: str, grouping: str = "star", ids=None):
    parts = os.path.join(out, "steps", "verify")
    factory = functools.partial(verdict_factory, keep_one_in)
    lo, hi, cand, secs, got = verified_edges(out, n, THRESHOLD, parts, w, launcher, factory)
    res = copy_dedup_from_edges(n, np.arange(n) if ids is None else ids, lo, hi, n_candidates=cand, verifier=factory(),
                                grouping=grouping, verify_seconds=secs)
    return res, got


@pytest.mark.parametrize("grouping", ["star", "components"])
def test_tasks_decide_as_the_keys_path_for_any_w(tmp_path, monkeypatch, grouping):
    monkeypatch.setattr(verify_tasks, "OWN_BLOCK", 64)  # several ownership blocks per task on a small pool
    monkeypatch.setattr(knn_shards, "PAIR_SLICE", 1000)  # several slices per chunk
    monkeypatch.setattr(verify_tasks, "VERIFY_SLICE", 512)  # several verifier calls per (inline) task
    n = 3000
    _job(str(tmp_path), n)
    old = _old(str(tmp_path), n, 3, grouping)
    assert old.n_duplicates > n // 10
    for w, launcher in ((1, "inline"), (3, "inline"), (2, "local")):
        out = tmp_path / f"w{w}{launcher}"
        out.mkdir()
        os.symlink(tmp_path / "knn", out / "knn")
        new, got = _new(str(out), n, 3, w, launcher, grouping)
        np.testing.assert_array_equal(np.asarray(new.component), np.asarray(old.component))
        np.testing.assert_array_equal(np.asarray(new.keep), np.asarray(old.keep))
        assert (new.n_edges, new.n_candidates) == (old.n_edges, old.n_candidates), (w, launcher)
        # each task verified its own pairs: the candidates are the sum of the parts, split about evenly
        cands = [g["result"]["candidates"] for g in got]
        assert sum(cands) == old.n_candidates and len(cands) == w and min(cands) > 0.6 * old.n_candidates / w
        assert [g["result"]["computed"] for g in got] == [1] * w
        # a rerun reads the finished parts back; a killed task's rerun computes only its part
        os.remove(out / "steps" / "verify" / f"cand-part-{w - 1:05d}-of-{w:05d}.npz")
        again, got = _new(str(out), n, 3, w, launcher, grouping)
        assert [g["result"]["computed"] for g in got] == [0] * (w - 1) + [1]
        np.testing.assert_array_equal(np.asarray(again.component), np.asarray(old.component))


def test_a_changed_verifier_verifies_again(tmp_path):
    n = 1000
    _job(str(tmp_path), n)
    a, _ = _new(str(tmp_path), n, 3, 1, "inline")
    b, got = _new(str(tmp_path), n, 5, 1, "inline")  # another verification threshold: another digest
    assert got[0]["result"]["computed"] == 1 and a.n_candidates == b.n_candidates and b.n_edges < a.n_edges


def _traced_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


PER_ROW = 27  # directed pairs per row: the default config's (k=64, cosine 0.45) in the 300k simulation
RARE = 800  # about 1 verified copy per 100 rows, as the 300k simulation's 2,932 edges of 8.28M candidates


def test_orchestrator_holds_the_verified_edges_only(tmp_path):
    """The orchestrator's heap (tracemalloc; the W = 2 tasks run in their own processes) while the tasks verify
    the candidates and it groups the edges, at N and 2N rows: its growth per row. Measured (2026-11-28, 27
    directed pairs per row, 1 verified copy in 800 candidates): the keys path (pair_keys -> copy_dedup_from_keys,
    main) 400-454 B per row, the tasks 0.66 B per row (the block-bounded id-order check). The part files, not this
    process, held the candidates."""
    n = 20_000
    warm = tmp_path / "warm"  # the launcher's and the verifier's first imports: not per row, made before tracing
    _job(str(warm), 1000, PER_ROW)
    _old(str(warm), 1000, RARE)
    _new(str(warm), 1000, RARE, 2, "local")
    held = {}
    for name in ("old", "new"):
        peaks = []
        for m in (n, 2 * n):
            out = tmp_path / f"{name}{m}"
            _job(str(out), m, PER_ROW)
            ids = np.arange(m)  # an input (the pipeline reads it a block at a time): made before tracing
            if name == "old":
                peaks.append(_traced_peak(lambda: _old(str(out), m, RARE, ids=ids)))
            else:
                peaks.append(_traced_peak(lambda: _new(str(out), m, RARE, 2, "local", ids=ids)))
                cands = sum(int(np.load(p)["candidates"]) for p in sorted((out / "steps" / "verify").iterdir()))
                assert cands > 7 * m  # the tasks' parts counted the candidates (~8 unique pairs per row)
                assert not [f for f in os.listdir(out / "steps" / "verify") if "pairs" in f]  # no pairs file
        held[name] = (peaks[1] - peaks[0]) / n
    print(f"orchestrator copy dedup with a verifier, B per row: {held}")
    assert held["old"] > 50, held
    assert held["new"] < 2, held
