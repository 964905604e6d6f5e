"""`curate run` with tasks.launcher=srun on a real Slurm (the single-node cluster of slurm/local_cluster.sh):
one batch job allocated 3 tasks, whose single process runs every sharded step as an `srun --ntasks=3` job
step; its decisions.tsv equals a local `curate run tasks.count=1`'s, and every runner call really ran in
three srun tasks (the job log's per-call line: SLURM_PROCIDs 0,1,2, three pids).

The cluster here has 2 cores, so the job overcommits (sbatch -O; CURATE_SRUN="srun --overcommit": the
override sites use for their own srun flags). Skipped with the reason when no Slurm runs or can be started
here (DINOPIPE_REQUIRE_SLURM=1 makes that a failure), as tests/curation/test_sharded_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dinopipe.utils import debug_hooks
from tests.curation.test_sharded_slurm import ENV_SETUP, _wait

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "curation" / "quickstart.yaml")
HOOK = debug_hooks.env(curate_block=8)  # blocks of 8 rows: the small pool splits over the 3 tasks


def _args(root, out, *extra):
    return ["--config", QUICKSTART, f"input.paths=[{root}]", f"output.dir={out}", "progress=false",
            "dedup.index=flat", *extra]


def test_curate_run_with_the_srun_launcher_matches_one_task(slurm, pool_dir, tmp_path):
    root, _ = pool_dir
    one, multi, logs = tmp_path / "one", tmp_path / "srun", tmp_path / "logs"
    logs.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **HOOK)
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "curation.cli", "run",
                                             *_args(root, multi, "tasks.launcher=srun", "tasks.count=3")])
    script = f"{ENV_SETUP} {' '.join(f'{k}={shlex.quote(v)}' for k, v in HOOK.items())}; " \
             f"export CURATE_SRUN='srun --overcommit'; {cmd}"
    r = subprocess.run(["sbatch", "--parsable", "--overcommit", "--ntasks=3", "--cpus-per-task=1",
                        "--time=00:20:00", f"--output={logs}/%x-%j.out", "--job-name=curate-srun",
                        f"--chdir={REPO}", "--wrap", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    slurm.append(job)

    # meanwhile, the reference: one task, this machine
    ref = subprocess.run([sys.executable, "-m", "curation.cli", "run", *_args(root, one, "tasks.count=1")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert ref.returncode == 0, ref.stderr[-3000:]

    _wait([job], logs, timeout=900)
    log = next(logs.glob("curate-srun-*.out")).read_text()
    assert (multi / "decisions.tsv").read_text() == (one / "decisions.tsv").read_text()

    calls = re.findall(r"^\[srun\] (\w+): (\d+) tasks on \S+: procids ([\d,]+), pids (\d+(?:,\d+)*)", log, flags=re.M)
    names = {c[0] for c in calls}
    # the path table's tasks as srun tasks too, each output slice placed by its owner (curation.core.table_owned)
    for want in ("run_task", "rank_task", "place_task", "copy_task",
                 "pairs_task", "verify_pairs_task", "verify_candidates_task", "search_task", "tree_task", "hist_task",
                 "select_task",
                 "_write_shards_task", "_decisions_part_task", "report_figures_task"):
        # hash dedup, verification, kNN, k-means tree, sampling, shards, decisions
        assert want in names, (want, sorted(names), log[-3000:])
    for name, w, procids, pids in calls:  # three srun tasks each: SLURM_PROCID 0..2, three processes
        if name in ("index_train", "index_merge", "report_figures_task"):  # one task by design: a one-task srun step
            assert (w, procids) == ("1", "0"), (name, w, procids)
            continue
        assert w == "3" and procids == "0,1,2" and len(set(pids.split(","))) == 3, (name, procids, pids)

    steps = multi / "steps"
    dedup = json.loads((steps / "dedup.json").read_text())
    rebalance = json.loads((steps / "rebalance.json").read_text())
    assert dedup["tasks"]["hash"] == 3 and dedup["tasks"]["knn"] == 3, dedup["tasks"]
    assert len(rebalance["kmeans_tasks"]) == 3, rebalance.keys()
    assert json.loads((multi / "manifest.json").read_text())["tasks"]["write"] == 3
    assert not list((steps / "srun").iterdir())  # every call's spec and reports removed once collected


def test_curate_simulate_with_the_srun_launcher_matches_one_local_task(slurm, tmp_path):
    """`curate simulate` takes `curate run`'s launchers: tasks.launcher=srun generates the pool and runs every
    step of the default chain (write and report included) as srun tasks; the same decisions as W=1 here."""
    work, logs = tmp_path / "srun", tmp_path / "logs"
    logs.mkdir()
    hook = debug_hooks.env(curate_block=1024)  # 3 blocks of the 3000 rows: one per task
    args = ["--n", "3000", "--dim", "16", "--clusters", "8", "--eval", "60", "--overlap", "12", "--tasks", "3",
            "--work", str(work), "tasks.launcher=srun", "progress=false", "dedup.index=flat"]
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "curation.cli", "simulate", *args])
    script = f"{ENV_SETUP} {' '.join(f'{k}={shlex.quote(v)}' for k, v in hook.items())}; " \
             f"export CURATE_SRUN='srun --overcommit'; {cmd}"
    r = subprocess.run(["sbatch", "--parsable", "--overcommit", "--ntasks=3", "--cpus-per-task=1",
                        "--time=00:20:00", f"--output={logs}/%x-%j.out", "--job-name=simulate-srun",
                        f"--chdir={REPO}", "--wrap", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    slurm.append(r.stdout.strip().split(";")[0])
    code = ("import sys; from curation.core import runner; runner.BLOCK = 1024; "
            "from curation.simulate.run import simulate; "
            "r = simulate(sys.argv[1], 3000, 16, tasks=1, n_clusters=8, n_eval=60, overlap=12, processes=0, "
            "overrides=['progress=false', 'dedup.index=flat']); print(r['decisions_sha256'])")
    ref = subprocess.run([sys.executable, "-c", code, str(tmp_path / "one")], cwd=REPO, capture_output=True,
                         text=True, timeout=900, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    _wait([slurm[-1]], logs, timeout=900)
    log = next(logs.glob("simulate-srun-*.out")).read_text()
    assert f"decisions.tsv sha256: {ref.stdout.split()[-1]}" in log, log[-3000:]
    names = set(re.findall(r"^\[srun\] (\w+): 3 tasks on \S+: procids 0,1,2", log, flags=re.M))
    for want in ("pool_task", "run_task", "place_task", "pairs_task", "search_task", "_write_shards_task",
                 "report_scan_task"):
        assert want in names, (want, sorted(names), log[-3000:])
    assert (work / "report" / "summary.md").is_file() and list((work / "shards").glob("shard-*.tar"))
