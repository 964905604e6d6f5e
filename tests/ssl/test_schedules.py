"""Per-step schedules: DINOv2's cosine-with-warm-up values, the recipe's teacher temperature / momentum /
last-layer freeze, the sqrt lr scaling rule, and piecewise (phase) construction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dinopipe.ssl.schedules import (
    Piece,
    Schedule,
    build_ssl_schedules,
    cosine_schedule,
    linear_warmup_cosine_decay,
    piecewise,
    scaled_lr,
    warmup_then_constant,
)


def test_cosine_schedule_matches_formula():
    s = cosine_schedule(1.0, 0.1, total_steps=20, warmup_steps=5, start_warmup_value=0.0, freeze_steps=2)
    assert len(s) == 20
    np.testing.assert_array_equal(s[:2], 0.0)
    np.testing.assert_allclose(s[2:7], np.linspace(0, 1, 5))  # warm-up reaches the peak on its last step
    it = np.arange(13)
    np.testing.assert_allclose(s[7:], 0.1 + 0.45 * (1 + np.cos(np.pi * it / 13)))
    assert np.all(np.diff(s[7:]) < 0) and s[-1] > 0.1
    # A warm-up longer than the schedule is cut, not compressed (DINOv2 never squeezes a ramp).
    np.testing.assert_allclose(cosine_schedule(1.0, 0.0, total_steps=4, warmup_steps=5), [0, 0.25, 0.5, 0.75])
    # DINOv3's form: warm-up, a cosine of its own length, then the end value.
    s3 = linear_warmup_cosine_decay(0.0, 1.0, 0.2, warmup=2, total=8, cosine=4)
    np.testing.assert_allclose(s3, [0, 1, 1, 0.2 + 0.4 * (1 + np.cos(np.pi / 4)), 0.6,
                                    0.2 + 0.4 * (1 + np.cos(3 * np.pi / 4)), 0.2, 0.2])


def test_ssl_schedules_follow_the_dinov2_recipe():
    spe, epochs = 10, 100
    sch = build_ssl_schedules(total_steps=spe * epochs, steps_per_epoch=spe, lr=4e-3, min_lr=1e-6,
                              warmup_epochs=10, weight_decay_end=0.2, momentum_teacher=0.994,
                              warmup_teacher_temp_epochs=30, freeze_last_layer_epochs=1)
    # lr: 0 -> peak over 10 epochs, then cosine towards min_lr.
    assert sch.lr[0] == 0.0 and sch.lr[99] == pytest.approx(4e-3)
    assert sch.lr[999] == pytest.approx(1e-6, abs=1e-6) and sch.lr[5000] == 1e-6
    # Teacher temperature: 0.04 -> 0.07 linearly over 30 epochs, then constant.
    assert sch.teacher_temp[0] == pytest.approx(0.04)
    assert sch.teacher_temp[150] == pytest.approx(0.04 + 0.03 * 150 / 299)
    assert all(sch.teacher_temp[s] == pytest.approx(0.07) for s in (299, 300, 999, 10**6))
    # Momentum 0.994 -> 1, weight decay 0.04 -> 0.2, both monotone cosines.
    assert sch.momentum[0] == pytest.approx(0.994) and sch.momentum[10**6] == 1.0
    assert np.all(np.diff(sch.momentum.values) >= 0) and sch.momentum[999] > 0.99999
    assert sch.weight_decay[0] == pytest.approx(0.04) and sch.weight_decay[999] == pytest.approx(0.2, abs=1e-5)
    # Last layer: frozen (lr 0) for the first epoch, then the lr schedule.
    assert all(sch.last_layer_lr[s] == 0.0 for s in range(spe))
    assert all(sch.last_layer_lr[s] == sch.lr[s] for s in range(spe, 200))
    assert set(sch.at(5)) == {"lr", "weight_decay", "momentum", "teacher_temp", "last_layer_lr"}


def test_short_runs_keep_the_ramps_slopes():
    """A run shorter than its warm-ups sees the start of each ramp, as DINOv2 would (no compression)."""
    sch = build_ssl_schedules(total_steps=7, steps_per_epoch=10, lr=1e-3)  # warm-ups longer than the run
    assert len(sch.lr) == len(sch.teacher_temp) == 7
    assert sch.lr[6] == pytest.approx(1e-3 * 6 / 99)  # 10 epochs x 10 steps of warm-up
    assert sch.teacher_temp[6] == pytest.approx(0.04 + 0.03 * 6 / 299)


def test_defaults_are_dinov2_ssl_default_config():
    sch = build_ssl_schedules(total_steps=100, steps_per_epoch=10, lr=1e-3)
    assert sch.momentum[0] == pytest.approx(0.992) and sch.weight_decay[99] == pytest.approx(0.4, abs=1e-3)


def test_scaled_lr_rules():
    assert scaled_lr(1e-3, 1024) == pytest.approx(1e-3)
    assert scaled_lr(1e-3, 2048) == pytest.approx(1e-3 * math.sqrt(2))
    assert scaled_lr(1e-3, 256, rule="linear") == pytest.approx(2.5e-4)
    with pytest.raises(ValueError, match="rule"):
        scaled_lr(1e-3, 256, rule="cube")


def test_piecewise_phases():
    # 224 px phase with warm-up and cosine, then a short high-res phase at a lower, compressed schedule.
    low = Piece("cosine", steps=90, start=1e-3, end=1e-4, warmup_steps=10)
    high = Piece("cosine", steps=10, start=2e-4, end=1e-6)
    arr = piecewise([low, high, Piece("constant", steps=3, start=5.0), np.array([7.0, 8.0])])
    assert len(arr) == 105
    np.testing.assert_allclose(arr[:90], cosine_schedule(1e-3, 1e-4, 90, 10))
    np.testing.assert_allclose(arr[90:100], cosine_schedule(2e-4, 1e-6, 10))
    np.testing.assert_allclose(arr[100:], [5, 5, 5, 7, 8])
    np.testing.assert_allclose(piecewise([Piece("linear", steps=3, start=0.0, end=1.0)]), [0, 0.5, 1])
    np.testing.assert_allclose(warmup_then_constant(0.04, 0.07, 4, 6), [0.04, 0.05, 0.06, 0.07, 0.07, 0.07])
    with pytest.raises(ValueError, match="kind"):
        piecewise([Piece("step", steps=3, start=1.0)])
    s = Schedule(arr)
    assert s[104] == 8.0 and s[10**9] == 8.0


def test_dinov3_shape_samples_warmup_and_cosine_as_dinov3():
    """dinov3 ``train/cosine_lr_scheduler.py:linear_warmup_cosine_decay``: ``np.linspace(start, peak, warmup,
    endpoint=False)``, then ``end + (peak - end) * (1 + cos(np.linspace(0, pi, cosine))) / 2``, then ``end``;
    DINOv2's CosineScheduler includes the peak in the warm-up and never reaches ``end`` inside the cosine."""
    from dinopipe.ssl.schedules import linear_warmup_cosine_decay

    v3 = linear_warmup_cosine_decay(0.0, 1.0, 0.2, 4, 12, cosine=5, shape="dinov3")
    want = [i / 4 for i in range(4)] + [0.2 + 0.8 * (1 + math.cos(math.pi * i / 4)) / 2 for i in range(5)] + [0.2] * 3
    np.testing.assert_allclose(v3, want, rtol=0, atol=1e-15)
    v2 = linear_warmup_cosine_decay(0.0, 1.0, 0.2, 4, 12, cosine=5)
    assert v2[3] == 1.0 and v3[3] == 0.75 and v3[8] == pytest.approx(0.2) and v2[8] > 0.2
    with pytest.raises(ValueError, match="shape"):
        linear_warmup_cosine_decay(0.0, 1.0, 0.2, 4, 12, shape="dinov1")
