"""The depth metrics equal dinov3's own code (``eval/depth/metrics.py`` + ``datasets_utils.make_valid_mask``, run
from the official source that ``make official-src`` extracts into .official/dinov3) on the same predictions."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from dinopipe.eval.depth import METRIC_KEYS, depth_metrics

REPO = Path(__file__).resolve().parents[2]
OFFICIAL = REPO / ".official" / "dinov3" / "dinov3" / "eval" / "depth"
needs_official = pytest.mark.skipif(not (OFFICIAL / "metrics.py").is_file(),
                                    reason="needs the dinov3 source in .official/dinov3: run `make official-src` "
                                           "(offline: OFFICIAL_SRC_V3=/path/to/dinov3.git)")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"_official_dinov3_{name}", OFFICIAL / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # torch only: no dinov3 package import
    return mod


def official_metrics(preds, gts, min_depth: float, max_depth: float, eigen: bool) -> dict:
    """dinov3's ``evaluate_depther_with_dataloader`` per image (batch 1), as its loop does it."""
    metrics, utils = _module("metrics"), _module("datasets/datasets_utils")
    rows = []
    for p, g in zip(preds, gts):
        gt = torch.as_tensor(np.asarray(g))[None, None]
        pred = torch.as_tensor(np.asarray(p))[None, None]
        gt = torch.where(torch.logical_or(gt >= max_depth, gt <= min_depth), 0.0, gt)
        valid = utils.make_valid_mask(gt, eval_crop=utils._EvalCropType("NYU_EIGEN" if eigen else "FULL"),
                                      ignored_value=0.0)
        pred = pred.clamp(min=min_depth, max=max_depth)
        v = metrics.calculate_depth_metrics(gt, pred, valid)
        rows.append({k: float(getattr(v, "log_10" if k == "log10" else k)) for k in METRIC_KEYS})
    return {k: float(np.nanmean([r[k] for r in rows])) for k in METRIC_KEYS}


def _case(seed: int, dtype):
    """Labels with holes (0), out-of-range depths and varied sizes; predictions near, some far off."""
    rng = np.random.default_rng(seed)
    preds, gts = [], []
    for h, w in ((48, 64), (30, 41), (96, 128)):
        g = rng.uniform(0.2, 12.0, (h, w))
        g[rng.random((h, w)) < 0.2] = 0.0
        p = g * rng.lognormal(0.0, 0.3, (h, w)) + rng.uniform(-0.5, 0.5, (h, w))
        preds.append(p.astype(dtype))
        gts.append(g.astype(dtype))
    return preds, gts


@needs_official
@pytest.mark.parametrize("eigen", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rng_", [(0.0, 65.536), (1e-3, 10.0)])
def test_metrics_equal_dinov3_code(eigen, dtype, rng_):
    preds, gts = _case(1, dtype)
    ours = depth_metrics(preds, gts, *rng_, eigen_crop=eigen)
    ref = official_metrics(preds, gts, *rng_, eigen)
    for k in METRIC_KEYS:
        assert ours[k] == pytest.approx(ref[k], abs=1e-6, rel=1e-6), (k, ours[k], ref[k])


def test_perfect_prediction_and_an_empty_label():
    g = np.full((8, 8), 2.0)
    m = depth_metrics([g, g], [g, np.zeros((8, 8))])
    assert m["images"] == 1  # the empty label has no valid pixel: skipped by the NaN-mean, as dinov3 does
    assert (m["a1"], m["abs_rel"], m["rmse"], m["silog"]) == (1.0, 0.0, 0.0, 0.0)
    half = depth_metrics([np.full((8, 8), 4.0)], [g])  # twice too far everywhere
    assert half["a1"] == 0.0 and half["abs_rel"] == pytest.approx(1.0) and half["silog"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="differ in size"):
        depth_metrics([np.ones((4, 4))], [np.ones((4, 5))])
