"""The teacher's kNN during pretraining (knn.* config): points at the start and a few steps, RUN/knn.jsonl, the
pipeline report's plot beside the losses and its one sentence per curve; mistakes in the sets exit 2 first."""

import json
from types import SimpleNamespace

import pytest

from dinopipe.train.knn_probe import probe_steps, read_knn
from tests.train.conftest import losses, run_pretrain, stage_cmd


def test_probe_steps_start_with_the_random_init_and_end_at_the_last_step():
    assert probe_steps(4, 8) == [0, 3, 5, 8]
    assert probe_steps(3, 4) == [0, 2, 4]
    assert probe_steps(1, 10) == [10]
    assert probe_steps(5, 2) == [0, 1, 2]  # more points than steps: each step once


@pytest.fixture(scope="module")
def eval_sets(tmp_path_factory):
    from dinopipe.data.samples import build_eval_set

    return build_eval_set(tmp_path_factory.mktemp("evalset"), n_train=2, n_val=2, size=64)


@pytest.mark.parametrize("overrides, says", [
    (["knn.train={train}"], "give both"),
    (["knn.train={train}", "knn.val={missing}"], "does not exist"),
    (["knn.train={train}", "knn.val={train}", "knn.points=0"], "knn.points"),
])
def test_knn_set_mistakes_exit_2_before_anything_is_written(overrides, says, eval_sets, tmp_path, photo_pool,
                                                             capsys):
    from dinopipe.train.pretrain import main

    out = tmp_path / "run"
    ov = [o.format(train=eval_sets["train"], missing=tmp_path / "nothing") for o in overrides]
    with pytest.raises(SystemExit) as exit_:
        main(stage_cmd("pretrain", out, photo_pool, *ov)[3:])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err and "knn" in err, err
    assert not out.exists()


@pytest.mark.slow
def test_a_tiny_pretraining_records_the_teachers_knn_and_the_report_plots_it(eval_sets, tmp_path, photo_pool):
    import dinopipe
    from dinopipe.eval import extract_features, knn_classify
    from dinopipe.app.pipeline_report import HEALTHY, _loss_plot, write_report
    from dinopipe.train.knn_probe import open_sets

    steps = ["train.epochs=2", "train.checkpoint_every=100"]  # 8 steps, TINY's epoch_length 4
    probe = [f"knn.train={eval_sets['train']}", f"knn.val={eval_sets['val']}", "knn.points=3", "knn.max_queries=40",
             "knn.k=5"]
    run = tmp_path / "pretrain"
    run_pretrain(run, photo_pool, *steps, *probe)
    points = read_knn(run)
    assert [r["step"] for r in points] == [0, 4, 8]
    assert all(r["queries"] == 40 and r["k"] == 5 and 0 <= r["top1"] <= 1 for r in points), points
    # The last point is the exported teacher's kNN, computed here independently of the probe.
    gallery, queries = open_sets(eval_sets["train"], eval_sets["val"], 40)
    teacher = dinopipe.load(run)
    ft, fq = (extract_features(teacher, s, num_workers=0, device="cpu") for s in (gallery, queries))
    last = knn_classify(ft.feats, ft.labels, fq.feats, fq.labels, ks=(5,), num_classes=len(gallery.classes))[5]
    assert points[-1]["top1"] == last["top1"], (points[-1], last)
    # The probe leaves training alone: the same losses as a run without it.
    plain = tmp_path / "plain"
    run_pretrain(plain, photo_pool, *steps)
    assert losses(plain) == losses(run)
    assert not (plain / "knn.jsonl").exists()

    p = SimpleNamespace(report=tmp_path / "report", curated=tmp_path / "curated", pretrain=run,
                        distill=tmp_path / "distill", eval=tmp_path / "eval_results.json")
    report = write_report(p, {}).read_text()
    for key in ("loss", "dino_loss", "ibot_loss", "koleo_loss", "knn_curve", "knn"):
        assert HEALTHY[key] in report, key
    assert "Teacher kNN during pretraining" in report and "step 0 " in report and "step 8 " in report
    assert (tmp_path / "report" / "pretrain_loss.png").is_file()
    drawn = _loss_plot(run, ["loss", "dino_loss"], tmp_path / "again.png", "pretraining", knn=points)
    assert drawn == ["loss", "dino_loss", "knn_top1"]
    print("kNN points:", json.dumps(points))
