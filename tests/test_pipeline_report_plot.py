"""The report says, one sentence per curve, what a healthy run looks like (the DINO loss rising early is expected)."""

import json
from types import SimpleNamespace

from dinopipe.app.pipeline_report import HEALTHY, write_report


def test_report_says_what_a_healthy_run_looks_like_for_each_curve(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    pre = tmp_path / "pretrain"
    pre.mkdir()
    rows = [{"step": i, "loss": 9 + 0.01 * i, "dino_loss": 5 + 0.02 * i, "ibot_loss": 4.0, "koleo_loss": -0.1,
             "phase": "base"} for i in range(50)]
    (pre / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    p = SimpleNamespace(report=tmp_path / "report", curated=tmp_path / "curated", pretrain=pre,
                        distill=tmp_path / "distill", eval=tmp_path / "eval_results.json")
    report = write_report(p, {}).read_text()
    for key in ("loss", "dino_loss", "ibot_loss", "koleo_loss", "knn"):
        assert HEALTHY[key] in report
    assert "rises during the teacher-temperature warm-up" in report
    assert (tmp_path / "report" / "pretrain_loss.png").is_file()
