"""Decisions that do not depend on how the work was split: rows in canonical order (by input id).

On main, 3 `curate embed` tasks gave the pool's rows in task order, and on a 600-image pool 214 lines of
decisions.tsv differed from the single-task run (dedup for 4 images, the hierarchical selection for the
rest). Here: 1 vs 3 embedding tasks, and 1 vs 3 search tasks, on one pool of real photos with planted
copies, through the quickstart config (hierarchical rebalancing) -> identical decisions.tsv and shards."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from curation.cli import main
from curation.core.embstore import open_embeddings

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


def _args(step: str, pool, out, *extra) -> list[str]:
    return [step, "--config", QUICKSTART, f"input.paths=[{pool}]", f"output.dir={out}", "progress=false",
            "embed.num_workers=0", "embed.batch_size=8", "embed.shard_size=10", "knn.chunk_size=16",
            "report.enabled=false", "write.shard_size=7", *extra]


def test_one_and_three_embed_and_search_tasks_give_identical_decisions(pool_dir, tmp_path):
    pool = pool_dir[0]
    one, three = tmp_path / "one", tmp_path / "three"
    assert main(_args("embed", pool, one)) == 0
    for t in range(3):
        assert main(_args("embed", pool, three, f"embed.task_index={t}", "embed.num_tasks=3")) == 0
    e1 = open_embeddings(str(one / "embeddings" / "descriptor"))
    e3 = open_embeddings(str(three / "embeddings" / "descriptor"))
    # the same int64 ids and strings, row for row, whatever the number of tasks
    assert isinstance(e3.ids, np.memmap) and e3.ids.dtype == np.int64
    np.testing.assert_array_equal(e1.ids, e3.ids)
    assert e1.id_strings(np.arange(len(e1))) == e3.id_strings(np.arange(len(e3)))
    assert len({p for p in os.listdir(three / "embeddings" / "descriptor") if p.startswith("task-")}) == 3
    np.testing.assert_allclose(e1.rows(np.arange(len(e1))), e3.rows(np.arange(len(e3))), rtol=0, atol=2.0 ** -10)
    assert main(_args("index", pool, three)) == 0
    for t in range(3):
        assert main(_args("search", pool, three, f"knn.task_index={t}", "knn.num_tasks=3")) == 0
    for out in (one, three):
        for step in ("dedup", "decontaminate", "rebalance", "write"):
            assert main(_args(step, pool, out)) == 0, (out, step)
    d1, d3 = (one / "decisions.tsv").read_text(), (three / "decisions.tsv").read_text()
    assert d1 == d3
    lines = d1.splitlines()[1:]
    ids = [line.split("\t")[0] for line in lines]
    assert ids == sorted(ids)  # one line per input, by id
    statuses = [line.split("\t")[2] for line in lines]
    assert statuses.count("copy_duplicates") + statuses.count("hash_duplicates") >= 8
    assert statuses.count("not_selected") >= 10  # the hierarchical selection agreed too
    s1, s3 = sorted(os.listdir(one / "shards")), sorted(os.listdir(three / "shards"))
    assert s1 == s3 and len(s1) >= 3
    for name in (n for n in s1 if n.endswith(".tar")):  # pool-index.bin records file times
        assert (one / "shards" / name).read_bytes() == (three / "shards" / name).read_bytes()
