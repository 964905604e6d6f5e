"""Per-step hyper-parameter schedules, precomputed as arrays: one shape, :func:`linear_warmup_cosine_decay`
(dinov3 ``train/train.py:178-212``), serves the lr, weight decay, teacher momentum, teacher temperature and the
loss-weight ramps; its values are DINOv2's ``CosineScheduler``'s, element for element.

Every schedule is a float64 numpy array indexed by the global step; :class:`Schedule` returns its final value
past the end. The DINOv2 defaults (``ssl_default_config.yaml``; its ViT-L/g recipes override weight decay end
to 0.2 and momentum to 0.994): lr linear warm-up then cosine to ``min_lr``, weight decay cosine 0.04 -> 0.4,
teacher momentum cosine 0.992 -> 1, teacher temperature linear 0.04 -> 0.07 over the first epochs then
constant, last layer's lr 0 for the first epoch, base lr scaled by sqrt(global batch / 1024).

A ramp keeps its own length when the run is shorter (DINOv2 does not compress its warm-ups to fit a short
run): the array is cut at the run's end.

Resolution phases (224 px then 518 px with a compressed, lower lr schedule) are built with :func:`piecewise`,
which concatenates per-phase pieces into one array so the training loop keeps indexing by global step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


SHAPES = ("dinov2", "dinov3")


def linear_warmup_cosine_decay(start: float, peak: float, end: float, warmup: int, total: int,
                               cosine: Optional[int] = None, freeze: int = 0, shape: str = "dinov2") -> np.ndarray:
    """The one schedule shape: ``freeze`` zeros, a linear warm-up ``start -> peak`` over ``warmup`` steps, half a
    cosine ``peak -> end`` over ``cosine`` steps (default: the rest of the run), then ``end``. Exactly ``total``
    values: a freeze or warm-up longer than the run is cut, never compressed.

    The two official codes sample the same curve differently. ``shape="dinov2"`` (its ``CosineScheduler``): the
    warm-up includes ``peak`` (``np.linspace(start, peak, warmup)``) and the cosine's i-th value is
    ``end + (peak - end) * (1 + cos(pi * i / cosine)) / 2`` (never quite ``end``). ``shape="dinov3"`` (dinov3
    ``train/cosine_lr_scheduler.py:linear_warmup_cosine_decay``): the warm-up stops one step short of ``peak``
    (``endpoint=False``) and the cosine runs over ``np.linspace(0, pi, cosine)``, reaching ``end`` on its last step."""
    if min(total, warmup, freeze) < 0 or (cosine is not None and cosine < 0):
        raise ValueError("schedule lengths must be >= 0")
    if shape not in SHAPES:
        raise ValueError(f"schedule shape must be one of {SHAPES}, got '{shape}'")
    n = max(total - warmup - freeze, 0) if cosine is None else cosine
    v3 = shape == "dinov3"
    angle = np.linspace(0, np.pi, n) if v3 else np.pi * np.arange(n) / max(n, 1)
    decay = end + 0.5 * (peak - end) * (1 + np.cos(angle))
    tail = np.full(max(total - freeze - warmup - n, 0), float(end))
    ramp = np.linspace(start, peak, warmup, endpoint=not v3)
    out = np.concatenate([np.zeros(freeze), ramp, decay, tail])
    return out[:total].astype(np.float64)


def cosine_schedule(base_value: float, final_value: float, total_steps: int, warmup_steps: int = 0,
                    start_warmup_value: float = 0.0, freeze_steps: int = 0, shape: str = "dinov2") -> np.ndarray:
    """DINOv2's ``CosineScheduler`` arguments on :func:`linear_warmup_cosine_decay`."""
    return linear_warmup_cosine_decay(start_warmup_value, base_value, final_value, warmup_steps, total_steps,
                                      freeze=freeze_steps, shape=shape)


def linear_schedule(start_value: float, end_value: float, steps: int) -> np.ndarray:
    """``steps`` values from start to end, both included."""
    steps = max(steps, 0)
    return linear_warmup_cosine_decay(start_value, end_value, end_value, steps, steps)


def constant_schedule(value: float, steps: int) -> np.ndarray:
    return linear_warmup_cosine_decay(value, value, value, 0, max(steps, 0))


def warmup_then_constant(start_value: float, value: float, warmup_steps: int, total_steps: int,
                         shape: str = "dinov2") -> np.ndarray:
    """Linear warm-up start -> value over ``warmup_steps``, then constant; a warm-up longer than ``total_steps`` is
    cut, not compressed."""
    return linear_warmup_cosine_decay(start_value, value, value, warmup_steps, total_steps, shape=shape)


@dataclass
class Piece:
    """One segment of a piecewise schedule.

    kind: 'cosine' (warm-up ``warmup_start`` -> ``start`` over ``warmup_steps``, then cosine ``start`` -> ``end``),
    'linear' (``start`` -> ``end``) or 'constant' (``start``).
    """

    kind: str
    steps: int
    start: float
    end: Optional[float] = None
    warmup_steps: int = 0
    warmup_start: float = 0.0

    def build(self) -> np.ndarray:
        end = self.start if self.end is None else self.end
        if self.kind == "cosine":
            return cosine_schedule(self.start, end, self.steps, self.warmup_steps, self.warmup_start)
        if self.warmup_steps:
            raise ValueError(f"warm-up is only supported on 'cosine' pieces, not '{self.kind}'")
        if self.kind == "linear":
            return linear_schedule(self.start, end, self.steps)
        if self.kind == "constant":
            return constant_schedule(self.start, self.steps)
        raise ValueError(f"schedule piece kind must be cosine | linear | constant, got '{self.kind}'")


def piecewise(pieces: Sequence[Piece | np.ndarray | Sequence[float]]) -> np.ndarray:
    """Concatenate pieces (``Piece`` specs or ready arrays) into one per-step array."""
    arrays = [p.build() if isinstance(p, Piece) else np.asarray(p, dtype=np.float64).reshape(-1) for p in pieces]
    return np.concatenate(arrays) if arrays else np.zeros(0)


class Schedule:
    """A per-step array; indexing past the end returns the last value (or ``final_value`` when given)."""

    def __init__(self, values: np.ndarray | Sequence[float], final_value: Optional[float] = None) -> None:
        self.values = np.asarray(values, dtype=np.float64).reshape(-1)
        if final_value is None:
            if not len(self.values):
                raise ValueError("an empty schedule needs an explicit final_value")
            final_value = float(self.values[-1])
        self.final_value = float(final_value)

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, step: int) -> float:
        if step < 0:
            raise IndexError(f"negative step {step}")
        return float(self.values[step]) if step < len(self.values) else self.final_value


def scaled_lr(base_lr: float, global_batch_size: int, reference_batch_size: int = 1024, rule: str = "sqrt") -> float:
    """DINOv2's scaling rule: lr = base_lr * sqrt(global batch / 1024) ('linear' and 'none' also offered)."""
    ratio = global_batch_size / reference_batch_size
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "linear":
        return base_lr * ratio
    if rule == "none":
        return base_lr
    raise ValueError(f"lr scaling rule must be sqrt | linear | none, got '{rule}'")


@dataclass
class SSLSchedules:
    """All per-step values the SSL loop reads; ``at(step)`` gives one step's values as a dict."""

    lr: Schedule
    weight_decay: Schedule
    momentum: Schedule
    teacher_temp: Schedule
    last_layer_lr: Schedule

    def at(self, step: int) -> dict[str, float]:
        return {
            "lr": self.lr[step],
            "weight_decay": self.weight_decay[step],
            "momentum": self.momentum[step],
            "teacher_temp": self.teacher_temp[step],
            "last_layer_lr": self.last_layer_lr[step],
        }


def build_ssl_schedules(
    total_steps: int,
    steps_per_epoch: int,
    lr: float,
    min_lr: float = 1.0e-6,
    warmup_epochs: float = 10,
    weight_decay: float = 0.04,
    weight_decay_end: float = 0.4,
    momentum_teacher: float = 0.992,
    final_momentum_teacher: float = 1.0,
    warmup_teacher_temp: float = 0.04,
    teacher_temp: float = 0.07,
    warmup_teacher_temp_epochs: float = 30,
    freeze_last_layer_epochs: float = 1,
    shape: str = "dinov2",
) -> SSLSchedules:
    """The DINOv2 single-phase schedules (its defaults); ``lr`` is the already-scaled peak lr.

    Epoch counts become steps with ``steps_per_epoch``; a warm-up longer than the run keeps its slope and is cut
    at the run's end (DINOv2 never compresses it). The last layer follows the lr schedule but is 0 for the first
    ``freeze_last_layer_epochs`` (DINOv2 freezes the prototypes early for stability).
    """
    if total_steps <= 0 or steps_per_epoch <= 0:
        raise ValueError(f"total_steps and steps_per_epoch must be > 0, got {total_steps} and {steps_per_epoch}")

    def steps(epochs: float) -> int:
        return int(round(epochs * steps_per_epoch))

    lr_values = cosine_schedule(lr, min_lr, total_steps, steps(warmup_epochs), 0.0, shape=shape)
    last_layer = lr_values.copy()
    last_layer[: steps(freeze_last_layer_epochs)] = 0.0
    return SSLSchedules(
        lr=Schedule(lr_values, min_lr),
        weight_decay=Schedule(cosine_schedule(weight_decay, weight_decay_end, total_steps, shape=shape),
                              weight_decay_end),
        momentum=Schedule(cosine_schedule(momentum_teacher, final_momentum_teacher, total_steps, shape=shape),
                          final_momentum_teacher),
        teacher_temp=Schedule(
            warmup_then_constant(warmup_teacher_temp, teacher_temp, steps(warmup_teacher_temp_epochs), total_steps,
                                 shape=shape),
            teacher_temp,
        ),
        last_layer_lr=Schedule(last_layer, min_lr),
    )


def weight_schedule(ws, total_steps: int, steps_per_epoch: int) -> np.ndarray:
    """A ``WeightSchedule`` (start, peak, end, warmup_epochs, cosine_epochs) as a per-step array, sampled as DINOv3
    samples it (a DINOv3 loss weight: ``shape="dinov3"``)."""
    def steps(epochs: float) -> int:
        return int(round(epochs * steps_per_epoch))

    return linear_warmup_cosine_decay(ws.start, ws.peak, ws.end, steps(ws.warmup_epochs), total_steps,
                                      cosine=steps(ws.cosine_epochs), shape="dinov3")


__all__ = [
    "Piece", "SSLSchedules", "Schedule", "build_ssl_schedules", "constant_schedule", "cosine_schedule",
    "linear_schedule", "linear_warmup_cosine_decay", "piecewise", "weight_schedule", "scaled_lr", "warmup_then_constant",
]
