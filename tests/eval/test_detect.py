"""Detection: pycocotools metrics (perfect boxes 1.000, a hand-computed case), COCO results rows, the
`dinopipe eval detect` command end to end (metrics recomputed from predictions.json) and each detector on the pyramid."""

import json

import pytest
import numpy as np
import torch

pytest.importorskip("pycocotools")

from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

from dinopipe.eval.cli import main  # noqa: E402
from dinopipe.eval.coco import coco_metrics, open_coco, to_coco_results  # noqa: E402
from dinopipe.eval.detect import train_detector  # noqa: E402
from dinopipe.eval.paste_data import build_paste_sets  # noqa: E402
from dinopipe.models import create_model  # noqa: E402


@pytest.fixture(scope="module")
def paste(tmp_path_factory):
    return build_paste_sets(tmp_path_factory.mktemp("paste"), 6, 3, size=64)


def test_perfect_boxes_and_masks_score_one(paste):
    gt = open_coco(paste["val_json"])
    rows = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0,
             "segmentation": a["segmentation"]} for a in gt.coco.dataset["annotations"]]
    m = coco_metrics(gt, rows, ("bbox", "segm"))
    assert m["bbox_AP"] == m["bbox_AP50"] == m["bbox_AP75"] == 1.0
    assert m["segm_AP"] == m["segm_AP50"] == m["segm_AP75"] == 1.0


def test_hand_computed_ap(tmp_path):
    from PIL import Image

    Image.new("RGB", (100, 100)).save(tmp_path / "a.png")
    gt = {"images": [{"id": 1, "file_name": "a.png", "height": 100, "width": 100}], "categories": [{"id": 7}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 7, "bbox": [10, 10, 40, 40]},
                          {"id": 2, "image_id": 1, "category_id": 7, "bbox": [60, 60, 30, 30]}]}
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    rows = [{"image_id": 1, "category_id": 7, "bbox": [0, 60, 20, 20], "score": 0.9},  # a false positive first
            {"image_id": 1, "category_id": 7, "bbox": [14, 10, 40, 40], "score": 0.8}]  # IoU 1440/1760 = 0.818
    m = coco_metrics(open_coco(tmp_path / "gt.json"), rows)
    # Recall reaches 1/2 at precision 1/2: 51 of COCO's 101 recall points at 0.5. IoU 0.818 matches at the
    # thresholds 0.50..0.80 (7 of 10), not at 0.85..0.95.
    assert m["bbox_AP50"] == pytest.approx(51 * 0.5 / 101, abs=1e-6)
    assert m["bbox_AP75"] == pytest.approx(51 * 0.5 / 101, abs=1e-6)
    assert m["bbox_AP"] == pytest.approx(0.7 * 51 * 0.5 / 101, abs=1e-6)


def test_results_rows_map_labels_back_to_coco_ids_and_xywh():
    det = {"boxes": torch.tensor([[10.0, 20.0, 30.0, 60.0]]), "labels": torch.tensor([2]),
           "scores": torch.tensor([0.5])}
    assert to_coco_results(4, det, [3, 9]) == [{"image_id": 4, "category_id": 9, "bbox": [10.0, 20.0, 20.0, 40.0],
                                                "score": 0.5}]


def test_cli_detect_writes_coco_results_that_pycocotools_scores_the_same(paste, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["detect", "--model", "vit_test", "--train", str(paste["train_json"]), "--val",
               str(paste["val_json"]), "--out", str(out), "--img-size", "64", "--epochs", "1", "--channels", "16",
               "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    preds = json.loads((out / "predictions.json").read_text())
    assert preds and set(preds[0]) == {"image_id", "category_id", "bbox", "score"}
    gt = COCO(str(paste["val_json"]))
    ev = COCOeval(gt, gt.loadRes(str(out / "predictions.json")), "bbox")
    ev.evaluate(), ev.accumulate(), ev.summarize()
    for k, v in zip(("bbox_AP", "bbox_AP50", "bbox_AP75"), ev.stats[:3]):
        assert metrics[k] == pytest.approx(v, abs=1e-6)
    # saved with its backbone: dinopipe.load gives the detector back, and it detects what eval detect wrote
    import dinopipe
    from dinopipe.eval.detect import predict_coco

    model = dinopipe.load(str(out / "model"))
    val = open_coco(paste["val_json"], cat_ids=open_coco(paste["train_json"]).cat_ids)
    again = predict_coco(model, val, val.cat_ids)
    assert [(r["image_id"], r["category_id"]) for r in again] == [(r["image_id"], r["category_id"]) for r in preds]
    np.testing.assert_allclose([r["bbox"] + [r["score"]] for r in again], [r["bbox"] + [r["score"]] for r in preds],
                               rtol=1e-5, atol=1e-4)


def test_cli_detect_bad_input_exits_2_and_writes_nothing(paste, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    d = json.loads(paste["val_json"].read_text())
    d["images"][0]["file_name"] = "nowhere.png"
    bad.write_text(json.dumps(d))
    base = ["detect", "--model", "vit_test", "--out", str(tmp_path / "o"), "--device", "cpu"]
    assert main(base + ["--train", str(bad), "--val", str(paste["val_json"])]) == 2
    assert "nowhere.png" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("{not json")
    assert main(base + ["--train", str(tmp_path / "x.json"), "--val", str(paste["val_json"])]) == 2
    assert "not a JSON" in capsys.readouterr().err
    ok = ["--train", str(paste["train_json"]), "--val", str(paste["val_json"])]
    for bad, key in ((["train.weight_decay=-1"], "train.weight_decay"), (["no_such_key=1"], "no_such_key")):
        assert main(base + ok + bad) == 2
        assert key in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["maskrcnn", "fcos"])
def test_each_detector_trains_on_the_pyramid(paste, kind):
    tr = open_coco(paste["train_json"])
    va = open_coco(paste["val_json"], cat_ids=tr.cat_ids)
    _, res, rows = train_detector(create_model("vit_test_dinov3"), kind, tr, va, img_size=64, epochs=1, lr=1e-4,
                                  channels=32, batch_size=3)
    assert np.isfinite(res["train_loss"]) and all(0 <= res[k] <= 1 for k in ("bbox_AP", "bbox_AP50", "bbox_AP75"))
    if kind == "maskrcnn":
        assert "segm_AP" in res and all("segmentation" in r for r in rows)


@pytest.mark.parametrize("backbone_lr", [0.0, 1e-4])
def test_the_detector_trains_through_the_one_loop_with_the_vit_frozen_or_tuned(paste, tmp_path, backbone_lr):
    """The detector holds the ViT; the loop owns it: frozen (unchanged), or tuned in its own lr group (changed), and
    the loss terms land in the run folder's metrics.jsonl next to a checkpoint."""
    tr = open_coco(paste["train_json"])
    torch.manual_seed(0)
    vit = create_model("vit_test")
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    _, res, _ = train_detector(vit, "fasterrcnn", tr, tr, img_size=64, epochs=1, lr=1e-3, channels=32, batch_size=3,
                               backbone_lr=backbone_lr, run_dir=tmp_path / "run")
    changed = [k for k, v in vit.state_dict().items() if not torch.equal(v, before[k])]
    assert res["exit"] == 0 and np.isfinite(res["train_loss"])
    assert (len(changed) > 0) == (backbone_lr > 0), changed[:5]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("loss_box_reg" in r and "loss_objectness" in r for r in rows), rows[-1]
    assert any((tmp_path / "run" / "checkpoints").iterdir())
