"""Install extras: one faiss wheel per environment (cpu or gpu extra, never in the base), no xformers in any
extra (its wheels pin one torch), `make venv` picks the cpu extra; curation without faiss says what to install."""

import os
import subprocess
import sys

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_extras_never_mix_faiss_wheels_and_leave_xformers_out():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    proj = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = proj["optional-dependencies"]
    faiss = lambda reqs: [r for r in reqs if r.startswith("faiss")]  # noqa: E731
    assert faiss(proj["dependencies"]) == []
    assert [r.split(">")[0] for r in faiss(extras["cpu"])] == ["faiss-cpu"]
    assert [r.split(">")[0] for r in faiss(extras["gpu"])] == ["faiss-gpu-cu12"]
    assert not any("xformers" in r for reqs in [proj["dependencies"], *extras.values()] for r in reqs)
    assert "'.[cpu,dev]'" in (REPO / "Makefile").read_text()


def test_curation_without_faiss_names_the_extra():
    code = "import sys; sys.modules['faiss'] = None\nimport curation.knn.index"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode != 0
    assert "pip install 'dinopipe[cpu]'" in r.stderr and "faiss-gpu-cu12" in r.stderr
    # training never needs it
    r = subprocess.run([sys.executable, "-c", code.replace("curation.knn.index", "dinopipe.ssl.task")],
                       capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
