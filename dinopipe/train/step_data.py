"""What the ranks agree on about a step's data *before* running it: whether some rank has a micro-batch with no
readable image, and how many images each step lost to corrupt files.

A rank whose whole batch failed to decode cannot run the step (there is nothing to forward), and under FSDP2 a
rank that skips the forward leaves the others waiting in its all-gathers forever. So every rank reports on the
batches of step s+1 inside step s's one all-reduce (the loop fetches them before the reduction: the loader
prefetches anyway), and all ranks skip step s+1 together when any of them has an empty micro-batch. Only the
first step after a loader starts (a run or a phase starting) needs a reduction of its own. A skipped step still
advances the step, the schedules and the data position; it is counted in ``skipped_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..data.decode import REASONS

RETRY_KINDS = ("throttled", "server_error", "connection")  # object-storage retries (dinopipe.utils.storage)
REPORT_SIZE = 1 + len(REASONS) + len(RETRY_KINDS)
"""Slots of one data report in the step's all-reduce vector: [empty micro-batch flag, corrupt count per reason,
storage retries per kind]."""


def is_empty(batch: Any) -> bool:
    """A batch in which every sample failed to decode (SkipCorrupt's ``n_images == 0``)."""
    return isinstance(batch, dict) and batch.get("n_images", 1) == 0


def local_report(micro: Sequence[Any]) -> list[float]:
    """This rank's report on one step's micro-batches (zeros for no batches: nothing to say)."""
    corrupt = [0.0] * len(REASONS)
    for b in micro:
        for reason, n in ((b.get("corrupt") or {}) if isinstance(b, dict) else {}).items():
            corrupt[REASONS.index(reason) if reason in REASONS else REASONS.index("read_error")] += n
    retries = [0.0] * len(RETRY_KINDS)
    for b in micro:
        for key, n in ((b.get("io") or {}) if isinstance(b, dict) else {}).items():
            kind = key.removeprefix("retry/")
            if kind in RETRY_KINDS:
                retries[RETRY_KINDS.index(kind)] += n
    return [1.0 if any(is_empty(b) for b in micro) else 0.0] + corrupt + retries


@dataclass
class DataReport:
    """A step's data, as all ranks agree on it (summed over ranks)."""

    skip: bool = False
    corrupt: dict[str, int] = field(default_factory=dict)
    retries: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_reduced(cls, vals: Sequence[float]) -> "DataReport":
        k = 1 + len(REASONS)
        return cls(vals[0] > 0, {r: int(v) for r, v in zip(REASONS, vals[1:k]) if v > 0},
                   {r: int(v) for r, v in zip(RETRY_KINDS, vals[k:REPORT_SIZE]) if v > 0})

    def logs(self) -> dict[str, int]:
        """``corrupt_images`` (this step, all ranks), one ``corrupt/REASON`` per reason seen and one
        ``storage_retries/KIND`` per kind of object-storage retry seen."""
        return {"corrupt_images": sum(self.corrupt.values()), **{f"corrupt/{r}": n for r, n in self.corrupt.items()},
                **{f"storage_retries/{r}": n for r, n in self.retries.items()}}


class TooMuchBadData(RuntimeError):
    """Training only skips: K steps in a row had a rank with no readable image, or the fraction of unreadable images
    passed the bound. Every rank raises it in the same step (it is decided on the reduced reports); exit 65."""


class DataGuard:
    """Ends a training that only skips (``train.max_skipped_in_a_row``, ``train.max_corrupt_fraction``; 0 / 1.0
    turn a bound off). The fraction counts this invocation's images and is checked once ``min_images`` were read,
    so a few bad files at the start do not stop a run. Keeps the last few files or objects that failed on this
    rank, to name them."""

    def __init__(self, max_in_a_row: int, max_fraction: float, min_images: int = 256) -> None:
        self.max_in_a_row, self.max_fraction, self.min_images = max_in_a_row, max_fraction, min_images
        self.in_a_row, self.seen, self.corrupt = 0, 0, 0
        self.where: dict[str, None] = {}  # insertion-ordered set of the latest failing shards / objects

    def update(self, step: int, report: DataReport, micro: Sequence[Any], images: int) -> None:
        """After step ``step`` (``report``: its agreed data report; ``images``: its global images)."""
        for b in micro:
            for w in (b.get("corrupt_where") or ()) if isinstance(b, dict) else ():
                self.where.pop(w, None)
                self.where[w] = None
        while len(self.where) > 8:
            self.where.pop(next(iter(self.where)))
        self.in_a_row = self.in_a_row + 1 if report.skip else 0
        self.seen += images
        self.corrupt += sum(report.corrupt.values())
        why = None
        if self.max_in_a_row and self.in_a_row >= self.max_in_a_row:
            why = f"{self.in_a_row} steps in a row were skipped (train.max_skipped_in_a_row={self.max_in_a_row})"
        elif (self.max_fraction < 1.0 and self.seen >= self.min_images
              and self.corrupt > self.max_fraction * self.seen):
            why = (f"{self.corrupt} of {self.seen} images were unreadable ({self.corrupt / self.seen:.0%} > "
                   f"train.max_corrupt_fraction={self.max_fraction:g})")
        if why:
            names = ", ".join(self.where) or "none on this rank"
            raise TooMuchBadData(f"training stopped at step {step}: {why}; unreadable data in: {names} "
                                 f"(reasons: {report.corrupt or 'see metrics.jsonl corrupt/*'}). Fix or remove those "
                                 f"shards, then rerun: it resumes from the last checkpoint")


__all__ = ["DataReport", "DataGuard", "TooMuchBadData", "REPORT_SIZE", "is_empty", "local_report"]
