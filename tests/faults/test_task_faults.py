"""The curation-task rows of the fault table (tests/faults/rows_tasks.py): `curate run` with 2 tasks, a task
SIGKILLed (the ``kill_task`` debug hook: the task kills itself at a chosen point, as the OOM killer would) at a
point of every step -- embed, the path table, hash dedup, index add, kNN search, verification, decontamination,
the k-means tree, the rebalance sampling, write and report.

Each row's run must exit 75 within the row's bound after the kill (the subprocess timeout bounds the whole run, so
a hang fails too), with one line naming the step and the task, and leave no manifest before write has finished.
The rows run one after another on one output folder, each run resuming what the last one left (so every step's
rerun after a kill is exercised without paying for a whole pipeline per row); the last run, undisturbed, must give
decisions.tsv and manifest.json byte for byte equal to an undisturbed run's in a fresh folder (computed once).
The srun rows do the same under the srun launcher on the repository's local Slurm (skipped where none can start).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dinopipe.utils import debug_hooks
from tests._photos import encode, make_copy
from tests.curation.conftest import copied, photos, pool_dir, slurm  # noqa: F401 -- the fixtures used here
from tests.faults.rows_tasks import LOCAL, SRUN

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "curation" / "quickstart.yaml")
TIMEOUT_S = 900  # a run that hangs fails here (the rows' own bound is checked from the kill's time stamp)
OUTPUTS = ("decisions.tsv", "manifest.json")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(pool_dir, photos, tmp_path_factory):  # noqa: F811 -- fixtures imported above
    """pool_dir's photos and planted copies plus the halves of every photo (over 78 hash survivors, so the pool
    index is an IVF filled by add tasks), and an eval set of copies of 3 pool photos (decontamination finds them)."""
    root = tmp_path_factory.mktemp("task_faults")
    shutil.copytree(pool_dir[0], root / "pool")
    (root / "pool" / "halves").mkdir()
    names = sorted(photos)
    for name in names:
        arr = photos[name]
        h = arr.shape[0]
        for i, part in enumerate((arr[: h // 2], arr[h // 2:])):
            (root / "pool" / "halves" / f"{name}-{i}.jpg").write_bytes(encode(np.ascontiguousarray(part)))
    (root / "eval").mkdir()
    for name in names[1:12:4]:
        (root / "eval" / f"{name}.jpg").write_bytes(encode(make_copy(photos[name], "resize")))
    return root


def _args(pool: Path, out: Path, launcher: str = "local") -> list[str]:
    return ["run", "--config", QUICKSTART, f"input.paths=[{pool / 'pool'}]", f"input.eval_paths=[{pool / 'eval'}]",
            f"output.dir={out}", "progress=false", "embed.num_workers=0", "tasks.count=2",
            f"tasks.launcher={launcher}", "dedup.index=ivf", "knn.nlist=2", "dedup.nprobe=2"]


def _env(**hooks) -> dict:
    env = {k: v for k, v in os.environ.items() if k != debug_hooks.ENV}
    return dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **debug_hooks.env(curate_block=8, **hooks))


def _curate(args: list[str], env: dict) -> tuple[int, str, float]:
    r = subprocess.run([sys.executable, "-m", "curation.cli", *args], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    return r.returncode, r.stderr, time.time()


@pytest.fixture(scope="module")
def undisturbed(pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("undisturbed") / "out"
    rc, err, _ = _curate(_args(pool, out), _env())
    assert rc == 0, err[-3000:]
    return {name: (out / name).read_bytes() for name in OUTPUTS}


def _killed_at(err: str) -> float:
    m = re.search(r"^test hook: task \d+ of \w+ SIGKILLs itself at its \w+, time ([\d.]+)$", err, flags=re.M)
    assert m, f"the hook did not fire (no task reached the point):\n{err[-3000:]}"
    return float(m.group(1))


def check_row(point, rc: int, err: str, ended: float, out: Path) -> None:
    """A row's end: 75 within 30 s of the kill, one line naming the step and the task, no manifest before write."""
    assert rc == 75, f"exit {rc}, not 75:\n{err[-3000:]}"
    assert ended - _killed_at(err) <= 30, "not within 30 s of the kill"
    lines = [ln for ln in err.splitlines() if ln.startswith("curate run: unfinished:")]
    assert len(lines) == 1, err[-3000:]
    assert f"task {point.task} of 2 of step {point.step} ({point.fn})" in lines[0], lines[0]
    assert lines[0].endswith("rerun the same command"), lines[0]
    assert "Traceback" not in err, err[-3000:]
    if point.step not in ("write", "report"):
        assert not (out / "manifest.json").exists()


@pytest.fixture(scope="module")
def local_chain(pool, tmp_path_factory):
    """One folder, the local rows' kills in order; yields {point: (rc, stderr, end time)} as the rows run."""
    return {"out": tmp_path_factory.mktemp("local_chain") / "out", "runs": {}}


@pytest.mark.parametrize("point", LOCAL, ids=lambda p: p.row("local", True).id())
def test_a_killed_local_task_ends_the_run_with_75(point, pool, local_chain):
    out = local_chain["out"]
    rc, err, ended = _curate(_args(pool, out), _env(kill_task=point.hook()))
    local_chain["runs"][point] = rc
    check_row(point, rc, err, ended, out)


def test_the_local_reruns_end_equal_to_the_undisturbed_run(pool, local_chain, undisturbed):
    """After every local row's kill, the same command undisturbed: the same decisions and manifest, byte for byte."""
    assert set(local_chain["runs"]) == set(LOCAL), "run the rows first (the whole module)"
    out = local_chain["out"]
    rc, err, _ = _curate(_args(pool, out), _env())
    assert rc == 0, err[-3000:]
    for name in OUTPUTS:
        assert (out / name).read_bytes() == undisturbed[name], name


# ----------------------------------------------------------------------------------------------- srun on Slurm
def _sbatch_curate(pool: Path, out: Path, logs: Path, hooks: dict) -> tuple[int, str, float]:
    """`curate run tasks.launcher=srun` as the single process of an sbatch job of 2 tasks (sbatch --wait);
    (curate's exit code, its stderr, the time it ended), from the job's log."""
    env = _env(**hooks)
    setup = " ".join(f"{k}={shlex.quote(env[k])}" for k in ("PYTHONPATH", "OMP_NUM_THREADS", debug_hooks.ENV))
    cmd = shlex.join([sys.executable, "-m", "curation.cli", *_args(pool, out, "srun")])
    log = logs / f"job-{len(list(logs.iterdir()))}.out"
    script = (f"export {setup} CURATE_SRUN='srun --overcommit'; {cmd}; rc=$?; "
              f"echo \"curate-exit rc=$rc time=$(date +%s.%N)\" >&2; exit 0")
    r = subprocess.run(["sbatch", "--wait", "--parsable", "--overcommit", "--ntasks=2", "--cpus-per-task=1",
                        "--time=00:20:00", f"--output={log}", f"--chdir={REPO}", "--wrap", script],
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    text = log.read_text() if log.exists() else ""
    assert r.returncode == 0, f"sbatch: {r.stderr}\n{text[-3000:]}"
    m = re.search(r"^curate-exit rc=(\d+) time=([\d.]+)$", text, flags=re.M)
    assert m, text[-3000:]
    return int(m.group(1)), text, float(m.group(2))


@pytest.fixture(scope="module")
def srun_chain(slurm, pool, tmp_path_factory):  # noqa: F811 -- fixtures imported above
    root = tmp_path_factory.mktemp("srun_chain")
    (root / "logs").mkdir()
    return {"out": root / "out", "logs": root / "logs", "runs": {}}


@pytest.mark.parametrize("point", SRUN, ids=lambda p: p.row("srun", True).id())
def test_a_killed_srun_task_ends_the_run_with_75(point, pool, srun_chain):
    rc, text, ended = _sbatch_curate(pool, srun_chain["out"], srun_chain["logs"], {"kill_task": point.hook()})
    srun_chain["runs"][point] = rc
    check_row(point, rc, text, ended, srun_chain["out"])


def test_the_srun_reruns_end_equal_to_the_undisturbed_run(pool, srun_chain, undisturbed):
    assert set(srun_chain["runs"]) == set(SRUN), "run the rows first (the whole module)"
    rc, text, _ = _sbatch_curate(pool, srun_chain["out"], srun_chain["logs"], {})
    assert rc == 0, text[-3000:]
    for name in OUTPUTS:
        assert (srun_chain["out"] / name).read_bytes() == undisturbed[name], name
