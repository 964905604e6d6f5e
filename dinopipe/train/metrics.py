"""Metrics: one JSON object per logged step in ``RUN/metrics.jsonl`` (+ TensorBoard when installed).

A resumed run appends; rows from steps at or after the resume point are dropped first, so the file holds
one row per step even when a killed run had logged past its last checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no nan/inf
    return v


class MetricsLogger:
    def __init__(self, run_dir: str | Path, enabled: bool = True, resume_step: int = 0,
                 tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
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
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


__all__ = ["MetricsLogger", "read_metrics"]
