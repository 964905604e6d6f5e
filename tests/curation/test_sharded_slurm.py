"""The sharded curation chain on a real Slurm (the single-node cluster of slurm/local_cluster.sh):
embed array -> index job -> 3-task search array -> finishing job, submitted by `dinopipe slurm
submit`; its decisions.tsv equals a 1-process run's on the same embeddings.

Skipped with the reason when no Slurm runs or can be started here (DINOPIPE_REQUIRE_SLURM=1 makes that
a failure). A cluster found running is left running; only this test's jobs are cancelled.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from curation.cli import main

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
ENV_SETUP = (f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH PYTHONPATH={shlex.quote(str(REPO))} "
             "PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1")
CURATE = ["curate:rebalance.mode=none", "curate:knn.chunk_size=6", "curate:knn.batch_size=4", "curate:dedup.index=flat"]


def _states(job_id: str) -> list[str]:
    r = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    return re.findall(r"\bJobState=(\S+)", r.stdout)


def _wait(ids: list[str], logs: Path, timeout: float) -> None:
    def tail():
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*.out")))

    deadline = time.time() + timeout
    while time.time() < deadline:
        states = {i: _states(i) for i in ids}
        failed = {i: s for i, s in states.items() if set(s) & (TERMINAL - {"COMPLETED"})}
        assert not failed, f"jobs failed: {failed}\n{tail()}"
        if all(s and set(s) == {"COMPLETED"} for s in states.values()):
            return
        time.sleep(2)
    raise AssertionError(f"jobs not done after {timeout}s: { {i: _states(i) for i in ids} }\n{tail()}")


def test_sharded_chain_on_slurm_matches_one_process(slurm, pool_dir, tmp_path):
    root, _ = pool_dir
    run = tmp_path / "chain"
    r = subprocess.run(
        [sys.executable, "-m", "dinopipe.app.cli", "slurm", "submit", "--config", "configs/slurm/quickstart.yaml",
         f"--env={ENV_SETUP}", "--time=00:20:00", "slurm.cpus_per_task=1", "stages=[curate]",
         f"output_dir={run}", f"input_paths=[{root}]", "curate.search_tasks=3", *CURATE],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ids = dict(re.findall(r"^(\w+): (\d+)$", r.stdout, flags=re.M))
    slurm.extend(ids.values())
    assert list(ids) == ["curate_embed", "curate_index", "curate_search", "curate_finish"], r.stdout
    _wait(list(ids.values()), run / "logs", timeout=900)
    assert len(_states(ids["curate_search"])) == 3  # three array tasks searched
    curated = run / "curated"
    chunks = sorted((curated / "knn" / "pool" / "chunks").glob("chunk-*.npz"))
    assert len(chunks) >= 5

    # one process, same embeddings: the kNN is built and searched in-process as task 0 of 1
    one = tmp_path / "one"
    one.mkdir()
    for item in ("embeddings", "descriptor.npz"):
        (shutil.copytree if (curated / item).is_dir() else shutil.copy)(curated / item, one / item)
    args = ["--config", str(REPO / "configs/curation/quickstart.yaml"), f"input.paths=[{root}]",
            f"output.dir={one}", "progress=false", *(c.split(":", 1)[1] for c in CURATE)]
    for step in ("dedup", "decontaminate", "rebalance", "write"):
        assert main([step, *args]) == 0, step
    assert (one / "decisions.tsv").read_text() == (curated / "decisions.tsv").read_text()
