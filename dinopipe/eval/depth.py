"""Monocular depth on a ViT backbone: DINOv3's linear-bins protocol, a DPT head, the official metrics.

Protocol (dinov3 ``eval/depth``): patch features of one block (``linear``: the last; DINOv2's ``lin. 4``
variant: four evenly spaced blocks with the CLS token concatenated to each patch token) go through BatchNorm and a
1x1 conv to 256 logits per patch; ``relu + 0.1`` normalised over the logits weighs 256 depth bins spaced
linearly over (min_depth, max_depth) (AdaBins), and the loss is the scale-invariant SigLoss (0.15 * mean^2
always, + variance after a 100-step warm-up). The DPT head (``depth_dpt.py``) ends in the same bins.

Metrics (``depth_metrics``): the formulas of dinov3 ``eval/depth/metrics.py``, per image on the valid pixels
(label > 0, inside the evaluation range and the optional Eigen crop), the prediction clamped to the range, then
averaged over images: a1, a2, a3, abs_rel, sq_rel, rmse, rmse_log, log10, silog (x100) and mae.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

METRIC_KEYS = ("a1", "a2", "a3", "abs_rel", "sq_rel", "rmse", "rmse_log", "log10", "silog", "mae")
EIGEN_CROP = (45, 471, 41, 601, 480, 640)  # y1, y2, x1, x2 on NYU's 480 x 640 frame, scaled to the label


# -- metrics -------------------------------------------------------------------------------------------
def eval_mask(gt: Tensor, min_depth: float, max_depth: float, eigen_crop: bool = False) -> Tensor:
    """Pixels that count: a measurement strictly inside (min_depth, max_depth) and, with ``eigen_crop``, inside
    the Eigen crop scaled to the label's size (dinov3 ``make_valid_mask``)."""
    keep = (gt > min_depth) & (gt < max_depth) & (gt > 0)
    if eigen_crop:
        y1, y2, x1, x2, h0, w0 = EIGEN_CROP
        h, w = gt.shape[-2:]
        crop = torch.zeros_like(keep)
        crop[..., int(y1 / h0 * h):int(y2 / h0 * h), int(x1 / w0 * w):int(x2 / w0 * w)] = True
        keep &= crop
    return keep


def image_metrics(pred: Tensor, gt: Tensor, valid: Tensor) -> dict[str, float]:
    """One image's metrics on ``valid`` pixels (float64), dinov3's formulas; NaN when no pixel is valid."""
    g, p = gt[valid].double(), pred[valid].double()
    if g.numel() == 0:
        return {k: float("nan") for k in METRIC_KEYS}
    thresh = torch.maximum(g / p, p / g)
    err = g - p
    err_log = torch.log(g) - torch.log(p)
    silog = torch.sqrt(torch.mean(err_log**2) - torch.mean(err_log) ** 2) * 100
    return {
        "a1": float((thresh < 1.25).double().mean()), "a2": float((thresh < 1.25**2).double().mean()),
        "a3": float((thresh < 1.25**3).double().mean()), "abs_rel": float(torch.mean(err.abs() / g)),
        "sq_rel": float(torch.mean(err**2 / g)), "rmse": float(torch.sqrt((err**2).mean())),
        "rmse_log": float(torch.sqrt((err_log**2).mean())),
        "log10": float((torch.log10(g) - torch.log10(p)).abs().mean()),
        "silog": 0.0 if torch.isnan(silog) else float(silog),  # dinov3: a NaN silog (rounding below 0) is 0
        "mae": float(err.abs().mean()),
    }


def depth_metrics(preds: Sequence[np.ndarray | Tensor], gts: Sequence[np.ndarray | Tensor],
                  min_depth: float = 0.0, max_depth: float = 65.536, eigen_crop: bool = False) -> dict:
    """Mean over images (NaN-skipping, as dinov3's ``nanmean``) of the per-image metrics; predictions are clamped
    to the evaluation range first. Also ``images`` (how many had a valid pixel)."""
    rows = []
    for p, g in zip(preds, gts):
        p, g = torch.as_tensor(np.asarray(p)).double(), torch.as_tensor(np.asarray(g)).double()
        if p.shape != g.shape:
            raise ValueError(f"prediction {tuple(p.shape)} and label {tuple(g.shape)} differ in size")
        rows.append(image_metrics(p.clamp(min_depth, max_depth), g, eval_mask(g, min_depth, max_depth, eigen_crop)))
    out = {k: float(np.nanmean([r[k] for r in rows])) if rows else float("nan") for k in METRIC_KEYS}
    out["images"] = sum(not np.isnan(r["a1"]) for r in rows)
    return out


# -- loss and bins ---------------------------------------------------------------------------------------
class SigLoss(nn.Module):
    """Scale-invariant log loss (Eigen et al.; dinov3 ``loss.SigLoss``): sqrt(var(g) + 0.15 * mean(g)^2), g the
    log ratio on valid pixels; the variance term joins after ``warm_iter`` calls (its step count is a buffer, so it
    is checkpointed with the head and a resumed run repeats the same loss)."""

    def __init__(self, warm_up: bool = True, warm_iter: int = 100, eps: float = 1e-3) -> None:
        super().__init__()
        self.warm_iter, self.eps = warm_iter if warm_up else 0, eps
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, pred: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        g = torch.log(pred[valid] + self.eps) - torch.log(target[valid] + self.eps)
        dg = 0.15 * g.mean() ** 2
        if self.training:
            warm = bool(self.calls < self.warm_iter)
            self.calls += 1
        else:
            warm = False
        if not warm and g.numel() > 1:
            dg = dg + g.var()
        return torch.sqrt(dg.clamp_min(1e-12))


class DepthLoss(nn.Module):
    """``loss_fn(pred, target) -> (loss, logs)`` for ``fit_dense_head``: the (B, 1, h, w) prediction upsampled to
    the label, SigLoss on pixels with a measurement. A module, so SigLoss's warm-up count is checkpointed."""

    metric_keys = ("sigloss",)

    def __init__(self, warm_iter: int = 100) -> None:
        super().__init__()
        self.sig = SigLoss(warm_iter=warm_iter)

    def forward(self, pred: Tensor, target: Tensor) -> tuple[Tensor, dict]:
        pred = F.interpolate(pred, size=target.shape[-2:], mode="bilinear", align_corners=False)
        loss = self.sig(pred, target, target > 0)
        return loss, {"sigloss": loss.detach()}


class BinsHead(nn.Module):
    """A head's bin logits -> (B, 1, h, w) metres on the head's grid: the module ``fit_dense_head`` trains."""

    def __init__(self, head: nn.Module, min_depth: float, max_depth: float) -> None:
        super().__init__()
        self.head, self.min_depth, self.max_depth = head, min_depth, max_depth

    def forward(self, feats) -> Tensor:
        return bins_to_depth(self.head(feats), self.min_depth, self.max_depth)


def bins_to_depth(logits: Tensor, min_depth: float, max_depth: float) -> Tensor:
    """(B, n_bins, h, w) logits -> (B, 1, h, w) metres: AdaBins' linear bins and linear norm (dinov3 default)."""
    bins = torch.linspace(min_depth, max_depth, logits.shape[1], device=logits.device, dtype=logits.dtype)
    w = torch.relu(logits) + 0.1
    w = w / w.sum(dim=1, keepdim=True)
    return (w * bins[None, :, None, None]).sum(dim=1, keepdim=True)


# -- backbone features and the linear head ---------------------------------------------------------------
def out_indices(n_blocks: int, n: int) -> list[int]:
    """``n`` evenly spaced block indices ending at the last (dinov3 FOUR_EVEN_INTERVALS for n=4)."""
    if n == 1:
        return [n_blocks - 1]
    if n_blocks >= n:
        return [i * (n_blocks // n) - 1 for i in range(1, n + 1)]
    return [max(0, -(-(i + 1) * n_blocks // n) - 1) for i in range(n)]  # a shallow model: blocks repeat


class BackboneFeatures(nn.Module):
    """A dinopipe ViT (DINOv2 pos-embed or DINOv3 RoPE, with or without registers) -> list of (patch map
    (B, D, h, w), CLS (B, D)) of the chosen blocks, final norm applied (``get_intermediate_layers``). The input
    side must be a multiple of the patch size (``DepthModel`` pads)."""

    def __init__(self, backbone: nn.Module, layers: Sequence[int]) -> None:
        super().__init__()
        self.backbone, self.layers = backbone, list(layers)

    def forward(self, x: Tensor) -> list[tuple[Tensor, Tensor]]:
        uniq = sorted(set(self.layers))  # the backbone returns each block once, in block order
        outs = self.backbone.get_intermediate_layers(x, n=uniq, reshape=True, return_class_token=True, norm=True)
        return [outs[uniq.index(i)] for i in self.layers]


class LinearDepthHead(nn.Module):
    """BatchNorm + 1x1 conv to ``n_bins`` logits on the patch grid (dinov3 ``LinearHead``); with ``use_cls`` the
    CLS token is concatenated to every patch token of every block (DINOv2's lin. 1 / lin. 4)."""

    def __init__(self, dim: int, n_layers: int = 1, n_bins: int = 256, use_cls: bool = False) -> None:
        super().__init__()
        self.use_cls = use_cls
        ch = dim * n_layers * (2 if use_cls else 1)
        self.bn = nn.BatchNorm2d(ch)
        self.conv = nn.Conv2d(ch, n_bins, kernel_size=1)
        nn.init.normal_(self.conv.weight, std=0.01)
        nn.init.zeros_(self.conv.bias)

    def forward(self, feats: list[tuple[Tensor, Tensor]]) -> Tensor:
        maps = []
        for x, cls in feats:
            maps.append(torch.cat([x, cls[:, :, None, None].expand_as(x)], 1) if self.use_cls else x)
        return self.conv(self.bn(torch.cat(maps, 1)))


# -- the whole predictor ---------------------------------------------------------------------------------
class DepthModel(nn.Module):
    """backbone + head + bins: ``forward(images)`` with (B, 3, H, W) normalised images of any size returns
    (B, 1, H, W) metres. The input is centre-padded to a multiple of the patch size (dinov3's CENTER_PADDING),
    the bins' depth map upsampled bilinearly to the padded size and cropped back."""

    def __init__(self, backbone: nn.Module, head: nn.Module, layers: Sequence[int], min_depth: float,
                 max_depth: float) -> None:
        super().__init__()
        self.features = BackboneFeatures(backbone, layers)
        self.head, self.min_depth, self.max_depth = head, float(min_depth), float(max_depth)
        self.patch = int(backbone.patch_size)

    @property
    def backbone(self) -> nn.Module:
        return self.features.backbone

    def forward_from_features(self, feats: list[tuple[Tensor, Tensor]], out_hw: tuple[int, int]) -> Tensor:
        depth = bins_to_depth(self.head(feats), self.min_depth, self.max_depth)
        return F.interpolate(depth, size=out_hw, mode="bilinear", align_corners=False)

    def forward(self, x: Tensor) -> Tensor:
        H, W = x.shape[-2:]
        ph, pw = (self.patch - H % self.patch) % self.patch, (self.patch - W % self.patch) % self.patch
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        out = self.forward_from_features(self.features(x), (H + ph, W + pw))
        return out[..., ph // 2:ph // 2 + H, pw // 2:pw // 2 + W]


@torch.no_grad()
def predict(model: nn.Module, x: Tensor, out_hw: tuple[int, int], flip_tta: bool = False) -> Tensor:
    """(B, 1, h, w) metres at the label size ``out_hw``; with ``flip_tta`` the mean of the image's and its mirror's
    prediction (dinov3 LeftRightFlipAug)."""
    y = model(x)
    if flip_tta:
        y = 0.5 * (y + model(x.flip(-1)).flip(-1))
    return F.interpolate(y.float(), size=out_hw, mode="bilinear", align_corners=False)


def build_head(kind: str, dim: int, n_blocks: int, protocol: str = "dinov3", n_bins: int = 256,
               dpt_features: Optional[int] = None) -> tuple[nn.Module, list[int]]:
    """(head, block indices it reads). ``linear``: dinov3 = last block, no CLS; dinov2 = 4 blocks + CLS.
    ``dpt``: 4 evenly spaced blocks into ``DPTHead``."""
    if kind == "linear":
        n, cls = (1, False) if protocol == "dinov3" else (4, True)
        layers = out_indices(n_blocks, n)
        return LinearDepthHead(dim, len(layers), n_bins, use_cls=cls), layers
    if kind == "dpt":
        from .depth_dpt import DPTHead

        layers = out_indices(n_blocks, 4)
        return DPTHead(dim, n_layers=len(layers), n_out=n_bins, features=dpt_features or min(256, 4 * dim)), layers
    raise ValueError(f"--head must be linear or dpt, got '{kind}'")


__all__ = ["METRIC_KEYS", "depth_metrics", "image_metrics", "eval_mask", "SigLoss", "DepthLoss", "BinsHead",
            "bins_to_depth", "out_indices",
           "BackboneFeatures", "LinearDepthHead", "DepthModel", "predict", "build_head"]
