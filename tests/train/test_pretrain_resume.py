"""A killed run resumes exactly; a NaN stops with the last good checkpoint; bad config exits 2."""

import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import dinopipe
from conftest import env, losses, pretrain_cmd, run_pretrain

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, photo_pool):
    run = tmp_path_factory.mktemp("ref")
    run_pretrain(run, photo_pool, "train.epochs=3", "train.checkpoint_every=4", "data.num_workers=1")
    return run


def test_uninterrupted_run_logs_checkpoints_and_exports(reference_run):
    traj = losses(reference_run)
    assert sorted(traj) == list(range(12))
    assert all(torch.isfinite(torch.tensor(v)) for v in traj.values())
    model = dinopipe.load(reference_run)  # the run dir resolves to export/teacher
    assert model.embed_dim == 64 and not model.training
    assert (Path(reference_run) / "config.yaml").is_file()
    ckpts = sorted(p.name for p in (Path(reference_run) / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000004", "step_00000008", "step_00000012"]


def test_sigkill_then_rerun_repeats_the_trajectory(tmp_path, photo_pool, reference_run):
    run = tmp_path / "killed"
    args = ("train.epochs=3", "train.checkpoint_every=4", "data.num_workers=1")
    proc = subprocess.Popen(pretrain_cmd(run, photo_pool, *args), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    # Kill hard once step 6 is logged: past the step-4 checkpoint, before the step-8 one.
    while time.time() < deadline and proc.poll() is None:
        if len(losses(run) if (run / "metrics.jsonl").exists() else {}) >= 7:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    r = run_pretrain(run, photo_pool, *args)
    assert "resuming from checkpoint at step 4" in r.stdout
    ref, got = losses(reference_run), losses(run)
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=1e-6), step


def test_nan_stops_with_last_good_checkpoint(tmp_path, photo_pool):
    r = run_pretrain(tmp_path / "nan", photo_pool, "train.epochs=2", "train.checkpoint_every=2",
                     "optim.base_lr=1e30", "optim.warmup_epochs=0", "optim.clip_grad=0", check=False)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "not finite" in r.stderr and "last good checkpoint" in r.stderr
    latest = tmp_path / "nan" / "checkpoints" / "latest"
    if latest.exists():  # whatever was saved before the blow-up is still complete and loadable
        assert (tmp_path / "nan" / "checkpoints" / latest.read_text().strip() / ".metadata").is_file()


def test_bad_config_key_exits_2_before_work(tmp_path, photo_pool):
    r = run_pretrain(tmp_path / "bad", photo_pool, "optim.lr_typo=1", check=False)
    assert r.returncode == 2 and "lr_typo" in r.stderr
    assert not (tmp_path / "bad").exists()
