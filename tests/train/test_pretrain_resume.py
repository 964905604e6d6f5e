"""An uninterrupted run logs, checkpoints and exports; a NaN stops with the last good checkpoint; bad config
exits 2. (Killed and preempted runs: test_preemption.py.)"""

from pathlib import Path

import pytest
import torch

import dinopipe
from tests.train.conftest import losses, run_pretrain

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


def test_nan_stops_with_last_good_checkpoint(tmp_path, photo_pool):
    run = tmp_path / "nan"
    args = ("train.epochs=2", "train.checkpoint_every=2")
    run_pretrain(run, photo_pool, *args, "train.stop_after=2")  # a good checkpoint at step 2
    r = run_pretrain(run, photo_pool, *args, "optim.base_lr=1e30", "optim.warmup_epochs=0", "optim.clip_grad=0",
                     check=False)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "not finite" in r.stderr and "The last good checkpoint is step 2" in r.stderr
    # The blow-up wrote nothing: the step-2 checkpoint is still the complete, loadable latest.
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert (run / "checkpoints" / "step_00000002" / ".metadata").is_file()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002"]


def test_bad_config_key_exits_2_before_work(tmp_path, photo_pool):
    r = run_pretrain(tmp_path / "bad", photo_pool, "optim.lr_typo=1", check=False)
    assert r.returncode == 2 and "lr_typo" in r.stderr
    assert not (tmp_path / "bad").exists()
