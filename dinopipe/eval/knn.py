"""Weighted k-nearest-neighbour classification on frozen features (Wu et al. 2018; DINO, Caron et al. 2021;
DINOv2, Oquab et al. 2023).

Features are L2-normalised; the k most cosine-similar training samples vote for their class with weight
``exp(sim / T)`` (T = 0.07), and classes are ranked by their summed weight. ``temperature=None`` gives a
plain majority vote (for comparison). Queries run in batches of one matmul + top-k, so the (queries x train)
similarity matrix never exists in full; one top-k at the largest k serves every k.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.no_grad()
def knn_classify(
    train_feats: Tensor,
    train_labels: Tensor,
    val_feats: Tensor,
    val_labels: Tensor,
    ks: Sequence[int] = (10, 20),
    temperature: Optional[float] = 0.07,
    num_classes: Optional[int] = None,
    batch_size: int = 1024,
    device: Optional[str | torch.device] = None,
) -> dict[int, dict[str, float]]:
    """``{k: {"top1": acc, "top5": acc, "k_used": k'}}`` with accuracies in [0, 1].

    A k larger than the training set uses every training sample (``k_used`` says so). top-5 counts a hit
    among the min(5, classes) best-ranked classes.
    """
    if len(train_feats) == 0 or len(val_feats) == 0:
        raise ValueError("kNN needs at least one training and one validation feature")
    if not ks or min(ks) < 1:
        raise ValueError(f"k must be >= 1, got {list(ks)}")
    device = torch.device(device) if device is not None else train_feats.device
    train = F.normalize(train_feats.float(), dim=-1).to(device)  # (N, D)
    train_labels = train_labels.long().to(device)
    n_cls = num_classes or int(max(train_labels.max(), val_labels.max())) + 1
    k_max = min(max(ks), len(train))
    n_top = min(5, n_cls)
    hits = {k: torch.zeros(2, dtype=torch.long, device=device) for k in ks}

    for start in range(0, len(val_feats), batch_size):
        q = F.normalize(val_feats[start:start + batch_size].float(), dim=-1).to(device)  # (B, D)
        y = val_labels[start:start + batch_size].long().to(device)  # (B,)
        sim, idx = (q @ train.T).topk(k_max, dim=1)  # (B, k_max), sorted descending
        neigh = train_labels[idx]  # (B, k_max)
        # exp((s - s_max) / T): the same ranking as exp(s / T) (one factor per row) without overflow at small T.
        weight = ((sim - sim[:, :1]) / temperature).exp() if temperature else torch.ones_like(sim)
        for k in ks:
            kk = min(k, k_max)
            votes = torch.zeros(len(q), n_cls, device=device)
            votes.scatter_add_(1, neigh[:, :kk], weight[:, :kk])  # (B, C) summed weight per class
            ranked = votes.topk(n_top, dim=1).indices  # (B, n_top)
            correct = ranked == y[:, None]
            hits[k][0] += correct[:, 0].sum()
            hits[k][1] += correct.any(dim=1).sum()
    n = len(val_feats)
    return {k: {"top1": hits[k][0].item() / n, "top5": hits[k][1].item() / n, "k_used": min(k, k_max)} for k in ks}


__all__ = ["knn_classify"]
