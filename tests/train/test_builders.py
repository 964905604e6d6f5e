"""What every training stage builds the same way: phase step ranges, per-step schedules and the phases' loaders."""

from __future__ import annotations

import numpy as np
import pytest

from dinopipe.config import load_config
from dinopipe.ssl.config import PretrainConfig
from dinopipe.train.builders import build_phases, build_schedules, phase_steps
from dinopipe.train.dist import DistInfo

TWO_PHASES = ("phases=[{name: low, fraction: 0.7, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: 4},"
              " {name: high, fraction: 0.3, global_crops_size: 112, local_crops_size: 28, batch_size_per_gpu: 2,"
              " lr_scale: 0.5, warmup_fraction: 0.25}]")


def _cfg(*overrides):
    return load_config(PretrainConfig, None, ["train.epochs=3", "train.epoch_length=11", "optim.warmup_epochs=1",
                                              "optim.freeze_last_layer_epochs=1", "optim.base_lr=0.01",
                                              "optim.min_lr=0.0001", *overrides])


def test_phase_steps_cover_the_run_without_gaps():
    assert phase_steps(_cfg()) == [(0, 33)]
    bounds = phase_steps(_cfg(TWO_PHASES))
    assert bounds == [(0, 23), (23, 33)]  # round(0.7 * 33) = 23; the last phase ends exactly at the total


def test_schedules_one_value_per_step_and_a_restart_per_phase():
    cfg = _cfg(TWO_PHASES)
    s = build_schedules(cfg, world_size=1)
    assert set(s) == {"lr", "wd", "last_layer_lr", "momentum", "teacher_temp"}
    assert all(len(v) == 33 for v in s.values())
    lr = s["lr"]
    peak1 = 0.01 * (4 / 1024) ** 0.5  # DINOv2's rule: base_lr * sqrt(global batch / 1024)
    assert np.all(np.diff(lr[:11]) > 0) and max(lr[:23]) == pytest.approx(peak1)  # warm-up over epoch 1
    assert np.all(np.diff(lr[11:23]) < 0) and lr[22] > 1e-4  # cosine towards min_lr
    # the second phase restarts: warm-up from min_lr to its own, lower peak (lr_scale 0.5, batch 2), then decays
    peak2 = 0.5 * 0.01 * (2 / 1024) ** 0.5
    assert lr[23] == pytest.approx(1e-4) and lr[23] < lr[24] and max(lr[23:]) == pytest.approx(peak2)
    assert lr[-1] < max(lr[23:])
    assert (s["last_layer_lr"][:11] == 0).all() and s["last_layer_lr"][11] == lr[11]  # frozen for one epoch
    assert np.all(np.diff(s["momentum"]) >= 0) and np.all(np.diff(s["wd"]) >= 0)  # run-long, not per phase


def test_the_lr_scales_with_the_global_batch():
    cfg = _cfg()
    one, four = build_schedules(cfg, 1)["lr"], build_schedules(cfg, 4)["lr"]
    assert max(four) == pytest.approx(2 * max(one))  # DINOv2's sqrt(global batch / 1024) rule


def test_build_phases_one_loader_per_phase_with_its_sizes():
    cfg = _cfg(TWO_PHASES)
    phases = build_phases(cfg, DistInfo(), refs=[], read=None, patch_size=14)
    assert [(p.name, p.start, p.end, p.batch_per_rank, p.global_size, p.local_size) for p in phases] == [
        ("low", 0, 23, 4, 56, 28), ("high", 23, 33, 2, 112, 28)]
    assert all(callable(p.build_loader) for p in phases)
