"""A part is reused only when everything that made it is the same (issue 48): the verification parts' digest covers
every setting of the verifier (the objects it is built from, the sources, the row files' content), and the path
table's plan.json the launcher's layout, so an srun build killed half-way and rerun with another launcher does not
leave zeroed slices. Each test changes the setting between two runs and checks that the stale part is not reused."""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import pytest

from curation.core import pathtable
from curation.dedup.knn import same_verifier
from curation.core import srun
from curation.verify.tasks import verified_edges
from dinopipe.utils import debug_hooks
from dinopipe.utils.exits import UnfinishedError
from tests.curation.test_dedup_pair_keys import THRESHOLD
from tests.curation.test_pathtable_tasks import FILES, synthetic_parts
from tests.curation.test_srun_launcher import FAKE_SRUN
from tests.curation.test_verify_tasks import _job, rare_verdict

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Verdict:
    """A verifier object built by the caller (the `same_verifier` path: its settings are attributes)."""

    def __init__(self, keep_one_in: int):
        self.keep_one_in = keep_one_in

    def __call__(self, x, y):
        return rare_verdict(x, y, self.keep_one_in)


def verdict_from(names: list[str], rows_path: str, keep_one_in: int):
    """A factory body taking what the pixel verifier takes: the sources (a list) and a row file."""
    return functools.partial(rare_verdict, keep_one_in=keep_one_in)


def _run(out: str, factory) -> tuple[int, int]:
    """(edges, tasks that computed their part) of verified_edges inline, 2 tasks."""
    lo, _, _, _, got = verified_edges(out, 1000, THRESHOLD, os.path.join(out, "steps", "verify"), 2, "inline",
                                      factory)
    return len(lo), sum(g["result"]["computed"] for g in got)


def test_a_verifier_object_with_other_settings_verifies_again(tmp_path):
    _job(str(tmp_path), 1000)
    a, computed = _run(str(tmp_path), functools.partial(same_verifier, Verdict(3)))
    assert computed == 2
    assert _run(str(tmp_path), functools.partial(same_verifier, Verdict(3))) == (a, 0)  # the same settings: reused
    b, computed = _run(str(tmp_path), functools.partial(same_verifier, Verdict(5)))
    assert computed == 2 and b < a


def test_other_sources_or_other_rows_verify_again(tmp_path):
    _job(str(tmp_path), 1000)
    rows = tmp_path / "rows.npy"
    np.save(rows, np.arange(10))
    assert _run(str(tmp_path), functools.partial(verdict_from, ["pool-a"], str(rows), 3))[1] == 2
    assert _run(str(tmp_path), functools.partial(verdict_from, ["pool-a"], str(rows), 3))[1] == 0
    assert _run(str(tmp_path), functools.partial(verdict_from, ["pool-b"], str(rows), 3))[1] == 2  # sources
    np.save(rows, np.arange(1, 11))  # the same file name, other rows
    assert _run(str(tmp_path), functools.partial(verdict_from, ["pool-b"], str(rows), 3))[1] == 2


@pytest.fixture
def fake_srun(tmp_path, monkeypatch):
    script = tmp_path / "fake_srun.py"
    script.write_text(FAKE_SRUN)
    monkeypatch.setenv("CURATE_SRUN", f"{sys.executable} {script}")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("PYTHONPATH", REPO)
    monkeypatch.chdir(REPO)
    return tmp_path


def test_a_table_build_killed_under_srun_and_rerun_locally_is_whole(fake_srun, monkeypatch):
    """Under srun (W > 1) the rank tasks leave their writes as parts per owner, placed by place_task; an srun build
    whose first place_task is killed leaves the rank tasks done and the outputs unplaced (zeros). The rerun with
    another launcher writes in place: its plan differs (plan.json's layout), so it starts over -- the same files
    as an undisturbed build, no zeroed slice."""
    ref = str(fake_srun / "ref")
    pathtable.build_table(ref, *synthetic_parts(ref, 300, 3), num_tasks=2, launcher="inline")  # undisturbed
    emb = str(fake_srun / "emb")
    metas, rows = synthetic_parts(emb, 300, 3)  # the same parts
    monkeypatch.setenv(debug_hooks.ENV, "kill_task=place_task:0")
    with srun.spool(str(fake_srun / "spool")), pytest.raises(UnfinishedError, match="task 0 of 2 of step place_task"):
        pathtable.build_table(emb, metas, rows, num_tasks=2, launcher="srun")
    monkeypatch.delenv(debug_hooks.ENV)
    work = os.path.join(emb, "table", "work")
    assert os.path.isdir(os.path.join(work, "owned")) and not os.path.exists(os.path.join(emb, "table", "meta.json"))
    pathtable.build_table(emb, metas, rows, num_tasks=2, launcher="inline")
    for name in FILES[:-1]:  # (meta.json: its "parts" digest has the part files' times)
        a, b = os.path.join(ref, "table", name), os.path.join(emb, "table", name)
        assert open(a, "rb").read() == open(b, "rb").read(), name
