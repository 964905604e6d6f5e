"""Shard writing and the decisions table as W tasks: W=1 and W=3 give the same bytes, a killed task is rerun
and only its unfinished part is redone, and a decisions task's memory does not grow with the pool."""

from __future__ import annotations

import os
import shutil
import tracemalloc
from pathlib import Path

import numpy as np

from curation.cli import main
from curation.config import WriteConfig
from curation.core.decisions import decisions_task, iter_decisions
from curation.core.embstore import mark_task_done, open_embeddings, save_shard
from curation.write.step import step_write
from curation.write.tasks import write_task
from curation.core.status import STATUSES

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


def _args(step: str, pool, out) -> list[str]:
    return [step, "--config", QUICKSTART, f"input.paths=[{pool}]", f"output.dir={out}", "progress=false",
            "embed.num_workers=0", "report.enabled=false", "rebalance.target_size=40"]


def test_one_and_three_write_tasks_give_the_same_shards_and_decisions_and_a_killed_task_reruns(
        pool_dir, tmp_path):
    pool = pool_dir[0]
    base = tmp_path / "base"
    for step in ("embed", "dedup", "decontaminate", "rebalance"):
        assert main(_args(step, pool, base)) == 0
    one, three = tmp_path / "one", tmp_path / "three"
    shutil.copytree(base, one)
    shutil.copytree(base, three)
    m1 = step_write([str(pool)], str(one), WriteConfig(shard_size=5), num_tasks=1)
    m3 = step_write([str(pool)], str(three), WriteConfig(shard_size=5), num_tasks=3)
    assert m1["counts"] == m3["counts"] and m1["shards"] == m3["shards"] and len(m1["shards"]) >= 6
    assert m1["counts"]["input"] == sum(m1["counts"][s] for s in STATUSES)
    assert (one / "decisions.tsv").read_text() == (three / "decisions.tsv").read_text()
    assert len(os.listdir(three / "decisions")) == 6  # 3 x (.tsv + .json)
    for name in m1["shards"]:
        assert (one / name).read_bytes() == (three / name).read_bytes()
    # the reader presents the parts as one table, = decisions.tsv
    rows = ["\t".join(r) for r in iter_decisions(str(three))]
    assert rows == (three / "decisions.tsv").read_text().splitlines()[1:]

    # task 1 of 3 killed while writing its second shard: that shard and its record are gone
    lost = "shard-000003.json"  # task 1 owns shards 2..3 of 8; its record goes last, so a kill leaves none
    assert (three / "steps" / "write" / "shard-000003.loc.npy").exists()  # the shard's part of the pool index
    os.remove(three / "steps" / "write" / lost)
    os.remove(three / "shards" / lost.replace(".json", ".tar"))
    before = {n: os.stat(three / "shards" / n).st_mtime_ns for n in os.listdir(three / "shards") if n.endswith(".tar")}
    done = [write_task(str(three), [str(pool)], 5, t, 3) for t in range(3)]
    assert [d["shards_written"] for d in done] == [0, 1, 0]
    assert sum(d["shards_skipped"] for d in done) == len(m1["shards"]) - 1
    for n, t in before.items():
        assert os.stat(three / "shards" / n).st_mtime_ns == t  # finished shards were not rewritten
    m3b = step_write([str(pool)], str(three), WriteConfig(shard_size=5), num_tasks=3)
    assert m3b["counts"] == m1["counts"]
    for name in m1["shards"]:
        assert (one / name).read_bytes() == (three / name).read_bytes()


def _synthetic_pool(out: str, n: int, n_parts: int = 4) -> None:
    """An embeddings folder of ``n`` rows (8-d) and n // 50 unreadable inputs, written as ``n_parts`` tasks."""
    rng = np.random.default_rng(0)
    per = -(-n // n_parts)
    for t in range(n_parts):
        k = np.arange(t * per, min(n, (t + 1) * per))
        ids = [f"src/dir{i % 97:02d}/img{i:09d}.jpg" for i in k]
        bad = [[f"src/bad/b{i:09d}.jpg", "src", "truncated"] for i in k[::50]]
        emb = rng.standard_normal((len(k), 8)).astype(np.float16)
        save_shard(out, f"part-{t:05d}-00000", emb, {
            "ids": ids, "sources": ["src"] * len(k), "hashes": ["0" * 16] * len(k),
            "locs": [f"/nowhere/{i}" for i in ids], "unreadable": bad, "n_listed": len(k) + len(bad)})
        mark_task_done(out, t, n_parts, {})


def _peak_decisions_task(tmp: str, n: int, rows_per_task: int = 10000) -> tuple[int, int]:
    emb_dir = os.path.join(tmp, "embeddings")
    _synthetic_pool(emb_dir, n)
    emb = open_embeddings(emb_dir)
    assert isinstance(emb.ids, np.memmap) and emb.ids.dtype == np.int64  # no object array of ids
    assert isinstance(emb.table.blob, np.memmap) and isinstance(emb.table.offsets, np.memmap)
    assert isinstance(emb.locations.blob, np.memmap)
    status = (np.arange(len(emb)) % 5).astype(np.int8)
    component = np.arange(len(emb), dtype=np.int64)
    num_tasks = max(1, emb.n_inputs // rows_per_task)
    tracemalloc.start()
    out = decisions_task(tmp, emb, status, component, np.zeros(0, np.int64), 0, num_tasks)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(sum(c.values()) for c in out["counts"].values()) == out["inputs"][1] - out["inputs"][0]
    return peak, emb.n_inputs


def test_a_decisions_task_memory_does_not_grow_with_the_pool(tmp_path):
    """Task 0 of N/10k tasks (same rows per task) at N = 20k and 200k: the task's peak allocation (Python
    objects and numpy buffers, tracemalloc) stays the same. The step arrays it is given (status, component) are
    made before tracing here; the pipeline hands a task the memory-mapped step files (test_step_memory.py)."""
    small, n_small = _peak_decisions_task(str(tmp_path / "s"), 20_000)
    large, n_large = _peak_decisions_task(str(tmp_path / "l"), 200_000)
    assert n_large >= 10 * n_small * 0.99
    assert large < 1.3 * small + (1 << 20), (small, large)
