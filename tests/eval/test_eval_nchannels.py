"""``dinopipe eval knn|linear`` of a 4-channel model on 4-band tiles (16-bit TIFF and float .npy rendered from the
real photos, class = source photo): each file's bands are read and normalised with the statistics the model's
export records; files with another band count are skipped and counted."""

import json

import pytest
import torch
import torch.nn.functional as F

from dinopipe import hub
from dinopipe.app.cli import main
from dinopipe.data.channels import decode_channels
from dinopipe.data.samples_nch import build_multichannel_eval_set
from dinopipe.data.transforms import eval_transform
from dinopipe.eval.data import open_labelled
from dinopipe.eval.features import extract_features
from dinopipe.models import create_model
from dinopipe.models.channels import expand_patch_embed
from dinopipe.utils.norm import set_input_norm

STATS = ([0.46, 0.42, 0.38, 0.43], [0.28, 0.27, 0.28, 0.26])


@pytest.fixture(scope="module")
def bands(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval4")
    tif = build_multichannel_eval_set(root / "tif", channels=4, n_train=3, n_val=2, size=64, fmt="tiff16")
    npy = build_multichannel_eval_set(root / "npy", channels=4, n_train=3, n_val=2, size=64, fmt="npy", seed=2)
    torch.manual_seed(0)
    m = create_model("vit_test", img_size=56).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    expand_patch_embed(m, 4, "rgb_map", [0, 1, 2])
    set_input_norm(m, *STATS)
    hub.save_backbone(m, root / "model")
    return {"tif": tif, "npy": npy, "model": root / "model", "root": root}


def test_features_are_the_bands_normalised_with_the_recorded_statistics(bands):
    model = hub.load(bands["model"])
    assert model.input_mean == pytest.approx(STATS[0])
    data = open_labelled(bands["tif"]["val"])
    got = extract_features(model, data, img_size=56, batch_size=8, num_workers=0)
    assert got.unreadable == 0 and got.feats.shape[0] == len(data)
    x = decode_channels(data.read(data.refs[0]), 4)[0]
    with torch.no_grad():
        want = F.normalize(model(eval_transform(56, mean=STATS[0], std=STATS[1])(x)[None]), dim=-1)[0]
        imagenet = F.normalize(model(eval_transform(56, mean=[0.45] * 4, std=[0.226] * 4)(x)[None]), dim=-1)[0]
    torch.testing.assert_close(got.feats[0], want, atol=1e-6, rtol=0)
    assert (got.feats[0] - imagenet).abs().max() > 1e-3  # the statistics matter


@pytest.mark.parametrize("fmt", ["tif", "npy"])
def test_knn_and_linear_cli_on_four_band_tiles(bands, tmp_path, capsys, fmt):
    sets = bands[fmt]
    for task, extra in (("knn", ["--k", "3"]), ("linear", ["--epochs", "5", "--lrs", "0.01", "--holdout", "0.34"])):
        out = tmp_path / f"{task}.json"
        rc = main(["eval", task, "--model", str(bands["model"]), "--train", sets["train"], "--val", sets["val"],
                   "--out", str(out), "--workers", "0", "--img-size", "56", *extra])
        assert rc == 0, capsys.readouterr().err
        res = json.loads(out.read_text())
        assert res["train"]["unreadable"] == 0 and res["val"]["unreadable"] == 0
        assert res["train"]["images"] == 3 * sets["classes"] and res["val"]["images"] == 2 * sets["classes"]
        top1 = res["knn"]["3"]["top1"] if task == "knn" else res["linear"]["val"]["top1"]
        assert 0 <= top1 <= 1


def test_photos_are_unreadable_for_a_four_channel_model(bands, tmp_path, capsys):
    from dinopipe.data.samples import build_eval_set

    rgb = build_eval_set(tmp_path / "rgb", n_train=2, n_val=1, size=64)
    rc = main(["eval", "knn", "--model", str(bands["model"]), "--train", rgb["train"], "--val", rgb["val"],
               "--workers", "0", "--img-size", "56"])
    assert rc == 2 and "could be decoded" in capsys.readouterr().err
