"""Evaluation of frozen backbones: weighted kNN and linear probe on CLS (+ average patch) features, as in
DINO (Caron et al. 2021) and DINOv2 (Oquab et al. 2023). ``dinopipe eval knn|linear`` is the command line."""

from .data import LabelError, LabelledImages, open_labelled
from .features import Features, extract_features
from .knn import knn_classify
from .linear import linear_probe

__all__ = ["LabelError", "LabelledImages", "open_labelled", "Features", "extract_features", "knn_classify",
           "linear_probe"]
