"""A simple feature pyramid from a plain ViT's last block (ViTDet, Li et al. 2022, "Exploring Plain Vision
Transformer Backbones for Object Detection", §3): the final-norm patch grid is upsampled by transposed
convolutions (x4, x2), kept (x1) and max-pooled (/2), then each level is projected to ``out_channels`` by a 1x1
and a 3x3 convolution with LayerNorm. Levels are keyed "0".."3" (strides 4, 8, 16, 32), the OrderedDict
torchvision's detectors and transformers' UperNet / Mask2Former decoders consume.

Exact strides for every patch size. torchvision infers RoIAlign scales from feature size / image size rounded
to a power of 2, and anchor strides as ``image_size // feature_size``: a patch-14 grid (true strides
3.5/7/14/28) gets the wrong ones (1/16 for 1/14: boxes pooled 14 % off). So the image is resampled before the
backbone to exactly ``(H/16) x (W/16)`` patches (x14/16 for a patch-14 model, a no-op for patch 16): the grid is
then H/16 and every level's stride is exactly 4/8/16/32. H and W must be multiples of 32 (``SIZE_DIVISIBLE``);
:func:`pad_to` makes them so.

Works for every dinopipe backbone: ``forward_features(x)["x_norm_patchtokens"]`` excludes CLS and register /
storage tokens, and DINOv2 (interpolated position embeddings) and DINOv3 (RoPE) backbones accept any grid.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

STRIDES = (4, 8, 16, 32)
SIZE_DIVISIBLE = 32  # the coarsest level's stride: H/32 must be whole for the max-pool level


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over channels of a (B, C, H, W) map (ViTDet's norm in the pyramid)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def patch_grid(backbone: nn.Module, images: Tensor) -> Tensor:
    """(B, 3, H, W) -> (B, D, H/16, W/16): the last block's normed patch tokens on an exact stride-16 grid."""
    B, _, H, W = images.shape
    if H % 16 or W % 16:
        raise ValueError(f"pyramid input {H}x{W}: height and width must be multiples of 16 (see pad_to)")
    p = int(backbone.patch_size)
    h, w = H // 16, W // 16
    if p != 16:  # resample so that the patch grid is exactly H/16 (why: the module docstring)
        images = F.interpolate(images, size=(h * p, w * p), mode="bilinear", align_corners=False, antialias=True)
    tok = backbone.forward_features(images)["x_norm_patchtokens"]  # (B, h*w, D)
    return tok.transpose(1, 2).reshape(B, -1, h, w)


def pad_to(x: Tensor, multiple: int = SIZE_DIVISIBLE, value: float = 0.0) -> Tensor:
    """Pad the last two dims on the bottom/right up to a multiple (the crop back is ``[..., :H, :W]``)."""
    H, W = x.shape[-2:]
    ph, pw = -H % multiple, -W % multiple
    return F.pad(x, (0, pw, 0, ph), value=value) if ph or pw else x


def _proj(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), LayerNorm2d(cout),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), LayerNorm2d(cout))


class SimplePyramid(nn.Module):
    """Stride-16 patch grid (B, D, h, w) -> OrderedDict "0".."3" of (B, out_channels, 4h, 2h, h, h/2) maps."""

    strides = STRIDES

    def __init__(self, embed_dim: int, out_channels: int = 256) -> None:
        super().__init__()
        d = embed_dim
        self.out_channels = out_channels
        self.up4 = nn.Sequential(nn.ConvTranspose2d(d, d // 2, 2, stride=2), LayerNorm2d(d // 2), nn.GELU(),
                                 nn.ConvTranspose2d(d // 2, d // 4, 2, stride=2))
        self.up2 = nn.ConvTranspose2d(d, d // 2, 2, stride=2)
        self.down2 = nn.MaxPool2d(2, stride=2)
        self.proj = nn.ModuleList([_proj(c, out_channels) for c in (d // 4, d // 2, d, d)])

    def forward(self, grid: Tensor) -> "OrderedDict[str, Tensor]":
        if grid.shape[-2] % 2 or grid.shape[-1] % 2:
            raise ValueError(f"patch grid {tuple(grid.shape[-2:])}: the stride-32 level needs an even grid "
                             f"(image sides multiples of {SIZE_DIVISIBLE})")
        maps = (self.up4(grid), self.up2(grid), grid, self.down2(grid))
        return OrderedDict((str(i), proj(m)) for i, (proj, m) in enumerate(zip(self.proj, maps)))


class PyramidBackbone(nn.Module):
    """Backbone + pyramid as torchvision's ``BackboneWithFPN`` looks: ``out_channels`` and an OrderedDict of maps
    (strides 4/8/16/32, plus "pool" at 64 with ``extra_pool`` as Faster R-CNN's FPN has)."""

    def __init__(self, backbone: nn.Module, out_channels: int = 256, extra_pool: bool = False) -> None:
        super().__init__()
        self.body = backbone
        self.pyramid = SimplePyramid(int(backbone.embed_dim), out_channels)
        self.out_channels = out_channels
        self.extra_pool = extra_pool

    def forward(self, images: Tensor) -> "OrderedDict[str, Tensor]":
        maps = self.pyramid(patch_grid(self.body, images))
        if self.extra_pool:  # torchvision's LastLevelMaxPool: kernel 1, stride 2
            maps["pool"] = F.max_pool2d(maps["3"], 1, 2, 0)
        return maps


@torch.no_grad()
def level_strides(maps: "OrderedDict[str, Tensor]", image_hw: tuple[int, int]) -> list[float]:
    """The stride of each level as image size / map size (exact powers of 2 for this pyramid)."""
    return [image_hw[0] / m.shape[-2] for m in maps.values()]


def grid_features(backbone: nn.Module, x: Tensor) -> Tensor:
    """The pyramid heads' input: :func:`patch_grid` of ``x`` padded to a multiple of 32 (training and slide
    inference call this one function)."""
    return patch_grid(backbone, pad_to(x))


class GridFeatures(nn.Module):
    """:func:`grid_features` as the backbone module the one training loop trains or freezes (``backbone`` is the
    ViT; a tuned run's parameters are its parameters)."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: Tensor) -> Tensor:
        return grid_features(self.backbone, x)


__all__ = ["SimplePyramid", "PyramidBackbone", "patch_grid", "pad_to", "LayerNorm2d", "STRIDES",
           "SIZE_DIVISIBLE", "level_strides", "grid_features", "GridFeatures"]
