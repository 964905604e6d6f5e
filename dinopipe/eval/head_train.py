"""Train any dense head (depth, segmentation, detection) on a backbone through the project's one training loop.

``fit_dense_head(backbone, head, train_loader, val_fn, loss_fn, cfg)`` wraps the pair in a :class:`DenseHeadTask`
and runs :class:`dinopipe.train.loop.Trainer` on it, so a head gets what pretraining gets: the step-exact
data position (``GlobalBatchSampler``), DCP checkpoints in ``cfg.out/checkpoints`` and the resume of an
interrupted run (rerun the same command), ``metrics.jsonl``, the progress bar, gradient clipping, the finite
check, and SIGTERM/SIGUSR1 preemption (exit 124 after a checkpoint).

The contract:
  * ``backbone(images)`` returns what ``head`` takes (``head(features, targets)`` in training for a head with
    ``takes_targets = True``: torchvision's detectors, which also hold and run the backbone themselves). A bare
    dinopipe ViT (anything with ``get_intermediate_layers``) is wrapped in :class:`PatchMap`: the final-norm patch
    tokens of the last block as a (B, D, h, w) map. Depth passes its own multi-block wrapper, the pyramid heads
    their padded stride-16 grid (:class:`.pyramid.GridFeatures`) and build their pyramid inside the head module.
  * ``train_loader``: a ``DataLoader`` (or a ``Dataset``) whose samples are ``(image, target)`` or
    ``(key, image, target)``; its dataset is re-read through the loop's sampler (``dataset[(index, epoch)]`` when
    the dataset has ``takes_epoch = True``, else ``dataset[index]``), its ``batch_size``, ``collate_fn`` and
    ``num_workers`` kept. With a ``key`` and a frozen backbone, features are computed once per key and cached
    (``cfg.cache_features``): the key must name the exact input (e.g. index and flip).
  * ``loss_fn(pred, targets) -> (loss, logs)``: the logs' numeric keys are declared to the loop by ``metric_keys``
    (or the loss's ``metric_keys`` attribute) and logged to metrics.jsonl. A stateful loss (an ``nn.Module``) is
    checkpointed with the head, so a resumed run computes the same losses.
  * ``val_fn(backbone, head) -> dict`` runs once after training (eval mode, no grad) and is returned under
    ``"val"``.
  * ``cfg`` (:class:`HeadTrainConfig`): epochs, lr (the head's AdamW peak, linear warm-up then cosine),
    backbone_lr (0 = frozen: no gradient, eval mode; > 0 = tuned in the same optimizer as an ``is_backbone``
    group), device, out (the run folder), bf16 (autocast on CUDA where the backbone is tuned).

Not yet: several processes. The loop runs here in one process (``DistInfo()``); sharding a tuned backbone with
FSDP2 over a torchrun job (``train/parallel.py``) and evaluating on rank 0 is the missing piece.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ..data.loader import DataPosition, GlobalBatchSampler
from ..train.checkpoint import ModelOptimState
from ..train.dist import DistInfo
from ..train.loop import LoopConfig, Phase, Trainer
from ..train.signals import worker_ignore_signals
from ..utils.device import pick_device
from ..utils.run_layout import TrainLayout

log = logging.getLogger(__name__)


@dataclass
class HeadTrainConfig:
    epochs: int = 10
    lr: float = 1e-3
    backbone_lr: float = 0.0
    """0 = frozen backbone; > 0 = the backbone's own peak lr (same schedule shape as the head's)."""
    weight_decay: float = 1e-4
    warmup_frac: float = 0.1
    clip_grad: float = 35.0  # dinov3 depth's gradient_clip
    device: str = "auto"
    out: str = ""
    """Run folder: checkpoints/, metrics.jsonl. Rerunning with the same folder resumes."""
    seed: int = 0
    checkpoint_every: int = 0
    """Steps between checkpoints (0 = once per epoch; the last step always saves)."""
    log_every: int = 10
    progress: bool = True
    bf16: bool = True
    """bf16 autocast of the forward on CUDA (the head's and a tuned backbone's); ignored on CPU."""
    cache_features: bool = True
    stop_after: Optional[int] = None
    """Stop (with a checkpoint) after this many steps of this call: how tests interrupt a run."""


class PatchMap(nn.Module):
    """A dinopipe ViT -> (B, D, h, w) final-norm patch tokens of its last block."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: Tensor) -> Tensor:
        return self.backbone.get_intermediate_layers(x, n=1, reshape=True, norm=True)[0]


class _Epoched(Dataset):
    """``dataset[(index, epoch)]`` for the loop's sampler over a dataset indexed by int."""

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key):
        return self.ds[key[0]]


def _to(obj: Any, device: torch.device) -> Any:
    if torch.is_tensor(obj):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


class DenseHeadTask:
    """The loop's Task around (backbone, head, loss): the head always trains, the backbone when backbone_lr > 0.
    Checkpointed as one module (``head``, ``backbone``, a stateful loss) with its optimizer."""

    def __init__(self, backbone: nn.Module, head: nn.Module, loss_fn: Callable, cfg: HeadTrainConfig,
                 device: torch.device, metric_keys: tuple[str, ...] = ()) -> None:
        self.backbone, self.head, self.loss_fn, self.cfg, self.device = backbone, head, loss_fn, cfg, device
        self.tuned = cfg.backbone_lr > 0
        self.backbone.requires_grad_(self.tuned)
        for n, p in self.backbone.named_parameters():
            if n.endswith("mask_token"):
                p.requires_grad_(False)
        parts = {"head": head, "backbone": backbone}
        if isinstance(loss_fn, nn.Module):
            parts["loss"] = loss_fn
        self.modules = nn.ModuleDict(parts).to(device)
        self.metric_keys = metric_keys
        self._cache: dict[int, Any] = {}

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cfg.bf16 and self.device.type == "cuda")

    def _features(self, keys: Optional[Tensor], x: Tensor) -> Any:
        if self.tuned:
            return self.backbone(x)
        self.backbone.eval()
        if keys is None or not self.cfg.cache_features:
            with torch.no_grad():
                return self.backbone(x)
        keys_l = [int(k) for k in keys]
        todo = [i for i, k in enumerate(keys_l) if k not in self._cache]
        if todo:
            with torch.no_grad():
                out = self.backbone(x[todo])
            for j, i in enumerate(todo):
                self._cache[keys_l[i]] = _index(out, j)
        return _stack([self._cache[k] for k in keys_l])

    def __call__(self, batch: Any, values: dict[str, float]) -> tuple[Tensor, dict[str, Any]]:
        keys, x, y = batch if len(batch) == 3 else (None, *batch)
        x, y = _to(x, self.device), _to(y, self.device)  # x: a batch tensor, or a list of images (detection)
        self.head.train()
        if self.tuned:
            self.backbone.train()
        with self._autocast():
            feats = self._features(keys, x)
            # a head that computes its losses itself (torchvision's detectors) takes the targets in training
            pred = self.head(feats, y) if getattr(self.head, "takes_targets", False) else self.head(feats)
        loss, logs = self.loss_fn(_float(pred), y)
        return loss, logs

    def trainable_parameters(self):
        return [p for p in self.modules.parameters() if p.requires_grad]

    def after_step(self, values: dict[str, float]) -> None:
        pass

    def checkpoint_states(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"head": ModelOptimState(self.modules, optimizer)}

    def export(self, run_dir: Path, step: int) -> None:
        pass  # the command saves backbone + head with head_io.save_head (safetensors + config)


def _index(out: Any, j: int) -> Any:
    if torch.is_tensor(out):
        return out[j].detach()
    if isinstance(out, (list, tuple)):
        return type(out)(_index(o, j) for o in out)
    if isinstance(out, dict):
        return {k: _index(v, j) for k, v in out.items()}
    raise TypeError(f"cannot cache backbone output of type {type(out).__name__}")


def _stack(items: list) -> Any:
    first = items[0]
    if torch.is_tensor(first):
        return torch.stack(items)
    if isinstance(first, (list, tuple)):
        return type(first)(_stack([it[i] for it in items]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _stack([it[k] for it in items]) for k in first}
    raise TypeError(type(first).__name__)


def _float(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_float(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _float(v) for k, v in obj.items()}
    return obj


def lr_schedule(total: int, warmup_frac: float) -> np.ndarray:
    """Per-step multiplier: linear warm-up over ``warmup_frac`` of the steps, then cosine to 0."""
    warm = int(round(warmup_frac * total))
    s = np.arange(total, dtype=np.float64)
    cos = 0.5 * (1 + np.cos(math.pi * (s - warm) / max(1, total - warm)))
    return np.where(s < warm, (s + 1) / max(1, warm), cos)


def fit_dense_head(backbone: nn.Module, head: nn.Module, train_loader: DataLoader | Dataset,
                   val_fn: Optional[Callable[[nn.Module, nn.Module], dict]], loss_fn: Callable,
                   cfg: HeadTrainConfig, metric_keys: tuple[str, ...] = ()) -> dict:
    """Train ``head`` (and the backbone when ``cfg.backbone_lr > 0``) through the generic loop; returns
    ``{"exit": 0 | 124, "steps", "train_loss", "val": val_fn(...)}`` (no ``val`` when preempted)."""
    if not cfg.out:
        raise ValueError("HeadTrainConfig.out: a run folder is needed (checkpoints and metrics go there)")
    if hasattr(backbone, "get_intermediate_layers"):
        backbone = PatchMap(backbone)
    device = pick_device(cfg.device)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    loader = train_loader if isinstance(train_loader, DataLoader) else DataLoader(train_loader, batch_size=8)
    ds = loader.dataset if getattr(loader.dataset, "takes_epoch", False) else _Epoched(loader.dataset)
    n = len(ds)
    batch = min(int(loader.batch_size or 1), n)
    per_epoch = n // batch
    total = max(1, cfg.epochs * per_epoch)
    task = DenseHeadTask(backbone, head, loss_fn, cfg, device, metric_keys or tuple(getattr(loss_fn, "metric_keys", ())))
    # a head may hold the backbone (a torchvision detector runs it itself): those parameters are the backbone's
    bb_ids = {id(p) for p in backbone.parameters()}
    groups = [{"params": [p for p in head.parameters() if p.requires_grad and id(p) not in bb_ids],
               "lr_multiplier": 1.0}]
    if task.tuned:
        # mask_token only serves masked pretraining: no gradient here, and an optimizer state that never forms
        # would not match a resumed run's (DCP loads the state of every parameter in the optimizer)
        groups.append({"params": [p for n, p in backbone.named_parameters() if not n.endswith("mask_token")],
                       "is_backbone": True,
                       "lr_multiplier": cfg.backbone_lr / cfg.lr})
    if isinstance(loss_fn, nn.Module) and any(p.requires_grad for p in loss_fn.parameters()):
        groups.append({"params": [p for p in loss_fn.parameters() if p.requires_grad]})
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedules = {"lr": cfg.lr * lr_schedule(total, cfg.warmup_frac), "wd": np.full(total, cfg.weight_decay)}
    workers = int(loader.num_workers)

    def build_loader(pos: DataPosition):
        sampler = GlobalBatchSampler(n, batch, 0, 1, cfg.seed, pos)
        return DataLoader(ds, batch_sampler=sampler, collate_fn=loader.collate_fn, num_workers=workers,
                          worker_init_fn=worker_ignore_signals if workers else None,
                          pin_memory=device.type == "cuda")

    info = DistInfo(device=device)
    loop_cfg = LoopConfig(seed=cfg.seed, clip_grad=cfg.clip_grad, log_every=cfg.log_every,
                          checkpoint_every=cfg.checkpoint_every or per_epoch, keep_last=2, progress=cfg.progress,
                          stop_after=cfg.stop_after)
    trainer = Trainer(task, optimizer, schedules, [Phase("head", 0, total, batch, batch, batch, build_loader)],
                      cfg.out, info, loop_cfg, pool_size=n)
    rc = trainer.fit()
    out: dict[str, Any] = {"exit": rc, "steps": int(trainer.state.values["step"]), "epochs": cfg.epochs,
                           "batch_size": batch, "lr": cfg.lr, "backbone_lr": cfg.backbone_lr}
    logged = TrainLayout(cfg.out).metrics
    if logged.is_file():  # the last logged step's loss (the loop logs every log_every steps and the last one)
        import json

        last = [json.loads(x) for x in logged.read_text().splitlines() if '"loss"' in x][-1:]
        out["train_loss"] = last[0]["loss"] if last else None
    if rc == 0 and val_fn is not None:
        backbone.eval()
        head.eval()
        with torch.no_grad():
            out["val"] = val_fn(backbone, head)
    return out


__all__ = ["HeadTrainConfig", "DenseHeadTask", "PatchMap", "fit_dense_head", "lr_schedule"]
