"""The last stage of the training input: batches on the training device, as the model takes them.

The loader's workers hand over uint8 crops (CPU path, :mod:`.fast_crops`) or the images' bytes and drawn
parameters (GPU path, :mod:`.gpu_augment`); :class:`DeviceStage` moves each batch to the device (pinned,
non-blocking), runs the GPU augmentation when the batch carries bytes, and normalises uint8 crops there
(:func:`.fast_crops.normalize_batch`). Batches that are already float (N-channel input, the Gram teacher's
path) pass through unchanged apart from the move.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from .fast_crops import normalize_batch


class DeviceStage:
    """Wraps a loader: iterating it yields device batches. ``iter()`` starts the loader's iterator at once (its
    workers fork inside the caller's ``iter``, e.g. under the training loop's blocked signals)."""

    def __init__(self, loader: Iterable, device: torch.device, mean: Sequence[float], std: Sequence[float],
                 augment: Optional[Callable[[dict], dict]] = None) -> None:
        self.loader, self.device, self.mean, self.std, self.augment = loader, device, tuple(mean), tuple(std), augment

    def __iter__(self) -> Iterator[Any]:
        return _DeviceIterator(iter(self.loader), self)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


class _DeviceIterator:
    def __init__(self, it: Iterator, stage: DeviceStage) -> None:
        self.it, self.stage = it, stage

    def __iter__(self) -> "_DeviceIterator":
        return self

    def __next__(self) -> Any:
        batch = next(self.it)
        s = self.stage
        if not isinstance(batch, dict):
            return batch
        if s.augment is not None and batch.get("encoded") is not None:
            batch = s.augment(batch)
        return normalize_batch(batch, s.device, s.mean, s.std)


__all__ = ["DeviceStage"]
