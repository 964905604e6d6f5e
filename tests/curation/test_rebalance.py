"""Rebalancing modes: shapes of the selections, and hierarchical balancing flattens a long tail."""

from __future__ import annotations

import numpy as np
import pytest

from curation.kmeans.hierarchical import balanced_sample, cluster_balance, hierarchical_kmeans
from curation.kmeans.sampling import split_target
from curation.rebalance.modes import rebalance


@pytest.fixture(scope="module")
def long_tail():
    """20 concepts with Zipf-like sizes 1500 ... ~40 (a web pool's shape), as unit vectors."""
    rng = np.random.default_rng(0)
    d, n_concepts = 32, 20
    sizes = (1500 / np.arange(1, n_concepts + 1) ** 1.2).astype(int)
    centres = rng.standard_normal((n_concepts, d))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    concept = np.repeat(np.arange(n_concepts), sizes)
    x = centres[concept] + 0.25 * rng.standard_normal((len(concept), d)) / np.sqrt(d) * 3
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float16), concept, centres


def test_split_target_is_water_filling():
    rng = np.random.default_rng(0)
    alloc = split_target(np.array([100, 3, 50, 10]), 60, rng)
    assert alloc.sum() == 60 and list(alloc[[1, 3]]) == [3, 10]  # small clusters give all
    assert abs(int(alloc[0]) - int(alloc[2])) <= 1  # big ones share the rest evenly
    assert list(split_target(np.array([2, 3]), 10, rng)) == [2, 3]


def test_hierarchical_balancing_flattens_long_tail(long_tail):
    x, concept, _ = long_tail
    n_target = 800
    res = rebalance("hierarchical", x, levels=(60, 20), target_size=n_target, strategy="r",
                    n_resampling_steps=5, sample_size=10, seed=0)
    assert res.n_selected == n_target
    k = concept.max() + 1
    before = cluster_balance(concept, k)["normalised_entropy"]
    after = cluster_balance(concept[res.selected], k)["normalised_entropy"]
    rng = np.random.default_rng(0)
    uniform = cluster_balance(rng.choice(concept, n_target, replace=False), k)["normalised_entropy"]
    # measured: before 0.79, random subset 0.79, balanced >= 0.95
    assert after > before + 0.1 and after > uniform + 0.1, (before, uniform, after)
    rep = res.report["balance"]
    assert rep["after"]["normalised_entropy"] > rep["before"]["normalised_entropy"]
    # the tail survives: every concept is represented
    assert len(np.unique(concept[res.selected])) == k


def test_closest_strategy_picks_points_near_centroids(long_tail):
    x, _, _ = long_tail
    tree = hierarchical_kmeans(x, [40, 8], n_resampling_steps=2, sample_size=10, seed=1)
    c = balanced_sample(tree, 300, strategy="c", seed=1)
    r = balanced_sample(tree, 300, strategy="r", seed=1)
    assert len(c) == len(r) == 300 and len(np.unique(c)) == 300
    assert tree[0].dist[c].mean() < tree[0].dist[r].mean()
    assert [lvl.sizes.sum() for lvl in tree] == [len(x), len(x)]


def test_retrieval_sample_based_takes_k_neighbours_per_seed(long_tail):
    x, concept, centres = long_tail
    seeds = centres[[3, 15]].astype(np.float32)  # two curated "concepts"
    res = rebalance("sample", x, seeds, k=4)
    assert 4 <= res.n_selected <= 8
    assert set(concept[res.selected]) == {3, 15}
    assert set(res.nearest_seed[res.selected]) == {0, 1}
    assert np.all(res.seed_sim[res.selected] > 0.8) and np.isnan(res.seed_sim[~res.selected]).all()


def test_retrieval_cluster_based_takes_only_clusters_with_seeds(long_tail):
    x, concept, centres = long_tail
    seeds = centres[[15, 15, 2]].astype(np.float32)
    res = rebalance("cluster", x, seeds, n_clusters=20, max_per_cluster=30, min_seeds=2, seed=0)
    got = set(concept[res.selected])
    assert 15 in got and 2 not in got  # concept 2 has only one seed (< q = 2)
    assert 0 < res.n_selected <= 30 and len(set(res.cluster[res.selected])) == 1
    res1 = rebalance("cluster", x, seeds, n_clusters=20, max_per_cluster=30, min_seeds=1, seed=0)
    assert {2, 15} <= set(concept[res1.selected]) and res1.n_selected <= 60


def test_none_keeps_everything_and_seedless_retrieval_is_refused(long_tail):
    x, _, _ = long_tail
    assert rebalance("none", x).selected.all()
    with pytest.raises(ValueError, match="seed"):
        rebalance("sample", x)
    with pytest.raises(ValueError, match="choose one of"):
        rebalance("balanced", x)


def test_rebalance_is_deterministic(long_tail):
    x, _, _ = long_tail
    kw = dict(levels=(30, 6), target_size=200, n_resampling_steps=2, seed=7)
    a, b = rebalance("hierarchical", x, **kw), rebalance("hierarchical", x, **kw)
    np.testing.assert_array_equal(a.selected, b.selected)


def test_hierarchical_kmeans_options_reach_kmeans_and_keep_the_exact_target(long_tail):
    x, _, _ = long_tail
    kw = dict(levels=(60, 12), target_size=777, n_resampling_steps=2, seed=0)
    kpp = rebalance("hierarchical", x, **kw)
    rnd = rebalance("hierarchical", x, kmeans={"init": "random", "niter": 5}, **kw)
    for res in (kpp, rnd):  # exactly target_size distinct images, whatever the k-means
        assert res.n_selected == 777 and len(np.unique(np.flatnonzero(res.selected))) == 777
    assert not np.array_equal(kpp.cluster, rnd.cluster)


@pytest.mark.parametrize("override", ["rebalance.kmeans_init=kmeans||", "rebalance.kmeans_tol=-1",
                                      "rebalance.kmeans_niter=0"])
def test_kmeans_config_mistakes_name_the_key(override, tmp_path):
    from curation.config import CurationConfig, validate
    from dinopipe.config import ConfigError, load_config

    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", "\\.")):
        validate(load_config(CurationConfig, None, [override, f"output.dir={tmp_path}/o",
                                                       f"input.paths=[{tmp_path}]"]))
