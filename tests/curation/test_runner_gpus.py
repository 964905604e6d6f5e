"""Local W > 1 tasks each see their share of the parent's GPUs (CUDA_VISIBLE_DEVICES round-robin); a fake
device list stands in for the GPUs, so this runs on any machine."""

import os

import pytest

from curation.core import runner


def _seen(task_index, num_tasks):
    return {"gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}


def test_task_gpus_round_robin():
    g = ["0", "1", "2", "3", "4", "5", "6", "7"]
    assert [runner.task_gpus(g, t, 2) for t in range(2)] == [["0", "2", "4", "6"], ["1", "3", "5", "7"]]
    assert [runner.task_gpus(g, t, 8) for t in range(8)] == [[x] for x in g]
    shares = [runner.task_gpus(g, t, 3) for t in range(3)]
    assert shares == [["0", "3", "6"], ["1", "4", "7"], ["2", "5"]]
    assert sorted(sum(shares, [])) == g  # every GPU used once
    assert [runner.task_gpus(["a", "b"], t, 5) for t in range(5)] == [["a"], ["b"], ["a"], ["b"], ["a"]]
    assert runner.task_gpus([], 0, 4) == []


def test_visible_gpus_from_env(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,GPU-abc")
    assert runner.visible_gpus() == ["3", "5", "GPU-abc"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert runner.visible_gpus() == []


@pytest.mark.parametrize("tasks,expect", [(2, ["0,2", "1,3"]), (4, ["0", "1", "2", "3"]),
                                          (6, ["0", "1", "2", "3", "0", "1"])])
def test_local_tasks_get_their_share(monkeypatch, tasks, expect):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # the parent's (fake) devices
    res = runner.run_step(_seen, tasks, processes=2)
    assert [r["result"]["gpus"] for r in sorted(res, key=lambda r: r["task"])] == expect
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # the parent's own list is untouched


def test_no_gpus_is_a_no_op(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    res = runner.run_step(_seen, 2, processes=2)
    assert [r["result"]["gpus"] for r in res] == ["", ""]  # inherited as is, nothing set
    res = runner.run_step(_seen, 2, processes=0)  # inline: this process's environment is not changed
    assert [r["result"]["gpus"] for r in res] == ["", ""]
