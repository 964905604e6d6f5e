"""Linear semantic segmentation on frozen patch tokens (DINOv2's "linear" protocol, Oquab et al. 2023 §7.4).

A 1x1 linear layer (optionally after BatchNorm, as DINOv2's ``BNHead``) maps each final-norm patch token to
class logits on the (H/p, W/p) grid; the logits are upsampled bilinearly to the mask size and trained with
per-pixel cross-entropy (255 = ignore). Reported: mean IoU over classes present in val (prediction or
ground truth), per-class IoU and pixel accuracy. Features are extracted once and cached, like the other
probes; images are resized to a square ``img_size`` (a multiple of the patch size), masks with nearest.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from ..data.transforms import IMAGENET_MEAN, IMAGENET_STD
from .dense_data import IGNORE_INDEX, DenseSet


def load_pair(img_path, mask_path, size: int) -> tuple[Tensor, Tensor]:
    """((3, size, size) normalised image, (size, size) long mask)."""
    img = Image.open(img_path).convert("RGB").resize((size, size), Image.BICUBIC)
    mask = Image.open(mask_path).resize((size, size), Image.NEAREST)
    x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255
    x = (x - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[:, None, None]
    return x, torch.from_numpy(np.asarray(mask).astype(np.int64))


@torch.no_grad()
def extract_dense(model: nn.Module, data: DenseSet, size: int, batch_size: int = 16,
                  device: torch.device = torch.device("cpu")) -> tuple[Tensor, Tensor]:
    """((N, D, h, w) patch tokens, (N, size, size) masks)."""
    p = int(model.patch_size)
    if size % p:
        raise ValueError(f"--img-size {size} is not a multiple of the patch size {p}")
    model = model.eval().to(device)
    feats, masks = [], []
    for i in range(0, len(data), batch_size):
        xs, ms = zip(*(load_pair(a, b, size) for a, b in data.pairs[i:i + batch_size]))
        tok = model.forward_features(torch.stack(xs).to(device))["x_norm_patchtokens"].float().cpu()  # (B, hw, D)
        feats.append(tok.transpose(1, 2).reshape(len(xs), -1, size // p, size // p))
        masks.append(torch.stack(ms))
    return torch.cat(feats), torch.cat(masks)


class LinearSegHead(nn.Module):
    def __init__(self, dim: int, num_classes: int, bn: bool = True) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(dim) if bn else nn.Identity()
        self.conv = nn.Conv2d(dim, num_classes, kernel_size=1)

    def forward(self, feats: Tensor, out_hw: tuple[int, int]) -> Tensor:
        logits = self.conv(self.bn(feats))  # (B, C, h, w)
        return F.interpolate(logits, size=out_hw, mode="bilinear", align_corners=False)  # (B, C, H, W)


def confusion(pred: Tensor, target: Tensor, num_classes: int) -> Tensor:
    keep = target != IGNORE_INDEX
    idx = target[keep] * num_classes + pred[keep]
    return torch.bincount(idx, minlength=num_classes**2).reshape(num_classes, num_classes)  # [true, pred]


def iou_from_confusion(cm: Tensor) -> dict:
    cm = cm.double()
    inter = cm.diag()
    union = cm.sum(0) + cm.sum(1) - inter
    present = union > 0  # classes absent from both prediction and ground truth do not count
    iou = torch.where(present, inter / union.clamp_min(1), torch.full_like(inter, float("nan")))
    return {"miou": float(iou[present].mean()), "pixel_acc": float(inter.sum() / cm.sum().clamp_min(1)),
            "per_class_iou": [None if not ok else round(float(v), 6) for v, ok in zip(iou, present)]}


def seg_probe(f_train: Tensor, m_train: Tensor, f_val: Tensor, m_val: Tensor, num_classes: int,
              epochs: int = 100, lr: float = 1e-2, batch_size: int = 16, bn: bool = True, seed: int = 0,
              device: torch.device = torch.device("cpu")) -> dict:
    """Train the linear head (AdamW, cosine) on cached train tokens; mIoU on val at the mask resolution."""
    torch.manual_seed(seed)
    head = LinearSegHead(f_train.shape[1], num_classes, bn).to(device)
    steps = epochs * -(-len(f_train) // batch_size)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(f_train), generator=g).split(batch_size):
            x, y = f_train[idx].to(device), m_train[idx].to(device)
            loss = F.cross_entropy(head(x, y.shape[-2:]), y, ignore_index=IGNORE_INDEX)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    head.eval()
    cm = torch.zeros(num_classes, num_classes, dtype=torch.long)
    with torch.no_grad():
        for i in range(0, len(f_val), batch_size):
            y = m_val[i:i + batch_size]
            pred = head(f_val[i:i + batch_size].to(device), y.shape[-2:]).argmax(1).cpu()
            cm += confusion(pred, y, num_classes)
    return {**iou_from_confusion(cm), "train_loss": round(loss.item(), 6), "epochs": epochs, "lr": lr, "bn": bn}


__all__ = ["extract_dense", "seg_probe", "LinearSegHead", "confusion", "iou_from_confusion", "load_pair"]
