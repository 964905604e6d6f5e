"""Segmentation heads on a ViT's patch grid: linear (BN + 1x1, DINOv2's probe), UperNet (Xiao et al. 2018) and
Mask2Former (Cheng et al. 2022) from transformers, with their CNN / Swin encoder swapped for the simple feature
pyramid of :mod:`.pyramid` (strides 4/8/16/32 from the last block).

Every head maps the stride-16 patch grid (B, D, H/16, W/16) of an image padded to a multiple of 32 to a raw
output; ``head.logits(raw, out_hw)`` gives (B, C, H, W) class scores on the unpadded image and
``head.loss(raw, masks)`` the training loss (per-pixel cross-entropy, 255 = ignore; Mask2Former: its own
Hungarian-matched class + mask + dice loss, which needs scipy — the ``seg`` extra).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dense_data import IGNORE_INDEX
from .pyramid import SimplePyramid

HEADS = ("linear", "upernet", "m2f")


def _upsample_crop(x: Tensor, stride: int, out_hw: tuple[int, int]) -> Tensor:
    """A map on the padded canvas at ``stride`` -> (B, C, *out_hw): upsample to the canvas, crop the padding."""
    canvas = (x.shape[-2] * stride, x.shape[-1] * stride)
    if tuple(x.shape[-2:]) != canvas:
        x = F.interpolate(x, size=canvas, mode="bilinear", align_corners=False)
    return x[..., : out_hw[0], : out_hw[1]]


class _PixelHead(nn.Module):
    """Heads whose raw output is a (B, C, h, w) logit map at ``stride`` of the padded canvas."""

    stride = 16
    metric_keys = ("ce",)  # what ``loss`` logs (the training loop's metrics.jsonl)

    def logits(self, raw: Tensor, out_hw: tuple[int, int]) -> Tensor:
        return _upsample_crop(raw, self.stride, out_hw)

    def loss(self, raw: Tensor, masks: Tensor) -> tuple[Tensor, dict]:
        masks = masks.to(raw.device)
        loss = F.cross_entropy(self.logits(raw, masks.shape[-2:]), masks, ignore_index=IGNORE_INDEX)
        return loss, {"ce": loss.detach()}


class LinearGridHead(_PixelHead):
    """DINOv2's linear probe (BatchNorm + 1x1 conv) on the patch grid."""

    def __init__(self, embed_dim: int, num_classes: int, bn: bool = True) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(embed_dim) if bn else nn.Identity()
        self.conv = nn.Conv2d(embed_dim, num_classes, 1)

    def forward(self, grid: Tensor) -> Tensor:
        return self.conv(self.bn(grid))


class UperNetSegHead(_PixelHead):
    """Pyramid -> transformers' ``UperNetHead`` (PSP on stride 32 + FPN fusion) -> logits at stride 4."""

    stride = 4

    def __init__(self, embed_dim: int, num_classes: int, channels: int = 256, hidden_size: int = 256) -> None:
        super().__init__()
        from transformers import UperNetConfig
        from transformers.models.upernet.modeling_upernet import UperNetHead

        self.pyramid = SimplePyramid(embed_dim, channels)
        cfg = UperNetConfig(hidden_size=hidden_size, num_labels=num_classes, pool_scales=[1, 2, 3, 6])
        self.decode = UperNetHead(cfg, in_channels=[channels] * 4)

    def forward(self, grid: Tensor) -> Tensor:
        return self.decode(list(self.pyramid(grid).values()))


def _init_as_transformers(cfg, *parts: nn.Module) -> None:
    """Mask2Former's own initialisation of modules built outside its model. transformers initialises them from the
    model's ``post_init`` (``Mask2FormerPreTrainedModel._init_weights``, children before their parent); built on
    their own they keep what their constructors left: the pixel decoder's ``level_embed`` is ``torch.Tensor(L, C)``,
    uninitialised memory (a NaN loss at step 0 now and then, depending on what the process freed before), and the
    deformable attention misses its sampling-offset grid."""
    from transformers.models.mask2former.modeling_mask2former import Mask2FormerPreTrainedModel

    initializer = Mask2FormerPreTrainedModel(cfg)

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        initializer._init_weights(module)

    with torch.no_grad():
        for part in parts:
            visit(part)


class Mask2FormerSegHead(nn.Module):
    """Pyramid -> transformers' Mask2Former pixel decoder (multi-scale deformable attention over strides 8/16/32,
    mask features at 4) -> masked-attention transformer decoder -> per-query class and mask logits."""

    size_generic_export = False  # transformers' deformable attention splits its values by level sizes as ints

    def __init__(self, embed_dim: int, num_classes: int, channels: int = 256, num_queries: int = 100,
                 decoder_layers: int = 10, encoder_layers: int = 6, train_num_points: int = 12544) -> None:
        super().__init__()
        from transformers import Mask2FormerConfig
        from transformers.models.mask2former.modeling_mask2former import (
            Mask2FormerLoss, Mask2FormerPixelDecoder, Mask2FormerTransformerModule)

        if channels % 32:
            raise ValueError(f"Mask2Former's width must be a multiple of 32 (its GroupNorm), got {channels}")
        cfg = Mask2FormerConfig(num_labels=num_classes, feature_size=channels, mask_feature_size=channels,
                                hidden_dim=channels, encoder_feedforward_dim=4 * channels,
                                dim_feedforward=4 * channels, num_queries=num_queries,
                                decoder_layers=decoder_layers, encoder_layers=encoder_layers,
                                num_attention_heads=max(1, channels // 32), train_num_points=train_num_points)
        self.num_classes = num_classes
        self.pyramid = SimplePyramid(embed_dim, channels)
        self.pixel_decoder = Mask2FormerPixelDecoder(cfg, feature_channels=[channels] * 4)
        self.transformer = Mask2FormerTransformerModule(in_features=cfg.feature_size, config=cfg)
        self.class_predictor = nn.Linear(cfg.hidden_dim, num_classes + 1)  # + "no object"
        self.weights = {"loss_cross_entropy": cfg.class_weight, "loss_mask": cfg.mask_weight,
                        "loss_dice": cfg.dice_weight}
        self.criterion = Mask2FormerLoss(config=cfg, weight_dict=self.weights)
        _init_as_transformers(cfg, self.pixel_decoder, self.transformer)
        self.metric_keys = tuple(self.weights)  # what ``loss`` logs

    def forward(self, grid: Tensor) -> dict:
        maps = list(self.pyramid(grid).values())
        dec = self.pixel_decoder(maps)
        out = self.transformer(multi_scale_features=dec.multi_scale_features, mask_features=dec.mask_features,
                               output_hidden_states=True)
        classes = [self.class_predictor(h.transpose(0, 1)) for h in out.intermediate_hidden_states]
        return {"classes": classes, "masks": out.masks_queries_logits}  # per decoder layer: (B,Q,C+1), (B,Q,h,w)

    def logits(self, raw: dict, out_hw: tuple[int, int]) -> Tensor:
        """Semantic inference (the paper's): sum over queries of P(class) * sigmoid(mask)."""
        cls = raw["classes"][-1].softmax(-1)[..., :-1]  # (B, Q, C): "no object" dropped
        masks = _upsample_crop(raw["masks"][-1], 4, out_hw).sigmoid()
        return torch.einsum("bqc,bqhw->bchw", cls, masks)

    def loss(self, raw: dict, masks: Tensor) -> tuple[Tensor, dict]:
        # Targets on the padded canvas (stride 4 x mask grid), one binary mask per class present in the image.
        h, w = raw["masks"][-1].shape[-2:]
        masks = masks.to(raw["masks"][-1].device)
        masks = F.pad(masks, (0, 4 * w - masks.shape[-1], 0, 4 * h - masks.shape[-2]), value=IGNORE_INDEX)
        mask_labels, class_labels = [], []
        for m in masks:
            present = [c for c in m.unique().tolist() if c != IGNORE_INDEX]
            class_labels.append(torch.tensor(present, dtype=torch.long, device=m.device))
            mask_labels.append(torch.stack([(m == c).float() for c in present]) if present
                               else m.new_zeros((0, *m.shape), dtype=torch.float))
        aux = [{"masks_queries_logits": m, "class_queries_logits": c}
               for m, c in zip(raw["masks"][:-1], raw["classes"][:-1])]
        losses = self.criterion(masks_queries_logits=raw["masks"][-1], class_queries_logits=raw["classes"][-1],
                                mask_labels=mask_labels, class_labels=class_labels, auxiliary_predictions=aux)
        total = sum(v * next(w for k, w in self.weights.items() if k in name) for name, v in losses.items())
        return total, {k: losses[k].detach() for k in self.weights}


def build_seg_head(kind: str, embed_dim: int, num_classes: int, channels: int = 256, **m2f) -> nn.Module:
    if kind == "linear":
        return LinearGridHead(embed_dim, num_classes)
    if kind == "upernet":
        return UperNetSegHead(embed_dim, num_classes, channels=channels, hidden_size=channels)
    if kind == "m2f":
        return Mask2FormerSegHead(embed_dim, num_classes, channels=channels, **m2f)
    raise ValueError(f"unknown seg head {kind!r}; choose from {HEADS}")


__all__ = ["HEADS", "LinearGridHead", "UperNetSegHead", "Mask2FormerSegHead", "build_seg_head"]
