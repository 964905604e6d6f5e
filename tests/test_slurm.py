"""Real Slurm on this machine: slurm/local_cluster.sh installs and starts a single-node cluster (munge,
slurmctld, slurmd); the quickstart chain curate -> pretrain -> distill runs through `dinopipe slurm submit`
and its outputs load; a running pretraining job that is requeued resumes from its checkpoint.

Where Slurm cannot be started (not root, no apt-get, ...) these tests are skipped with the reason;
DINOPIPE_REQUIRE_SLURM=1 turns that into a failure (for CI machines that must run them).
"""

import getpass
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dinopipe
from dinopipe.app import cli

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "slurm" / "local_cluster.sh"
CONFIG = "configs/slurm/quickstart.yaml"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _tiny():
    """The tiny pretraining/distillation overrides of tests/train (vit_test at 56 px, 4 steps per epoch)."""
    spec = importlib.util.spec_from_file_location("_train_conftest", REPO / "tests" / "train" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [f"pretrain:{o}" for o in mod.TINY], [f"distill:{o}" for o in mod.TINY_DISTILL]


TINY_PRETRAIN, TINY_DISTILL = _tiny()
# The jobs find this interpreter's environment (and its dinopipe) whatever the submitting shell's PATH.
ENV_SETUP = (f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH PYTHONUNBUFFERED=1 "
             "OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1")
SITE = [f"--env={ENV_SETUP}", "--time=00:20:00", "slurm.cpus_per_task=1"]


@pytest.fixture(scope="session")
def slurm():
    """A running Slurm; the ids of jobs the tests submit are appended to the yielded list."""
    was_up = subprocess.run([str(CLUSTER), "status"], capture_output=True).returncode == 0
    t0 = time.time()
    r = subprocess.run([str(CLUSTER), "start"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        reason = (f"Slurm could not be started here (slurm/local_cluster.sh start exited {r.returncode}): "
                  f"{(r.stderr or r.stdout).strip()[-800:]}")
        if os.environ.get("DINOPIPE_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    print(f"\nlocal Slurm ready in {time.time() - t0:.1f}s: {r.stdout.strip()}")
    jobs: list[str] = []
    yield jobs
    if was_up:  # somebody's cluster: cancel only what the tests submitted, leave the daemons running
        if jobs:
            subprocess.run(["scancel", *jobs], capture_output=True)
    else:
        subprocess.run(["scancel", "-u", getpass.getuser()], capture_output=True)
        subprocess.run([str(CLUSTER), "stop"], capture_output=True)


@pytest.fixture(scope="session")
def pool(tmp_path_factory):
    from dinopipe.data.samples import build_sample_pool

    root = tmp_path_factory.mktemp("slurm_pool")
    build_sample_pool(root, n_images=60)  # real photos + planted copies + corrupt files, in root/pool
    return root / "pool"


def _ids(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w+): (\d+)$", stdout, flags=re.M))


def _states(job_id: str) -> list[str]:
    """JobState of a job, or of every task of an array job (scontrol: there is no accounting)."""
    r = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    return re.findall(r"\bJobState=(\S+)", r.stdout)


def _logs(run: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run / "logs").glob("*.out")))


def _wait(ids, run: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = {i: _states(i) for i in ids}
        failed = {i: s for i, s in states.items() if set(s) & (TERMINAL - {"COMPLETED"})}
        assert not failed, f"jobs failed: {failed}\n{_logs(run)}"
        if all(s and set(s) == {"COMPLETED"} for s in states.values()):
            return
        time.sleep(2)
    raise AssertionError(f"jobs not done after {timeout}s: { {i: _states(i) for i in ids} }\n{_logs(run)}")


@pytest.fixture(scope="module")
def chain(slurm, pool, tmp_path_factory):
    """Submit the quickstart chain (tiny) through the real CLI; tests wait for it where they need it."""
    run = tmp_path_factory.mktemp("slurm_chain")
    r = subprocess.run(
        [sys.executable, "-m", "dinopipe.app.cli", "slurm", "submit", "--config", CONFIG, *SITE,
         f"output_dir={run}", f"input_paths=[{pool}]", *TINY_PRETRAIN, "pretrain:train.epochs=2",
         *TINY_DISTILL, "distill:train.epochs=2"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ids = _ids(r.stdout)
    slurm.extend(ids.values())
    assert list(ids) == ["curate_embed", "curate_finish", "pretrain", "distill"], r.stdout
    return run, ids


def test_dry_run_prints_the_chain(capsys, tmp_path):
    rc = cli.main(["slurm", "submit", "--config", CONFIG, "--dry-run", "--partition", "gpu", "--account", "proj",
                   "--gpus-per-node", "8", "--nodes", "2", "--time", "12:00:00", "--env", "source env/bin/activate",
                   f"output_dir={tmp_path}", f"input_paths=[{tmp_path}]", "slurm.signal_lead=300",
                   "pretrain:train.epochs=3"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = [ln for ln in out.splitlines() if "sbatch" in ln]
    assert [ln.split("=")[0] for ln in lines] == ["curate_embed", "curate_finish", "pretrain", "distill"]
    embed, finish, pre, dis = lines
    assert "--array=0-1" in embed and "slurm/curate.sbatch" in embed and "--dependency" not in embed
    assert '"--dependency=afterok:${curate_embed}"' in finish and "slurm/curate_finish.sbatch" in finish
    assert '"--dependency=afterok:${curate_finish}"' in pre and '"--dependency=afterok:${pretrain}"' in dis
    for line in (pre, dis):
        assert "--requeue" in line and "--signal=USR1@300" in line and "--partition=gpu" in line
        assert "--account=proj" in line and "--nodes=2" in line and "--gpus-per-node=8" in line
        assert "--ntasks-per-node=8" in line and "--time=12:00:00" in line
        assert "DINOPIPE_ENV='source env/bin/activate'" in line
    assert f"data.paths=[{tmp_path}/curated/shards]" in pre and "train.epochs=3" in pre
    assert f"teacher_model.path={tmp_path}/pretrain" in dis and "train.epochs=3" not in dis
    assert "CURATE_SETUP='source env/bin/activate'" in embed and "--gpus-per-task=1" in embed
    assert not (tmp_path / "logs").exists()  # nothing submitted, nothing written
    # A typo in a stage override fails at submit time, naming the stage.
    with pytest.raises(SystemExit) as exc:
        cli.main(["slurm", "submit", "--config", CONFIG, "--dry-run", f"input_paths=[{tmp_path}]",
                  "distill:train.epochz=3"])
    assert exc.value.code == 2 and "distill stage" in capsys.readouterr().err


def test_preempted_pretrain_resumes_from_its_checkpoint(slurm, pool, chain, tmp_path, capsys):
    """Preempted twice while running with 2 data workers: USR1 to every process of the job step, workers
    included (what --signal=USR1@lead sends before the time limit; the batch script requeues the job
    itself), then `scontrol requeue` (SIGTERM to the whole job; Slurm requeues). The job waits at steps 3 and
    9 for the signal (debug hook DINOPIPE_DEBUG_HOOKS=signal=wait:N), so each lands at a known step. Each time the
    step in flight finishes, a checkpoint is saved, every step before it is kept and none is run twice."""
    run = tmp_path / "requeue"
    steps = 40  # 10 epochs x 4 steps; checkpoints only at the end and when preempted
    site = [f"--env={ENV_SETUP} DINOPIPE_DEBUG_HOOKS=signal=wait:3,wait:9", *SITE[1:]]
    rc = cli.main(["slurm", "submit", "--config", CONFIG, *site, f"output_dir={run}", "stages=[pretrain]",
                   *TINY_PRETRAIN, "pretrain:train.epochs=10", "pretrain:train.checkpoint_every=1000",
                   "pretrain:data.num_workers=2", f"pretrain:data.paths=[{pool}]"])
    assert rc == 0
    job = _ids(capsys.readouterr().out)["pretrain"]
    slurm.append(job)
    metrics = run / "pretrain" / "metrics.jsonl"

    def logged():
        return [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []

    def output():
        return "".join(p.read_text() for p in (run / "logs").glob(f"dinopipe-pretrain-{job}.out"))

    def wait_for(text, timeout=300):
        deadline = time.time() + timeout
        while text not in output():
            assert time.time() < deadline and not set(_states(job)) & TERMINAL, \
                f"waiting for {text!r}: {_states(job)}\n{output()[-3000:]}"
            time.sleep(0.5)

    def saved_at(signal_no):
        m = re.search(rf"preempted \(signal {signal_no}\): checkpoint saved at step (\d+)", output())
        return int(m.group(1)) if m else None

    wait_for("test hook: step 3 waits")
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait_for("test hook: step 9 waits")  # the job saved, requeued itself and resumed
    assert saved_at(10) == 4 and "resuming from checkpoint at step 4" in output(), output()[-3000:]
    assert f"preempted: checkpoint saved, requeueing job {job}" in output()  # the script requeued itself
    subprocess.run(["scontrol", "requeue", job], check=True)
    _wait([job], run, timeout=400)

    out = output()
    assert saved_at(15) == 10 and "resuming from checkpoint at step 10" in out, out[-3000:]
    assert "DataLoader worker" not in out and "Traceback" not in out, out[-3000:]
    assert "restart 2 on" in out  # the batch script ran three times, in the same job
    assert re.search(r"\bRestarts=2\b", subprocess.run(["scontrol", "show", "job", job], capture_output=True,
                                                        text=True).stdout)
    assert logged() == list(range(steps))  # every step exactly once: nothing lost, nothing redone
    assert (run / "pretrain" / "export" / "teacher").is_dir()


def test_tasks_without_srun_fail_fast_on_slurm(slurm, pool, tmp_path):
    """`python -m dinopipe.train.pretrain` typed straight into an `sbatch --ntasks=2` script (no srun): the job
    fails at once with a one-line error instead of waiting 30 minutes for ranks that never start."""
    script = tmp_path / "direct.sbatch"
    script.write_text(f"#!/bin/bash\n{ENV_SETUP}\nexec {shlex.join(_pretrain_args(tmp_path / 'run', pool))}\n")
    r = subprocess.run(["sbatch", "--parsable", "--ntasks=2", "--cpus-per-task=1", "--time=00:05:00",
                        f"--output={tmp_path}/direct.out", str(script)], capture_output=True, text=True, check=True)
    job = r.stdout.strip().split(";")[0]
    slurm.append(job)
    deadline = time.time() + 180
    while not set(_states(job)) & TERMINAL:
        assert time.time() < deadline, f"still {_states(job)} after 180 s: hanging?"
        time.sleep(1)
    out = (tmp_path / "direct.out").read_text()
    assert _states(job) == ["FAILED"], out[-2000:]
    assert "error: SLURM_NTASKS=2" in out and "srun" in out, out[-2000:]


def _pretrain_args(run: Path, pool: Path) -> list[str]:
    return [sys.executable, "-m", "dinopipe.train.pretrain", "--config", str(REPO / "configs/pretrain/quickstart.yaml"),
            *(o.split(":", 1)[1] for o in TINY_PRETRAIN), f"data.paths=[{pool}]", f"train.output_dir={run}"]


def test_quickstart_chain_on_slurm(chain):
    run, ids = chain
    _wait(list(ids.values()), run, timeout=600)
    assert len(_states(ids["curate_embed"])) == 2  # both array tasks ran

    manifest = json.loads((run / "curated" / "manifest.json").read_text())
    assert sorted((run / "curated" / "shards").glob("*.tar"))
    counts = manifest["counts"] if "counts" in manifest else manifest
    parts = ("kept", "hash_duplicates", "copy_duplicates", "decontaminated", "unreadable", "not_selected")
    assert counts["input"] == sum(counts[k] for k in parts) and counts["kept"] > 0

    x = torch.randn(2, 3, 56, 56)
    teacher = dinopipe.load(run / "pretrain")
    assert (run / "pretrain" / "export" / "teacher").is_dir()
    with torch.no_grad():
        assert teacher(x).shape[0] == 2
    assert sorted(json.loads(r)["step"] for r in (run / "pretrain" / "metrics.jsonl").read_text().splitlines()) \
        == list(range(8))
    cfg = (run / "distill" / "config.yaml").read_text()
    assert str(run / "pretrain") in cfg and str(run / "curated" / "shards") in cfg
    for name in ("s1", "s2"):
        student = dinopipe.load(run / "distill" / "export" / name)
        with torch.no_grad():
            assert student(x).shape[0] == 2
