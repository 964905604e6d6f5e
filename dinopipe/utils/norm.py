"""The input normalisation every dinopipe backbone is trained and evaluated with (ImageNet statistics, as
DINOv2 / DINOv3). One home at the bottom layer: the augmentations, the eval transform, the exporters
(which write it into timm / HF preprocessor configs) and the curation embedder all read it here."""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD"]
