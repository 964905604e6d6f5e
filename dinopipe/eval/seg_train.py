"""Train and score a segmentation head (``dinopipe eval seg --head linear|upernet|m2f``).

Training: images resized to a square ``size`` (masks nearest, as the linear probe), random horizontal flips,
per-pixel cross-entropy (Mask2Former: its matched loss), through the one training loop
(:func:`.head_train.fit_dense_head`: checkpoints and metrics.jsonl in ``OUT/run``, a rerun resumes). Scoring is the same for
every head: each val image is resized so that its short side is ``size`` (aspect kept); an image longer than
that is covered by ``size`` x ``size`` windows at stride 2/3 ``size`` whose logits are averaged (slide
inference, as mmseg's ``slide`` mode); the logits are upsampled to the label's own size and counted in the
confusion matrix of :func:`.seg.confusion` (mIoU over classes present in prediction or truth).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from ..data.transforms import IMAGENET_MEAN, IMAGENET_STD
from .dense_data import DenseSet
from .head_train import HeadTrainConfig, fit_dense_head
from .pyramid import GridFeatures, grid_features
from .seg import confusion, iou_from_confusion, load_pair
from .seg_heads import build_seg_head


class SegTrainSet(torch.utils.data.Dataset):
    def __init__(self, data: DenseSet, size: int, flip: bool = True) -> None:
        self.pairs, self.size, self.flip = data.pairs, size, flip

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x, m = load_pair(*self.pairs[i], self.size)
        if self.flip and torch.rand(()) < 0.5:  # torch's RNG: seeded by the fit, repeatable
            x, m = x.flip(-1), m.flip(-1)
        return x, m


def _normalise(img: Image.Image) -> Tensor:
    x = torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1).float() / 255
    return (x - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[:, None, None]


def _starts(n: int, crop: int, stride: int) -> list[int]:
    if n <= crop:
        return [0]
    return sorted({*range(0, n - crop, stride), n - crop})


@torch.no_grad()
def slide_logits(backbone: nn.Module, head: nn.Module, x: Tensor, crop: int, batch: int = 8) -> Tensor:
    """(3, H, W) normalised image -> (C, H, W) logits averaged over ``crop`` windows at stride 2/3 crop."""
    H, W = x.shape[-2:]
    stride = max(1, math.ceil(2 * crop / 3))
    boxes = [(y, x0) for y in _starts(H, crop, stride) for x0 in _starts(W, crop, stride)]
    total, count = None, torch.zeros(1, H, W, device=x.device)
    for i in range(0, len(boxes), batch):
        part = boxes[i:i + batch]
        wins = torch.stack([x[:, y:y + crop, x0:x0 + crop] for y, x0 in part])
        logits = head.logits(head(grid_features(backbone, wins)), wins.shape[-2:])
        if total is None:
            total = torch.zeros(logits.shape[1], H, W, device=x.device)
        for (y, x0), lg in zip(part, logits):
            total[:, y:y + lg.shape[-2], x0:x0 + lg.shape[-1]] += lg
            count[:, y:y + lg.shape[-2], x0:x0 + lg.shape[-1]] += 1
    return total / count


@torch.no_grad()
def predict_image(backbone: nn.Module, head: nn.Module, img_path, size: int, out_hw: tuple[int, int],
                  device: torch.device) -> Tensor:
    """Class indices (H, W) at ``out_hw`` for one image (short side resized to ``size``, slide inference)."""
    img = Image.open(img_path).convert("RGB")
    s = size / min(img.size)
    img = img.resize((max(1, round(img.width * s)), max(1, round(img.height * s))), Image.BICUBIC)
    logits = slide_logits(backbone, head, _normalise(img).to(device), size)
    return F.interpolate(logits[None], size=out_hw, mode="bilinear", align_corners=False)[0].argmax(0).cpu()


def evaluate_seg(backbone: nn.Module, head: nn.Module, data: DenseSet, size: int, num_classes: int,
                 device: torch.device, save_dir: Optional[Path] = None) -> dict:
    """mIoU at each label's own resolution; with ``save_dir`` a PNG of class indices per image."""
    cm = torch.zeros(num_classes, num_classes, dtype=torch.long)
    for img_path, mask_path in data.pairs:
        mask = torch.from_numpy(np.asarray(Image.open(mask_path)).astype(np.int64))
        pred = predict_image(backbone, head, img_path, size, tuple(mask.shape), device)
        cm += confusion(pred, mask, num_classes)
        if save_dir is not None:
            dtype = np.uint8 if num_classes <= 256 else np.uint16  # 16-bit PNG past 256 classes
            Image.fromarray(pred.numpy().astype(dtype)).save(save_dir / (Path(img_path).stem + ".png"))
    return iou_from_confusion(cm)


def train_seg(backbone: nn.Module, kind: str, train: DenseSet, val: DenseSet, *, size: int, epochs: int,
              lr: float, backbone_lr: float = 0.0, batch_size: int = 8, device=torch.device("cpu"),
              seed: int = 0, channels: int = 256, m2f: Optional[dict] = None,
              save_dir: Optional[Path] = None, run_dir: Optional[Path] = None, progress: bool = False,
              weight_decay: float = 1e-4, warmup_frac: float = 0.1, clip_grad: float = 35.0, flip: bool = True,
              workers: int = 0) -> tuple[nn.Module, dict]:
    """Build the head, fit it through the one training loop (``run_dir``: its checkpoints and metrics.jsonl; a
    rerun with the same folder resumes; None = a temporary folder), score it on ``val``: (head, results)."""
    import tempfile

    torch.manual_seed(seed)
    head = build_seg_head(kind, int(backbone.embed_dim), train.num_classes, channels=channels, **(m2f or {}))
    loader = torch.utils.data.DataLoader(SegTrainSet(train, size, flip=flip), batch_size=batch_size,
                                         num_workers=workers)

    def val_fn(_features, hd):  # slide inference on the ViT itself (the loop hands back its GridFeatures wrapper)
        return evaluate_seg(backbone, hd, val, size, train.num_classes, device, save_dir)

    def loss(raw, y):
        value, logs = head.loss(raw, y)
        return value, {k: float(v) for k, v in logs.items()}

    with tempfile.TemporaryDirectory(prefix="dinopipe-seg-") as tmp:
        cfg = HeadTrainConfig(epochs=epochs, lr=lr, backbone_lr=backbone_lr, device=str(device),
                              out=str(run_dir or tmp), seed=seed, progress=progress, cache_features=False,
                              weight_decay=weight_decay, warmup_frac=warmup_frac, clip_grad=clip_grad)
        fit = fit_dense_head(GridFeatures(backbone), head, loader, val_fn, loss, cfg,
                             metric_keys=tuple(getattr(head, "metric_keys", ())))
    if fit["exit"] != 0:  # preempted (124): checkpointed in run_dir, the rerun resumes
        return head, {"head": kind, "exit": fit["exit"], "steps": fit["steps"]}
    return head, {"head": kind, "epochs": epochs, "lr": lr, "backbone_lr": backbone_lr, "exit": 0,
                  "steps": fit["steps"], "train_loss": fit.get("train_loss"), **fit["val"]}


def run_seg_heads(args, train: DenseSet, val: DenseSet, model: nn.Module, device, size: int, cfg=None) -> dict:
    """The CLI's path for ``--head`` / a folder ``--out``: metrics.json (+ predictions/) under OUT; ``cfg``: the
    :class:`.head_configs.SegHeadsConfig` (``--config`` and key=value)."""
    from dataclasses import asdict

    from ..utils.io import atomic_write_json
    from .head_configs import SegHeadsConfig, fit_kwargs

    cfg = cfg or SegHeadsConfig()
    m2f = asdict(cfg.m2f) if args.head == "m2f" else None

    out = Path(args.out) if args.out else None
    pred_dir = None
    if args.save_predictions and out is not None:
        pred_dir = out / "predictions.partial"  # renamed when complete: no half set of predictions
        shutil.rmtree(pred_dir, ignore_errors=True)
        pred_dir.mkdir(parents=True)
    head, res = train_seg(model, args.head, train, val, size=size, epochs=args.epochs, lr=args.lr,
                       backbone_lr=args.backbone_lr, batch_size=args.batch_size, device=device,
                       channels=args.channels, save_dir=pred_dir, run_dir=out / "run" if out is not None else None,
                       progress=out is not None, m2f=m2f, **fit_kwargs(cfg))
    if res.get("exit", 0) != 0:
        return res
    if out is not None:
        metrics = {"mIoU": res["miou"], "per_class_IoU": res["per_class_iou"], "pixel_acc": res["pixel_acc"],
                   "head": args.head, "img_size": size, "num_classes": train.num_classes}
        if pred_dir is not None:
            final = out / "predictions"
            shutil.rmtree(final, ignore_errors=True)
            os.replace(pred_dir, final)
        # the head with its backbone (the tuned one when --backbone-lr > 0): dinopipe.load(OUT/model) predicts
        from .head_io import save_head
        from .seg_model import seg_head_config

        save_head(out / "model", model, head, seg_head_config(args.head, train.num_classes, args.channels, size, m2f))
        atomic_write_json(out / "metrics.json", metrics, indent=2)
    return res


__all__ = ["SegTrainSet", "slide_logits", "predict_image", "evaluate_seg", "train_seg", "run_seg_heads"]
