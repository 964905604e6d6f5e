"""Gradient clipping, one norm per clip group (DINOv2 ``train/train.py``: ``for v in model.student.values():
v.clip_grad_norm_(clip_grad)``; DINOv3 ``train/train.py`` likewise per backbone and head).

The groups come from the task (``clip_groups``): by default each backbone and each head of a student on its own,
as the official codes clip. Norms are computed from this rank's local gradient storage and summed over ranks
by the loop's one all-reduce (:func:`local_grad_sq`), so under FSDP2 each group's norm is the norm of the full,
unsharded gradient: shard placements add their squared norms, replicated placements count once.
"""

from __future__ import annotations

import torch
from torch import nn

from .dist import get_info


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Total grad norm over all (possibly sharded) parameters, clipped in place when max_norm > 0 (torch's
    own clipping with its reduction and host sync; the loop folds both into its one all-reduce instead)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def _local_grads(params: list[nn.Parameter]) -> tuple[list[torch.Tensor], list[float]]:
    """This rank's gradient storage (views of FSDP2's shards) and, per gradient, how many ranks hold each of
    its elements: squared norms of shards add up over ranks to the global one; replicas count once."""
    from torch.distributed.tensor import DTensor

    info = get_info()
    grads, copies = [], []
    for p in params:
        g = p.grad
        if g is None:
            continue
        n = 1.0
        if isinstance(g, DTensor):
            for dim, pl in enumerate(g.placements):
                if pl.is_replicate():
                    n *= g.device_mesh.size(dim)
                elif not pl.is_shard():
                    raise RuntimeError(f"a gradient placed as {pl} cannot be clipped from local shards")
            g = g.to_local()
        elif info.distributed:
            n = float(info.world_size)  # a plain gradient in a multi-rank run is a replica
        grads.append(g)
        copies.append(n)
    return grads, copies


def local_grad_sq(params: list[nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient elements this rank contributes to the global norm (0-d float64, no sync)."""
    grads, copies = _local_grads(params)
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=get_info().device)
    norms = torch._foreach_norm(grads)
    # Grouped by replica count (one group under FSDP2): a Python divisor per group, no tensor of divisors
    # copied from the host each step (a blocking copy on CUDA), one cast per group rather than per gradient.
    total = None
    for c in sorted(set(copies)):
        sq = torch.stack([n for n, k in zip(norms, copies) if k == c]).to(torch.float64).square().sum() / c
        total = sq if total is None else total + sq
    return total


def scale_grads_(params: list[nn.Parameter], coef: float) -> None:
    grads, _ = _local_grads(params)
    if grads:
        torch._foreach_mul_(grads, coef)


def clip_groups_(groups: list[list[nn.Parameter]], norms: list[float], max_norm: float) -> None:
    """Scale each group's gradients by ``max_norm / (norm + 1e-6)`` when that is below 1 (torch's and FSDP's
    ``clip_grad_norm_`` rule), given each group's full gradient norm (summed over ranks by the caller)."""
    if max_norm <= 0:
        return
    for group, norm in zip(groups, norms):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            scale_grads_(group, coef)


__all__ = ["clip_grad_norm", "clip_groups_", "local_grad_sq", "scale_grads_"]
