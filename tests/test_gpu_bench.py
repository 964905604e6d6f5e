"""``make gpu-bench``'s CPU smoke (bench/gpu_bench.py --cpu): every code path the GPU run takes, tiny.

The official side needs the official source (``make official-src``: .official/dinov2, never vendored) and
omegaconf + fvcore (``make gpu-bench-wheels``); without them only dinopipe's side runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OFFICIAL = REPO / ".official" / "dinov2"
HAVE_OFFICIAL = (OFFICIAL / "dinov2").is_dir() and all(importlib.util.find_spec(m) for m in ("omegaconf", "fvcore"))


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + sys.path), OMP_WAIT_POLICY="PASSIVE")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_bench.py"), "--cpu", "--out", str(tmp_path), *extra],
                       env=env, capture_output=True, text=True, timeout=300)
    report = tmp_path / "gpu_bench.json"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, json.loads(report.read_text())


def test_cpu_smoke_dinopipe_step(tmp_path):
    r, rep = _run(tmp_path, "--skip-official", "--no-e2e")
    d = rep["cases"]["vit_test_b4"]["dinopipe"]
    assert d["steps"] == 2 and d["images_per_s"] > 0 and d["achieved_tflops"] > 0
    assert d["dynamo_graphs"] == 0 and d["graph_breaks"] == 0  # the smoke runs eager: dynamo counts nothing
    assert set(rep["cases"]["vit_test_b4"]) >= {"dinopipe", "model_tflop_per_step"}
    assert "official" not in rep["cases"]["vit_test_b4"] and rep["official"].startswith("skipped")


@pytest.mark.slow
def test_cpu_smoke_all_cases(tmp_path):
    """The official step (when its source is here), its fp16 recipe row, and the end-to-end case: JPEG shards
    -> the training loader -> the same step."""
    r, rep = _run(tmp_path, *([] if HAVE_OFFICIAL else ["--skip-official"]))
    case = rep["cases"]["vit_test_b4"]
    e = case["dinopipe_e2e_jpeg_cpu_aug"]
    assert e["steps"] == 2 and e["images_per_s"] > 0 and e["loader_only_images_per_s"] > 0
    assert e["shards"]["images"] >= 2 * 4 and "vit_test_b4_e2e_cpu_aug_over_bare_step" in rep["ratios"]
    if HAVE_OFFICIAL:
        for side in ("dinopipe", "official", "official_fp16_recipe"):
            assert case[side]["images_per_s"] > 0, case[side]
        assert "xformers" in rep["official_shims"]
        assert f"vit_test_b4: {rep['ratios']['vit_test_b4']:.2f}" in r.stdout


def test_step_levers_cpu_smoke(tmp_path):
    """bench/gpu_step_levers.py (the next GPU session's breakdown of the step) runs each kind of variant; on CPU
    with vit_test, b=4, no profiler kernel times."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + sys.path), OMP_WAIT_POLICY="PASSIVE")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_step_levers.py"), str(tmp_path), "--steps", "2",
                        "--variants", "fsdp-eager,fsdp-eager-stockopt,fsdp-eager-noopt,single-eager-dp0"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / "levers.json").read_text())
    assert set(rep["variants"]) == {"fsdp-eager", "fsdp-eager-stockopt", "fsdp-eager-noopt", "single-eager-dp0"}
    for name, v in rep["variants"].items():
        assert v["images_per_s"] > 0 and v["step_s"] > 0, (name, v)
