"""Every rebalance mode, the ``balance_clusters`` k-means and the nearest-seed attachment as W tasks (issue 40):
`curate rebalance` decides byte for byte the same with 1 task, 3 inline tasks and 2 local processes (the cluster
mode's and balance's k-means as sharded ranks, the pick and the seed search over blocks of rows)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from curation.cli import main
from curation.core.stepfiles import load_step
from curation.core.status import KEPT

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


def _args(step: str, pool, out, seeds, *extra, progress=None) -> list[str]:
    return [step, *(["--progress", str(progress)] if progress else []), "--config", QUICKSTART,
            f"input.paths=[{pool}]", f"output.dir={out}", "progress=false",
            "embed.num_workers=0", "report.enabled=false", f"input.seed_paths=[{seeds}]", *extra]


@pytest.fixture(scope="module")
def base(pool_dir, tmp_path_factory):
    pool = pool_dir[0]
    root = tmp_path_factory.mktemp("rebalance_tasks")
    seeds = root / "seeds"
    seeds.mkdir()
    for p in sorted(pool.glob("*.jpg"))[:24:6]:
        shutil.copy(p, seeds / p.name)
    out = root / "base"
    for step in ("embed", "dedup", "decontaminate"):
        assert main(_args(step, pool, out, seeds)) == 0
    return pool, seeds, out, root


MODES = {
    "cluster": ["rebalance.mode=cluster", "rebalance.n_clusters=6", "rebalance.max_per_cluster=4",
                "rebalance.min_seeds=1", "rebalance.balance_clusters=3"],
    "hierarchical": ["rebalance.mode=hierarchical", "rebalance.levels=[6,3]", "rebalance.target_size=20"],
    "sample": ["rebalance.mode=sample", "rebalance.k=3", "rebalance.balance_clusters=4"],
    "none": ["rebalance.mode=none"],
}
SPLITS = {"1": ["tasks.count=1"], "3 inline": ["tasks.count=3", "tasks.launcher=inline"],
          "2 local": ["tasks.count=2", "tasks.launcher=local"]}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_decides_the_same_for_any_w(base, mode):
    pool, seeds, out, root = base
    got = {}
    for name, split in SPLITS.items():
        if mode in ("sample", "none") and name == "2 local":
            continue  # their row work is the seed search alone, inline already splits it
        d = root / f"{mode}-{name.replace(' ', '-')}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(out, d)
        log = d / "progress.jsonl"
        assert main(_args("rebalance", pool, d, seeds, *MODES[mode], *split, progress=log)) == 0
        report = json.loads((d / "steps" / "rebalance_report.json").read_text())
        got[name] = (load_step(str(d), "rebalance"), report)
        runs = {r["fn"]: r["tasks"] for line in log.read_text().splitlines() for r in json.loads(line)["runs"]}
        w = int(split[0].split("=")[1])
        # the row work ran as W tasks of the runner, not in this process
        want = {"cluster": ["tree_task", "hist_task", "select_task", "nearest_seed_task"],
                "hierarchical": ["tree_task", "select_task", "nearest_seed_task"],
                "sample": [], "none": ["nearest_seed_task"]}[mode]  # sample: the sharded kNN's (curation.rebalance.retrieval)
        for fn in want:
            # the k-means tree: one rank inline (the same tree), W ranks in local processes
            assert runs.get(fn) == (1 if fn == "tree_task" and name == "3 inline" else w), (name, fn, runs)
    first, rep = got["1"]
    kept = first["status"] == KEPT
    assert 0 < kept.sum() and (first["nearest_seed"][kept] >= 0).all()  # every kept row has its nearest seed
    assert np.isfinite(first["seed_sim"][kept]).all()
    if mode == "cluster":
        assert kept.sum() < (first["cluster"] >= 0).sum() and rep["balance"]["clusters"] == 3
    for name, (arrays, report) in got.items():
        for key in ("status", "cluster", "nearest_seed", "seed_sim"):
            np.testing.assert_array_equal(arrays[key], first[key], err_msg=f"{mode}, {name}: {key}")
        assert report["balance"] == rep["balance"], name
