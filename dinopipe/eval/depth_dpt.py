"""A DPT head in plain torch (Ranftl et al. 2021, "Vision Transformers for Dense Prediction"; the layout of
dinov3 ``eval/depth/models/dpt_head.py``), reading the patch maps of 4 ViT blocks.

Reassemble: each block's (B, D, h, w) patch map (registers / storage tokens and CLS already dropped by the
backbone's ``get_intermediate_layers``; RoPE backbones give the same maps) is projected by a 1x1 conv and
resampled to strides 4, 8, 16 and 32 of the image (x4 and x2 transposed convs, identity, a stride-2 3x3 conv),
then brought to ``features`` channels by a 3x3 conv. Fusion: from the coarsest level up, residual conv units,
add the next finer level, upsample x2. Head: 3x3 conv to features/2, 3x3 conv to 32, ReLU, 1x1 conv to
``n_out`` (256 depth-bin logits). The logits are at 8x the patch grid (stride 2 for patch 16; the official
head upsamples once more before its last convs: left out, as 256 bins at full resolution cost 4x the memory on
CPU for a map ``DepthModel`` upsamples bilinearly anyway).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class ResidualConvUnit(nn.Module):
    """Pre-activation residual unit: x + conv(relu(conv(relu(x))))."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(F.relu(self.conv1(F.relu(x))))


class FusionBlock(nn.Module):
    """(coarser path, this level) -> refined, upsampled x2 to the next finer level's size."""

    def __init__(self, ch: int, has_skip: bool = True) -> None:
        super().__init__()
        # the coarsest level starts the path: no skip to refine (no weights that would never train)
        self.res1 = ResidualConvUnit(ch) if has_skip else None
        self.res2 = ResidualConvUnit(ch)
        self.project = nn.Conv2d(ch, ch, 1)

    def forward(self, x: Tensor, skip: Tensor | None, out_hw: tuple[int, int]) -> Tensor:
        if self.res1 is not None:
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False) + self.res1(skip)
        x = self.res2(x)
        return self.project(F.interpolate(x, size=out_hw, mode="bilinear", align_corners=False))


class DPTHead(nn.Module):
    def __init__(self, dim: int, n_layers: int = 4, n_out: int = 256, features: int = 256,
                 hidden: tuple[int, ...] | None = None) -> None:
        super().__init__()
        if n_layers != 4:
            raise ValueError(f"the DPT head reassembles 4 blocks, got {n_layers}")
        hidden = hidden or (max(dim // 8, 8), max(dim // 4, 8), max(dim // 2, 8), dim)  # dinov3: D/8..D
        self.project = nn.ModuleList(nn.Conv2d(dim, c, 1) for c in hidden)
        self.resize = nn.ModuleList([
            nn.ConvTranspose2d(hidden[0], hidden[0], 4, stride=4),
            nn.ConvTranspose2d(hidden[1], hidden[1], 2, stride=2),
            nn.Identity(),
            nn.Conv2d(hidden[3], hidden[3], 3, stride=2, padding=1),
        ])
        self.to_features = nn.ModuleList(nn.Conv2d(c, features, 3, padding=1, bias=False) for c in hidden)
        self.fusion = nn.ModuleList(FusionBlock(features, has_skip=i < 3) for i in range(4))
        self.out = nn.Sequential(
            nn.Conv2d(features, features // 2, 3, padding=1),
            nn.Conv2d(features // 2, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, n_out, 1),
        )

    def forward(self, feats: list[tuple[Tensor, Tensor]]) -> Tensor:
        levels = [to_f(rs(pr(x))) for (x, _), pr, rs, to_f in zip(feats, self.project, self.resize, self.to_features)]
        h, w = feats[0][0].shape[-2:]
        path = None
        # coarsest (stride 32) to finest (stride 4); each fusion output has the next finer level's size
        for i in range(3, -1, -1):
            target = tuple(levels[i - 1].shape[-2:]) if i else (8 * h, 8 * w)
            path = self.fusion[i](levels[i] if path is None else path, levels[i], target)
        return self.out(path)


__all__ = ["DPTHead", "FusionBlock", "ResidualConvUnit"]
