"""Weighted kNN (DINO protocol) against hand-made features with known answers."""

import math

import pytest
import torch

from dinopipe.eval.knn import knn_classify


def test_separated_clusters_are_perfect_and_batching_does_not_matter():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(6, 32, generator=g) * 5
    y_tr, y_va = torch.arange(6).repeat_interleave(30), torch.arange(6).repeat_interleave(10)
    x_tr = centres[y_tr] + 0.3 * torch.randn(len(y_tr), 32, generator=g)
    x_va = centres[y_va] + 0.3 * torch.randn(len(y_va), 32, generator=g)
    res = knn_classify(x_tr, y_tr, x_va, y_va, ks=(10, 20))
    assert res == {10: {"top1": 1.0, "top5": 1.0, "k_used": 10}, 20: {"top1": 1.0, "top5": 1.0, "k_used": 20}}
    assert knn_classify(x_tr, y_tr, x_va, y_va, ks=(10, 20), batch_size=7) == res
    # Features are L2-normalised inside: rescaling rows changes nothing.
    scale = torch.rand(len(x_va), 1, generator=g) * 100 + 0.01
    assert knn_classify(x_tr, y_tr, x_va * scale, y_va, ks=(10, 20)) == res
    # Shuffled labels: the neighbours carry no class information any more.
    y_rand = y_tr[torch.randperm(len(y_tr), generator=g)]
    assert knn_classify(x_tr, y_rand, x_va, y_va, ks=(10,))[10]["top1"] < 0.6


def _unit(deg):
    return torch.tensor([math.cos(math.radians(deg)), math.sin(math.radians(deg))])


def test_exponential_weighted_vote_beats_majority_vote():
    # Query at 0 deg. Class 0: one neighbour at 0 deg (sim 1). Class 1: two at +-36.87 deg (sim 0.8).
    train = torch.stack([_unit(0), _unit(36.87), _unit(-36.87), _unit(180)])
    labels = torch.tensor([0, 1, 1, 2])
    q, y = _unit(0)[None], torch.tensor([0])
    # Majority of the 3 nearest: class 1 (2 votes against 1).
    assert knn_classify(train, labels, q, y, ks=(3,), temperature=None)[3]["top1"] == 0.0
    # exp(sim / 0.07): class 0 gets e^(1/0.07), class 1 gets 2 e^(0.8/0.07) = 0.11 of that -> class 0.
    assert knn_classify(train, labels, q, y, ks=(3,))[3]["top1"] == 1.0
    # At T = 1 the weights are e^1 vs 2 e^0.8 = 1.64 e^1: class 1 wins again, so T is used as exp(sim / T).
    assert knn_classify(train, labels, q, y, ks=(3,), temperature=1.0)[3]["top1"] == 0.0
    # A tiny T must not overflow (weights are relative to the nearest neighbour).
    assert knn_classify(train, labels, q, y, ks=(3,), temperature=1e-4)[3]["top1"] == 1.0


def test_k_larger_than_train_set_uses_all_of_it():
    train = torch.stack([_unit(0), _unit(10), _unit(170), _unit(200)])
    labels = torch.tensor([0, 0, 1, 1])
    q = torch.stack([_unit(5), _unit(185)])
    y = torch.tensor([0, 1])
    res = knn_classify(train, labels, q, y, ks=(10, 20))
    assert res[10] == res[20] == {"top1": 1.0, "top5": 1.0, "k_used": 4}
    assert knn_classify(train, labels, q, y, ks=(4,))[4] == res[10]


def test_top5_counts_the_true_class_ranked_third():
    # 8 classes, one training point each at increasing angle; the true class (7) is the 3rd nearest.
    angles = [0, 10, 20, 30, 40, 50, 60, 20.5]
    train = torch.stack([_unit(a) for a in angles])
    labels = torch.arange(8)
    q, y = _unit(12)[None], torch.tensor([7])  # nearest: 10 (cls 1), 20 (cls 2), 20.5 (cls 7)
    res = knn_classify(train, labels, q, y, ks=(20,), num_classes=8)[20]
    assert res["top1"] == 0.0 and res["top5"] == 1.0


def test_bad_arguments():
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match="k must be"):
        knn_classify(x, y, x, y, ks=(0,))
    with pytest.raises(ValueError, match="at least one"):
        knn_classify(x[:0], y[:0], x, y)
