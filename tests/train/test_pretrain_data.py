"""Pretraining on what users actually have: corrupt files in the pool, released weights to continue from."""

import json
import shutil

import pytest
import torch

import dinopipe
from dinopipe.hub import export_dinov2
from dinopipe.models import create_model
from tests.train.conftest import losses, run_pretrain

pytestmark = pytest.mark.slow


def test_corrupt_images_are_skipped_and_counted(tmp_path, photo_pool):
    from tests._photos import bad_file_kinds

    pool = tmp_path / "pool"
    shutil.copytree(photo_pool, pool)
    from tests._photos import real_photos

    photo = next(iter(real_photos().values()))
    for name, (data, _reason) in bad_file_kinds(photo).items():
        (pool / name).write_bytes(data)
    run = tmp_path / "run"
    run_pretrain(run, pool, "train.epochs=3")  # 12 steps x 4 images: touches most of the ~40-image pool
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    corrupt = {k: sum(r.get(k, 0) for r in rows) for r in rows for k in r if k.startswith("corrupt/")}
    assert corrupt, "no corrupt image was ever drawn"
    assert set(corrupt) <= {f"corrupt/{r}" for _, r in bad_file_kinds(photo).values()}
    assert sorted(losses(run)) == list(range(12))


def test_continued_pretraining_from_dinov2_layout_weights(tmp_path, photo_pool):
    released = create_model("vit_test_reg4", img_size=112, init_values=1.0).eval()
    with torch.no_grad():
        for p in released.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    path = export_dinov2(released, tmp_path / "released.pth")
    run = tmp_path / "cont"
    run_pretrain(run, photo_pool, "train.epochs=1", f"model.pretrained={path}", "model.num_heads=2", "optim.base_lr=0.0",
                 "optim.min_lr=0.0", "teacher.momentum_teacher=1.0",
                 "teacher.final_momentum_teacher=1.0")
    # lr 0 and momentum 1: the exported teacher must still be exactly the released backbone.
    got = dinopipe.load(run)
    assert got.num_register_tokens == 4
    x = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        torch.testing.assert_close(got(x), released(x))


def test_missing_data_path_is_a_config_error(tmp_path):
    r = run_pretrain(tmp_path / "run", tmp_path / "nowhere", check=False)
    assert r.returncode == 2 and "data.paths" in r.stderr
