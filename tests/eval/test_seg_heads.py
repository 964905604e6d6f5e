"""Segmentation heads on the pyramid: the CLI's outputs, mIoU equal to the confusion-matrix one recomputed from
the saved predictions, slide inference on an image larger than the crop, and Mask2Former's loss and inference."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from dinopipe.eval.cli import main
from dinopipe.eval.dense_data import open_dense
from dinopipe.eval.paste_data import build_paste_sets
from dinopipe.eval.seg import confusion, iou_from_confusion
from dinopipe.eval.seg_heads import build_seg_head
from dinopipe.eval.seg_train import slide_logits, train_seg
from dinopipe.models import create_model

M2F_SMALL = dict(num_queries=8, decoder_layers=3, encoder_layers=1, train_num_points=256)


@pytest.fixture(scope="module")
def paste(tmp_path_factory):
    return build_paste_sets(tmp_path_factory.mktemp("paste"), 8, 3, size=64)


def _recomputed_miou(pred_dir, val_dir, num_classes):
    cm = torch.zeros(num_classes, num_classes, dtype=torch.long)
    for m in sorted((val_dir / "masks").iterdir()):
        truth = torch.from_numpy(np.asarray(Image.open(m)).astype(np.int64))
        pred = torch.from_numpy(np.asarray(Image.open(pred_dir / m.name)).astype(np.int64))
        assert pred.shape == truth.shape
        cm += confusion(pred, truth, num_classes)
    return iou_from_confusion(cm)


def test_cli_upernet_writes_metrics_equal_to_the_confusion_miou_of_its_predictions(paste, tmp_path, capsys):
    out = tmp_path / "out"
    # One val image larger than the crop: slide inference, prediction at the label's own size.
    big = paste["val"]
    Image.open(big / "images" / "0000.png").resize((160, 64)).save(big / "images" / "0000.png")
    Image.open(big / "masks" / "0000.png").resize((160, 64), Image.NEAREST).save(big / "masks" / "0000.png")
    rc = main(["seg", "--model", "vit_test", "--train", str(paste["train"]), "--val", str(big), "--head", "upernet",
               "--img-size", "64", "--epochs", "2", "--lr", "1e-3", "--channels", "16", "--batch-size", "4",
               "--device", "cpu", "--out", str(out), "--save-predictions"])
    assert rc == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) >= {"mIoU", "per_class_IoU", "pixel_acc"} and metrics["head"] == "upernet"
    assert sorted(p.name for p in (out / "predictions").iterdir()) == ["0000.png", "0001.png", "0002.png"]
    assert not (out / "predictions.partial").exists()
    ref = _recomputed_miou(out / "predictions", big, 4)
    assert metrics["mIoU"] == pytest.approx(ref["miou"], abs=1e-6)
    assert metrics["per_class_IoU"] == ref["per_class_iou"]
    assert "mIoU" in capsys.readouterr().out
    # the head was saved with its backbone: dinopipe.load gives a model that predicts what eval seg predicted
    import dinopipe
    from dinopipe.eval.seg_train import _normalise

    model = dinopipe.load(str(out / "model"))
    for name in ("0001.png", "0002.png"):  # 64 x 64 = the training size: one window
        x = _normalise(Image.open(big / "images" / name))[None]
        with torch.no_grad():
            scores = model(x)
        assert scores.shape == (1, 4, 64, 64)
        saved = np.asarray(Image.open(out / "predictions" / name)).astype(np.int64)
        np.testing.assert_array_equal(scores[0].argmax(0).numpy(), saved)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linear", "upernet"])
def test_a_saved_seg_head_exports_to_onnx_and_torch_export_matching_at_new_sizes(tmp_path, kind):
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    from dinopipe.eval.head_io import export_head, load_head_model, save_head
    from dinopipe.eval.seg_model import seg_head_config

    torch.manual_seed(0)
    bb = create_model("vit_test").eval()
    head = build_seg_head(kind, int(bb.embed_dim), 3, channels=16).eval()
    save_head(tmp_path / "m", bb, head, seg_head_config(kind, 3, 16, 64))
    model = load_head_model(tmp_path / "m")
    paths = export_head(model, tmp_path / "x")
    program = torch.export.load(str(paths["pt2"])).module()
    sess = ort.InferenceSession(str(paths["onnx"]), providers=["CPUExecutionProvider"])
    assert json.loads(sess.get_modelmeta().custom_metadata_map["dinopipe_head"])["head"] == kind
    p = int(bb.patch_size)
    for shape in ((2, 3, 4 * p, 4 * p), (1, 3, 6 * p, 5 * p), (3, 3, 3 * p, 7 * p)):  # traced, then never traced
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = model(x)
            got = program(x)
        onnx = torch.as_tensor(sess.run(["prediction"], {"images": x.numpy()})[0])
        assert ref.shape == (shape[0], 3, shape[2], shape[3])
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        # onnxruntime's Resize (the x16 bilinear upsampling of the logits) rounds differently from torch's: up to
        # 1.6e-5 measured on 0.2% of the pixels, at logits of order 1
        torch.testing.assert_close(onnx, ref, rtol=0, atol=5e-5)


@pytest.mark.slow
def test_a_mask2former_head_exports_at_its_training_size_matching_eager(tmp_path):
    """transformers' deformable attention splits its values by the levels' sizes as Python ints, so a Mask2Former
    graph holds for one size: it is exported at the size the head was trained at (slide inference's window), any
    batch, and says so in its metadata; there both exports equal eager."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("scipy")
    import onnxruntime as ort

    from dinopipe.eval.head_io import export_head, load_head_model, save_head
    from dinopipe.eval.seg_model import seg_head_config

    torch.manual_seed(0)
    bb = create_model("vit_test").eval()
    p = int(bb.patch_size)
    m2f = dict(num_queries=4, decoder_layers=2, encoder_layers=1, train_num_points=64)
    head = build_seg_head("m2f", int(bb.embed_dim), 3, channels=32, **m2f).eval()
    save_head(tmp_path / "m", bb, head, seg_head_config("m2f", 3, 32, 5 * p, m2f=m2f))
    model = load_head_model(tmp_path / "m")
    paths = export_head(model, tmp_path / "x")
    program = torch.export.load(str(paths["pt2"])).module()
    sess = ort.InferenceSession(str(paths["onnx"]), providers=["CPUExecutionProvider"])
    meta = json.loads(sess.get_modelmeta().custom_metadata_map["dinopipe_head"])
    assert meta["head"] == "m2f" and meta["export_size"] == [5 * p, 5 * p]
    for batch in (1, 3):  # traced with 2
        x = torch.randn(batch, 3, 5 * p, 5 * p, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            ref = model(x)
            got = program(x)
        assert ref.shape == (batch, 3, 5 * p, 5 * p)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        onnx = torch.as_tensor(sess.run(["prediction"], {"images": x.numpy()})[0])
        torch.testing.assert_close(onnx, ref, rtol=0, atol=5e-5)


def test_bad_flags_exit_2_before_anything_is_written(paste, tmp_path, capsys):
    base = ["seg", "--model", "vit_test", "--train", str(paste["train"]), "--val", str(paste["val"]), "--device", "cpu"]
    assert main(base + ["--head", "m2f", "--channels", "48", "--out", str(tmp_path / "o")]) == 2
    assert "--channels" in capsys.readouterr().err
    assert main(base + ["--save-predictions"]) == 2
    assert "--save-predictions" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_config_keys_reach_the_head_and_a_wrong_one_exits_2_before_anything_is_written(paste, tmp_path, capsys):
    """`--config` + key=value: the keys beyond the flags (dinopipe config --kind seg)."""
    base = ["seg", "--model", "vit_test", "--train", str(paste["train"]), "--val", str(paste["val"]), "--device", "cpu",
            "--head", "m2f", "--img-size", "64", "--epochs", "1", "--channels", "32", "--batch-size", "4"]
    for bad, key in ((["m2f.num_querys=8"], "num_querys"), (["m2f.num_queries=0"], "m2f.num_queries"),
                     (["train.warmup_frac=abc"], "train.warmup_frac")):
        assert main(base + ["--out", str(tmp_path / "bad")] + bad) == 2
        assert key in capsys.readouterr().err and not (tmp_path / "bad").exists()
    cfg = tmp_path / "seg.yaml"
    cfg.write_text("m2f:\n  num_queries: 8\n  decoder_layers: 3\n  encoder_layers: 1\n  train_num_points: 256\n")
    out = tmp_path / "out"
    assert main(base + ["--out", str(out), "--config", str(cfg), "train.weight_decay=0.05"]) == 0, capsys.readouterr().err
    saved = json.loads((out / "model" / "config.json").read_text())["head"]
    assert saved["m2f"] == {"num_queries": 8, "decoder_layers": 3, "encoder_layers": 1, "train_num_points": 256}
    import dinopipe

    model = dinopipe.load(str(out / "model"))  # rebuilt from the recorded keys: 8 queries
    assert model.head.transformer.queries_embedder.weight.shape[0] == 8


def test_slide_inference_averages_windows_and_equals_one_window_when_the_image_fits():
    torch.manual_seed(0)
    bb, head = create_model("vit_test").eval(), build_seg_head("linear", 64, 3).eval()
    x = torch.randn(3, 64, 64)
    one = slide_logits(bb, head, x, 64)
    from dinopipe.eval.pyramid import grid_features

    torch.testing.assert_close(one, head.logits(head(grid_features(bb, x[None])), (64, 64))[0])
    wide = torch.randn(3, 64, 150)
    got = slide_logits(bb, head, wide, 64)  # windows at x = 0, 43, 86: pixels 0-42 are seen by the first only
    first = head.logits(head(grid_features(bb, wide[None, :, :, :64])), (64, 64))[0]
    assert got.shape == (3, 64, 150) and torch.isfinite(got).all()
    torch.testing.assert_close(got[:, :, :43], first[:, :, :43])


def test_mask2former_trains_and_gives_semantic_scores(paste, tmp_path):
    import json

    tr = open_dense(paste["train"])
    head, res = train_seg(create_model("vit_test"), "m2f", tr, tr, size=64, epochs=1, lr=1e-3, channels=32,
                          batch_size=4, m2f=M2F_SMALL, run_dir=tmp_path / "run")
    assert 0 <= res["miou"] <= 1 and np.isfinite(res["train_loss"])
    # trained through the one loop: its metrics.jsonl holds the matched loss's terms
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("loss_dice", -1) >= 0 and "loss_mask" in r for r in logged), logged[-1]
    raw = head(torch.randn(2, 64, 4, 4))
    scores = head.logits(raw, (60, 64))
    assert scores.shape == (2, 4, 60, 64) and (scores >= 0).all()  # P(class) x sigmoid(mask), summed over queries


def test_mask2former_is_initialised_as_transformers_does_not_from_leftover_memory():
    """Its modules are built outside transformers' model, whose post_init initialises them: the pixel decoder's
    level_embed is torch.Tensor(L, C) (uninitialised). Freed NaN-filled blocks of that size lie in the allocator's
    cache before the build; the head built after them equals one built before, finite, level_embed ~ N(0, 1)."""
    def build():
        torch.manual_seed(0)
        return build_seg_head("m2f", 64, 4, channels=32, **M2F_SMALL).state_dict()

    first = build()
    for _ in range(64):  # the size of level_embed's storage: what malloc hands back next for it
        junk = torch.full((3, 32), float("nan"))
        del junk
    second = build()
    for name, value in second.items():
        assert torch.isfinite(value.float()).all() and torch.equal(value, first[name]), name
    assert 0.5 < float(second["pixel_decoder.level_embed"].std()) < 2.0
