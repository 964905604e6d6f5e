"""A trained segmentation head with its backbone as one model that predicts (``dinopipe.load(OUT/model)``).

``SegModel(images)`` takes normalised (B, 3, H, W) images of any size (multiples of the patch) and returns
(B, num_classes, H, W) class scores: the head's logits on the padded stride-16 grid, upsampled and cropped to the
input (``argmax(1)`` gives class indices). This is one window; ``eval seg`` scores large images by slide inference
(:func:`.seg_train.slide_logits`) over windows of the training size, which this model gives for each window.
The folder is head_io's (safetensors + config.json, nothing pickled); the builder is registered under task "seg".
"""

from __future__ import annotations

from torch import Tensor, nn

from .head_io import register_head_builder
from .pyramid import grid_features
from .seg_heads import build_seg_head


class SegModel(nn.Module):
    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, images: Tensor) -> Tensor:
        return self.head.logits(self.head(grid_features(self.backbone, images)), images.shape[-2:])


def seg_head_config(kind: str, num_classes: int, channels: int, img_size: int, m2f: dict | None = None) -> dict:
    """What config.json records: enough to rebuild the head's modules (and the size it was trained at)."""
    return {"task": "seg", "head": kind, "num_classes": int(num_classes), "channels": int(channels),
            "img_size": int(img_size), "m2f": dict(m2f or {})}


def _build_seg(backbone: nn.Module, hc: dict) -> tuple[nn.Module, nn.Module]:
    head = build_seg_head(str(hc["head"]), int(backbone.embed_dim), int(hc["num_classes"]),
                          channels=int(hc["channels"]), **dict(hc.get("m2f") or {}))
    return SegModel(backbone, head), head


register_head_builder("seg", _build_seg)

__all__ = ["SegModel", "seg_head_config"]
