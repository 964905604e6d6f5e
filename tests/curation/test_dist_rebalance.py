"""`curate rebalance` on a k-means tree made by `curate kmeans --curate` (2 gloo
processes under torchrun): the same selection as the one-process `curate run`, and a tree made for
other settings refused with an error naming the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests._photos import write_pool

from curation.cli import main
from curation.core.status import KEPT
from curation.core.stepfiles import load_step

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


def _args(cmd, pool_root, out, *extra):
    # no model: the rebalancing clusters the photos' descriptors (vit_test's random weights map
    # every photo to nearly the same vector); planted copies are dropped by dedup before the
    # k-means (the tree must be built on the survivors only); strategy 'c' reads level-1 distances
    return [cmd, "--config", QUICKSTART, f"input.paths=[{pool_root}]", f"output.dir={out}",
            "progress=false", "report.enabled=false",
            "rebalance.levels=[10,4]", "rebalance.strategy=c", *extra]


@pytest.fixture(scope="module")
def curated(tmp_path_factory, photos):
    root = tmp_path_factory.mktemp("distreb")
    pool = root / "pool"
    names = sorted(photos)
    write_pool(str(pool), copies_of=names[::9][:2], photos=photos)
    out = root / "curated"
    assert main(_args("run", pool, out)) == 0
    return pool, out


def test_dist_kmeans_on_2_processes_then_rebalance_selects_like_one_process(curated, capsys):
    pool, out = curated
    one = load_step(str(out), "rebalance")  # the one-process selection of `curate run`
    decont = load_step(str(out), "decontaminate")["status"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29631",
           "-m", "curation.cli", "kmeans", "--curate", *_args("x", pool, out)[1:],
           "rebalance.kmeans_dir=kmeans"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lab = np.load(out / "kmeans" / "level1_labels.npy")
    assert len(lab) == (decont == KEPT).sum() < len(decont)  # only the rows alive after decontamination
    assert len(np.unique(lab)) >= 8  # a real clustering (10 clusters asked), not ties

    assert main(_args("rebalance", pool, out, "rebalance.kmeans_dir=kmeans")) == 0
    two = load_step(str(out), "rebalance")
    for key in ("status", "cluster"):
        np.testing.assert_array_equal(two[key], one[key], err_msg=key)
    assert 0 < (two["status"] == KEPT).sum() < (decont == KEPT).sum()  # a real selection happened

    # other settings than the tree was made with: refused, naming the key and what differs
    capsys.readouterr()
    assert main(_args("rebalance", pool, out, "rebalance.kmeans_dir=kmeans", "rebalance.seed=3")) == 2
    err = capsys.readouterr().err
    assert "rebalance.kmeans_dir" in err and "seed" in err and "curate kmeans --curate" in err


def test_kmeans_dir_with_another_mode_is_a_config_error(curated, capsys):
    pool, out = curated
    with pytest.raises(SystemExit) as e:
        main(_args("rebalance", pool, out, "rebalance.mode=none", "rebalance.kmeans_dir=kmeans"))
    assert e.value.code == 2 and "rebalance.kmeans_dir" in capsys.readouterr().err
