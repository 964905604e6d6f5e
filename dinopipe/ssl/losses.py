"""Self-supervised losses of DINOv2 (Oquab et al. 2023):

* DINO loss on CLS prototypes (Caron et al. 2021): cross-entropy from centred, sharpened teacher
  distributions of the global crops to the student distributions of every crop, same-view pairs excluded.
* iBOT patch loss (Zhou et al. 2022, "iBOT: Image BERT Pre-Training with Online Tokenizer"): the same
  cross-entropy on the patch tokens the student saw masked.
* KoLeo (Sablayrolles et al. 2019, "Spreading vectors for similarity search"): differential-entropy
  regulariser pushing each student CLS feature away from its nearest neighbour in the batch.

The teacher side (centring / Sinkhorn-Knopp and its all-reduce) lives in :mod:`dinopipe.ssl.centering`; the
loss modules own one :class:`TeacherCentering` each so the centre is part of their state dict.
The DINO cross-entropy is computed in float32 whatever the logits' dtype; the iBOT one, over the (masked patches,
prototypes) matrix, divides and normalises in the logits' dtype as the official code does and sums in float32.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..utils.masks import mask_token_weights
from .centering import AllReduceFn, TeacherCentering


def _log_softmax_native(student_logits: Tensor, student_temp: float) -> Tensor:
    """log softmax(logits / temp) in the logits' own dtype, as DINOv2's and DINOv3's iBOT losses compute it (bf16
    logits: bf16 division and log-softmax, whose backward reads and writes bf16; fp32 logits: unchanged). The
    product with the fp32 teacher targets is then promoted to fp32 inside the multiply, so the sum over the K
    prototypes stays in fp32."""
    return F.log_softmax(student_logits / student_temp, dim=-1)


def _log_softmax32(student_logits: Tensor, student_temp: float) -> Tensor:
    # bf16 logits over an fp32 temperature *tensor*: type promotion does the division in fp32 in one pass, where
    # ``.float() / t`` first writes an fp32 copy of the whole (M, K) matrix (K = 65,536 prototypes)
    temp = student_logits.new_full((1,), student_temp, dtype=torch.float32)
    return F.log_softmax(student_logits / temp, dim=-1)


class _TeacherTargetLoss(nn.Module):
    """Shared by the DINO and iBOT losses: a student temperature and the teacher's centring state (EMA centre
    or Sinkhorn-Knopp), which lives in this module's state dict."""

    def __init__(
        self,
        out_dim: int,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
        centering: str = "centering",
        sk_iterations: int = 3,
        all_reduce_fn: Optional[AllReduceFn] = None,
    ) -> None:
        super().__init__()
        self.student_temp = student_temp
        self.teacher = TeacherCentering(out_dim, centering, center_momentum, sk_iterations, all_reduce_fn)

    @torch.no_grad()
    def teacher_probs(self, teacher_logits: Tensor, teacher_temp: float, update_center: bool = True) -> Tensor:
        """Teacher logits (rows = CLS tokens or masked patches) -> targets; updates the centre when asked."""
        return self.teacher(teacher_logits, teacher_temp, update=update_center)


class DINOLoss(_TeacherTargetLoss):
    """DINO cross-entropy between teacher global crops and student crops (CLS prototypes).

    Inputs are crop-major, as the collate function and the packed forward produce them: row ``c * B + b``
    is crop ``c`` of sample ``b``. The loss is DINOv2's average over loss *terms*:

        L = (sum over pairs (student crop s, teacher global crop t), s != t for globals,
             of mean_b H(teacher_t[b], student_s[b])) / (n_g * (n_g - 1) + n_l * n_g)

    with H(p, q) = -sum_k p_k log q_k and the student distribution softmax(logits / student_temp).
    """

    def forward(
        self,
        student_global_logits: Tensor,
        teacher_probs: Tensor,
        student_local_logits: Optional[Tensor] = None,
        n_global_crops: int = 2,
        return_parts: bool = False,
        local_weight: float = 1.0,
    ):
        """Student (n_g * B, K) [+ (n_l * B, K)] logits and teacher (n_g * B, K) targets -> scalar loss.

        With ``return_parts`` also returns ``{"dino_global": ..., "dino_local": ...}``, both already divided
        by the total number of terms (they add up to the loss), as DINOv2 logs them.
        """
        n_g = n_global_crops
        if teacher_probs.shape[0] % n_g or student_global_logits.shape[0] != teacher_probs.shape[0]:
            raise ValueError(
                f"expected teacher and student global logits of {n_g} crops x B rows, got "
                f"{tuple(teacher_probs.shape)} and {tuple(student_global_logits.shape)}"
            )
        b = teacher_probs.shape[0] // n_g
        t = teacher_probs.float().reshape(n_g, b, -1)  # (n_g, B, K)
        s_glob = _log_softmax32(student_global_logits, self.student_temp).reshape(n_g, b, -1)
        # ce[s, t] = mean_b H(teacher_t, student_s)
        ce_glob = -torch.einsum("sbk,tbk->st", s_glob, t) / b  # (n_g, n_g)
        off_diag = ~torch.eye(n_g, dtype=torch.bool, device=ce_glob.device)
        global_sum = torch.where(off_diag, ce_glob, 0.0).sum()  # no boolean indexing: traceable with fake tensors
        n_terms = n_g * (n_g - 1)
        local_sum = ce_glob.new_zeros(())
        if student_local_logits is not None and student_local_logits.shape[0] > 0:
            if student_local_logits.shape[0] % b:
                raise ValueError(f"local logits have {student_local_logits.shape[0]} rows, not a multiple of B={b}")
            n_l = student_local_logits.shape[0] // b
            s_loc = _log_softmax32(student_local_logits, self.student_temp).reshape(n_l, b, -1)
            local_sum = -torch.einsum("sbk,tbk->", s_loc, t) / b
            n_terms += n_l * n_g
        if n_terms == 0:
            raise ValueError("DINO loss needs 2+ global crops or at least one local crop")
        local_sum = local_sum * local_weight  # DINOv3's reweighting of the local-crop terms (1: DINOv2)
        loss = (global_sum + local_sum) / n_terms
        if return_parts:
            return loss, {"dino_global": global_sum.detach() / n_terms, "dino_local": local_sum.detach() / n_terms}
        return loss


class IBOTPatchLoss(_TeacherTargetLoss):
    """iBOT masked-patch cross-entropy, DINOv2's ``forward_masked``.

    Only the M patches the student saw masked enter: the student's logits on them (from the iBOT head,
    shared with the DINO head or separate — the caller decides) and the teacher's targets on the same
    patches (computed from the *unmasked* teacher view). Each patch is weighted by 1 / (masked patches in its
    image), so every masked image counts once whatever its mask ratio, and the sum is divided by the number of
    images in the batch ``n_images`` (all global crops, masked or not, as DINOv2 does).
    """

    def forward(
        self,
        student_logits: Tensor,
        teacher_probs: Tensor,
        n_images: int,
        masks_weight: Optional[Tensor] = None,
        masks: Optional[Tensor] = None,
    ) -> Tensor:
        """(M, K) student logits and teacher targets on masked patches -> scalar loss.

        Give ``masks_weight`` (M,) from the collate function, or ``masks`` (n_images, N) to compute it.
        """
        if student_logits.shape != teacher_probs.shape:
            raise ValueError(f"student {tuple(student_logits.shape)} vs teacher {tuple(teacher_probs.shape)} logits")
        if masks_weight is None:
            if masks is None:
                raise ValueError("IBOTPatchLoss needs masks_weight or masks")
            masks_weight = mask_token_weights(masks)
        if masks_weight.shape[0] != student_logits.shape[0]:
            raise ValueError(f"{masks_weight.shape[0]} mask weights for {student_logits.shape[0]} masked patches")
        # the largest tensor of the step ((M masked patches, 65,536) for the recipes): in the logits' dtype, as the
        # official loss; fp32 doubled its bytes (~8 GB per ViT-S/14 b=64 step, docs/gpu.md)
        lsm = _log_softmax_native(student_logits, self.student_temp)
        per_patch = -(teacher_probs.float() * lsm).sum(dim=-1)  # (M,)
        return (per_patch * masks_weight.float()).sum() / max(int(n_images), 1)


def koleo_loss(features: Tensor, eps: float = 1e-8) -> Tensor:
    """KoLeo on (B, D) features: -mean_i log(min_{j != i} ||x_i - x_j|| + eps) after L2 normalisation.

    Defined for any B: with fewer than two points there is no neighbour, and the loss is 0 (DINOv2 pairs the
    single point with itself and returns a huge or infinite value). Computed in float32 outside autocast.
    """
    if features.dim() != 2:
        raise ValueError(f"koleo_loss expects (B, D) features, got shape {tuple(features.shape)}")
    if features.shape[0] < 2:
        return features.sum() * 0.0  # keeps the graph (and the dtype) for an unconditional backward
    with torch.autocast(device_type=features.device.type, enabled=False):
        x = F.normalize(features.float(), p=2, dim=-1, eps=eps)
        with torch.no_grad():
            dots = x @ x.t()  # (B, B) cosine similarities in [-1, 1]
            dots.fill_diagonal_(-2.0)  # below any real similarity, so a point is never its own neighbour
            nn_idx = dots.argmax(dim=1)
        distances = F.pairwise_distance(x, x[nn_idx], p=2, eps=eps)  # as DINOv2's nn.PairwiseDistance
        return -torch.log(distances + eps).mean()


Gather = Callable[[Tensor], list[Tensor]]
"""All ranks' copies of a tensor, rank order, differentiable (the train layer's ``all_gather_fn``)."""


def koleo_loss_distributed(features: Tensor, gather: Optional[Gather] = None, rank: int = 0,
                           group_size: Optional[int] = None, topk: int = 1, eps: float = 1e-8) -> Tensor:
    """DINOv3's distributed KoLeo (``koleo_loss_distributed``; dinov3 ``loss/koleo_loss.py:KoLeoLossDistributed``).

    Each rank L2-normalises its (b, D) features, gathers every rank's (differentiably: the neighbours' gradient goes
    back to the rank that owns them), cuts the global batch into consecutive groups of ``group_size`` rows (null: one
    group, the global batch) and, for each of its own rows, takes the ``topk`` nearest other rows *of its group*;
    the loss is -mean log(distance + eps) over its own rows. Averaged over ranks (as the gradient all-reduce does),
    this is KoLeo over each group of the global batch, i.e. what one process holding the whole batch computes.
    With one process (``gather`` None) and ``topk`` 1 it equals :func:`koleo_loss`.
    """
    if features.dim() != 2:
        raise ValueError(f"koleo_loss_distributed expects (B, D) features, got shape {tuple(features.shape)}")
    b = features.shape[0]
    with torch.autocast(device_type=features.device.type, enabled=False):
        x = F.normalize(features.float(), p=2, dim=-1, eps=eps)
        everyone = torch.cat(list(gather(x)), dim=0) if gather is not None else x
        total = everyone.shape[0]
        size = total if group_size is None else int(group_size)
        if size % b or total % size:
            raise ValueError(f"dino.koleo_group_size {size} must be a multiple of the per-rank batch {b} and divide "
                             f"the global batch {total}")
        if size < topk + 1:
            raise ValueError(f"dino.koleo_group_size {size}: a group needs more than koleo_topk={topk} rows")
        ranks_per_group = size // b
        group = everyone.view(total // size, size, -1)[rank // ranks_per_group]  # (size, D)
        with torch.no_grad():
            dots = x @ group.t()  # (b, size)
            own = (rank % ranks_per_group) * b + torch.arange(b, device=x.device)
            dots[torch.arange(b, device=x.device), own] = -2.0  # never a row's own neighbour
            idx = dots.topk(topk, dim=1).indices  # (b, topk)
        distances = F.pairwise_distance(x.repeat_interleave(topk, dim=0), group[idx.flatten()], p=2, eps=eps)
        return -torch.log(distances + eps).mean()


class KoLeoLoss(nn.Module):
    def __init__(self, eps: float = 1e-8) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, features: Tensor) -> Tensor:
        return koleo_loss(features, self.eps)


__all__ = ["DINOLoss", "IBOTPatchLoss", "KoLeoLoss", "koleo_loss", "koleo_loss_distributed"]
