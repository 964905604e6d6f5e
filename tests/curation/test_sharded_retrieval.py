"""Sample-based retrieval (rebalance.mode=sample) on the sharded kNN: `curate rebalance` searching in
its own process vs `curate index` after decontaminate + 3 `curate search` array tasks over chunks of
the seeds select exactly the same images (byte-identical decisions.tsv and rebalance outputs)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
from tests._photos import encode, make_copy

from curation.cli import main
from curation.core.embstore import open_embeddings
from curation.knn.index import Rows
from curation.knn.candidates import exact_cosine
from curation.rebalance.modes import rebalance
from curation.core.stepfiles import load_step

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


def _args(cmd, pool_root, seed_root, out, *extra):
    return [cmd, "--config", QUICKSTART, f"input.paths=[{pool_root}]", f"output.dir={out}", "progress=false",
            f"input.seed_paths=[{seed_root}]", "rebalance.mode=sample", "rebalance.k=3",
            "knn.chunk_size=2", "knn.batch_size=2", "embed.num_workers=0", "report.enabled=false", *extra]


def test_one_and_three_search_tasks_retrieve_the_same_selection(pool_dir, photos, tmp_path):
    root, _ = pool_dir
    seed_root = tmp_path / "seeds"
    seed_root.mkdir()
    names = sorted(photos)
    for n in names[2:20:3]:  # six resized pool photos: the curated seed set (3 chunks of 2)
        (seed_root / f"{n}.jpg").write_bytes(encode(make_copy(photos[n], "resize")))
    base = tmp_path / "deduped"
    for step in ("embed", "dedup", "decontaminate"):
        assert main(_args(step, root, seed_root, base)) == 0, step
    one, three = tmp_path / "one", tmp_path / "three"
    shutil.copytree(base, one)
    shutil.copytree(base, three)
    # Slurm: `curate index` rerun after decontaminate adds the retrieval index, then the array
    assert main(_args("index", root, seed_root, three)) == 0
    for t in range(3):
        assert main(_args("search", root, seed_root, three, f"knn.task_index={t}", "knn.num_tasks=3")) == 0
        with open(three / "steps" / f"search-{t:05d}.json") as f:
            assert json.load(f)["retrieval"] == {"chunks": 1, "computed": 1, "skipped": 0}
    chunks = three / "knn" / "retrieval" / "chunks"
    stamps = {c: os.stat(chunks / c).st_mtime_ns for c in os.listdir(chunks)}
    assert len(stamps) == 3
    for out_dir in (one, three):
        for step in ("rebalance", "write"):
            assert main(_args(step, root, seed_root, out_dir)) == 0, (out_dir, step)
    # the merging step only read the array's chunks
    assert {c: os.stat(chunks / c).st_mtime_ns for c in os.listdir(chunks)} == stamps
    d1, d3 = (one / "decisions.tsv").read_text(), (three / "decisions.tsv").read_text()
    assert d1 == d3
    r1, r3 = load_step(str(one), "rebalance"), load_step(str(three), "rebalance")
    for key in r1:
        np.testing.assert_array_equal(r1[key], r3[key], err_msg=key)
    kept = r1["status"] == 0
    # 6 seeds x k=3 retrieve at most 18 images; each seed's own photo comes back, nearest to it
    assert 6 <= kept.sum() <= 18 and (r1["status"] == 4).sum() > 10
    assert (r1["seed_sim"][kept] > 0.99).sum() >= 6 and np.isnan(r1["seed_sim"][~kept]).all()
    seeds = open_embeddings(str(one / "embeddings" / "seeds"))  # nearest_seed: int64 rows of the seeds
    stems = [s.rsplit("/", 1)[-1] for s in seeds.id_strings(r1["nearest_seed"][kept])]
    assert len(set(stems)) == 6
    # a stale retrieval index (other rows) does not block a later pool search; it is reported
    meta_path = three / "knn" / "retrieval" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["params"]["rows"] = "0" * 16
    meta_path.write_text(json.dumps(meta))
    assert main(_args("search", root, seed_root, three)) == 0
    with open(three / "steps" / "search-00000.json") as f:
        assert "rerun `curate index`" in json.load(f)["retrieval"]["skipped"]


def test_sample_mode_scores_exactly_and_breaks_ties_by_seed():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    x = x.astype(np.float16).astype(np.float32)
    seeds = np.concatenate([x[[5, 5, 40]], x[[77]]])  # seeds 0 and 1 are identical: a tie
    res = rebalance("sample", x, seeds, k=2, balance_clusters=4)
    assert res.selected[[5, 40, 77]].all() and res.n_selected <= 8
    assert res.nearest_seed[5] == 0 and res.nearest_seed[40] == 2 and res.nearest_seed[77] == 3
    sel = np.flatnonzero(res.selected)
    want = exact_cosine(Rows(seeds), res.nearest_seed[sel], Rows(x), sel).astype(np.float32)
    np.testing.assert_array_equal(res.seed_sim[sel], want)
