"""tasks.launcher=srun without Slurm: a spec file is unpickled only with its call's key (an HMAC-SHA256 of
the pickle bytes, the key only in the environment), and the runner's srun calls -- here through a small
stand-in for srun that starts the W tasks on this machine (CURATE_SRUN) -- collect each task's report, refuse
more tasks than the allocation has, and fail with the failed task's stderr. The real Slurm run:
tests/curation/test_srun_slurm.py."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import numpy as np
import pytest

from curation.core import runner, srun
from curation.core import srun_task
from dinopipe.config import InputError

ROOT = Path(__file__).resolve().parents[2]

# srun's part we use: --ntasks=W and --error=PATTERN (%t: the task), the other flags ignored; the W tasks
# start at once with SLURM_PROCID / SLURM_NTASKS set; srun returns when all have ended, 1 if any task failed.
FAKE_SRUN = r'''
import os, subprocess, sys
args, w, err = sys.argv[1:], 1, None
while args and args[0].startswith("--"):
    a = args.pop(0)
    if a.startswith("--ntasks="): w = int(a.split("=", 1)[1])
    if a.startswith("--error="): err = a.split("=", 1)[1]
procs = [subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(t), SLURM_NTASKS=str(w)),
                          stderr=open(err.replace("%t", str(t)), "w")) for t in range(w)]
sys.exit(1 if any([p.wait() for p in procs]) else 0)  # a list: every task waited for, not only up to a failed one
'''


class Marker:
    """Unpickling this creates the file ``path`` (what a hostile spec could do)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _record(t, w, folder, fail_task=-1):
    if t == fail_task:
        raise RuntimeError(f"task {t} was told to fail")
    runner.write_part(runner.part_path(folder, "rec", t, w), t=np.int64(t))
    return {"t": t, "pid": os.getpid(), "procid": os.environ.get("SLURM_PROCID")}


@pytest.fixture
def task_env(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.delenv(srun.KEY_ENV, raising=False)
    return monkeypatch


def test_a_spec_without_its_key_is_refused_before_unpickling(tmp_path, task_env, capsys):
    key, marker = secrets.token_bytes(32), tmp_path / "marker"
    spec = str(tmp_path / "spec.pkl")
    srun.dump_signed({"fn": Marker(marker), "num_tasks": 1, "kw": {}}, spec, key)
    assert srun_task.main([spec]) == 2  # no key in the environment
    task_env.setenv(srun.KEY_ENV, secrets.token_bytes(32).hex())  # another call's key
    assert srun_task.main([spec]) == 2
    task_env.setenv(srun.KEY_ENV, key.hex())  # the right key, but the pickle changed after signing
    with open(spec, "ab") as f:
        f.write(b".")
    assert srun_task.main([spec]) == 2
    os.remove(spec + ".hmac")  # the right key, no HMAC beside the spec
    task_env.setenv(srun.KEY_ENV, key.hex())
    assert srun_task.main([spec]) == 2
    err = capsys.readouterr().err
    assert err.count("srun_task: refused") == 4 and "does not match" in err and "no key" in err
    assert not marker.exists()  # nothing was unpickled
    with pytest.raises(srun.Refused):
        srun.load_signed(spec, None)


def test_a_spec_with_its_key_runs_and_reports_signed(tmp_path, task_env):
    key = secrets.token_bytes(32)
    spec = str(tmp_path / "spec.pkl")
    srun.dump_signed({"fn": _record, "num_tasks": 1, "kw": {"folder": str(tmp_path)}}, spec, key)
    task_env.setenv(srun.KEY_ENV, key.hex())
    assert srun_task.main([spec]) == 0
    assert srun.KEY_ENV not in os.environ  # not handed on to what the task starts
    rep = srun.load_signed(srun.report_path(str(tmp_path), 0), key)
    assert rep["result"]["t"] == 0 and rep["procid"] == 0 and rep["wall_s"] >= 0 and rep["peak_rss"] > 0
    assert os.path.exists(runner.part_path(str(tmp_path), "rec", 0, 1))
    with pytest.raises(srun.Refused):  # the report is checked like the spec
        srun.load_signed(srun.report_path(str(tmp_path), 0), secrets.token_bytes(32))


@pytest.fixture
def fake_srun(tmp_path, monkeypatch):
    script = tmp_path / "fake_srun.py"
    script.write_text(FAKE_SRUN)
    monkeypatch.setenv("CURATE_SRUN", f"{sys.executable} {script}")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.chdir(ROOT)
    return tmp_path


def test_srun_calls_run_w_tasks_and_collect_their_reports(fake_srun):
    folder, spool = fake_srun / "parts", fake_srun / "spool"
    with srun.spool(str(spool)):
        with pytest.raises(InputError, match="SLURM_NTASKS=3"):  # more tasks than the allocation: before starting
            runner.run_step(_record, 4, launcher="srun", folder=str(folder))
        assert not spool.exists() and not folder.exists()
        res = runner.run_step(_record, 3, launcher="srun", folder=str(folder))
    assert [r["task"] for r in res] == [0, 1, 2] and [r["procid"] for r in res] == [0, 1, 2]
    assert len({r["pid"] for r in res} | {os.getpid()}) == 4  # three task processes, none of them this one
    assert sorted(os.listdir(folder)) == [f"rec-0000{t}-of-00003.npz" for t in range(3)]
    assert os.listdir(spool) == []  # a finished call's spec and reports are removed


def test_one_task_runs_as_an_srun_step_only_when_asked_to(fake_srun):
    """run_step(fn, 1, launcher="srun") runs in this process (nothing to spread); launch_one's arguments (the
    IVF training, curation.knn.shards) make it an srun step of one task, whose memory is not this process's."""
    folder = fake_srun / "parts"
    with srun.spool(str(fake_srun / "spool")), runner.recording() as rec:
        here = runner.run_step(_record, 1, launcher="srun", folder=str(folder))
        there = runner.run_step(_record, 1, **runner.launch_one("srun"), folder=str(folder / "one"))
    assert here[0]["result"]["pid"] == os.getpid()
    assert there[0]["result"]["pid"] != os.getpid() and there[0]["result"]["procid"] == "0"
    assert [r["inline"] for r in rec] == [True, False]
    assert runner.launch_one("local") == {"launcher": "local", "processes": None}


def test_a_failed_srun_task_raises_its_exception_and_a_killed_one_is_unfinished(fake_srun, monkeypatch, capsys):
    """A task that raised: its exception, raised here with the task's traceback (as the local launcher does). A task
    that left no report (SIGKILLed, as by the OOM killer: the kill_task debug hook): UnfinishedError (exit 75)
    naming the task; the finished tasks' parts are kept for the rerun."""
    from dinopipe.utils import debug_hooks
    from dinopipe.utils.exits import UnfinishedError

    folder = fake_srun / "parts"
    with srun.spool(str(fake_srun / "spool")), pytest.raises(RuntimeError) as exc:
        runner.run_step(_record, 3, launcher="srun", folder=str(folder), fail_task=1)
    assert str(exc.value) == "task 1 was told to fail" and "_record" in str(exc.value.__cause__)
    assert sorted(os.listdir(folder)) == ["rec-00000-of-00003.npz", "rec-00002-of-00003.npz"]  # kept for a rerun
    monkeypatch.setenv(debug_hooks.ENV, "kill_task=_record:2")
    with srun.spool(str(fake_srun / "spool")), pytest.raises(UnfinishedError) as exc:
        runner.run_step(_record, 3, launcher="srun", folder=str(fake_srun / "killed"))
    assert "task 2 of 3 of step _record ended without its report under srun" in str(exc.value)
    assert "SIGKILLs itself" in capsys.readouterr().err
    assert sorted(os.listdir(fake_srun / "killed")) == ["rec-00000-of-00003.npz", "rec-00001-of-00003.npz"]


def test_srun_outside_an_allocation_is_an_input_error(monkeypatch):
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    monkeypatch.delenv("SLURM_NPROCS", raising=False)
    with pytest.raises(InputError, match="SLURM_NTASKS is not set"):
        runner.run_step(_record, 2, launcher="srun", folder="unused")


def test_submit_curation_sh_gives_the_finishing_jobs_n_srun_tasks(tmp_path):
    import subprocess

    from tests.curation.conftest import fake_sbatch

    log, env = fake_sbatch(tmp_path)
    quick = str(ROOT / "configs" / "curation" / "quickstart.yaml")
    subprocess.run(["bash", str(ROOT / "slurm" / "submit_curation.sh"), "-n", "2", "-c", "4", "--search-tasks", "2",
                    "--finish-tasks", "6", "--logs", str(tmp_path / "logs"), "--", "--config", quick],
                   env=env, check=True, capture_output=True)
    embed, index, search, finish = log.read_text().splitlines()
    for line in (index, finish):  # the finishing jobs: 6 tasks of 4 CPUs, curate's steps as srun steps
        assert "--ntasks=6" in line and "--cpus-per-task=4" in line
        assert line.endswith("tasks.launcher=srun tasks.count=6")
    for line in (embed, search):  # the arrays are as before
        assert "--ntasks" not in line and "tasks.launcher" not in line
    log.unlink()  # default 0: one task, nothing added
    subprocess.run(["bash", str(ROOT / "slurm" / "submit_curation.sh"), "--", "--config", quick], env=env,
                   check=True, capture_output=True)
    assert "--ntasks" not in log.read_text() and "tasks.launcher" not in log.read_text()
    bad = subprocess.run(["bash", str(ROOT / "slurm" / "submit_curation.sh"), "--finish-tasks", "x", "--dry-run",
                          "--", "--config", quick], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "--finish-tasks" in bad.stderr


def test_the_srun_launcher_outside_an_allocation_exits_2_before_writing(monkeypatch, tmp_path, capsys):
    from curation.cli import main as curate

    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    monkeypatch.delenv("SLURM_NPROCS", raising=False)
    (tmp_path / "pool").mkdir()
    args = ["--config", str(ROOT / "configs" / "curation" / "quickstart.yaml"), f"input.paths=[{tmp_path / 'pool'}]",
            f"output.dir={tmp_path / 'out'}", "tasks.launcher=srun", "tasks.count=4"]
    with pytest.raises(SystemExit) as exc:
        curate(["dedup", *args])
    assert exc.value.code == 2 and "tasks.launcher" in capsys.readouterr().err and not (tmp_path / "out").exists()
    monkeypatch.setenv("SLURM_NTASKS", "3")  # an allocation of 3 tasks: 4 are refused
    with pytest.raises(SystemExit) as exc:
        curate(["run", *args])
    assert exc.value.code == 2 and "tasks.count: 4 tasks, but this Slurm job has SLURM_NTASKS=3" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_srun_command_that_does_not_exist_is_an_input_error(fake_srun, monkeypatch):
    monkeypatch.setenv("CURATE_SRUN", str(fake_srun / "no-such-srun"))
    with srun.spool(str(fake_srun / "spool")), pytest.raises(InputError, match="no-such-srun"):
        runner.run_step(_record, 3, launcher="srun", folder=str(fake_srun / "parts"))
    assert os.listdir(fake_srun / "spool") == []


def test_dinopipe_submit_gives_the_finishing_jobs_n_srun_tasks(tmp_path, capsys):
    from dinopipe.app import cli as dinopipe_cli

    assert dinopipe_cli.main(["slurm", "submit", "--config", "configs/slurm/quickstart.yaml", "--dry-run",
                              f"output_dir={tmp_path}", f"input_paths=[{tmp_path}]", "stages=[curate]",
                              "curate.search_tasks=2", "curate.finish_tasks=5"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "sbatch" in ln]
    embed, index, search, finish = lines
    for line in (index, finish):
        assert "--ntasks=5" in line and "tasks.launcher=srun" in line and "tasks.count=5" in line
    for line in (embed, search):
        assert "--ntasks" not in line and "tasks.launcher" not in line
