"""The run's learning rate survives a change of world size.

DINOv2 derives the peak lr from the global batch (``base_lr * sqrt(batch / 1024)``). The global batch is
``batch_size_per_gpu * world_size * accumulate``, so a run resumed on fewer or more GPUs would silently train
on with another lr. The checkpoint therefore records, per phase, the global batch the lr was derived from and
the peak lr it gave (:class:`LrBasis` states ``lr_batch`` / ``lr_peak`` in the trainer's state); on resume the
schedules are rebuilt from the *recorded* batch, so the lr curve continues exactly. Changing the lr on purpose
stays possible: when the config gives another peak for the recorded batch (``optim.base_lr``, a phase's
``lr_scale``, ``optim.scale_lr_with_batch`` changed), the new value applies from the resume step on, and one line
says what changed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class LrBasis:
    """How a run's schedules depend on the global batch: ``batches`` (per phase) in this invocation,
    ``build(batches)`` the per-step schedules and ``peaks(batches)`` each phase's peak lr for given batches."""

    batches: list[int]
    build: Callable[[Sequence[int]], dict[str, np.ndarray]]
    peaks: Callable[[Sequence[int]], list[float]]


def _fmt(xs: Sequence[float]) -> str:
    return "[" + ", ".join(f"{x:.4g}" for x in xs) + "]"


def resume_batches(basis: LrBasis, recorded_batches: Sequence[int], recorded_peaks: Sequence[float],
                   main: bool = True) -> list[int]:
    """The per-phase batches to derive the lr from when resuming a run recorded with ``recorded_*``; logs
    (on the main rank) one line when the world size or the config changes anything."""
    rec_b, rec_p = [int(b) for b in recorded_batches], [float(p) for p in recorded_peaks]
    if len(rec_b) != len(basis.batches):
        if main:
            log.warning("the checkpoint records the lr of %d phases, the config has %d: the lr is derived from "
                        "this run's global batch %s", len(rec_b), len(basis.batches), basis.batches)
        return list(basis.batches)
    new_p = basis.peaks(rec_b)
    changed = [i for i, (a, b) in enumerate(zip(rec_p, new_p)) if not math.isclose(a, b, rel_tol=1e-9, abs_tol=0)]
    if main and changed:
        log.info("lr override: the config changes the peak lr from %s to %s (phase %s; derived from the recorded "
                 "global batch %s); the new values apply from this step on", _fmt(rec_p), _fmt(new_p),
                 ", ".join(str(i) for i in changed), rec_b)
    elif main and rec_b != list(basis.batches):
        log.info("resumed at global batch %s (the lr was derived from %s): keeping the run's peak lr %s, not the %s "
                 "the new global batch would give", basis.batches, rec_b, _fmt(rec_p), _fmt(basis.peaks(basis.batches)))
    return rec_b


__all__ = ["LrBasis", "resume_batches"]
