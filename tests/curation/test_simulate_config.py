"""`curate simulate` runs the config a user runs (issue 40): the config it curates with (the config.yaml the
chain saves) is `curate run`'s for the same --config and overrides, except the documented input keys; the
default chain writes real output shards (of the generated JPEGs) and the report."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from curation.config import CurationConfig
from curation.simulate.run import INPUT_KEYS, chain_config, run_overrides, simulate
from curation.core import runner
from dinopipe.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PLAIN = set(INPUT_KEYS) - {"input.seed_paths"}  # the keys outside the retrieval modes
DEFAULT_YAML = str(ROOT / "configs" / "curation" / "default.yaml")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _differs(a: dict, b: dict) -> set:
    fa, fb = _flat(a), _flat(b)
    return {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


def test_documented_input_keys_are_in_the_docs():
    doc = (ROOT / "docs" / "curate.md").read_text()
    for key in INPUT_KEYS:
        assert f"`{key}`" in doc, key


@pytest.mark.parametrize("config", [None, DEFAULT_YAML])
def test_chain_config_is_curate_runs_but_the_input_keys(tmp_path, config):
    over = run_overrides(4, None, False, ["rebalance.mode=hierarchical"])
    got = dataclasses.asdict(chain_config(str(tmp_path / "w"), over, config))
    want = dataclasses.asdict(load_config(CurationConfig, config, over))
    assert _differs(got, want) == PLAIN
    # no override: the defaults, except W (the one `curate run tasks.count=4` gets too)
    got = dataclasses.asdict(chain_config(str(tmp_path / "w"), run_overrides(4)))
    assert _differs(got, dataclasses.asdict(CurationConfig())) == PLAIN | {"tasks.count"}
    assert not (tmp_path / "w").exists()  # only checked: nothing written


def test_default_chain_writes_shards_of_the_generated_jpegs_and_the_report(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(runner, "BLOCK", 1024)
    work = tmp_path / "s"
    res = simulate(str(work), 2500, 16, tasks=2, n_clusters=8, n_eval=60, overlap=12, processes=0)
    saved = OmegaConf.to_container(OmegaConf.load(work / "config.yaml"))  # what the chain ran with
    want = dataclasses.asdict(load_config(CurationConfig, None, run_overrides(2, 0)))
    assert _differs(saved, want) == PLAIN
    assert res["chain"][-2:] == ["write", "report"] and "embed" not in res["chain"]
    kept = res["counts"]["kept"]
    assert kept > 0 and res["step_results"]["report"]
    assert (work / "report" / "summary.md").is_file()
    members = []
    for shard in sorted((work / "shards").glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            members += [(m, tar.extractfile(m).read()) for m in tar.getmembers() if m.name.endswith(".jpg")]
    assert len(members) == kept  # every kept image copied from the generated pool's shards
    assert Image.open(io.BytesIO(members[0][1])).size == (16, 16)


@pytest.mark.parametrize("mode", ["sample", "cluster"])
def test_retrieval_modes_run_around_a_generated_seed_set(tmp_path, monkeypatch, mode):
    """The retrieval modes need seeds: the simulation generates them (input.seed_paths, its one more input
    key); every kept row of the retrieval is attached to its nearest seed, as `curate run` records it."""
    import numpy as np

    from curation.core.stepfiles import load_step

    monkeypatch.setattr(runner, "BLOCK", 1024)
    work = tmp_path / mode
    over = [f"rebalance.mode={mode}", "rebalance.n_clusters=16", "rebalance.min_seeds=1"]
    res = simulate(str(work), 2500, 16, tasks=2, n_clusters=8, n_eval=60, overlap=12, processes=0, overrides=over,
                   n_seeds=40)
    saved = OmegaConf.to_container(OmegaConf.load(work / "config.yaml"))
    want = dataclasses.asdict(load_config(CurationConfig, None, run_overrides(2, 0, overrides=over)))
    assert _differs(saved, want) == set(INPUT_KEYS)
    assert saved["input"]["seed_paths"] == [str(work / "seeds")] and len(list((work / "seeds").glob("*.jpg"))) == 40
    rb = load_step(str(work), "rebalance", mmap=False)
    near = np.asarray(rb["nearest_seed"])
    assert res["counts"]["kept"] > 0 and res["counts"]["not_selected"] > 0
    assert (near >= 0).sum() > 0 and near.max() < 40


def test_cli_bad_override_exits_2_before_writing(tmp_path):
    work = tmp_path / "bad"
    out = subprocess.run([sys.executable, "-m", "curation.cli", "simulate", "--n", "100", "--work", str(work),
                          "dedup.k=0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "dedup.k" in out.stderr and not work.exists()
