"""Linear probe on frozen features (DINO / DINOv2 linear evaluation, run on cached features, not images).

Several linear classifiers, one per (learning rate, weight decay) of a small sweep, train at once on the
same feature batches, as DINOv2's ``eval/linear.py`` does (one parameter group each). The best one is chosen
on a held-out split of the *training* set (stratified, ``holdout`` fraction; ties broken by held-out loss),
never on val; by default it is then retrained on the whole training set and reported on val.

Features are standardised with the training statistics (MAE's BatchNorm-without-affine before the probe), so
one default learning-rate grid suits models whose feature scales differ. SGD (momentum 0.9) or AdamW, cosine
schedule, zero-initialised weights: the run is deterministic for a seed.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .data import LabelError

DEFAULT_LRS = {"sgd": (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0), "adamw": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)}


def holdout_split(labels: Tensor, fraction: float, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(fit indices, held-out indices): ``fraction`` of every class held out, each class keeps >= 1 to fit."""
    if not 0 < fraction < 1:
        raise LabelError(f"--holdout: the held-out fraction must be in (0, 1), got {fraction}")
    g = torch.Generator().manual_seed(seed)
    fit, held = [], []
    for c in labels.unique():
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_held = min(int(math.floor(fraction * len(idx) + 0.5)), len(idx) - 1)
        held.append(idx[:n_held])
        fit.append(idx[n_held:])
    fit_idx, held_idx = torch.cat(fit).sort().values, torch.cat(held).sort().values
    if len(held_idx) == 0:  # the user's data: a LabelError, so `dinopipe eval linear` exits 2 naming it
        raise LabelError(f"--holdout: {len(labels)} training samples are too few for a held-out split of "
                         f"{fraction} (a class needs >= 2 images, one of them held out); use more data or a "
                         f"larger --holdout")
    return fit_idx, held_idx


def _standardizer(x: Tensor) -> tuple[Tensor, Tensor]:
    return x.mean(0), x.std(0, unbiased=False).clamp_min(1e-6)


def accuracy(logits: Tensor, y: Tensor) -> tuple[float, float]:
    """(top-1, top-5) in [0, 1]; top-5 over min(5, classes)."""
    top = logits.topk(min(5, logits.shape[1]), dim=1).indices == y[:, None]
    return top[:, 0].float().mean().item(), top.any(1).float().mean().item()


def train_heads(
    x: Tensor, y: Tensor, num_classes: int, configs: Sequence[tuple[float, float]], epochs: int,
    batch_size: int, optimizer: str, seed: int,
) -> list[nn.Linear]:
    """One linear classifier per (lr, weight decay), trained together on the same shuffled batches."""
    heads = [nn.Linear(x.shape[1], num_classes).to(x.device) for _ in configs]
    for h in heads:
        nn.init.zeros_(h.weight)
        nn.init.zeros_(h.bias)
    groups = [{"params": list(h.parameters()), "lr": lr, "weight_decay": wd} for h, (lr, wd) in zip(heads, configs)]
    if optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=configs[0][0], momentum=0.9)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=configs[0][0])
    else:
        raise ValueError(f"optimizer must be 'sgd' or 'adamw', got '{optimizer}'")
    steps_per_epoch = math.ceil(len(x) / batch_size)
    total = max(1, epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g).to(x.device)
        for i in range(steps_per_epoch):
            b = perm[i * batch_size:(i + 1) * batch_size]
            xb, yb = x[b], y[b]
            # Heads share nothing, so the summed loss gives each head exactly its own gradient.
            loss = sum(F.cross_entropy(h(xb), yb) for h in heads)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return heads


def linear_probe(
    train_feats: Tensor,
    train_labels: Tensor,
    val_feats: Tensor,
    val_labels: Tensor,
    lrs: Optional[Sequence[float]] = None,
    wds: Sequence[float] = (0.0,),
    epochs: int = 50,
    batch_size: int = 512,
    holdout: float = 0.1,
    optimizer: str = "sgd",
    refit: bool = True,
    seed: int = 0,
    device: Optional[str | torch.device] = None,
    num_classes: Optional[int] = None,
) -> dict:
    """Sweep, select on the held-out split, report on val. Returns a JSON-ready dict."""
    if optimizer not in DEFAULT_LRS:
        raise ValueError(f"optimizer must be one of {sorted(DEFAULT_LRS)}, got '{optimizer}'")
    lrs = tuple(lrs or DEFAULT_LRS[optimizer])
    configs = [(float(lr), float(wd)) for lr in lrs for wd in wds]
    device = torch.device(device) if device is not None else train_feats.device
    x_all, y_all = train_feats.float().to(device), train_labels.long().to(device)
    x_val, y_val = val_feats.float().to(device), val_labels.long().to(device)
    n_cls = num_classes or int(max(y_all.max(), y_val.max())) + 1

    fit, held = (i.to(device) for i in holdout_split(train_labels.cpu(), holdout, seed))
    mean, std = _standardizer(x_all[fit])
    x_fit, x_held = (x_all[fit] - mean) / std, (x_all[held] - mean) / std
    heads = train_heads(x_fit, y_all[fit], n_cls, configs, epochs, batch_size, optimizer, seed)
    sweep = []
    with torch.no_grad():
        for (lr, wd), h in zip(configs, heads):
            logits = h(x_held)
            sweep.append({"lr": lr, "wd": wd, "holdout_top1": accuracy(logits, y_all[held])[0],
                          "holdout_loss": F.cross_entropy(logits, y_all[held]).item()})
    best_i = max(range(len(configs)), key=lambda i: (sweep[i]["holdout_top1"], -sweep[i]["holdout_loss"]))
    best = configs[best_i]

    if refit:
        mean, std = _standardizer(x_all)
        head = train_heads((x_all - mean) / std, y_all, n_cls, [best], epochs, batch_size, optimizer, seed)[0]
    else:
        head = heads[best_i]
    with torch.no_grad():
        top1, top5 = accuracy(head((x_val - mean) / std), y_val)
    return {
        "best": dict(sweep[best_i]),
        "sweep": sweep,
        "val": {"top1": top1, "top5": top5},
        "n_fit": len(fit), "n_holdout": len(held), "epochs": epochs, "optimizer": optimizer, "refit": refit,
    }


__all__ = ["linear_probe", "holdout_split", "train_heads", "accuracy", "DEFAULT_LRS"]
