"""Metrics: one JSON object per logged step in ``RUN/metrics.jsonl`` (+ TensorBoard when installed), and the
fixed key set a task's per-step metrics are reduced over.

A resumed run appends; rows from steps at or after the resume point are dropped first, so the file holds
one row per step even when a killed run had logged past its last checkpoint.

Reduction (:class:`MetricSet`): every step the loop averages each rank's numbers in one all-reduce of a flat
vector. The vector's layout must be the same on every rank, so it comes from the keys a task *declares*
(``metric_keys``), never from the keys a rank happened to log: a key a rank leaves out this step is sent as
(0, absent) and averaged over the ranks that did log it (dropped from the row when none did); a numeric key
that was not declared is an error, raised on every rank in the same step (a flag in the same vector), with
the key's name. Strings (e.g. ``compute_dtype``) are not reduced: rank 0's value is logged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ..utils.device import host_tensor
from ..utils.run_layout import TrainLayout


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no nan/inf
    return v


class MetricsLogger:
    def __init__(self, run_dir: str | Path, enabled: bool = True, resume_step: int = 0,
                 tensorboard: bool = True) -> None:
        self.path = TrainLayout(run_dir).metrics
        self.enabled = enabled
        self.tb = None
        if not enabled:
            return
        if self.path.is_file():
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", -1) < resume_step]
            self.path.write_text("".join(line + "\n" for line in keep))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step)
            except Exception:  # tensorboard not installed: jsonl only
                self.tb = None

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = TrainLayout(run_dir).metrics
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class UndeclaredMetricError(RuntimeError):
    """A task logged a number under a key it did not declare in ``metric_keys``."""


def _numeric(v: Any) -> bool:
    return torch.is_tensor(v) or (isinstance(v, (int, float)) and not isinstance(v, bool))


class MetricSet:
    """The fixed, sorted key set of a task's per-step metrics and its place in the step's all-reduce vector:
    two slots per key (value, 1 if this rank logged it)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = tuple(sorted(set(keys)))
        self._index = {k: i for i, k in enumerate(self.keys)}
        self._dev_index: dict = {}

    def __len__(self) -> int:
        return 2 * len(self.keys)

    def undeclared(self, logs: dict[str, Any], ignore: Sequence[str] = ()) -> list[str]:
        """Numeric keys of ``logs`` not in the set (``ignore``: prefixes the loop reads itself)."""
        return sorted(k for k, v in logs.items()
                      if _numeric(v) and k not in self._index and not k.startswith(tuple(ignore)))

    def slots(self, logs: dict[str, Any], device: torch.device) -> torch.Tensor:
        """(2 * n_keys,) float64 on ``device``: values (device tensors stay there) and flags, with no host sync:
        the host numbers go over in one asynchronous copy, the device values are placed by an index made once."""
        if not self.keys:
            return torch.zeros(0, dtype=torch.float64, device=device)
        host = [0.0] * len(self)
        dev_idx, dev_vals = [], []
        for k in self.keys:
            v = logs.get(k)
            if v is None or not _numeric(v):
                continue
            i = self._index[k]
            host[2 * i + 1] = 1.0  # present
            if torch.is_tensor(v):
                dev_idx.append(2 * i)
                dev_vals.append(v.detach().reshape(()))
            else:
                host[2 * i] = float(v)
        out = host_tensor(host, device)
        if dev_idx:
            key = (tuple(dev_idx), str(device))
            if key not in self._dev_index:  # the same keys every step: made once (one copy), then reused
                self._dev_index[key] = torch.tensor(dev_idx, dtype=torch.long, device=device)
            out = out.index_copy(0, self._dev_index[key], torch.stack(dev_vals).to(device, torch.float64))
        return out

    def means(self, reduced: Sequence[float]) -> dict[str, float]:
        """Summed slots (over ranks) -> {key: mean over the ranks that logged it}; keys nobody logged are left out."""
        out = {}
        for i, k in enumerate(self.keys):
            total, count = reduced[2 * i], reduced[2 * i + 1]
            if count > 0:
                out[k] = total / count
        return out


__all__ = ["MetricsLogger", "read_metrics", "MetricSet", "UndeclaredMetricError"]
