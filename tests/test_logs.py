"""Quiet, useful logs: the package loggers speak at INFO on rank 0 only, third-party INFO lines stay out, and no
entry point changes the root logger."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests._photos import write_pool

from dinopipe.logs import setup_logging
from dinopipe.train.builders import stage_main

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Tiny:
    n: int = 1


def _run_stage(monkeypatch, rank: str | None) -> int:
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("SLURM_PROCID", raising=False)

    def run(cfg):
        logging.getLogger("dinopipe.train.fake").info("package info line n=%d", cfg.n)
        logging.getLogger("curation.fake").warning("package warning line")
        logging.getLogger("matplotlib.category").info("Using categorical units to plot a list of strings")
        logging.getLogger("PIL.PngImagePlugin").info("third-party info line")
        return 0

    return stage_main("fake", Tiny, lambda cfg: None, run, ["n=7"], None)


@pytest.fixture
def root_level():
    root = logging.getLogger()
    before = root.level, list(root.handlers)
    yield before
    root.setLevel(before[0])


def test_stage_main_leaves_root_alone_and_logs_package_info_on_rank_0(monkeypatch, capsys, root_level):
    root = logging.getLogger()
    assert _run_stage(monkeypatch, None) == 0
    out = capsys.readouterr().err
    assert (root.level, root.handlers) == root_level  # untouched: no level, no handler added
    assert "INFO dinopipe.train.fake: package info line n=7" in out
    assert "WARNING curation.fake: package warning line" in out
    assert "categorical" not in out and "third-party" not in out
    assert logging.getLogger("dinopipe").level == logging.INFO


def test_other_ranks_log_warnings_only(monkeypatch, capsys, root_level):
    try:
        assert _run_stage(monkeypatch, "1") == 0
        out = capsys.readouterr().err
        assert "package info line" not in out and "WARNING curation.fake: package warning line" in out
    finally:
        setup_logging(rank=0)


def test_setup_is_idempotent_and_follows_a_replaced_stderr(capsys):
    setup_logging(rank=0)
    setup_logging(rank=0)  # the pipeline runs several stages in one process
    logging.getLogger("dinopipe.x").info("once")
    assert capsys.readouterr().err.count("once") == 1
    assert sum(1 for h in logging.getLogger("dinopipe").handlers if type(h).__name__ == "_StderrHandler") == 1


@pytest.mark.slow
def test_quickstart_like_curation_prints_no_third_party_info(tmp_path):
    """The quickstart's path: `dinopipe pipeline` running the curate stage in-process with the quickstart config
    (hierarchical rebalancing, decontamination, the report's plots) on real photos with planted copies. The
    plots are drawn, and no matplotlib / PIL / faiss INFO line reaches the output."""
    from skimage import data

    photos = {name: getattr(data, name)() for name in ("astronaut", "coffee", "chelsea", "rocket")}
    # 16 distinct views (quadrants of 4 photos) + planted copies: enough for every plot, cheap to make
    views = {f"{n}_{i}": a[(i // 2) * (a.shape[0] // 2):, (i % 2) * (a.shape[1] // 2):][: a.shape[0] // 2,
                                                                                    : a.shape[1] // 2]
             for n, a in photos.items() for i in range(4)}
    pool, evalp = tmp_path / "pool", tmp_path / "eval"
    groups = write_pool(str(pool), copies_of=sorted(views)[::5], photos=views)
    (evalp / "a").mkdir(parents=True)
    for name in sorted(groups)[:2]:  # eval images that also sit in the pool: decontamination removes them
        (evalp / "a" / f"{name}.jpg").write_bytes((pool / f"{name}.jpg").read_bytes())
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "dinopipe.app.cli", "pipeline", "--config",
                        str(REPO / "configs/pipeline/quickstart.yaml"), f"output_dir={tmp_path / 'run'}",
                        "sample.enabled=false", f"input.paths=[{pool}]", f"input.eval_val={evalp}",
                        "stages=[curate]", "curate.overrides=[embed.num_workers=0,progress=false]"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout + r.stderr
    assert len(list((tmp_path / "run" / "curated" / "report").glob("*.png"))) >= 3, text[-2000:]
    noisy = [ln for ln in text.splitlines() if " INFO " in ln and not ln.split(" INFO ")[1].startswith(
        ("dinopipe", "curation"))]
    assert not noisy, noisy[:5]
    assert "Using categorical units" not in text
