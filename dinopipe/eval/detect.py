"""Object detection on a plain ViT: the simple feature pyramid (:mod:`.pyramid`, ViTDet) feeds torchvision's
Faster R-CNN, Mask R-CNN or FCOS (``dinopipe eval detect``).

The backbone the detectors see is :class:`.pyramid.PyramidBackbone`: ``out_channels`` and an OrderedDict of maps
"0".."3" at strides 4/8/16/32 plus "pool" at 64 (Faster R-CNN's FPN has it; FCOS uses it as P6). The patch-14
traps are closed by construction: the pyramid resamples a patch-14 image to an exact stride-16 grid, so the scales
torchvision's ``MultiScaleRoIAlign`` infers (rounded to powers of 2) and the anchor strides its
``AnchorGenerator`` computes (``image_size // map_size``) are the true ones, and the transform pads batches to
``size_divisible`` = 32, the coarsest level's stride, so that every level's map is whole. ``tests/eval/
test_detect.py`` checks both against the ground truth for patch 14 and 16.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..data.transforms import IMAGENET_MEAN, IMAGENET_STD
from .coco import CocoSet, CocoTrainSet, coco_metrics, collate, to_coco_results
from .head_configs import DetectConfig, fit_kwargs
from .head_io import register_head_builder, save_head
from .head_train import HeadTrainConfig, fit_dense_head
from .pyramid import SIZE_DIVISIBLE, STRIDES, PyramidBackbone

DETECTORS = ("fasterrcnn", "maskrcnn", "fcos")
LEVELS = ["0", "1", "2", "3"]  # RoI pooling reads the four pyramid levels (not "pool"), as torchvision's FPN


def build_detector(backbone: nn.Module, kind: str, num_classes: int, img_size: int, channels: int = 256) -> nn.Module:
    """A torchvision detector on ``backbone`` + pyramid; ``num_classes`` excludes the background."""
    from torchvision.models.detection import FCOS, FasterRCNN, MaskRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.ops import MultiScaleRoIAlign

    body = PyramidBackbone(backbone, channels, extra_pool=True)
    strides = (*STRIDES, 2 * STRIDES[-1])
    common = dict(min_size=img_size, max_size=round(img_size * 1333 / 800), image_mean=list(IMAGENET_MEAN),
                  image_std=list(IMAGENET_STD), size_divisible=SIZE_DIVISIBLE)
    if kind == "fcos":
        anchors = AnchorGenerator(tuple((s,) for s in strides), ((1.0,),) * len(strides))  # size = stride, as FCOS
        model = FCOS(body, num_classes + 1, anchor_generator=anchors, **common)
    elif kind in ("fasterrcnn", "maskrcnn"):
        anchors = AnchorGenerator(tuple((4 * s, 8 * s) for s in strides), ((0.5, 1.0, 2.0),) * len(strides))
        from torchvision.models.detection.rpn import RPNHead

        kw = dict(rpn_anchor_generator=anchors, rpn_head=RPNHead(channels, anchors.num_anchors_per_location()[0]),
                  box_roi_pool=MultiScaleRoIAlign(LEVELS, output_size=7, sampling_ratio=2),
                  # fewer proposals and sampled RoIs than COCO's defaults: small images hold a few objects each
                  rpn_pre_nms_top_n_train=1000, rpn_post_nms_top_n_train=500, rpn_pre_nms_top_n_test=500,
                  rpn_post_nms_top_n_test=200, box_batch_size_per_image=128, **common)
        if kind == "maskrcnn":
            model = MaskRCNN(body, num_classes + 1, mask_roi_pool=MultiScaleRoIAlign(LEVELS, 14, 2), **kw)
        else:
            model = FasterRCNN(body, num_classes + 1, **kw)
    else:
        raise ValueError(f"unknown detector {kind!r}; choose from {DETECTORS}")
    return model


class DetectorHead(nn.Module):
    """The detector as the fit's head: it takes the images itself (torchvision resizes, normalises and pads them)
    and returns its loss dict while training, its detections in eval."""

    takes_targets = True

    def __init__(self, detector: nn.Module) -> None:
        super().__init__()
        self.detector = detector

    def forward(self, images: list, targets: Optional[list] = None):
        dev = next(self.detector.parameters()).device
        images = [im.to(dev) for im in images]
        if not self.training:
            return self.detector(images)
        targets = [{k: v.to(dev) for k, v in t.items()} for t in targets]
        return self.detector(images, targets)


def detector_parts(detector: nn.Module) -> nn.Module:
    """The detector's own weights without its ViT (saved once, under backbone/): the pyramid and every other
    child (RPN and RoI heads, or FCOS's head). The modules are shared with ``detector``: loading into the parts
    loads the detector."""
    parts = {name: child for name, child in detector.named_children() if name != "backbone"}
    return nn.ModuleDict({"pyramid": detector.backbone.pyramid, **parts})


def detect_head_config(kind: str, num_classes: int, img_size: int, channels: int, categories: list[int]) -> dict:
    return {"task": "detect", "head": kind, "num_classes": int(num_classes), "img_size": int(img_size),
            "channels": int(channels), "categories": [int(c) for c in categories]}


def _build_detect(backbone: nn.Module, hc: dict) -> tuple[nn.Module, nn.Module]:
    det = build_detector(backbone, str(hc["head"]), int(hc["num_classes"]), int(hc["img_size"]), int(hc["channels"]))
    return DetectorHead(det), detector_parts(det)


register_head_builder("detect", _build_detect)


def _det_loss(losses: dict, _targets) -> tuple[torch.Tensor, dict]:
    return sum(losses.values()), {k: float(v.detach()) for k, v in losses.items()}


# the loss terms each torchvision detector returns in training (the training loop's metrics.jsonl)
LOSS_KEYS = {"fasterrcnn": ("loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"),
             "maskrcnn": ("loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"),
             "fcos": ("classification", "bbox_regression", "bbox_ctrness")}


class ImagesThrough(nn.Module):
    """The training loop's backbone for a detector: the images pass through unchanged (the detector runs the ViT
    itself, inside its pyramid); it holds the ViT so that the loop freezes it, or tunes it at its own lr."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.vit = vit

    def forward(self, images: list) -> list:
        return images


@torch.no_grad()
def predict_coco(head: DetectorHead, data: CocoSet, cat_ids: list[int], batch_size: int = 4) -> list[dict]:
    """COCO results rows for every image of ``data`` (boxes in the image's own pixels)."""
    head.eval()
    ds = CocoTrainSet(data, masks=False, flip=False)
    rows = []
    for i in range(0, len(ds), batch_size):
        idx = range(i, min(i + batch_size, len(ds)))
        dets = head([ds[j][0] for j in idx])
        for j, det in zip(idx, dets):
            rows += to_coco_results(data.image_ids[j], {k: v.cpu() for k, v in det.items()}, cat_ids)
    return rows


def train_detector(backbone: nn.Module, kind: str, train: CocoSet, val: CocoSet, *, img_size: int, epochs: int,
                   lr: float, backbone_lr: float = 0.0, batch_size: int = 4, device=torch.device("cpu"),
                   seed: int = 0, channels: int = 256, run_dir: Optional[Path] = None, progress: bool = False,
                   weight_decay: float = 1e-4, warmup_frac: float = 0.1, clip_grad: float = 35.0, flip: bool = True,
                   workers: int = 0) -> tuple[DetectorHead, dict, list[dict]]:
    """Fit a detector through the one training loop (``run_dir``: its checkpoints and metrics.jsonl; a rerun with
    the same folder resumes; None = a temporary folder) and score it on ``val``: (head, metrics, COCO rows)."""
    import tempfile

    torch.manual_seed(seed)
    head = DetectorHead(build_detector(backbone, kind, len(train.cat_ids), img_size, channels))
    masks = kind == "maskrcnn"
    loader = torch.utils.data.DataLoader(CocoTrainSet(train, masks=masks, flip=flip), batch_size=batch_size,
                                         collate_fn=collate, num_workers=workers)
    rows: list[dict] = []

    def val_fn(bb, hd):
        rows.extend(predict_coco(hd, val, train.cat_ids))
        return coco_metrics(val, rows, ("bbox", "segm") if masks else ("bbox",))

    with tempfile.TemporaryDirectory(prefix="dinopipe-detect-") as tmp:
        cfg = HeadTrainConfig(epochs=epochs, lr=lr, backbone_lr=backbone_lr, device=str(device),
                              out=str(run_dir or tmp), seed=seed, progress=progress, cache_features=False,
                              weight_decay=weight_decay, warmup_frac=warmup_frac, clip_grad=clip_grad)
        fit = fit_dense_head(ImagesThrough(backbone), head, loader, val_fn, _det_loss, cfg,
                             metric_keys=LOSS_KEYS[kind])
    res = {"head": kind, "epochs": epochs, "lr": lr, "backbone_lr": backbone_lr, "exit": fit["exit"],
           "steps": fit["steps"], "train_loss": fit.get("train_loss"), **fit.get("val", {})}
    return head, res, rows


def run_detect(args, cfg=None) -> dict:
    """``dinopipe eval detect``: OUT/predictions.json (COCO results) and OUT/metrics.json (pycocotools)."""
    from ..hub import load
    from ..utils.device import pick_device
    from ..utils.io import atomic_write_json
    from .coco import open_coco

    train = open_coco(args.train, args.images)  # data problems surface before the model is loaded
    val = open_coco(args.val, args.images, cat_ids=train.cat_ids)
    device = pick_device(args.device, key="--device")
    model = load(args.model, device=device, num_heads=args.num_heads)
    size = args.img_size or int(model.patch_embed.img_size[0])
    head, res, rows = train_detector(model, args.head, train, val, img_size=size, epochs=args.epochs, lr=args.lr,
                                  backbone_lr=args.backbone_lr, batch_size=args.batch_size, device=device,
                                  channels=args.channels, run_dir=Path(args.out) / "run", progress=True,
                                  **fit_kwargs(cfg or DetectConfig()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if res["exit"] != 0:  # preempted: checkpointed in OUT/run, the rerun of the same command resumes
        return {"task": "detect", "exit": res["exit"], "out": os.fspath(out)}
    atomic_write_json(out / "predictions.json", rows)
    # the detector with its backbone (the tuned one with --backbone-lr): dinopipe.load(OUT/model) detects
    save_head(out / "model", model, detector_parts(head.detector),
              detect_head_config(args.head, len(train.cat_ids), size, args.channels, train.cat_ids))
    metrics = {k: v for k, v in res.items() if k.startswith(("bbox_", "segm_"))}
    atomic_write_json(out / "metrics.json", {**metrics, "head": args.head, "img_size": size,
                                             "train_images": len(train), "val_images": len(val),
                                             "categories": train.cat_ids}, indent=2)
    return {"task": "detect", "model": str(args.model), "device": str(device), "img_size": size,
            "out": os.fspath(out), "detect": res}


__all__ = ["DETECTORS", "LOSS_KEYS", "detector_parts", "detect_head_config", "ImagesThrough", "build_detector",
           "DetectorHead", "predict_coco", "train_detector", "run_detect"]
