"""`curate plan` (the curation cost model) and the sharded steps in the Slurm submitters."""

from __future__ import annotations

import subprocess
from pathlib import Path

from curation.cli import main
from curation.plan import code_bytes, parse_count, plan
from dinopipe import cli as dinopipe_cli
from tests.curation.conftest import fake_sbatch

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


def test_plan_sizes_the_index_and_places_the_search(capsys):
    assert parse_count("1.2B") == 1_200_000_000 and parse_count("142M") == 142_000_000
    assert code_bytes("ivf", 1024, 0) == 2048 and code_bytes("ivf_pq", 1024, 64) == 64
    by = {s.name: s for s in plan(142_000_000, 1024, "ivf_pq", 64, nodes=20, gpus_per_node=8)}
    # 142M x (64 B codes + 8 B id) = 9.5 GiB (+ centroids): fits one 32 GB V100 -> one task per GPU
    assert 9.5 < by["search (dedup)"].gpu_gib < 10.5 and by["search (dedup)"].tasks == 160
    big = {s.name: s for s in plan(1_200_000_000, 1024, "ivf_pq", 64, nodes=20, gpus_per_node=8)}
    assert big["search (dedup)"].tasks == 20  # 81 GiB: sharded over a node's 8 GPUs
    assert big["embed"].hours > 8 * by["embed"].hours  # time grows with the pool
    fp16 = {s.name: s for s in plan(142_000_000, 1024, "ivf", nodes=20, gpus_per_node=8)}
    assert "does not fit the GPUs" in fp16["search (dedup)"].note  # 272 GiB of fp16 codes
    assert main(["plan", "--pool", "1.2B", "--index", "ivf_pq"]) == 0
    out = capsys.readouterr().out
    assert "1,200,000,000 x 1024-d" in out and "| search (dedup) | 20 |" in out
    assert main(["plan", "--pool", "lots"]) == 2
    assert "--pool 'lots'" in capsys.readouterr().err


def test_submitters_chain_index_and_search_between_embed_and_finish(tmp_path, capsys):
    log, env = fake_sbatch(tmp_path)
    subprocess.run(["bash", str(ROOT / "slurm" / "submit_curation.sh"), "-n", "2", "-s", "3", "--logs",
                    str(tmp_path / "logs"), "--", "--config", QUICKSTART], env=env, check=True, capture_output=True)
    embed, index, search, finish = log.read_text().splitlines()
    assert "CURATE_STEPS=index" in index and "--dependency=afterok:1001" in index
    assert "CURATE_STEP=search" in search and "--array=0-2" in search and "afterok:1002" in search
    assert "afterok:1003" in finish and "curate_finish.sbatch" in finish
    rc = dinopipe_cli.main(["slurm", "submit", "--config", "configs/slurm/quickstart.yaml", "--dry-run",
                            f"output_dir={tmp_path}", f"input_paths=[{tmp_path}]", "stages=[curate]",
                            "curate.search_tasks=3"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "sbatch" in ln]
    assert rc == 0 and [ln.split("=")[0] for ln in lines] == ["curate_embed", "curate_index", "curate_search",
                                                               "curate_finish"]
    assert "CURATE_STEP=search" in lines[2] and "--array=0-2" in lines[2]
    assert '"--dependency=afterok:${curate_search}"' in lines[3]
