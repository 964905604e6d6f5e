"""`dinopipe eval depth` end to end on rendered scenes (vit_test, seconds): the outputs a user reads, the saved model
predicting what the metrics were computed on, bad input refused before anything is written, and the heads'
training through the loop (frozen vs tuned backbone, an interrupted run resumed to the same weights)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import dinopipe
from dinopipe.eval.cli import main
from dinopipe.eval.depth import METRIC_KEYS, BinsHead, DepthLoss, DepthModel, build_head
from dinopipe.eval.depth_data import DepthTrainSet, image_tensor, open_depth, read_depth_png
from dinopipe.eval.depth_scenes import build_depth_scenes
from dinopipe.eval.head_train import HeadTrainConfig, fit_dense_head
from dinopipe.models import create_model

from .test_depth_metrics import needs_official, official_metrics


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("depth")
    build_depth_scenes(root / "train", 8, size=56, seed=0, half="left")
    val = build_depth_scenes(root / "val", 3, size=84, seed=1, half="right")
    for img, dep in val.pairs:  # non-square labels at another size than the model's input
        Image.open(img).crop((0, 0, 84, 70)).save(img)
        Image.open(dep).crop((0, 0, 84, 70)).save(dep)
    return root


def _run(sets, out, *flags, overrides=()):
    return main(["depth", "--model", "vit_test", "--train", str(sets / "train"), "--val", str(sets / "val"),
                 "--out", str(out), "--epochs", "2", "--img-size", "56", "--batch-size", "4", "--device", "cpu",
                 *flags, "workers=0", "dpt_features=32", *overrides])


@pytest.mark.parametrize("head", ["linear", "dpt"])
def test_eval_depth_writes_metrics_predictions_and_a_model_that_predicts(sets, tmp_path, head):
    out = tmp_path / "out"
    assert _run(sets, out, "--head", head, "--save-predictions") == 0
    m = json.loads((out / "metrics.json").read_text())
    assert set(METRIC_KEYS) <= set(m) and m["head"] == head and m["images"] == 3
    assert all(np.isfinite(m[k]) for k in METRIC_KEYS)
    val = open_depth(sets / "val")
    preds = [np.load(out / "predictions" / f"{n}.npy") for n in val.names]
    gts = [read_depth_png(d) for _, d in val.pairs]
    assert all(p.dtype == np.float32 and p.shape == g.shape == (70, 84) for p, g in zip(preds, gts))
    model = dinopipe.load(out / "model")  # backbone + head: forward(images) -> metres
    x = image_tensor(val.pairs[0][0], (56, 56))[None]
    with torch.no_grad():
        y = torch.nn.functional.interpolate(model(x), size=(70, 84), mode="bilinear", align_corners=False)
    np.testing.assert_allclose(y[0, 0].numpy(), preds[0], atol=1e-5)


@needs_official
def test_saved_predictions_give_the_reported_metrics_under_dinov3_code(sets, tmp_path):
    out = tmp_path / "out"
    assert _run(sets, out, "--save-predictions", overrides=("flip_tta=true", "eigen_crop=true")) == 0
    m = json.loads((out / "metrics.json").read_text())
    val = open_depth(sets / "val")
    preds = [np.load(out / "predictions" / f"{n}.npy") for n in val.names]
    ref = official_metrics(preds, [read_depth_png(d) for _, d in val.pairs], 0.0, 65.536, True)
    for k in METRIC_KEYS:
        assert m[k] == pytest.approx(ref[k], abs=1e-6, rel=1e-6), k


def test_bad_input_exits_2_before_writing(sets, tmp_path, capsys):
    bad = tmp_path / "bad"
    (bad / "images").mkdir(parents=True)
    (bad / "depth").mkdir()
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(bad / "images" / "a.png")
    Image.fromarray(np.zeros((28, 28), np.uint8)).save(bad / "depth" / "a.png")  # 8-bit: not millimetres
    out = tmp_path / "out"
    assert main(["depth", "--model", "vit_test", "--train", str(bad), "--val", str(sets / "val"), "--out",
                 str(out)]) == 2
    assert "16-bit" in capsys.readouterr().err and not out.exists()
    assert main(["depth", "--model", "vit_test", "--train", str(tmp_path), "--val", str(sets / "val"), "--out",
                 str(out)]) == 2
    assert "images/ and depth/" in capsys.readouterr().err and not out.exists()
    assert _run(sets, out, overrides=("no_such_key=1",)) == 2 and not out.exists()


def _fit(sets, run, backbone_lr=0.0, name="vit_test", stop_after=None):
    torch.manual_seed(0)
    size = 64 if "dinov3" in name else 56  # 4 patches
    backbone = create_model(name, img_size=size)
    head, layers = build_head("dpt", backbone.embed_dim, backbone.n_blocks, dpt_features=32)
    model = DepthModel(backbone, head, layers, 1e-3, 20.0)
    data = DepthTrainSet(open_depth(sets / "train"), size)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    cfg = HeadTrainConfig(epochs=3, lr=1e-3, backbone_lr=backbone_lr, device="cpu", out=str(run), progress=False,
                          stop_after=stop_after)
    res = fit_dense_head(model.features, BinsHead(head, 1e-3, 20.0), loader, lambda b, h: {"ok": 1},
                         DepthLoss(warm_iter=2), cfg)
    return res, model


@pytest.mark.parametrize("name", ["vit_test_reg4", "vit_test_dinov3"])
def test_dpt_trains_with_registers_and_rope_frozen_or_tuned(sets, tmp_path, name):
    for lr, changes in ((0.0, False), (1e-3, True)):
        torch.manual_seed(0)
        ref = {k: v.clone() for k, v in create_model(name, img_size=64 if "dinov3" in name else 56
                                                     ).state_dict().items()}
        res, model = _fit(sets, tmp_path / f"run{lr}", backbone_lr=lr, name=name)
        assert res["exit"] == 0 and res["steps"] == 6 and res["val"] == {"ok": 1}
        assert np.isfinite(res["train_loss"])
        moved = any(not torch.equal(ref[k], v) for k, v in model.backbone.state_dict().items())
        assert moved == changes
        assert (tmp_path / f"run{lr}" / "metrics.jsonl").is_file()


def test_interrupted_head_training_resumes_to_the_same_weights(sets, tmp_path):
    _, whole = _fit(sets, tmp_path / "whole")
    res, _ = _fit(sets, tmp_path / "cut", stop_after=2)  # a checkpoint at step 2, then stop
    assert res["steps"] == 2 and "val" in res
    res, resumed = _fit(sets, tmp_path / "cut")  # the same command again: resumes at step 2
    assert res["steps"] == 6
    for (k, a), b in zip(whole.head.state_dict().items(), resumed.head.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=k)
