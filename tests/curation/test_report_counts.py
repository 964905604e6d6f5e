"""One set of numbers: the log (step summaries), the manifest, summary.md and the plots' titles and legends
agree on copy duplicates, hash duplicates, decontaminated images and the number of clusters. On main the
quickstart report printed 353 / 145 / 388 copy duplicates, 662 / 614 decontaminated and 8 / 3 clusters."""

from __future__ import annotations

import json
import re
import shutil

import curation.report.plots as R
from curation.pipeline import run_curation
from tests.curation.test_pipeline import _config


def test_log_manifest_summary_and_plots_agree(pool_dir, photos, tmp_path, monkeypatch):
    root = pool_dir[0]
    ev = tmp_path / "eval"
    ev.mkdir()
    for name in sorted(photos)[:12:3]:  # four pool photos (some with copies) are test images too
        shutil.copy(root / f"{name}.jpg", ev / f"{name}.jpg")
    texts: dict[str, list[str]] = {}
    real_save = R._save

    def capture(fig, path):  # every title, legend and label each plot shows
        texts[path.rsplit("/", 1)[-1]] = [t.get_text() for t in fig.findobj(lambda o: hasattr(o, "get_text"))]
        return real_save(fig, path)

    monkeypatch.setattr(R, "_save", capture)
    out = tmp_path / "out"
    cfg = _config([str(root)], out, [str(ev)], embed={"num_workers": 0},
                  rebalance={"mode": "hierarchical", "levels": [6, 3], "target_size": 20})
    cfg.report.enabled = True
    m = run_curation(cfg)
    c = m["counts"]
    steps = {s: json.loads((out / "steps" / f"{s}.json").read_text()) for s in ("dedup", "decontaminate")}
    assert c["copy_duplicates"] >= 1 and c["hash_duplicates"] >= 1 and c["decontaminated"] >= 4
    # the log lines are the step summaries: the same numbers as the manifest
    assert steps["dedup"]["copy_duplicates"] == c["copy_duplicates"]
    assert steps["dedup"]["hash_duplicates"] == c["hash_duplicates"]
    assert steps["decontaminate"]["decontaminated"] == c["decontaminated"]
    summary = (out / "report" / "summary.md").read_text()
    for s in ("copy_duplicates", "hash_duplicates", "decontaminated", "kept", "not_selected"):
        assert re.search(rf"\| {s} \| {c[s]} \|", summary), s
    comp = " ".join(texts["components.png"])
    assert f"removed {c['copy_duplicates']} copy + {c['hash_duplicates']} hash duplicates" in comp
    sim = " ".join(texts["similarity.png"])
    assert f"decontaminated: {c['decontaminated']} images" in sim
    assert f"removed: {c['copy_duplicates']} copy duplicates" in sim
    k = int(re.search(r"over (\d+) clusters", summary).group(1))
    assert f", {k} clusters)" in " ".join(texts["clusters.png"])
    assert f"rebalancing keeps {c['kept']} of" in summary
