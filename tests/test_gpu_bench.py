"""``make gpu-bench``'s CPU smoke (bench/gpu_bench.py --cpu): every code path the GPU run takes, tiny.

The official side needs the official source (``make official-src``: .official/dinov2, never vendored) and
omegaconf + fvcore; without them only dinopipe's side runs and the official test is skipped."""

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


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + sys.path), OMP_WAIT_POLICY="PASSIVE")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_bench.py"), "--cpu", "--out", str(tmp_path), *extra],
                       env=env, capture_output=True, text=True, timeout=300)
    report = tmp_path / "gpu_bench.json"
    return r, (json.loads(report.read_text()) if report.is_file() else {})


def test_cpu_smoke_dinopipe_side(tmp_path):
    r, rep = _run(tmp_path, "--skip-official")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = rep["cases"]["vit_test_b4"]["dinopipe"]
    assert d["steps"] == 2 and d["images_per_s"] > 0 and d["achieved_tflops"] > 0
    assert "official" not in rep["cases"]["vit_test_b4"] and rep["official"].startswith("skipped")


@pytest.mark.slow
@pytest.mark.skipif(not (OFFICIAL / "dinov2").is_dir() or not all(
    importlib.util.find_spec(m) for m in ("omegaconf", "fvcore")),
    reason="needs `make official-src` and omegaconf + fvcore (make gpu-bench-wheels)")
def test_cpu_smoke_both_sides(tmp_path):
    r, rep = _run(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    case = rep["cases"]["vit_test_b4"]
    for side in ("dinopipe", "official", "official_fp16_recipe"):
        assert case[side]["images_per_s"] > 0, case[side]
    assert "xformers" in rep["official_shims"]
    assert f"vit_test_b4: {rep['ratios']['vit_test_b4']:.2f}" in r.stdout
