"""The one-command pipeline on its embedded sample pool: every stage runs, the report shows the kNN table,
and a rerun continues instead of starting over."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

TINY_TRAIN = ["train.epochs=2", "train.epoch_length=4", "train.log_every=1", "train.progress=false",
              "data.num_workers=0", "crops.local_crops_number=2"]


def run_pipeline(cfg_path, *overrides):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "dinopipe.cli", "pipeline", "--config", str(cfg_path), *overrides],
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


def test_all_stages_produce_their_outputs(pipeline_run):
    _, run, r = pipeline_run
    m = json.loads((run / "curated" / "manifest.json").read_text())
    assert m["counts"]["unreadable"] == 3  # the planted corrupt files, counted not fatal
    assert (run / "pretrain" / "export" / "teacher" / "model.safetensors").is_file()
    assert {p.name for p in (run / "distill" / "export").iterdir()} == {"small", "tiny"}
    ev = json.loads((run / "eval_results.json").read_text())
    assert set(ev["knn_top1"]) == {"random init (teacher arch)", "teacher", "student small", "student tiny"}
    for accs in ev["knn_top1"].values():
        assert all(0.0 <= a <= 1.0 for a in accs.values())
    report = (run / "report" / "report.md").read_text()
    assert "| teacher |" in report and "student small" in report
    assert (run / "report" / "pretrain_loss.png").is_file() and (run / "report" / "distill_loss.png").is_file()
    for link in [line.split("](")[1].rstrip(")") for line in report.splitlines() if line.startswith("![")]:
        assert (run / "report" / link).is_file(), link  # relative links that resolve
    assert f"report: {run / 'report' / 'report.md'}" in r.stdout


def test_rerun_skips_complete_stages_and_redoes_missing_ones(pipeline_run):
    cfg, run, _ = pipeline_run
    import shutil

    shutil.rmtree(run / "distill" / "export")
    r = run_pipeline(cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    for stage in ("curate", "pretrain", "eval"):
        assert f"== {stage}: outputs complete, skipped" in r.stdout
    assert "== distill\n" in r.stdout and "resuming from checkpoint" in r.stdout  # continues, not from scratch
    assert {p.name for p in (run / "distill" / "export").iterdir()} == {"small", "tiny"}


def test_bad_key_exits_2(pipeline_run):
    cfg, _, _ = pipeline_run
    r = run_pipeline(cfg, "sample.n_imagez=3")
    assert r.returncode == 2 and "n_imagez" in r.stderr
