"""`dinopipe gpu-check --cpu`: the CPU smoke subset of the GPU acceptance check runs in CI so the script cannot
rot; a failing check gives a non-zero exit and says why in report.json."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env():
    return dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1",
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_cpu_smoke_runs_every_cpu_part_and_writes_a_report(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dinopipe.app.cli", "gpu-check", "--cpu", "--out", str(tmp_path)],
                       env=_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    checks = report["checks"]
    assert report["mode"] == "cpu-smoke" and report["failed"] == []
    assert {n: c["status"] for n, c in checks.items()} == {
        "attention": "ok", "block": "ok", "losses": "ok", "task": "ok", "trace": "skipped", "cli": "skipped", "curation": "ok"}
    task = checks["task"]
    assert task["compute_dtype"] == "bf16" and task["teacher_fp32_after_forward"]
    assert task["ema_moved_teacher"] and task["dcp_roundtrip_identical"]
    assert checks["curation"]["flat_recall@10"] == 1.0
    assert checks["attention"]["sdpa_bf16_vs_math_fp32"]["out_rel"] < 3e-2


def test_a_failing_check_exits_non_zero_and_names_the_error(tmp_path, monkeypatch, capsys):
    import dinopipe.app.gpu_check as gc

    def broken(dev, small):
        raise AssertionError("DINO loss differs from the CPU reference")

    monkeypatch.setattr(gc, "check_losses", broken)
    assert gc.main(["--cpu", "--only", "losses,attention", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed"] == ["losses"] and report["checks"]["attention"]["status"] == "ok"
    assert "DINO loss differs" in report["checks"]["losses"]["error"]


def test_gpu_mode_without_a_gpu_says_so():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    r = subprocess.run([sys.executable, "-m", "dinopipe.app.gpu_check", "--out", "/nonexistent/x"], env=_env(),
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode != 0 and "no CUDA device" in r.stderr
