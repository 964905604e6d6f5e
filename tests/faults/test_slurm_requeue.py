"""The curation Slurm scripts requeue their job on exit 75 (unfinished) and 124 (preempted), on the repository's
local Slurm (slurm/local_cluster.sh; skipped where none can start, DINOPIPE_REQUIRE_SLURM=1 makes that a failure).

slurm/curate.sbatch embeds a pool as 2 local tasks; in the job's first run, task 1 SIGKILLs itself (the kill_task
debug hook, set by CURATE_SETUP only while SLURM_RESTART_COUNT is 0), `curate embed` exits 75, the script requeues
the job, and the second run finishes the embedding: the job completes after one restart."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dinopipe.utils import debug_hooks
from tests.curation.conftest import copied, photos, pool_dir, slurm  # noqa: F401 -- the fixtures used here
from tests.curation.test_sharded_slurm import _states

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def test_a_curation_job_that_exits_75_is_requeued_and_finishes(slurm, pool_dir, tmp_path):  # noqa: F811
    out, log = tmp_path / "out", tmp_path / "embed.out"
    hook = debug_hooks.env(kill_task="embed/embed_task:1")[debug_hooks.ENV]
    setup = (f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH PYTHONPATH={shlex.quote(str(REPO))} "
             f"OMP_NUM_THREADS=1; if [ \"${{SLURM_RESTART_COUNT:-0}}\" = 0 ]; then "
             f"export {debug_hooks.ENV}={shlex.quote(hook)}; fi")
    env = dict(os.environ, CURATE_SETUP=setup, CURATE_CMD=f"{sys.executable} -m curation.cli",
               CURATE_WORKDIR=str(REPO))  # sbatch exports the submitting environment (--export=ALL)
    env.pop(debug_hooks.ENV, None)
    r = subprocess.run(["sbatch", "--parsable", "--array=0-0", "--cpus-per-task=1", "--time=00:15:00",
                        f"--output={log}", str(REPO / "slurm" / "curate.sbatch"), "--config",
                        str(REPO / "configs" / "curation" / "quickstart.yaml"), f"input.paths=[{pool_dir[0]}]",
                        f"output.dir={out}", "progress=false", "embed.num_workers=0", "tasks.count=2"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    slurm.append(job)
    deadline = time.time() + 600
    while not (set(_states(job)) & TERMINAL) or "PENDING" in _states(job):
        assert time.time() < deadline, f"job {job}: {_states(job)}\n{_text(log)[-3000:]}"
        time.sleep(2)
    text = _text(log)
    assert _states(job) == ["COMPLETED"], text[-3000:]
    assert "SIGKILLs itself" in text and "curate embed: unfinished: task 1 of 2 of step embed (embed_task)" in text
    assert re.search(r"curate: exit 75 \(unfinished\): requeueing job \d+ \(restart 1 of at most 3\)", text), text
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert re.search(r"\bRestarts=1\b", shown), shown
    markers = sorted((out / "embeddings" / "descriptor").glob("task-*-of-00002.json"))
    assert len(markers) == 2, markers  # both embedding tasks finished, the killed one in the second run
    assert sum(json.loads(m.read_text())["images"] for m in markers) == len(list(pool_dir[0].rglob("*.jpg")))
    assert (out / "embeddings" / "descriptor" / "table" / "meta.json").exists()  # and the path table after them


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
