"""`dinopipe pretrain data.paths=[s3://...]`: the losses of the run on local shards, an exact resume after SIGTERM
mid-epoch, and a planted secret that never reaches a log, a run folder or an error message."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from tests.storage.conftest import PLANTED_SECRET

pytestmark = [pytest.mark.slow]

_spec = importlib.util.spec_from_file_location("train_conftest", Path(__file__).parents[1] / "train" / "conftest.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)

SAME = ("train.epochs=2", "train.checkpoint_every=4", "data.num_workers=2")


def _no_secret(*texts_and_dirs) -> None:
    for x in texts_and_dirs:
        if isinstance(x, Path):
            for f in x.rglob("*"):
                if f.is_file():
                    assert PLANTED_SECRET.encode() not in f.read_bytes(), f
        else:
            assert PLANTED_SECRET not in x


def test_pretraining_from_a_bucket_matches_local_and_resumes_exactly(s3, shards, tmp_path):
    local_dir, url = shards
    ref, s3_ref, run = tmp_path / "local", tmp_path / "s3", tmp_path / "s3_resumed"
    train.run_pretrain(ref, local_dir, *SAME)
    a = train.run_pretrain(s3_ref, url, *SAME)
    env = dict(train.env(), DINOPIPE_DEBUG_HOOKS="signal=step:5:TERM")
    r1 = subprocess.run(train.pretrain_cmd(run, url, *SAME), env=env, capture_output=True, text=True, timeout=600,
                        start_new_session=True)
    assert r1.returncode == 124, r1.stderr[-3000:]  # preempted mid-epoch: checkpoint, exit 124
    r2 = train.run_pretrain(run, url, *SAME)
    assert "resuming from checkpoint" in r2.stderr
    want, got_s3, got = train.losses(ref), train.losses(s3_ref), train.losses(run)
    assert sorted(want) == sorted(got_s3) == sorted(got) and len(want) == 8
    for step in want:  # the same batches: same shapes, same process layout, so the same numbers
        assert got_s3[step] == want[step], step
        assert got[step] == want[step], step
    _no_secret(a.stdout, a.stderr, r1.stdout, r1.stderr, r2.stdout, r2.stderr, s3_ref, run)
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == PLANTED_SECRET  # the secret was there to leak


def test_a_missing_bucket_prefix_is_a_one_line_config_error_without_the_secret(s3, tmp_path):
    r = train.run_pretrain(tmp_path / "run", "s3://pool/no-such-prefix", check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "data.paths" in r.stderr and "no-such-prefix" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()
    _no_secret(r.stdout, r.stderr)


def test_checkpoints_in_a_bucket_resume_a_preempted_job_on_a_fresh_machine(s3, shards, tmp_path):
    """train.checkpoint_dir=s3://...: killed (SIGKILL, no goodbye) mid-epoch after a periodic checkpoint, the job
    restarts with an empty run folder (another machine) and resumes from the bucket with exactly the
    uninterrupted run's losses."""
    local_dir, url = shards
    ref, first, second = tmp_path / "ref", tmp_path / "first", tmp_path / "second"
    ckpt = "s3://pool/runs/a/checkpoints"
    train.run_pretrain(ref, local_dir, *SAME)
    env = dict(train.env(), DINOPIPE_DEBUG_HOOKS="signal=step:6:KILL")
    r1 = subprocess.run(train.pretrain_cmd(first, url, *SAME, f"train.checkpoint_dir={ckpt}"), env=env,
                        capture_output=True, text=True, timeout=600, start_new_session=True)
    assert r1.returncode == -9, r1.stderr[-3000:]
    listed = s3.client().ls("pool/runs/a/checkpoints", detail=False)
    assert any(p.endswith("/latest") for p in listed) and any("step_" in p for p in listed)
    assert not (first / "checkpoints").exists()  # nothing of the checkpoint is on the local disk
    r2 = train.run_pretrain(second, url, *SAME, f"train.checkpoint_dir={ckpt}")
    assert "resumed from s3://pool/runs/a/checkpoints/step_00000004" in r2.stderr, r2.stderr[-2000:]
    want, got = train.losses(ref), train.losses(second)
    assert sorted(got) == [s for s in sorted(want) if s >= 4]  # from the periodic checkpoint at step 4
    for step in got:
        assert got[step] == want[step], step
    _no_secret(r1.stderr, r2.stderr, first, second)
