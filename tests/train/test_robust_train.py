"""Training that holds on many nodes: a resume at another world size keeps the run's lr, and a rank whose whole
batch is unreadable skips the step together with the others instead of hanging them (issue 20, items 3 and 5)."""

import io
import math
import tarfile

import numpy as np
import pytest
from PIL import Image

from dinopipe.config import load_config
from dinopipe.data.loader import DataPosition, GlobalBatchSampler
from dinopipe.ssl.config import PretrainConfig
from dinopipe.train.builders import build_schedules
from tests.train.conftest import REPO, TINY, metrics, run_pretrain

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def _jpeg(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).resize((80, 80)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_a_rank_whose_whole_batch_is_corrupt_skips_the_step_with_the_others(tmp_path):
    """Issue 20 item 5, reproduced before the fix: rank 1 died of KeyError 'global_crops', rank 0 of 'Connection
    closed by peer' (under NCCL: a 30-minute wait). Now both skip step 0, count it, and train on."""
    from tests._photos import real_photos

    photos = list(real_photos().values())
    n, b = 16, 2
    perm_first = [i for i, _ in next(iter(GlobalBatchSampler(n, b, 1, 2, 0, DataPosition())))]  # rank 1, step 0
    shard = tmp_path / "shards" / "part-000.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w") as tar:
        for i in range(n):
            data = _jpeg(photos[i % len(photos)])
            if i in perm_first:
                data = data[: len(data) // 3]  # cut off: decodes as 'truncated'
            info = tarfile.TarInfo(f"img{i:02d}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    run = tmp_path / "run"
    r = run_pretrain(run, shard.parent, "train.epochs=1", "data.num_workers=1",
                     "phases=[{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, "
                     "batch_size_per_gpu: 2}]", nproc=2, timeout=600)
    assert r.returncode == 0
    rows = {row["step"]: row for row in metrics(run)}
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[0]["skipped_steps"] == 1 and rows[0]["corrupt_images"] == 2 and rows[0]["corrupt/truncated"] == 2
    assert "loss" not in rows[0]
    assert all(math.isfinite(rows[s]["loss"]) and rows[s]["skipped_steps"] == 1 for s in (1, 2, 3)), rows
    assert "step 0 skipped on every rank" in r.stderr
    assert (run / "export" / "teacher").is_dir()


def test_resume_at_4_then_2_then_3_ranks_continues_the_lr_schedule(tmp_path, photo_pool):
    """Issue 20 item 3: the peak lr was recomputed from the current world size on resume. The run starts on 4
    ranks (global batch 8), resumes on 2 (4) and 3 (6): the lr in metrics.jsonl is the 4-rank schedule at every
    step, the loss stays finite, and each resume says once which lr it keeps (an explicit lr change:
    tests/train/test_lr_record.py)."""
    run = tmp_path / "run"
    phase = ("phases=[{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, "
             "batch_size_per_gpu: 2}]")
    common = ("train.epochs=2", phase, "optim.warmup_epochs=1")
    first = run_pretrain(run, photo_pool, *common, "train.stop_after=3", nproc=4)
    second = run_pretrain(run, photo_pool, *common, "train.stop_after=3", nproc=2)
    third = run_pretrain(run, photo_pool, *common, nproc=3)
    assert "keeping the run's peak lr" not in first.stderr
    for r, now in ((second, 4), (third, 6)):
        line = [ln for ln in r.stderr.splitlines() if "keeping the run's peak lr" in ln]
        assert len(line) == 1 and f"resumed at global batch [{now}]" in line[0] and "from [8]" in line[0], r.stderr
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/quickstart.yaml",
                      [*TINY, f"data.paths=[{photo_pool}]", f"train.output_dir={run}", *common])
    want = build_schedules(cfg, world_size=4)["lr"]
    other = build_schedules(cfg, world_size=2)["lr"]
    rows = {row["step"]: row for row in metrics(run)}
    assert sorted(rows) == list(range(8))
    assert [rows[s]["lr"] for s in range(8)] == pytest.approx(want.tolist(), rel=1e-12)
    assert not np.allclose(want[3:], other[3:])  # what the 2-rank resume would have used before
    assert all(math.isfinite(rows[s]["loss"]) for s in range(8))
