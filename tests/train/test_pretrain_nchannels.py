"""Continued pretraining of RGB weights on a 4-band pool (16-bit TIFF and float .npy tiles rendered from real
photos): the statistics come from `dinopipe channel-stats`, the patch embedding is expanded, the run trains and
exports a 4-channel backbone that records its statistics; config mistakes exit 2 before any work."""

import json
import subprocess
import sys

import pytest
import torch

import dinopipe
from dinopipe.data.channels import decode_channels
from dinopipe.hub import export_dinov2
from dinopipe.models import create_model
from dinopipe.models.channels import expand_patch_embed
from tests.train.conftest import env, losses, run_pretrain

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def band_pool(tmp_path_factory):
    from dinopipe.data.samples_nch import build_multichannel_pool

    root = tmp_path_factory.mktemp("bands")
    build_multichannel_pool(root / "pool", channels=4, n_images=16, size=72, fmt="tiff16", seed=0)
    build_multichannel_pool(root / "pool", channels=4, n_images=8, size=72, fmt="npy", seed=1)
    return root / "pool"


def _stats(pool):
    r = subprocess.run([sys.executable, "-m", "dinopipe.app.cli", "channel-stats", str(pool), "--channels", "4"],
                       env=env(), capture_output=True, text=True, check=True)
    keys = r.stdout.split()
    assert [k.split("=")[0] for k in keys] == ["data.channels", "data.mean", "data.std"], r.stdout
    return keys


def test_rgb_weights_continue_on_four_bands(tmp_path, band_pool):
    released = create_model("vit_test", img_size=56).eval()
    with torch.no_grad():
        for p in released.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    path = export_dinov2(released, tmp_path / "released.pth")
    stats = _stats(band_pool)
    frozen = tmp_path / "frozen"  # lr 0, momentum 1: the export is exactly the expanded release
    run_pretrain(frozen, band_pool, "train.epochs=1", f"model.pretrained={path}", *stats, "optim.base_lr=0.0",
                 "optim.min_lr=0.0", "teacher.momentum_teacher=1.0", "teacher.final_momentum_teacher=1.0",
                 "model.expand_patch_embed=rgb_map", "model.rgb_channels=[0,1,2]")
    got = dinopipe.load(frozen)
    want = expand_patch_embed(create_model("vit_test", img_size=56).eval(), 4, "rgb_map", [0, 1, 2])
    want.load_state_dict(expand_patch_embed(released, 4, "rgb_map", [0, 1, 2]).state_dict())
    x = decode_channels((band_pool / sorted(p.name for p in band_pool.iterdir())[0]).read_bytes(), 4)[0]
    x = x[None, :, :56, :56]
    with torch.no_grad():
        torch.testing.assert_close(got(x), want(x))
    cfg = json.loads((frozen / "export" / "teacher" / "config.json").read_text())
    mean = json.loads(stats[1].split("=", 1)[1])
    assert got.patch_embed.proj.in_channels == 4 and cfg["arch"]["in_chans"] == 4
    assert cfg["mean"] == pytest.approx(mean) and len(cfg["std"]) == 4

    moving = tmp_path / "moving"
    run_pretrain(moving, band_pool, "train.epochs=2", f"model.pretrained={path}", *stats)
    steps = losses(moving)
    assert sorted(steps) == list(range(8)) and all(torch.isfinite(torch.tensor(v)) for v in steps.values())
    trained = dinopipe.load(moving)
    assert trained.patch_embed.proj.in_channels == 4
    with torch.no_grad():
        assert not torch.allclose(trained(x), want(x))  # it trained (from the mean expansion this time)


@pytest.mark.parametrize("overrides,needle", [
    (["data.channels=4"], "channel-stats"),
    (["data.channels=4", "data.mean=[0.5,0.5,0.5]", "data.std=[0.2,0.2,0.2,0.2]"], "data.mean"),
    (["data.channels=4", "data.mean=[0.5,0.5,0.5,0.5]", "data.std=[0.2,0.2,0.2,0.2]", "model.in_chans=3"],
     "model.in_chans"),
    (["data.channels=4", "data.mean=[0.5,0.5,0.5,0.5]", "data.std=[0.2,0.2,0.2,0.2]",
      "model.expand_patch_embed=rgb_map", "model.rgb_channels=[0,1,4]"], "model.rgb_channels"),
    (["data.channels=17"], "data.channels"),
])
def test_channel_config_mistakes_exit_2_naming_the_key(tmp_path, band_pool, overrides, needle):
    r = run_pretrain(tmp_path / "run", band_pool, *overrides, check=False)
    assert r.returncode == 2 and needle in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run").exists()
