"""``dinopipe eval depth``: train a depth head on a backbone, evaluate it, write metrics, predictions and the
model (backbone + head, loadable by ``dinopipe.load``).

OUT/ holds ``metrics.json`` (the official metric keys + the run's settings), ``config.yaml`` (the resolved
:class:`DepthConfig`), ``model/`` (``head_io.save_head``: safetensors + config.json), ``run/`` (the loop's
checkpoints and ``metrics.jsonl``: rerunning the same command resumes an interrupted training) and, with
``--save-predictions``, ``predictions/X.npy`` (float32 metres at the label's size, clamped to the evaluation
range, after TTA: exactly what the metrics were computed on).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..config import Choice, ConfigError, save_config
from .data import LabelError
from .depth import METRIC_KEYS, BinsHead, DepthLoss, DepthModel, build_head, depth_metrics, predict
from .depth_data import DepthSet, DepthTrainSet, image_tensor, max_valid_depth, open_depth, read_depth_png

log = logging.getLogger(__name__)


class DepthHeadKind(Choice):
    linear = "linear"
    dpt = "dpt"


class DepthProtocol(Choice):
    dinov3 = "dinov3"
    dinov2 = "dinov2"


@dataclass
class DepthConfig:
    """`dinopipe eval depth` settings (the flags override these; `dinopipe config --kind depth` lists them)."""

    head: DepthHeadKind = DepthHeadKind.linear
    """linear: BN + 1x1 conv to depth bins (dinov3 protocol); dpt: a DPT decoder on 4 blocks."""
    protocol: DepthProtocol = DepthProtocol.dinov3
    """linear head inputs: dinov3 = last block's patch tokens; dinov2 = 4 blocks + CLS concatenated (lin. 4)."""
    n_bins: int = 256
    min_depth: float = 0.001
    max_depth: float = 0.0
    """Upper end of the depth bins in metres; 0 = the largest depth in the training labels."""
    eval_min_depth: float = 0.0
    """Labels <= this are not evaluated (dinov3 NYU: 0.001)."""
    eval_max_depth: float = 65.536
    """Labels >= this are not evaluated (dinov3 NYU: 10); predictions are clamped to the evaluation range."""
    eigen_crop: bool = False
    """Evaluate inside the Eigen crop only (NYU_EIGEN, scaled to the label size)."""
    flip_tta: bool = False
    """Average the prediction with that of the mirrored image."""
    epochs: int = 20
    lr: float = 1e-3
    backbone_lr: float = 0.0
    """0 = frozen backbone; > 0 = fine-tune it with this peak lr."""
    weight_decay: float = 1e-4
    warmup_frac: float = 0.1
    batch_size: int = 8
    workers: int = 2
    img_size: int = 0
    """Square training / inference size (a multiple of the patch size); 0 = the model's img_size."""
    train_flip: bool = True
    """Random horizontal flips during training."""
    dpt_features: int = 0
    """DPT fusion channels; 0 = min(256, 4 * embed_dim)."""
    sigloss_warm_iter: int = 100
    """SigLoss steps with the mean term only (dinov3: 100); a run of fewer than 10x this many steps uses a tenth of
    its steps, or the variance term (the shape of the scene) would never be trained."""
    seed: int = 0


def evaluate(model: DepthModel, data: DepthSet, size: int, cfg: DepthConfig, device: torch.device,
             save_dir: Optional[Path] = None) -> dict:
    """Metrics over ``data`` (each prediction at its label's size); saves ``X.npy`` per image into ``save_dir``."""
    model.eval()
    preds, gts = [], []
    for img, dep in data.pairs:
        gt = read_depth_png(dep)
        x = image_tensor(img, (size, size))[None].to(device)
        p = predict(model, x, gt.shape, flip_tta=cfg.flip_tta)[0, 0].cpu().numpy()
        p = np.clip(p, cfg.eval_min_depth, cfg.eval_max_depth).astype(np.float32)
        if save_dir is not None:
            save_dir.mkdir(parents=True, exist_ok=True)
            np.save(save_dir / f"{img.stem}.npy", p)
        preds.append(p)
        gts.append(gt)
    return depth_metrics(preds, gts, cfg.eval_min_depth, cfg.eval_max_depth, cfg.eigen_crop)


def check_depth_config(cfg: DepthConfig) -> None:
    def need(ok: bool, key: str, what: str, got) -> None:
        if not ok:
            raise ConfigError(f"{key}: must be {what}, got {got}")

    need(cfg.epochs >= 1, "epochs", ">= 1", cfg.epochs)
    need(cfg.lr > 0, "lr", "> 0", cfg.lr)
    need(cfg.backbone_lr >= 0, "backbone_lr", ">= 0", cfg.backbone_lr)
    need(cfg.batch_size >= 1, "batch_size", ">= 1", cfg.batch_size)
    need(cfg.n_bins >= 2, "n_bins", ">= 2", cfg.n_bins)
    need(cfg.min_depth > 0, "min_depth", "> 0", cfg.min_depth)
    need(cfg.max_depth == 0 or cfg.max_depth > cfg.min_depth, "max_depth", "0 or > min_depth", cfg.max_depth)
    need(0 <= cfg.eval_min_depth < cfg.eval_max_depth, "eval_min_depth", ">= 0 and < eval_max_depth",
         cfg.eval_min_depth)
    need(cfg.img_size >= 0, "img_size", ">= 0", cfg.img_size)
    need(0 <= cfg.warmup_frac < 1, "warmup_frac", "in [0, 1)", cfg.warmup_frac)
    need(cfg.sigloss_warm_iter >= 0, "sigloss_warm_iter", ">= 0", cfg.sigloss_warm_iter)


def run_depth(cfg: DepthConfig, model_ref: str, train_dir: str, val_dir: str, out: Path, device: torch.device,
              save_predictions: bool = False, num_heads: Optional[int] = None, progress: bool = True) -> dict:
    from ..hub import load
    from .head_io import save_head
    from .head_train import HeadTrainConfig, fit_dense_head

    check_depth_config(cfg)
    train, val = open_depth(train_dir), open_depth(val_dir)  # data problems surface before the model loads
    max_depth = cfg.max_depth or float(math.ceil(max_valid_depth(train)))
    torch.manual_seed(cfg.seed)  # a registry name is a random init: the same one for the same seed
    backbone = load(model_ref, device=device, num_heads=num_heads)
    p = int(backbone.patch_size)
    size = cfg.img_size or int(backbone.patch_embed.img_size[0])
    if size % p:
        raise LabelError(f"--img-size {size} is not a multiple of the model's patch size {p}")
    torch.manual_seed(cfg.seed)
    head, layers = build_head(str(cfg.head.value), backbone.embed_dim, backbone.n_blocks, str(cfg.protocol.value),
                              cfg.n_bins, cfg.dpt_features or None)
    model = DepthModel(backbone, head, layers, cfg.min_depth, max_depth).to(device)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out)
    loader = DataLoader(DepthTrainSet(train, size, flip=cfg.train_flip, seed=cfg.seed), batch_size=cfg.batch_size,
                        num_workers=cfg.workers)
    tcfg = HeadTrainConfig(epochs=cfg.epochs, lr=cfg.lr, backbone_lr=cfg.backbone_lr, weight_decay=cfg.weight_decay,
                           warmup_frac=cfg.warmup_frac, device=str(device), out=str(out / "run"), seed=cfg.seed,
                           progress=progress)
    t0 = time.time()
    steps = cfg.epochs * (len(train) // min(cfg.batch_size, len(train)))
    loss = DepthLoss(warm_iter=min(cfg.sigloss_warm_iter, steps // 10))
    fit = fit_dense_head(model.features, BinsHead(head, cfg.min_depth, max_depth), loader, None, loss, tcfg)
    if fit["exit"] != 0:
        return {"exit": fit["exit"]}
    train_s = time.time() - t0
    metrics = evaluate(model, val, size, cfg, device, out / "predictions" if save_predictions else None)
    save_head(out / "model", model.backbone, model.head, head_config(cfg, layers, max_depth, size))
    res = {**{k: metrics[k] for k in METRIC_KEYS}, "images": metrics["images"], "task": "depth",
           "model": str(model_ref), "device": str(device), "head": cfg.head.value, "protocol": cfg.protocol.value,
           "img_size": size, "max_depth": max_depth, "train_images": len(train), "val_images": len(val),
           "steps": fit["steps"], "train_seconds": round(train_s, 2), "config": _plain(cfg)}
    (out / "metrics.json").write_text(json.dumps(res, indent=2))
    return res


def head_config(cfg: DepthConfig, layers: list[int], max_depth: float, size: int) -> dict:
    return {"task": "depth", "head": cfg.head.value, "protocol": cfg.protocol.value, "n_bins": cfg.n_bins,
            "layers": list(layers), "min_depth": cfg.min_depth, "max_depth": max_depth,
            "dpt_features": cfg.dpt_features, "img_size": size}


def _plain(cfg: DepthConfig) -> dict:
    return {k: (v.value if isinstance(v, Choice) else v) for k, v in asdict(cfg).items()}


__all__ = ["DepthConfig", "run_depth", "evaluate", "check_depth_config", "head_config"]


def _flags_into(cfg_overrides: list[str], args) -> list[str]:
    """The command's flags as config overrides (flags win over --config and key=value)."""
    out = list(cfg_overrides)
    for flag, key in (("head", "head"), ("epochs", "epochs"), ("lr", "lr"), ("backbone_lr", "backbone_lr"),
                      ("img_size", "img_size"), ("batch_size", "batch_size")):
        v = getattr(args, flag, None)
        if v is not None:
            out.append(f"{key}={v}")
    return out


def main_depth(args) -> int:
    """`dinopipe eval depth`: 0 done, 2 bad input (before anything is written), 124 preempted (rerun resumes)."""
    import sys

    from ..config import load_config
    from ..hub import CheckpointError
    from ..utils.device import pick_device

    try:
        cfg = load_config(DepthConfig, args.config, _flags_into(args.overrides, args))
        check_depth_config(cfg)
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out: '{out}' is a file; give a folder")
        device = pick_device(args.device, key="--device")
        res = run_depth(cfg, args.model, args.train, args.val, out, device, args.save_predictions, args.num_heads)
    except (ConfigError, LabelError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"error: cannot load --model: {exc}", file=sys.stderr)
        return 2
    if res.get("exit"):
        return int(res["exit"])
    print(f"depth ({res['head']}, {res['protocol']}): {res['train_images']} train / {res['val_images']} val images "
          f"at {res['img_size']} px, {res['steps']} steps")
    print("  ".join(f"{k} {res[k]:.4f}" for k in METRIC_KEYS))
    print(f"results written to {out / 'metrics.json'}; model (dinopipe.load) in {out / 'model'}")
    return 0
