"""The distributed k-means in the Slurm chain: both submitters put a dedup/decontaminate job, an
`srun --ntasks N` k-means job and the rebalance/write/report job after the embedding (and search)
work, each after the one before succeeded; a chain that cannot work is refused before submitting."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dinopipe.app import cli as dinopipe_cli
from tests.curation.conftest import fake_sbatch

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


def _submit(tmp_path, *extra):
    return dinopipe_cli.main(["slurm", "submit", "--config", "configs/slurm/quickstart.yaml", "--dry-run",
                              f"output_dir={tmp_path}", f"input_paths=[{tmp_path}]", "stages=[curate]", *extra])


def test_dinopipe_submit_puts_the_kmeans_job_between_decontamination_and_selection(tmp_path, capsys):
    assert _submit(tmp_path, "curate.kmeans_tasks=3", "curate.search_tasks=2") == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "sbatch" in ln]
    assert [ln.split("=")[0] for ln in lines] == ["curate_embed", "curate_index", "curate_search",
                                                   "curate_prepare", "curate_kmeans", "curate_finish"]
    prepare, kmeans, finish = lines[3:]
    assert "CURATE_STEPS='dedup decontaminate'" in prepare and '"--dependency=afterok:${curate_search}"' in prepare
    assert "slurm/curate_kmeans.sbatch" in kmeans and "--ntasks=3" in kmeans
    assert '"--dependency=afterok:${curate_prepare}"' in kmeans
    assert "CURATE_STEPS='rebalance write report'" in finish and '"--dependency=afterok:${curate_kmeans}"' in finish
    for line in (kmeans, finish):  # both read/write the same folder, under output.dir
        assert "rebalance.kmeans_dir=kmeans" in line and f"output.dir={tmp_path}/curated" in line
    assert "rebalance.kmeans_dir" not in prepare
    # default 0: one finishing job clusters in-process, as before
    assert _submit(tmp_path) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "sbatch" in ln]
    assert [ln.split("=")[0] for ln in lines] == ["curate_embed", "curate_finish"]
    assert "kmeans" not in lines[1]


@pytest.mark.parametrize("extra,key", [(["curate.kmeans_tasks=-1"], "curate.kmeans_tasks"),
                                       (["curate.kmeans_tasks=2", "curate:rebalance.mode=none"],
                                        "curate.kmeans_tasks")])
def test_a_kmeans_chain_that_cannot_work_exits_2_naming_the_key(tmp_path, capsys, extra, key):
    with pytest.raises(SystemExit) as exc:
        _submit(tmp_path, *extra)
    assert exc.value.code == 2 and key in capsys.readouterr().err


def test_submit_curation_sh_chains_the_kmeans_job(tmp_path):
    log, env = fake_sbatch(tmp_path)
    subprocess.run(["bash", str(ROOT / "slurm" / "submit_curation.sh"), "-n", "2", "--kmeans-tasks", "4", "--logs",
                    str(tmp_path / "logs"), "--", "--config", QUICKSTART], env=env, check=True, capture_output=True)
    embed, prepare, kmeans, finish = log.read_text().splitlines()
    assert "CURATE_STEPS=dedup decontaminate" in prepare and "--dependency=afterok:1001" in prepare
    assert "curate_kmeans.sbatch" in kmeans and "--ntasks=4" in kmeans and "afterok:1002" in kmeans
    assert "CURATE_STEPS=rebalance write report" in finish and "afterok:1003" in finish
    assert kmeans.endswith("rebalance.kmeans_dir=kmeans") and finish.endswith("rebalance.kmeans_dir=kmeans")
    bad = subprocess.run(["bash", str(ROOT / "slurm" / "submit_curation.sh"), "--kmeans-tasks", "x", "--dry-run",
                          "--", "--config", QUICKSTART], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "--kmeans-tasks" in bad.stderr


def test_dinopipe_submit_shards_the_seed_retrieval_after_decontamination(tmp_path, capsys):
    """rebalance.mode=sample with seeds: the retrieval index needs the images kept after decontamination, so
    the chain gets prepare -> retrieval index -> retrieval search array before the finishing job."""
    (tmp_path / "seeds").mkdir()
    assert _submit(tmp_path, "curate.search_tasks=2", "curate:rebalance.mode=sample",
                   f"curate:input.seed_paths=[{tmp_path}/seeds]") == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "sbatch" in ln]
    assert [ln.split("=")[0] for ln in lines] == ["curate_embed", "curate_index", "curate_search", "curate_prepare",
                                                   "curate_retrieval_index", "curate_retrieval_search",
                                                   "curate_finish"]
    prepare, r_index, r_search, finish = lines[3:]
    assert "CURATE_STEPS='dedup decontaminate'" in prepare
    assert "CURATE_STEPS=index" in r_index and '"--dependency=afterok:${curate_prepare}"' in r_index
    assert "CURATE_STEP=search" in r_search and "--array=0-1" in r_search
    assert '"--dependency=afterok:${curate_retrieval_index}"' in r_search
    assert "CURATE_STEPS='rebalance write report'" in finish
    assert '"--dependency=afterok:${curate_retrieval_search}"' in finish


def test_without_seeds_the_search_chain_has_no_retrieval_pass(tmp_path, capsys):
    assert _submit(tmp_path, "curate.search_tasks=2", "curate:rebalance.mode=none") == 0
    names = [ln.split("=")[0] for ln in capsys.readouterr().out.splitlines() if "sbatch" in ln]
    assert names == ["curate_embed", "curate_index", "curate_search", "curate_finish"]
