"""Preemption as Slurm delivers it: SIGTERM / SIGUSR1 to every process of the job step, DataLoader workers
included, in the middle of a step or during a checkpoint save, on one process and on 2 gloo ranks. Every
rank saves and exits 124, and the reruns end with exactly the uninterrupted run's metrics.

The signals come from the debug hook ``signal`` (dinopipe/utils/debug_hooks.py, dinopipe/train/signals.py): the process signals
its own process group at an exact point, as ``scancel --signal`` would, so nothing here polls or races.
"""

import re
import signal
import subprocess
from pathlib import Path

import pytest

import dinopipe
from dinopipe.utils import debug_hooks
from tests.train.conftest import env, launch_ranks, losses, metrics, pretrain_cmd

pytestmark = pytest.mark.slow

# Two resolution phases (steps 0-5 at 56 px, 6-11 at 84 px) with 2 data workers; checkpoints at 4, 6, 8, 12.
PHASES = ("phases=[{name: low, fraction: 0.5, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: 4},"
          " {name: high, fraction: 0.5, global_crops_size: 84, local_crops_size: 28, batch_size_per_gpu: 2}]")
ONE = ("train.epochs=3", "train.checkpoint_every=4", "data.num_workers=2", PHASES)
TWO = ("train.epochs=2", "train.checkpoint_every=4", "data.num_workers=2")


def group_alive(pgid: int) -> list[int]:
    """Live processes (not zombies) still in a process group (a rank's data workers share its group)."""
    alive = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    alive.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return alive


def run_one(run, pool, spec=None):
    """One process, leading its own process group (as an srun task does); returns (exit code, stdout)."""
    e = dict(env(), **(debug_hooks.env(signal=spec) if spec else {}))
    p = subprocess.Popen(pretrain_cmd(run, pool, *ONE), env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    out, err = p.communicate(timeout=600)
    if p.returncode != -signal.SIGKILL:  # (SIGKILL'd ones are the kernel's to reap, eventually)
        assert not group_alive(p.pid), "data workers outlived their main process"
        assert workers_survived(out, 1 if spec else 0), (out + err)[-3000:]
    return p.returncode, out + err


def workers_survived(out, hooks):
    """Each signalled rank's hook reports how many other processes of its group (its 2 data workers) died."""
    found = re.findall(r"(\d+) of its (\d+) other processes died", out)
    return len(found) == hooks and all(dead == "0" and int(n) >= 2 for dead, n in found)


def latest(run):
    return (Path(run) / "checkpoints" / "latest").read_text().strip()


def assert_same_trajectory(ref, run, steps):
    rows = [r["step"] for r in metrics(run)]
    assert rows == list(range(steps)), rows  # every step exactly once: nothing lost, nothing redone
    a, b = losses(ref), losses(run)
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step


@pytest.fixture(scope="module")
def reference(tmp_path_factory, photo_pool):
    run = tmp_path_factory.mktemp("ref1")
    rc, out = run_one(run, photo_pool)
    assert rc == 0, out[-3000:]
    return run


def test_signals_to_the_process_group_with_workers_always_save(tmp_path, photo_pool, reference):
    run = tmp_path / "run"
    # SIGTERM mid-step: the step finishes, every process of the group survives it, step 2 is saved.
    rc, out = run_one(run, photo_pool, "step:1:TERM")
    assert rc == 124 and "preempted (signal 15): checkpoint saved at step 2" in out, out[-3000:]
    assert latest(run) == "step_00000002"
    # SIGUSR1 in the first step of the 84 px phase, whose loader's workers were just forked.
    rc, out = run_one(run, photo_pool, "step:6:USR1")
    assert rc == 124 and "resuming from checkpoint at step 2" in out, out[-3000:]
    assert "preempted (signal 10): checkpoint saved at step 7" in out and latest(run) == "step_00000007"
    # SIGTERM while the periodic checkpoint of step 8 is being written: that save completes, the run stops.
    rc, out = run_one(run, photo_pool, "save:8:TERM")
    assert rc == 124 and "checkpoint saved at step 8" in out and latest(run) == "step_00000008", out[-3000:]
    # SIGKILL (no chance to save) at step 9: the rerun falls back to the last complete checkpoint.
    rc, out = run_one(run, photo_pool, "step:9:KILL")
    assert rc == -signal.SIGKILL and latest(run) == "step_00000008"
    rc, out = run_one(run, photo_pool)
    assert rc == 0 and "resuming from checkpoint at step 8" in out, out[-3000:]
    assert_same_trajectory(reference, run, 12)
    assert dinopipe.load(run).embed_dim == 64


@pytest.mark.dist
def test_two_ranks_preempted_and_resumed_from_rank_0s_checkpoint(tmp_path, photo_pool):
    """2 gloo ranks, each leading its own process group with 2 data workers (as srun starts them)."""
    def go(run, **extra):
        res = launch_ranks(pretrain_cmd(run, photo_pool, *TWO), 2, extra)
        return [r[0] for r in res], "".join(r[1] + r[2] for r in res)

    ref = tmp_path / "ref"
    codes, out = go(ref)
    assert codes == [0, 0], out[-3000:]
    run = tmp_path / "run"
    # Every rank's group gets SIGTERM mid-step 2.
    codes, out = go(run, **debug_hooks.env(signal="step:2:TERM"))
    assert codes == [124, 124] and latest(run) == "step_00000003" and workers_survived(out, 2), out[-3000:]
    # Only rank 1's group gets SIGUSR1, during the save of step 4; meanwhile rank 1 cannot see `latest` (a
    # stale view of a shared filesystem): it must still resume from rank 0's choice, step 3, not start fresh.
    codes, out = go(run, **debug_hooks.env(signal="save:4:USR1@1", stale_latest=1))
    assert codes == [124, 124] and "resuming from checkpoint at step 3" in out, out[-3000:]
    assert workers_survived(out, 1), out[-3000:]
    assert latest(run) == "step_00000004"
    codes, out = go(run, **debug_hooks.env(stale_latest=1))
    assert codes == [0, 0] and "resuming from checkpoint at step 4" in out, out[-3000:]
    assert_same_trajectory(ref, run, 8)


def test_slurm_tasks_without_srun_fail_fast(tmp_path, photo_pool):
    """`dinopipe pretrain` typed into an `sbatch --ntasks=4` script: one line and exit 2, not a 30-min wait."""
    e = {k: v for k, v in env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and
         not k.startswith("SLURM_")}
    e.update(SLURM_JOB_ID="4242", SLURM_NTASKS="4", SLURM_NPROCS="4", SLURM_PROCID="0", SLURM_LOCALID="0",
             SLURM_JOB_NODELIST="localhost")
    r = subprocess.run(pretrain_cmd(tmp_path / "run", photo_pool), env=e, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "SLURM_NTASKS=4" in err[0] and "srun" in err[0], r.stderr[-2000:]
