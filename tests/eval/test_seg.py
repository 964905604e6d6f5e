"""Linear segmentation probe on patch tokens: mIoU where the answer is known, and the CLI end to end on a
dense set built from scikit-image textures."""

import json

import pytest
import torch
import torch.nn.functional as F

from dinopipe.eval.cli import main
from dinopipe.eval.dense_data import build_texture_set, open_dense
from dinopipe.eval.seg import confusion, iou_from_confusion, seg_probe

P, G, C = 8, 6, 4  # pixels per patch, patches per side, classes


def _blocky_masks(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, C, (n, G // 2, G // 2), generator=g).repeat_interleave(2, 1).repeat_interleave(2, 2)
    return labels, labels.repeat_interleave(P, 1).repeat_interleave(P, 2)  # (n, G, G), (n, G*P, G*P)


def _features(labels, noise, seed):
    g = torch.Generator().manual_seed(seed)
    f = F.one_hot(labels, C).permute(0, 3, 1, 2).float()  # (n, C, G, G): the class, written in the token
    return torch.cat([f, torch.randn(f.shape[0], 12, G, G, generator=g)], 1) + noise * torch.randn(
        f.shape[0], C + 12, G, G, generator=g)


def test_miou_of_known_confusion():
    target = torch.tensor([[0, 0, 1, 1], [2, 2, 255, 255]])
    pred = torch.tensor([[0, 1, 1, 1], [2, 2, 0, 0]])
    res = iou_from_confusion(confusion(pred, target, 4))
    # class 0: 1 / (2 + 1 - 1) = 0.5; class 1: 2 / 3; class 2: 1; class 3 absent everywhere -> not counted
    assert res["per_class_iou"] == [0.5, round(2 / 3, 6), 1.0, None]
    assert res["miou"] == pytest.approx((0.5 + 2 / 3 + 1) / 3)
    assert res["pixel_acc"] == pytest.approx(5 / 6)


def test_probe_separable_features_near_perfect_and_random_labels_low():
    lab_tr, m_tr = _blocky_masks(24, 0)
    lab_va, m_va = _blocky_masks(12, 1)
    good = seg_probe(_features(lab_tr, 0.1, 2), m_tr, _features(lab_va, 0.1, 3), m_va, C, epochs=30, lr=0.05)
    print("separable", good["miou"])
    assert good["miou"] > 0.95, good
    # Same features, but val masks belong to other images: nothing to learn that transfers.
    shuffled = m_va[torch.roll(torch.arange(len(m_va)), 1)]
    bad = seg_probe(_features(lab_tr, 0.1, 2), m_tr, _features(lab_va, 0.1, 3), shuffled, C, epochs=30, lr=0.05)
    print("shuffled", bad["miou"])
    assert bad["miou"] < 0.45, bad


def test_cli_seg_on_texture_set(tmp_path, capsys):
    build_texture_set(tmp_path / "train", 12, size=56, cell=14, seed=0)
    build_texture_set(tmp_path / "val", 6, size=56, cell=14, seed=1)
    assert open_dense(tmp_path / "val").num_classes <= 4
    out = tmp_path / "seg.json"
    rc = main(["seg", "--model", "vit_test", "--train", str(tmp_path / "train"), "--val", str(tmp_path / "val"),
               "--img-size", "56", "--epochs", "20", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["train"]["images"] == 12 and res["seg"]["epochs"] == 20 and 0 <= res["seg"]["miou"] <= 1
    assert "mIoU" in capsys.readouterr().out
    (tmp_path / "val" / "masks" / "0000.png").unlink()
    assert main(["seg", "--model", "vit_test", "--train", str(tmp_path / "train"),
                 "--val", str(tmp_path / "val"), "--device", "cpu"]) == 2
    assert "without a mask" in capsys.readouterr().err
