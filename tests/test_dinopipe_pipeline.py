"""The one-command pipeline on its embedded sample pool: every stage runs, the report shows the kNN table
with standard errors, and a rerun continues instead of starting over. The quickstart's eval set is big
enough (>= 512 queries) for its differences to mean something."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
slow = pytest.mark.slow  # the end-to-end runs; the config and report-arithmetic checks below are fast
N_PHOTOS = 32  # distinct sample photos = eval classes (pinned by the end-to-end run below)

TINY_TRAIN = ["train.epochs=2", "train.epoch_length=4", "train.log_every=1", "train.progress=false",
              "data.num_workers=0", "crops.local_crops_number=2"]


def run_pipeline(cfg_path, *overrides):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "dinopipe.app.cli", "pipeline", "--config", str(cfg_path), *overrides],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=900)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipe")
    base = yaml.safe_load((REPO / "configs/pipeline/quickstart.yaml").read_text())
    base.update(output_dir=str(out / "run"))
    base["sample"].update(n_images=200, eval_train_per_class=4, eval_val_per_class=2)
    small = "[{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: 8}]"
    base["pretrain"]["overrides"] = TINY_TRAIN + ["model.img_size=56", f"phases={small}"]
    base["distill"]["overrides"] = TINY_TRAIN + [f"phases={small}"]
    base["eval"]["img_size"] = 56
    cfg = out / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(base))
    r = run_pipeline(cfg)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return cfg, out / "run", r


@slow
def test_all_stages_produce_their_outputs(pipeline_run):
    _, run, r = pipeline_run
    m = json.loads((run / "curated" / "manifest.json").read_text())
    assert m["counts"]["unreadable"] == 3  # the planted corrupt files, counted not fatal
    assert (run / "pretrain" / "export" / "teacher" / "model.safetensors").is_file()
    assert {p.name for p in (run / "distill" / "export").iterdir()} == {"small", "tiny"}
    ev = json.loads((run / "eval_results.json").read_text())
    # Every trained model next to a random init of its own architecture.
    assert set(ev["knn_top1"]) == {"random init (teacher arch)", "teacher", "random init (student small arch)",
                                   "student small", "random init (student tiny arch)", "student tiny"}
    assert ev["classes"] == N_PHOTOS and ev["val"] == N_PHOTOS * 2  # queries = photos x eval_val_per_class
    for name, accs in ev["knn_top1"].items():
        assert all(0.0 <= a <= 1.0 for a in accs.values())
        for k, a in accs.items():
            assert ev["knn_top1_se"][name][k] == pytest.approx(math.sqrt(a * (1 - a) / ev["val"]))
    report = (run / "report" / "report.md").read_text()
    acc_t, acc_r = ev["knn_top1"]["teacher"]["20"], ev["knn_top1"]["random init (teacher arch)"]["20"]
    se_t, se_r = math.sqrt(acc_t * (1 - acc_t) / 64), math.sqrt(acc_r * (1 - acc_r) / 64)
    acc, gain = f"{acc_t:.3f} ± {se_t:.3f}", f"{acc_t - acc_r:+.3f} ± {math.hypot(se_t, se_r):.3f}"
    teacher_row = next(line for line in report.splitlines() if line.startswith("| teacher |"))
    assert acc in teacher_row and gain in teacher_row
    assert "student small" in report
    summary = [line.split() for line in r.stdout.splitlines()]  # the printed summary states them too
    assert ["teacher", *acc.split(), *gain.split(), "over", "random", "init", "(teacher", "arch)"] in summary
    assert (run / "report" / "pretrain_loss.png").is_file() and (run / "report" / "distill_loss.png").is_file()
    # The teacher's kNN during pretraining (the pipeline passes its held-out set): 4 points over the 8 steps, the
    # last one the same number the eval stage measures on the exported teacher (same queries, k and size).
    from dinopipe.app.pipeline_report import HEALTHY
    from dinopipe.train.knn_probe import read_knn

    points = read_knn(run / "pretrain")
    assert [p["step"] for p in points] == [0, 3, 5, 8] and points[-1]["k"] == 20
    assert points[-1]["top1"] == pytest.approx(acc_t, abs=1e-12)
    assert "Teacher kNN during pretraining" in report and HEALTHY["knn_curve"] in report
    for link in [line.split("](")[1].rstrip(")") for line in report.splitlines() if line.startswith("![")]:
        assert (run / "report" / link).is_file(), link  # relative links that resolve
    assert f"report: {run / 'report' / 'report.md'}" in r.stdout


@slow
def test_rerun_skips_complete_stages_and_redoes_missing_ones(pipeline_run):
    cfg, run, _ = pipeline_run
    import shutil

    shutil.rmtree(run / "distill" / "export")
    r = run_pipeline(cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    for stage in ("curate", "pretrain", "eval"):
        assert f"== {stage}: outputs complete, skipped" in r.stdout
    assert "== distill\n" in r.stdout and "resuming from checkpoint" in r.stderr  # continues, not from scratch (log)
    assert {p.name for p in (run / "distill" / "export").iterdir()} == {"small", "tiny"}


@slow
def test_bad_key_exits_2(pipeline_run):
    cfg, _, _ = pipeline_run
    r = run_pipeline(cfg, "sample.n_imagez=3")
    assert r.returncode == 2 and "n_imagez" in r.stderr


def test_quickstart_eval_set_has_at_least_512_queries():
    """The quickstart's headline differences (~0.1) must stand several standard errors (~0.02 at n=512)
    above held-out-set noise."""
    from omegaconf import OmegaConf

    from dinopipe.app.pipeline import PipelineConfig

    cfg = OmegaConf.merge(OmegaConf.structured(PipelineConfig),
                          OmegaConf.load(REPO / "configs/pipeline/quickstart.yaml"))
    assert cfg.sample.enabled
    assert cfg.sample.eval_val_per_class * N_PHOTOS >= 512
    assert 20 in cfg.eval.k  # the k the README and the summary quote


def test_report_states_se_and_gain_over_own_random_init(tmp_path):
    from types import SimpleNamespace

    from dinopipe.app.pipeline_report import summary_lines, write_report

    ev = {"classes": 32, "train": 512, "val": 512, "knn_top1": {
        "random init (teacher arch)": {"20": 0.3}, "teacher": {"20": 0.5},
        "random init (student s arch)": {"20": 0.25}, "student s": {"20": 0.4}}}
    (tmp_path / "eval_results.json").write_text(json.dumps(ev))
    p = SimpleNamespace(report=tmp_path / "report", curated=tmp_path / "c", pretrain=tmp_path / "p",
                        distill=tmp_path / "d", eval=tmp_path / "eval_results.json")
    report = write_report(p, {}).read_text()
    se = {a: math.sqrt(a * (1 - a) / 512) for a in (0.3, 0.5, 0.25, 0.4)}
    assert f"| teacher | 0.500 ± {se[0.5]:.3f} | +0.200 ± {math.hypot(se[0.5], se[0.3]):.3f} |" in report
    # a student is compared with the random init of its own architecture, not the teacher's
    assert f"| student s | 0.400 ± {se[0.4]:.3f} | +0.150 ± {math.hypot(se[0.4], se[0.25]):.3f} |" in report
    assert f"| random init (teacher arch) | 0.300 ± {se[0.3]:.3f} | — |" in report
    lines = summary_lines(ev, 20)
    assert "512 held-out queries" in lines[0]
    assert any(line.split() == ["student", "s", "0.400", "±", f"{se[0.4]:.3f}", "+0.150", "±",
                                f"{math.hypot(se[0.4], se[0.25]):.3f}", "over", "random", "init", "(student",
                                "s", "arch)"] for line in lines)
