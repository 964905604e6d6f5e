"""Frozen features of a labelled image set, as DINO / DINOv2 evaluate them.

Eval transform: resize the short side to ``crop * 256 / 224`` (bicubic), centre-crop ``crop`` (a multiple of
the patch size), normalisation with the statistics the model records (``utils/norm.py:input_norm``: ImageNet's
for an RGB model without a record). An N-channel model reads each file's N bands (``.tif`` / ``.npy``, through
``data/channels.py:decode_channels``, on the value scale its statistics were computed on); a file with another
band count is unreadable, skipped and counted. The feature is the final-norm CLS token, optionally concatenated with
the average patch token (DINOv2's linear-probe ``avgpool`` option). On CUDA the forward runs under bf16
autocast; features come back float32 on the CPU. Images that cannot be decoded are skipped and counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ..data.channels import decode_channels
from ..data.decode import safe_decode
from ..data.transforms import eval_crop_size, eval_transform
from ..utils.device import pick_device
from ..utils.norm import in_channels, input_norm
from .data import LabelError, LabelledImages

log = logging.getLogger(__name__)


class _EvalDataset(Dataset):
    """(image tensor, label, ok); an unreadable image gives a zero tensor and ok=False. RGB models see the
    upright RGB photo (``safe_decode``), others the file's ``channels`` bands (``decode_channels``)."""

    def __init__(self, data: LabelledImages, transform, crop: int, channels: int = 3):
        self.data, self.transform, self.crop, self.channels = data, transform, crop, channels

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        raw = self.data.read(self.data.refs[i])
        img, _ = safe_decode(raw) if self.channels == 3 else decode_channels(raw, self.channels)
        if img is None:
            return torch.zeros(self.channels, self.crop, self.crop), self.data.labels[i], False
        return self.transform(img), self.data.labels[i], True


@dataclass
class Features:
    """(N, D) float32 features on the CPU, (N,) int64 labels, and how many images were unreadable."""

    feats: Tensor
    labels: Tensor
    unreadable: int


@torch.no_grad()
def model_features(model: nn.Module, x: Tensor, avgpool: bool = False) -> Tensor:
    out = model.forward_features(x)
    cls = out["x_norm_clstoken"]  # (B, D)
    if not avgpool:
        return cls
    return torch.cat([cls, out["x_norm_patchtokens"].mean(dim=1)], dim=-1)  # (B, 2D)


def model_crop_size(model: nn.Module, img_size: Optional[int] = None) -> int:
    """The eval crop for ``model``: ``img_size`` (default: the size it was built for) rounded down to a multiple
    of a ViT's patch size; a CNN student (``timm:NAME``) takes any size, so it is evaluated at ``img_size``."""
    size = img_size or int(getattr(model, "img_size", 0) or model.patch_embed.img_size[0])
    return eval_crop_size(size, int(getattr(model, "input_multiple", model.patch_size)))


@torch.no_grad()
def extract_features(
    model: nn.Module,
    data: LabelledImages,
    img_size: Optional[int] = None,
    batch_size: int = 64,
    num_workers: int = 4,
    device: str | torch.device = "auto",
    avgpool: bool = False,
    normalize: bool = True,
) -> Features:
    """Features of every readable image in ``data``; L2-normalised rows when ``normalize``.

    ``img_size`` defaults to the size the model was built for. With ``avgpool`` and ``normalize`` the CLS and
    average-patch halves are normalised separately, so neither dominates the concatenation.
    """
    device = pick_device(device)
    crop = model_crop_size(model, img_size)
    mean, std = input_norm(model)
    dataset = _EvalDataset(data, eval_transform(crop, mean=mean, std=std), crop, in_channels(model))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                        num_workers=num_workers, pin_memory=device.type == "cuda")
    model = model.to(device).eval()
    feats, labels, bad = [], [], 0
    for x, y, ok in loader:
        bad += int((~ok).sum())
        if not ok.any():
            continue
        x = x[ok].to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            f = model_features(model, x, avgpool)
        f = f.float()
        if normalize:
            f = torch.cat([F.normalize(h, dim=-1) for h in f.chunk(2 if avgpool else 1, dim=-1)], dim=-1)
        feats.append(f.cpu())
        labels.append(y[ok])
    if bad:
        log.warning("%s: %d of %d images could not be decoded and were skipped", data.source, bad, len(data))
    if not feats:
        raise LabelError(f"{data.source}: none of the {len(data)} images could be decoded")
    return Features(torch.cat(feats), torch.cat(labels).long(), bad)


__all__ = ["Features", "extract_features", "model_crop_size", "eval_transform", "eval_crop_size", "model_features"]
