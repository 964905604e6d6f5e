"""The local launcher's supervision (curation/core/supervise.py): results in task order, a task's exception raised
with its traceback, and a task that dies -- here SIGKILLed by the ``kill_task`` debug hook, as by the OOM killer --
ends the call with UnfinishedError naming the step and the task while the other tasks are stopped, never a hang
(each case runs in a subprocess under a timeout, so a hang fails). And where a missing file is 75 and where 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from curation.pipeline import StepError, missing_file
from curation.core import runner
from dinopipe.utils import debug_hooks
from dinopipe.utils.exits import UnfinishedError
from tests.faults._tasks import record

REPO = Path(__file__).resolve().parents[2]


def _call(code: str, hooks: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != debug_hooks.ENV}
    env.update(PYTHONPATH=str(REPO), **(hooks or {}))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_results_come_back_in_task_order_processes_at_a_time(tmp_path):
    res = runner.run_step(record, 3, processes=2, folder=str(tmp_path))
    assert [r["result"]["t"] for r in res] == [0, 1, 2] and [r["task"] for r in res] == [0, 1, 2]
    assert len({r["result"]["pid"] for r in res} | {os.getpid()}) == 4  # a fresh process per task
    assert sorted(os.listdir(tmp_path)) == [f"rec-0000{t}-of-00003.npz" for t in range(3)]


def test_a_task_that_raised_raises_here_with_its_traceback(tmp_path):
    with pytest.raises(KeyError, match="task 1 was told to fail") as exc:
        runner.run_step(record, 3, folder=str(tmp_path), fail=1)
    assert "record" in str(exc.value.__cause__)  # the task's traceback, as multiprocessing.Pool gave it


def test_a_killed_task_ends_the_call_at_once_and_stops_the_others(tmp_path):
    """Task 1 is SIGKILLed at its start while task 0 would run for an hour: the call ends with UnfinishedError
    naming the step and the task (within the subprocess timeout: task 0 was stopped, nobody waits on task 1)."""
    code = (f"from curation.core import runner; from curation.core import supervise\n"
            f"from tests.faults._tasks import record\n"
            f"with supervise.step_named('dedup'):\n"
            f"    runner.run_step(record, 2, folder={str(tmp_path)!r}, block=0)\n")
    r = _call(code, debug_hooks.env(kill_task="dedup/record:1"))
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == ("curation.core.supervise.TaskDied: task 1 of 2 of step dedup (record) was killed by signal 9 "
                    "(SIGKILL, e.g. the OOM killer)"), r.stderr[-2000:]
    assert not os.listdir(tmp_path) if tmp_path.exists() else True  # neither task wrote a part


def test_a_task_killed_after_writing_its_part_keeps_the_part(tmp_path):
    code = (f"from curation.core import runner\n"
            f"from tests.faults._tasks import record\n"
            f"runner.run_step(record, 2, processes=1, folder={str(tmp_path)!r})\n")
    r = _call(code, debug_hooks.env(kill_task="record:0:end"))
    assert "task 0 of 2 of step record was killed by signal 9" in r.stderr, r.stderr[-2000:]
    assert os.listdir(tmp_path) == ["rec-00000-of-00002.npz"]  # written before the kill; task 1 never started


def test_the_hook_picks_its_call_and_step():
    from curation.core import supervise

    os.environ[debug_hooks.ENV] = "kill_task=dedup/fn#2:1:end"
    try:
        with supervise.step_named("dedup"):
            assert supervise.dies_at("fn", 2) == {} and supervise.dies_at("other", 2) == {}
            assert supervise.dies_at("fn", 2) == {1: "end"}  # the second call of fn in dedup
            assert supervise.dies_at("fn", 2) == {}
        with supervise.step_named("write"):
            assert supervise.dies_at("fn", 2) == {}
    finally:
        del os.environ[debug_hooks.ENV]


def test_a_missing_file_of_the_output_folder_is_unfinished_any_other_is_the_users(tmp_path):
    out = tmp_path / "out"
    inside = FileNotFoundError(2, "No such file or directory", str(out / "steps" / "verify" / "cand-part.npz"))
    assert isinstance(missing_file("dedup", inside, str(out)), UnfinishedError)
    outside = FileNotFoundError(2, "No such file or directory", str(tmp_path / "pool" / "a.jpg"))
    assert isinstance(missing_file("dedup", outside, str(out)), StepError)
    told = FileNotFoundError(f"{out}/steps/dedup is missing: run the 'dedup' step first")  # no file name: a message
    assert isinstance(missing_file("write", told, str(out)), StepError)
    sibling = FileNotFoundError(2, "No such file or directory", str(tmp_path / "out2" / "x.npy"))  # not a prefix match
    assert isinstance(missing_file("write", sibling, str(out)), StepError)
