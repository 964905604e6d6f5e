"""rebalance.levels: auto (the default) sizes the hierarchical k-means to the pool: the published recipes' clusters
per level scaled to N. Before it, the default [10M, 500k, 50k, 10k] asked for one cluster per row on any pool
under 10M rows (issue 49)."""

from __future__ import annotations

import numpy as np
import pytest

from curation.cli import main
from curation.config import CurationConfig, rebalance_kwargs, validate
from curation.rebalance.modes import rebalance
from curation.kmeans.hierarchical import PUBLISHED_LEVELS, auto_levels
from dinopipe.config import ConfigError, load_config

DEFAULT = "configs/curation/default.yaml"
LEAF = (60, 240)  # mean rows per bottom cluster the docs state for auto (docs/curation.md)


def _default(*overrides):
    return load_config(CurationConfig, DEFAULT, ["rebalance.mode=hierarchical", *overrides])


def test_auto_is_the_default_and_gives_the_published_levels_at_their_pool_sizes():
    assert CurationConfig().rebalance.levels == "auto" and _default().rebalance.levels == "auto"
    for pool, ks in PUBLISHED_LEVELS:
        assert auto_levels(pool) == list(ks)
    # 1M rows (derived only: the real k-means at this size is bench work): Vo et al.'s ratios, 120 rows a leaf
    assert auto_levels(1_000_000) == [8333, 417, 42, 8]
    for n in (10_000, 100_000, 1_000_000, 10**8, 5 * 10**9):
        ks = auto_levels(n)
        assert LEAF[0] <= n / ks[0] <= LEAF[1] and ks == sorted(ks, reverse=True) and ks[-1] >= 2
    assert auto_levels(50) == [1]  # a tiny pool: one cluster (uniform sampling), not an error


def _pool(n: int, d: int = 16) -> np.ndarray:
    """A long-tailed mixture of 200 concepts (Zipf sizes) on the unit sphere."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((200, d))
    x = centres[rng.zipf(1.5, n) % 200] + 0.3 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def _run_default(n: int):
    x = _pool(n)
    res = rebalance("hierarchical", x, **rebalance_kwargs(_default().rebalance))
    used = len(np.unique(np.asarray(res.cluster)))  # non-empty bottom clusters
    return res, n / used


@pytest.mark.parametrize("n", [10_000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_default_config_clusters_a_pool_to_sane_leaves(n):
    res, leaf = _run_default(n)
    assert res.report["levels"] == auto_levels(n)
    assert LEAF[0] <= leaf <= LEAF[1], leaf
    assert res.n_selected == n // 2  # target_size null: half the pool, exactly


def test_an_explicit_list_still_wins():
    cfg = _default("rebalance.levels=[40,5]")
    res = rebalance("hierarchical", _pool(2000), **rebalance_kwargs(cfg.rebalance))
    assert res.report["levels"] == [40, 5]


@pytest.mark.parametrize("value", ["5", "bogus", "null", "[]", "[3,5]", "[8,true]"])
def test_a_bad_levels_value_is_a_config_error(value, tmp_path):
    cfg = _default(f"rebalance.levels={value}", f"output.dir={tmp_path}", f"input.paths=[{tmp_path}]")
    with pytest.raises(ConfigError, match="rebalance.levels"):
        validate(cfg, "rebalance")


def test_a_bad_levels_value_exits_2_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["run", "--config", DEFAULT, f"input.paths=[{tmp_path}]", f"output.dir={out}",
              "rebalance.mode=hierarchical", "rebalance.levels=lots"])
    assert e.value.code == 2 and "rebalance.levels" in capsys.readouterr().err and not out.exists()
