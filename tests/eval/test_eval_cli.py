"""``dinopipe eval knn|linear`` on labelled folders and webdataset shards built from real photos."""

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from dinopipe import hub
from dinopipe.app.cli import main
from dinopipe.eval.data import LabelError, open_labelled
from dinopipe.models import create_model
from tests._photos import real_photos

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


def _crops(arr, n, rng, size=64):
    h, w = arr.shape[:2]
    out = []
    for _ in range(n):
        s = int(min(h, w) * rng.uniform(0.5, 0.9))
        y, x = rng.integers(0, h - s + 1), rng.integers(0, w - s + 1)
        out.append(Image.fromarray(arr[y:y + s, x:x + s]).resize((size, size), Image.BICUBIC))
    return out


def _jpeg(img):
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """train/<photo>/*.jpg (4 crops each), val/<photo>/*.jpg (2 each), val.tar (the val crops with json labels),
    and a dinopipe export of a random vit_test."""
    root = tmp_path_factory.mktemp("eval")
    rng = np.random.default_rng(0)
    photos = real_photos()
    with tarfile.open(root / "val.tar", "w") as tf:
        for name in PHOTOS:
            crops = _crops(photos[name], 6, rng)
            for split, imgs in (("train", crops[:4]), ("val", crops[4:])):
                (root / split / name).mkdir(parents=True)
                for i, img in enumerate(imgs):
                    img.save(root / split / name / f"{i}.jpg", quality=90)
                    if split == "val":
                        for ext, data in ((".jpg", _jpeg(img)), (".json", json.dumps({"label": name}).encode())):
                            info = tarfile.TarInfo(f"{name}_{i}{ext}")
                            info.size = len(data)
                            tf.addfile(info, io.BytesIO(data))
    torch.manual_seed(0)
    hub.save_backbone(create_model("vit_test", img_size=56), root / "model")
    return root


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_knn_writes_json_and_table(dataset, tmp_path, capsys):
    out = tmp_path / "res" / "knn.json"
    rc, stdout, err = _run(["eval", "knn", "--model", str(dataset / "model"), "--train", str(dataset / "train"),
                            "--val", str(dataset / "val"), "--k", "1", "10", "20", "--workers", "0",
                            "--out", str(out)], capsys)
    assert rc == 0, err
    res = json.loads(out.read_text())
    assert res["train"] == {"source": str(dataset / "train"), "images": 16, "unreadable": 0, "classes": 4}
    assert res["val"]["images"] == 8 and res["img_size"] == 56 and res["feature"] == "cls"
    assert set(res["knn"]) == {"1", "10", "20"}
    for r in res["knn"].values():
        assert 0.0 <= r["top1"] <= r["top5"] <= 1.0
    assert res["knn"]["20"]["k_used"] == 16  # more neighbours asked for than training images
    assert "top1 %" in stdout and "results written" in stdout


def test_val_as_webdataset_shard_gives_the_same_result(dataset, tmp_path, capsys):
    outs = []
    for val in ("val", "val.tar"):
        out = tmp_path / f"{val}.json"
        rc, _, err = _run(["eval", "knn", "--model", str(dataset / "model"), "--train", str(dataset / "train"),
                           "--val", str(dataset / val), "--workers", "0", "--out", str(out)], capsys)
        assert rc == 0, err
        outs.append(json.loads(out.read_text())["knn"])
    assert outs[0] == outs[1]  # same pixels, same labels: the shard reader agrees with the folder reader


def test_linear_with_dataloader_workers(dataset, tmp_path, capsys):
    out = tmp_path / "lin.json"
    rc, stdout, err = _run(["eval", "linear", "--model", str(dataset / "model"), "--train", str(dataset / "train"),
                            "--val", str(dataset / "val"), "--avgpool", "--lrs", "0.01", "0.1", "--epochs", "5",
                            "--holdout", "0.25", "--workers", "1", "--out", str(out)], capsys)
    assert rc == 0, err
    res = json.loads(out.read_text())["linear"]
    assert res["n_holdout"] == 4 and res["n_fit"] == 12  # one crop of every photo held out
    assert [r["lr"] for r in res["sweep"]] == [0.01, 0.1]
    assert 0.0 <= res["val"]["top1"] <= res["val"]["top5"] <= 1.0
    assert " *" in stdout  # the chosen configuration is marked


def test_bad_inputs_exit_nonzero_with_clear_errors(dataset, tmp_path, capsys):
    base = ["eval", "knn", "--model", str(dataset / "model"), "--workers", "0"]
    rc, _, err = _run(base + ["--train", str(tmp_path / "nope"), "--val", str(dataset / "val")], capsys)
    assert rc == 2 and "nope" in err and "does not exist" in err
    loose = tmp_path / "loose"
    loose.mkdir()
    Image.new("RGB", (32, 32)).save(loose / "a.jpg")
    rc, _, err = _run(base + ["--train", str(loose), "--val", str(dataset / "val")], capsys)
    assert rc == 2 and "class sub-folders" in err
    rc, _, err = _run(["eval", "knn", "--model", str(tmp_path / "missing"), "--train", str(dataset / "train"),
                       "--val", str(dataset / "val")], capsys)
    assert rc == 2 and "--model" in err  # a model path that does not exist: the user's mistake


def test_labelled_sources(dataset, tmp_path):
    train = open_labelled(dataset / "train")
    assert train.classes == sorted(PHOTOS) and len(train) == 16
    val = open_labelled(dataset / "val.tar", classes=train.classes)
    assert sorted(val.labels) == sorted(train.labels[::2])  # 2 per class
    # Integer labels in 'cls' (json) or a .cls member; classes sort numerically.
    with tarfile.open(tmp_path / "s.tar", "w") as tf:
        img = _jpeg(Image.new("RGB", (16, 16)))
        for key, ext, label in [("a", ".json", b'{"cls": 10}'), ("b", ".cls", b"2"), ("c", ".json", b'{"cls": 2}')]:
            for e, data in ((".png" if key == "b" else ".jpg", img), (ext, label)):
                info = tarfile.TarInfo(key + e)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    s = open_labelled(tmp_path / "s.tar")
    assert s.classes == ["2", "10"] and s.labels == [1, 0, 0]
    with pytest.raises(LabelError, match=r"do not occur in the training set"):
        open_labelled(tmp_path / "s.tar", classes=train.classes)


def test_unreadable_images_are_counted_not_fatal(dataset, tmp_path, capsys):
    import shutil

    train = tmp_path / "train"
    shutil.copytree(dataset / "train", train)
    (train / "coffee" / "broken.jpg").write_bytes(b"<html>404</html>")
    out = tmp_path / "r.json"
    base = ["eval", "knn", "--model", str(dataset / "model"), "--workers", "0"]
    rc, _, err = _run(base + ["--train", str(train), "--val", str(dataset / "val"), "--out", str(out)], capsys)
    assert rc == 0, err
    assert json.loads(out.read_text())["train"] == {"source": str(train), "images": 17, "unreadable": 1,
                                                    "classes": 4}
    bad = tmp_path / "bad" / "coffee"
    bad.mkdir(parents=True)
    (bad / "x.jpg").write_bytes(b"")
    rc, _, err = _run(base + ["--train", str(bad.parent), "--val", str(bad.parent)], capsys)
    assert rc == 2 and "could be decoded" in err
