"""bench/bench_curation_real.py on a tiny pool, so the real-image run cannot rot: the same tiles every build,
`curate run --progress` records every step's tasks, and W = 1 and W = 2 give the same decisions.tsv."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "bench_curation_real.py"


def _load_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_curation_real", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.jpg"))}


def test_pool_is_the_same_every_build(tmp_path):
    bench = _load_bench()
    a = bench.build(str(tmp_path / "a"), 120, 0.05, 20, 8, seed=3)
    b = bench.build(str(tmp_path / "b"), 120, 0.05, 20, 8, seed=3)
    assert a == b
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    pool = _digest(tmp_path / "a" / "pool")
    assert len(pool) == 120 + 6 and sum(k.startswith("copies/") for k in pool) == 6
    assert len(_digest(tmp_path / "a" / "eval")) == 20
    # every planted copy and eval near-copy is of a pool tile that was written
    assert all(orig in pool and copy in pool for orig, copy, _ in a["copies"])
    assert all(orig in pool for _, orig, _ in a["eval_overlap"])
    bench.build(str(tmp_path / "c"), 120, 0.05, 20, 8, seed=4)
    assert _digest(tmp_path / "c" / "pool") != pool  # the seed picks the tiles


@pytest.mark.slow
def test_bench_runs_w1_and_w2_with_identical_decisions(tmp_path):
    out = tmp_path / "real.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH), "--tiles", "300", "--copy-fraction", "0.05", "--eval", "40",
                           "--eval-copies", "10", "--tasks", "1", "2", "--block", "128", "--work", str(tmp_path / "w"),
                           "--json", str(out)], env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    one, two = res["runs"]
    assert res["identical"] and one["decisions_sha256"] == two["decisions_sha256"]
    assert one["counts"] == two["counts"] and one["counts"]["input"] == 300 + 15
    # `curate run --progress`: one line per step, and the sharded steps' tasks each with their own record
    assert [s["step"] for s in two["steps"]] == ["embed", "dedup", "decontaminate", "rebalance", "write"]
    for step in ("dedup", "decontaminate", "rebalance", "write"):
        s = next(s for s in two["steps"] if s["step"] == step)
        # not: single-process phases (grouping), the IVF training and merge (one task each, by design:
        # knn_shards.build_ondisk) and the eval folder's small path table (one task)
        calls = [call for call in s["runs"] if not call.get("phase") and call["fn"] not in ("index_train", "index_merge")
                 and not (call["fn"] in ("run_task", "rank_task", "copy_task") and call["tasks"] == 1)]
        assert calls and all(call["tasks"] == 2 for call in calls), (step, [(c["fn"], c["tasks"]) for c in s["runs"]])
        for call in calls:
            assert [r["task"] for r in call["reports"]] == [0, 1]
            assert all(r["peak_rss_mb"] > 0 and r["wall_s"] >= 0 for r in call["reports"])
    w1_dedup = next(s for s in one["steps"] if s["step"] == "dedup")
    assert {call["tasks"] for call in w1_dedup["runs"]} == {1}
    # the planted answer is found (15 copies, 10 eval overlaps): a detector that missed most would fail here
    assert one["recall"]["copies"] >= 0.8 and one["recall"]["eval_overlap"] >= 0.8
    assert "| **dedup** |" in proc.stdout and "decisions identical for W = 1, 2: True" in proc.stdout
