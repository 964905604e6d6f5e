"""`curate` end to end on real photos: exit codes, the manifest, the report, resumable embedding,
config mistakes caught before anything is written, and shards the training loader reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests._photos import bad_file_kinds, write_pool

from curation.cli import main
from curation.core.status import STATUSES
from tests.curation.conftest import fake_sbatch

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")
N_COPIED = 4


@pytest.fixture(scope="module")
def pool(tmp_path_factory, photos):
    """~45 real photos, 4 of them with 4 planted copies each, and one bad file of each kind."""
    root = tmp_path_factory.mktemp("cli") / "pool"
    names = sorted(photos)
    groups = write_pool(str(root), copies_of=names[::7][:N_COPIED], photos=photos)
    bad = bad_file_kinds(photos["chelsea"])
    (root / "bad").mkdir()
    for name, (data, _) in bad.items():
        (root / "bad" / name).write_bytes(data)
    return root, groups, len(bad)


def _args(cmd, pool_root, out, *extra):
    return [cmd, "--config", QUICKSTART, f"input.paths=[{pool_root}]", f"output.dir={out}",
            "progress=false", *extra]


@pytest.fixture(scope="module")
def run(pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli_out") / "curated"
    # vit_test exercises the backbone path: model embeddings drive the hierarchical rebalancing
    rc = main(_args("run", pool[0], out, "embed.model=vit_test"))
    return rc, out


def test_run_exits_0_and_the_manifest_adds_up(run, pool):
    rc, out = run
    assert rc == 0
    _, groups, n_bad = pool
    m = json.loads((out / "manifest.json").read_text())
    c = m["counts"]
    assert c["input"] == sum(len(g) for g in groups.values()) + n_bad
    assert c["input"] == sum(c[s] for s in STATUSES)
    assert c["unreadable"] == n_bad
    # every planted copy is gone (hash or copy duplicate), one image per group survives dedup
    assert c["hash_duplicates"] + c["copy_duplicates"] == N_COPIED * 4
    assert c["kept"] + c["not_selected"] == len(groups)
    assert c["kept"] == len(groups) // 2  # hierarchical, target_size null: half the deduplicated pool
    assert (out / "config.yaml").read_text().count("model: vit_test") == 1


def test_report_has_plots_and_a_summary_with_the_counts(run):
    rc, out = run
    rep = out / "report"
    for png in ("similarity", "components", "clusters", "duplicates"):
        f = rep / f"{png}.png"
        assert f.stat().st_size > 5000 and f.read_bytes()[:4] == b"\x89PNG", png
    text = (rep / "summary.md").read_text()
    c = json.loads((out / "manifest.json").read_text())["counts"]
    for s in ("input",) + STATUSES:
        assert f"| {s} | {c[s]} |" in text
    assert "candidates at cosine > 0.45" in text and "verified on pixels" in text  # dedup
    # no eval set in this run: the report says so rather than a threshold nothing was compared with
    assert "decontamination: no eval set (input.eval_paths is empty), nothing removed" in text
    assert "entropy" in text and "report/duplicates.png" in text


def test_shards_load_through_the_training_loader(run):
    from dinopipe.data.decode import safe_decode
    from dinopipe.data.loader import list_pool

    _, out = run
    kept = {l.split("\t")[0] for l in (out / "decisions.tsv").read_text().splitlines()[1:]
            if l.split("\t")[2] == "kept"}
    refs, read = list_pool([str(out / "shards")])
    assert len(refs) == len(kept)
    for ref in refs:
        img, reason = safe_decode(read(ref))
        assert img is not None, (ref.id, reason)


def test_embed_twice_does_not_recompute(run, pool, capsys):
    _, out = run
    npys = sorted((out / "embeddings").rglob("*.npy"))
    before = {p: p.stat().st_mtime_ns for p in npys}
    capsys.readouterr()
    assert main(_args("embed", pool[0], out, "embed.model=vit_test")) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("embed:")][0]
    counts = json.loads(line[len("embed:"):])
    for space in ("descriptor", "model"):
        assert counts[space]["shards_written"] == 0
        assert counts[space]["shards_skipped"] == counts[space]["shards"] >= 1
    assert {p: p.stat().st_mtime_ns for p in npys} == before


@pytest.mark.parametrize("override, key", [
    ("dedup.treshold=0.5", "dedup.treshold"),  # a typo: unknown key
    ("dedup.k=many", "dedup.k"),  # wrong type
    ("rebalance.mode=sample", "input.seed_paths"),  # needs seeds
    ("embed.image_size=100", "embed.image_size"),  # not a multiple of vit_test's patch 14
    ("embed.model=no_such_model", "embed.model"),
])
def test_config_mistakes_exit_2_naming_the_key_before_writing(pool, tmp_path, capsys, override,
                                                              key):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        main(_args("run", pool[0], out, "embed.model=vit_test", override))
    assert e.value.code == 2
    assert key in capsys.readouterr().err
    assert not out.exists()


def test_dinopipe_curate_forwards(pool, tmp_path, capsys):
    from dinopipe.app.cli import main as dinopipe_main

    with pytest.raises(SystemExit) as e:
        dinopipe_main(["curate", "dedup", "--config", QUICKSTART, "output.dir=" + str(tmp_path / "x"),
                       f"input.paths=[{pool[0]}]", "bogus.key=1"])
    assert e.value.code == 2 and "bogus" in capsys.readouterr().err


def test_steps_alone_as_a_slurm_array_then_the_rest(pool, tmp_path, capsys):
    """What slurm/curate.sbatch + curate_finish.sbatch run: 2 embed tasks, then each step."""
    root, groups, n_bad = pool
    out = tmp_path / "steps"
    extra = ("rebalance.mode=none", "embed.num_tasks=2")
    assert main(_args("embed", root, out, *extra, "embed.task_index=1")) == 0
    capsys.readouterr()
    assert main(_args("dedup", root, out, *extra)) == 75  # task 0 has not embedded yet: rerun, not a mistake
    assert "tasks [0] of 2 have not finished" in capsys.readouterr().err
    assert main(_args("embed", root, out, *extra, "embed.task_index=0")) == 0
    for step in ("dedup", "decontaminate", "rebalance", "write", "report"):
        assert main(_args(step, root, out, *extra)) == 0, step
    c = json.loads((out / "manifest.json").read_text())["counts"]
    assert c["kept"] == len(groups) and c["unreadable"] == n_bad
    assert c["hash_duplicates"] + c["copy_duplicates"] == N_COPIED * 4
    assert "report/summary.md" in capsys.readouterr().out


def test_a_step_before_its_inputs_exist_says_what_to_run(pool, tmp_path, capsys):
    assert main(_args("rebalance", pool[0], tmp_path / "empty")) == 2
    assert "run the 'decontaminate' step first" in capsys.readouterr().err


def test_submit_script_chains_the_finish_job_after_the_array(tmp_path):
    """slurm/submit_curation.sh against a stand-in sbatch that records its arguments."""
    import subprocess

    log, env = fake_sbatch(tmp_path, ";cluster")
    env["CURATE_ACCOUNT"] = "acct"
    res = subprocess.run(
        ["bash", str(ROOT / "slurm" / "submit_curation.sh"), "-n", "3", "-p", "gpu", "--logs",
         str(tmp_path / "logs"), "--", "--config", QUICKSTART, "output.dir=/o"],
        env=env, capture_output=True, text=True, check=True)
    embed, finish = log.read_text().splitlines()
    assert "--array=0-2" in embed and "--partition=gpu" in embed and "--account=acct" in embed
    assert embed.split("curate.sbatch ")[1] == f"--config {QUICKSTART} output.dir=/o"
    assert "--dependency=afterok:1001" in finish and "curate_finish.sbatch" in finish
    assert "1001" in res.stdout and "1002" in res.stdout
