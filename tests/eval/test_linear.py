"""Linear probe on frozen features: known answers, and selection on the held-out split only."""

import pytest
import torch

from dinopipe.eval.linear import holdout_split, linear_probe


def _clusters(n_cls, per_cls, dim, seed):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n_cls, dim, generator=torch.Generator().manual_seed(0)) * 3
    y = torch.arange(n_cls).repeat_interleave(per_cls)
    return centres[y] + torch.randn(len(y), dim, generator=g), y


def test_linearly_separable_problem_is_learned():
    x_tr, y_tr = _clusters(4, 60, 16, seed=1)
    x_va, y_va = _clusters(4, 30, 16, seed=2)
    res = linear_probe(x_tr, y_tr, x_va, y_va, epochs=20, batch_size=64)
    assert res["val"]["top1"] >= 0.98 and res["val"]["top5"] == 1.0
    assert res["best"]["holdout_top1"] >= 0.95
    assert len(res["sweep"]) == 7 and res["n_fit"] + res["n_holdout"] == 240


def test_labels_independent_of_features_stay_near_chance():
    g = torch.Generator().manual_seed(3)
    x_tr, x_va = torch.randn(400, 16, generator=g), torch.randn(1000, 16, generator=g)
    y_tr, y_va = torch.randint(0, 2, (400,), generator=g), torch.randint(0, 2, (1000,), generator=g)
    res = linear_probe(x_tr, y_tr, x_va, y_va, lrs=(0.01, 0.1), epochs=20, batch_size=64)
    assert 0.42 < res["val"]["top1"] < 0.58  # chance = 0.5; 1000 val samples: std 0.016


def _correlated(n, seed):
    """x1 = s + n, x2 = n with a large shared n: the class (sign of s) is x1 - x2, but the class means differ
    along x1 only, so a barely-trained probe (its weights ~ the mean difference) reaches only ~63%."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    noise = 3 * torch.randn(n, generator=g)
    return torch.stack([2.0 * y - 1 + noise, noise], dim=1), y


def test_sweep_selects_on_the_holdout_split_not_on_val():
    x_tr, y_tr = _correlated(600, seed=4)
    x_va, y_va = _correlated(400, seed=5)
    kw = dict(lrs=(1e-5, 1.0), epochs=30, batch_size=64)
    res = linear_probe(x_tr, y_tr, x_va, y_va, **kw)
    by_lr = {r["lr"]: r["holdout_top1"] for r in res["sweep"]}
    assert by_lr[1.0] > 0.95 and 0.5 < by_lr[1e-5] < 0.8
    assert res["best"]["lr"] == 1.0 and res["val"]["top1"] > 0.95
    # Inverted val labels make the barely-trained probe the better one *on val*; the choice must not move.
    flipped = linear_probe(x_tr, y_tr, x_va, 1 - y_va, **kw)
    assert flipped["best"] == res["best"] and flipped["sweep"] == res["sweep"]
    assert flipped["val"]["top1"] < 0.05
    no_refit = linear_probe(x_tr, y_tr, x_va, y_va, refit=False, **kw)
    assert no_refit["best"]["lr"] == 1.0 and no_refit["val"]["top1"] > 0.95


def test_adamw_and_weight_decay_sweep():
    x_tr, y_tr = _clusters(3, 40, 8, seed=6)
    x_va, y_va = _clusters(3, 20, 8, seed=7)
    res = linear_probe(x_tr, y_tr, x_va, y_va, optimizer="adamw", lrs=(1e-2,), wds=(0.0, 0.05), epochs=15,
                       batch_size=32)
    assert [(r["lr"], r["wd"]) for r in res["sweep"]] == [(1e-2, 0.0), (1e-2, 0.05)]
    assert res["val"]["top1"] >= 0.95


def test_holdout_split_is_stratified_and_disjoint():
    y = torch.tensor([0] * 50 + [1] * 20 + [2] * 1)
    fit, held = holdout_split(y, 0.2, seed=0)
    assert set(fit.tolist()).isdisjoint(held.tolist()) and len(fit) + len(held) == len(y)
    assert [int((y[held] == c).sum()) for c in range(3)] == [10, 4, 0]  # a single-sample class stays in fit
    assert torch.equal(holdout_split(y, 0.2, seed=0)[1], held)
    with pytest.raises(ValueError, match="too few"):
        holdout_split(torch.tensor([0, 1]), 0.1)
