"""Hash dedup as W tasks of the step runner, computed once and saved (issue 30): W=1 and W=3 give the same
groups, `curate index` / `curate dedup` read the saved result, and a killed task's rerun redoes only its part."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from curation.cli import main
from curation.config import DedupConfig
from curation.core.embstore import open_embeddings
from curation.dedup.hash_step import hash_dir, hash_step
from curation.core.stepfiles import load_step
from curation.core.runner import write_part

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


def _args(step: str, pool, out, *extra) -> list[str]:
    return [step, "--config", QUICKSTART, f"input.paths=[{pool}]", f"output.dir={out}", "progress=false",
            "embed.num_workers=0", "report.enabled=false", *extra]


@pytest.fixture(scope="module")
def embedded(pool_dir, tmp_path_factory):
    pool = pool_dir[0]
    out = tmp_path_factory.mktemp("hash_tasks") / "base"
    assert main(_args("embed", pool, out)) == 0
    return pool, out


def _run(out, pool, w: int):
    emb = open_embeddings(str(out / "embeddings" / "descriptor"))
    d = DedupConfig()
    return hash_step(str(out), emb, True, 4, ([str(pool)], d.verify_size, d.verify_threshold),
                     {"tasks": w, "launcher": "inline"})


def test_hash_dedup_as_one_and_three_tasks_is_the_same_saved_once_and_a_killed_task_reruns(embedded, tmp_path):
    pool, base = embedded
    one, three = tmp_path / "one", tmp_path / "three"
    shutil.copytree(base, one)
    shutil.copytree(base, three)
    h1, info1 = _run(one, pool, 1)
    h3, info3 = _run(three, pool, 3)
    np.testing.assert_array_equal(h1.group, h3.group)
    np.testing.assert_array_equal(h1.keep, h3.keep)
    assert h1.n_duplicates >= 4  # the planted re-encoded / resized copies
    assert (info1["tasks"], info3["tasks"]) == (1, 3) and not info3["reused"]
    parts = sorted(os.listdir(os.path.join(hash_dir(str(three)), "parts")))
    assert parts == [f"pairs-{t:05d}-of-00003.npz" for t in range(3)]
    # every hash duplicate was verified on pixels, its kept image's pairs in one task
    assert len(os.listdir(os.path.join(hash_dir(str(three)), "verify"))) == 3

    # a second call (as `curate index`, a `curate search` task or `curate dedup`) reads the saved result
    again, info = _run(three, pool, 3)
    assert info["reused"] and np.array_equal(again.group, h3.group)

    # task 1 was killed before its part was written (the grouping never ran): only it is redone
    os.remove(os.path.join(hash_dir(str(three)), "result.json"))
    os.remove(os.path.join(hash_dir(str(three)), "parts", "pairs-00001-of-00003.npz"))
    h3b, info = _run(three, pool, 3)
    assert [bool(r.get("skipped")) for r in info["pair_tasks"]] == [True, False, True]
    np.testing.assert_array_equal(h3b.group, h1.group)
    assert isinstance(h3b.group, np.memmap) and isinstance(h3b.keep, np.memmap)  # mapped, not held

    # an output folder of an older version (result.npz, whole arrays) is read, not recomputed
    folder = hash_dir(str(three))
    write_part(os.path.join(folder, "result.npz"), group=np.array(h3b.group), keep=np.array(h3b.keep),
               n_pairs=np.int64(h3b.n_pairs))
    for f in ("group.npy", "keep.npy", "result.json"):
        os.remove(os.path.join(folder, f))
    old, info = _run(three, pool, 3)
    assert info["reused"] and np.array_equal(old.group, h1.group) and old.n_pairs == h3b.n_pairs


def test_index_and_dedup_read_the_saved_hash_dedup(embedded, tmp_path):
    """`curate index` computes the hash dedup once (as tasks.count tasks) and `curate dedup` reads it back:
    a change planted in the saved file is what dedup uses."""
    pool, base = embedded
    out = tmp_path / "o"
    shutil.copytree(base, out)
    assert main(_args("index", pool, out, "tasks.count=2")) == 0
    saved = hash_dir(str(out))
    assert sorted(os.listdir(os.path.join(saved, "parts"))) == [f"pairs-{t:05d}-of-00002.npz" for t in range(2)]
    group, keep = (np.load(os.path.join(saved, f"{a}.npy")) for a in ("group", "keep"))
    dup = np.flatnonzero(~keep)
    assert len(dup) >= 4
    keep[dup[0]], group[dup[0]] = True, dup[0]  # planted: dedup must take these files, not recompute them
    np.save(os.path.join(saved, "group.npy"), group)
    np.save(os.path.join(saved, "keep.npy"), keep)
    assert main(_args("dedup", pool, out, "tasks.count=2")) == 0
    status = load_step(str(out), "dedup")["status"]
    assert np.array_equal(np.flatnonzero(status == 1), dup[1:])  # HASH_DUP: the saved result's duplicates


def test_hash_dedup_off_holds_nothing_per_row_and_the_knn_finds_the_copies(embedded, tmp_path):
    """hash_dedup.enabled=false: every row its own group and kept -- read a block at a time from a broadcast view
    and per-block positions (no int64 or bool per row in the orchestrator) -- and the copies the hash step would
    have taken go to the kNN dedup instead."""
    from curation.core.status import COPY_DUP, HASH_DUP

    pool, base = embedded
    off = tmp_path / "off"
    shutil.copytree(base, off)
    emb = open_embeddings(str(off / "embeddings" / "descriptor"))
    h, info = hash_step(str(off), emb, False)
    assert info == {"tasks": 0, "reused": False} and h.n_duplicates == 0 and h.n_pairs == 0
    assert h.keep.strides == (0,) and bool(h.keep.all())  # one byte, not one per row
    np.testing.assert_array_equal(h.group[3:9], np.arange(3, 9))
    np.testing.assert_array_equal(np.asarray(h.group), np.arange(len(emb)))
    assert not os.path.exists(hash_dir(str(off))) or not os.listdir(hash_dir(str(off)))
    assert main(_args("dedup", pool, off, "hash_dedup.enabled=false")) == 0
    status = np.asarray(load_step(str(off), "dedup")["status"])
    assert not (status == HASH_DUP).any() and (status == COPY_DUP).sum() >= 4  # the planted copies, by the kNN
