"""`curate run`'s embed step as W tasks (issue 40), as a Slurm array embeds: with tasks.count=W the pool is
listed, read and embedded by W tasks (each its hash share, its own parts), never whole by the process running
the chain, and every decision is the one of a single embedding process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from curation.cli import main
from curation.core.embstore import open_embeddings

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


def _run(pool, out, *extra) -> dict:
    log = out.parent / f"{out.name}.progress.jsonl"
    args = ["run", "--progress", str(log), "--config", QUICKSTART, f"input.paths=[{pool}]", f"output.dir={out}",
            "progress=false", "embed.num_workers=0", "report.enabled=false", "rebalance.target_size=30", *extra]
    assert main(args) == 0
    return {r["fn"]: r["tasks"] for line in log.read_text().splitlines() for r in json.loads(line)["runs"]}


@pytest.mark.parametrize("model, split", [("vit_test", ["tasks.count=3", "tasks.launcher=inline"]),
                                          (None, ["tasks.count=2", "tasks.launcher=local"])])
def test_run_embeds_as_w_tasks_and_decides_as_one_process(pool_dir, tmp_path, model, split):
    pool = pool_dir[0]
    # embed.num_workers=2: a local task (a pool worker) cannot start DataLoader workers, it decodes itself
    m = ([f"embed.model={model}"] if model else []) + ["embed.num_workers=2"]
    _run(pool, tmp_path / "one", *m, "tasks.count=1")
    runs = _run(pool, tmp_path / "w", *m, *split)
    w = int(split[0].split("=")[1])
    assert runs.get("embed_task") == w  # the embedding ran as W tasks of the runner
    done = sorted(p.name for p in (tmp_path / "w" / "embeddings" / "descriptor").glob("task-*-of-*.json"))
    assert done == [f"task-{t:05d}-of-{w:05d}.json" for t in range(w)]
    for name in ("descriptor",) + (("model",) if model else ()):
        a, b = (open_embeddings(str(tmp_path / d / "embeddings" / name)) for d in ("one", "w"))
        assert a.id_strings(np.arange(len(a))) == b.id_strings(np.arange(len(b)))  # the same rows, in id order
        # other batches (each task batches its own share): the same vectors up to fp16 rounding, not bit for bit
        np.testing.assert_allclose(a.rows(np.arange(len(a))), b.rows(np.arange(len(b))), atol=2e-3)
    assert (tmp_path / "one" / "decisions.tsv").read_bytes() == (tmp_path / "w" / "decisions.tsv").read_bytes()
    one, ws = (json.loads((tmp_path / d / "manifest.json").read_text())["counts"] for d in ("one", "w"))
    assert one == ws and one["kept"] > 0
