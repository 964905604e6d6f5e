"""The metrics logger: one JSON line per logged step, on rank 0 only; a resumed run drops the rows it redoes."""

from __future__ import annotations

import json
import math

import torch

from dinopipe.train.metrics import MetricsLogger, read_metrics


def test_one_json_line_per_step_with_plain_values(tmp_path):
    m = MetricsLogger(tmp_path, tensorboard=False)
    m.log(0, {"loss": torch.tensor(1.5), "lr": 0.1, "phase": "base", "bad": float("nan"), "n": 3})
    m.log(1, {"loss": 1.25, "inf": float("inf")})
    m.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    rows = [json.loads(line) for line in lines]  # strict JSON: no NaN / Infinity tokens
    assert rows[0] == {"step": 0, "loss": 1.5, "lr": 0.1, "phase": "base", "bad": "nan", "n": 3}
    assert rows[1] == {"step": 1, "loss": 1.25, "inf": "inf"}
    assert read_metrics(tmp_path) == rows


def test_only_rank_0_writes(tmp_path):
    m = MetricsLogger(tmp_path, enabled=False, tensorboard=False)  # what every other rank gets
    m.log(0, {"loss": 1.0})
    m.close()
    assert not (tmp_path / "metrics.jsonl").exists() and read_metrics(tmp_path) == []


def test_a_resumed_run_drops_rows_from_its_resume_step_on(tmp_path):
    m = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(6):  # a run that logged up to step 5, then was killed; its checkpoint is at step 4
        m.log(step, {"loss": float(step)})
    m.close()
    m = MetricsLogger(tmp_path, resume_step=4, tensorboard=False)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
    for step in (4, 5, 6):
        m.log(step, {"loss": 10.0 + step})
    m.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(7))  # one row per step
    assert rows[5]["loss"] == 15.0 and not math.isnan(rows[3]["loss"])
