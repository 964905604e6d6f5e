"""Teacher centering: the two ways DINO-family methods keep the teacher from collapsing.

* EMA centre (Caron et al. 2021, "Emerging Properties in Self-Supervised Vision Transformers"): subtract a
  running mean of the teacher logits, then a sharp softmax.
* Sinkhorn-Knopp (Cuturi 2013; as in SwAV, Caron et al. 2020, and DINOv2, Oquab et al. 2023): a few
  alternating row/column normalisations so that, over the global batch, prototypes are used equally.

Both need sums over the *global* batch. Rather than importing ``torch.distributed`` here (this code must run
in a single plain process, where DINOv2's Sinkhorn-Knopp crashes), every function takes an optional
``all_reduce_fn``: a callable that sums a tensor over all processes and returns the result (in-place
reducers that return ``None``, like ``torch.distributed.all_reduce``, are accepted too). The default is the
identity, i.e. one process. Sample counts are reduced as well, so uneven per-rank batches (the number of
masked iBOT patches differs per rank) are handled without passing a world size.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

AllReduceFn = Callable[[Tensor], Optional[Tensor]]

CENTERING_MODES = ("centering", "sinkhorn_knopp")


def all_reduce_sum(tensor: Tensor, all_reduce_fn: Optional[AllReduceFn]) -> Tensor:
    """Sum ``tensor`` over processes with ``all_reduce_fn`` (identity when None)."""
    if all_reduce_fn is None:
        return tensor
    out = all_reduce_fn(tensor)
    # torch.distributed.all_reduce works in place and returns None (or a Work handle with async_op).
    return out if isinstance(out, Tensor) else tensor


@torch.no_grad()
def sinkhorn_knopp(
    teacher_logits: Tensor,
    teacher_temp: float,
    n_iterations: int = 3,
    all_reduce_fn: Optional[AllReduceFn] = None,
) -> Tensor:
    """(B, K) teacher logits -> (B, K) soft assignments Q, DINOv2's ``sinkhorn_knopp_teacher``.

    With P = exp(logits / T), the iterations alternate: scale each prototype (column of the returned
    matrix) so its mass over the *global* batch is 1/K, then scale each sample (row) to mass 1/B_global;
    finally rows are multiplied by B_global. Hence, exactly, every row of the result sums to 1 (each sample
    gets a probability distribution over prototypes), and each column sums to approximately B_global / K
    over the global batch (exactly so just before the last row step; the gap shrinks with iterations).

    Computed in float32: the logits are cosine similarities times a bounded gain, so exp(logit / T) stays
    finite for DINOv2's temperatures. B_global is the all-reduced row count, so ranks may hold different
    numbers of rows (including zero).
    """
    if n_iterations < 1:
        raise ValueError(f"sinkhorn_knopp needs at least 1 iteration, got {n_iterations}")
    q = torch.exp(teacher_logits.float() / teacher_temp).t()  # (K, B): the paper's notation
    k = q.shape[0]
    # One reduction gives both the total mass and the global number of samples.
    # (new_full: a fill on the device; new_tensor would copy Python data from the host, a sync on CUDA)
    stats = all_reduce_sum(torch.stack([q.sum(), q.new_full((), float(q.shape[1]))]), all_reduce_fn)
    # No host sync on the count: with zero samples everywhere every division below acts on an empty q.
    sum_q, b_global = stats[0], stats[1]
    tiny = torch.finfo(q.dtype).tiny
    q /= sum_q.clamp_min(tiny)
    for _ in range(n_iterations):
        # Each prototype gets total mass 1/K over the global batch.
        row_sums = all_reduce_sum(q.sum(dim=1, keepdim=True), all_reduce_fn)  # (K, 1)
        q /= row_sums.clamp_min(tiny)  # a prototype whose exp underflowed everywhere stays at 0, not NaN
        q /= k
        # Each sample gets mass 1/B (purely local: a sample lives on one rank).
        q /= q.sum(dim=0, keepdim=True).clamp_min(tiny)
        q /= b_global
    q *= b_global  # samples' assignments sum to 1
    return q.t()


class EMACenter(nn.Module):
    """Running mean of teacher logits, subtracted before the teacher softmax (DINO's centering).

    ``update`` computes the batch mean over the global batch (sums and counts all-reduced) and moves the
    centre with momentum ``m``: ``c <- m c + (1 - m) mean``. The centre is a persistent buffer, so it is
    saved and restored with the module's state dict; it is identical on every rank by construction.
    """

    def __init__(self, dim: int, momentum: float = 0.9) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("center", torch.zeros(1, dim))

    def softmax(self, teacher_logits: Tensor, teacher_temp: float) -> Tensor:
        # bf16 logits minus the fp32 (1, K) centre: promoted to fp32 inside the subtraction, no separate cast pass
        return F.softmax((teacher_logits - self.center) / teacher_temp, dim=-1)

    @torch.no_grad()
    def update(self, teacher_logits: Tensor, all_reduce_fn: Optional[AllReduceFn] = None) -> None:
        x = teacher_logits
        # a fill on the device, not a host-to-device copy
        count = x.new_full((1,), float(x.shape[0]), dtype=torch.float32)
        # summed in fp32 from the logits as they are (no fp32 copy of the whole matrix first)
        stats = all_reduce_sum(torch.cat([x.sum(dim=0, dtype=torch.float32), count]), all_reduce_fn)  # one reduction
        total = stats[-1]
        batch_center = (stats[:-1] / total.clamp_min(1.0)).unsqueeze(0)
        new_center = self.center * self.momentum + batch_center * (1.0 - self.momentum)
        # An empty global batch (no masked patch anywhere) leaves the centre as it was; no host sync.
        self.center.copy_(torch.where(total > 0, new_center, self.center))


class TeacherCentering(nn.Module):
    """Turns teacher logits into targets with either centering mode; one per loss (DINO, iBOT).

    ``mode='centering'``: softmax((logits - centre) / T) with the centre *before* this batch, then the
    centre is updated with this batch (DINOv2's order). ``mode='sinkhorn_knopp'``: SK with
    ``sk_iterations``; the EMA centre is not used (and not updated).
    """

    def __init__(
        self,
        dim: int,
        mode: str = "centering",
        center_momentum: float = 0.9,
        sk_iterations: int = 3,
        all_reduce_fn: Optional[AllReduceFn] = None,
    ) -> None:
        super().__init__()
        if mode not in CENTERING_MODES:
            raise ValueError(f"centering mode must be one of {CENTERING_MODES}, got '{mode}'")
        self.mode = mode
        self.sk_iterations = sk_iterations
        self.all_reduce_fn = all_reduce_fn
        # Kept in both modes so checkpoints have the same keys whichever mode a run used.
        self.ema = EMACenter(dim, center_momentum)

    @torch.no_grad()
    def forward(self, teacher_logits: Tensor, teacher_temp: float, update: bool = True) -> Tensor:
        """(M, K) teacher logits -> (M, K) float32 target distributions."""
        if self.mode == "sinkhorn_knopp":
            return sinkhorn_knopp(teacher_logits, teacher_temp, self.sk_iterations, self.all_reduce_fn)
        probs = self.ema.softmax(teacher_logits, teacher_temp)
        if update:
            self.ema.update(teacher_logits, self.all_reduce_fn)
        return probs


__all__ = ["AllReduceFn", "CENTERING_MODES", "EMACenter", "TeacherCentering", "all_reduce_sum", "sinkhorn_knopp"]
