"""`curate plan` (the curation cost model: the chain's task counts, rates measured or ASSUMED), the tables
rendered from the benches' JSON, and the sharded steps in the Slurm submitters."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.tools import rates_from_bench, render_tables
from curation.cli import main
from curation.config import TasksConfig, task_plan
from curation.plan import chain_tasks, code_bytes, parse_count, plan
from curation.plan_rates import load_rates
from dinopipe.app import cli as dinopipe_cli
from tests.curation.conftest import fake_sbatch

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


def test_plan_sizes_the_index_and_places_the_search(capsys):
    assert parse_count("1.2B") == 1_200_000_000 and parse_count("142M") == 142_000_000
    assert code_bytes("ivf", 1024, 0) == 2048 and code_bytes("ivf_pq", 1024, 64) == 64
    by = {s.name: s for s in plan(142_000_000, 1024, "ivf_pq", 64, nodes=20, gpus_per_node=8, search_tasks=160)}
    # 142M x (64 B codes + 8 B id) = 9.5 GiB (+ centroids): fits one 32 GB V100 -> one array task per GPU
    assert 9.5 < by["search (dedup)"].gpu_gib < 10.5 and by["search (dedup)"].tasks == 160
    big = {s.name: s for s in plan(1_200_000_000, 1024, "ivf_pq", 64, nodes=20, gpus_per_node=8, search_tasks=20)}
    assert "8 GPU(s) per task" in big["search (dedup)"].note  # 81 GiB: sharded over a node's 8 GPUs
    assert big["embed"].hours > 8 * by["embed"].hours  # time grows with the pool
    fp16 = {s.name: s for s in plan(142_000_000, 1024, "ivf", nodes=20, gpus_per_node=8, search_tasks=20)}
    assert "does not fit the GPUs" in fp16["search (dedup)"].note  # 272 GiB of fp16 codes
    assert main(["plan", "--pool", "1.2B", "--index", "ivf_pq", "--search-tasks", "20"]) == 0
    out = capsys.readouterr().out
    assert "1,200,000,000 x 1024-d" in out and "| search (dedup) | 20 |" in out
    assert main(["plan", "--pool", "lots"]) == 2
    assert "--pool 'lots'" in capsys.readouterr().err
    assert main(["plan", "--tasks", "0"]) == 2 and "--tasks must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("pool,count,cores", [(40_000, None, 8), (66_000, None, 16), (10_000_000, None, 2),
                                              (10_000_000, 3, 64), (1_200_000_000, None, 128)])
def test_plan_task_counts_are_the_chains(pool, count, cores):
    """Every step's W is what curation.config.task_plan -- the function the chain calls -- gives for the rows
    that step sees: the hash dedup all rows, the index, copy search and verification the hash survivors, ..."""
    tw = chain_tasks(pool, count, cores, "ivf", hash_dup=0.01, copy_dup=0.2, keep_fraction=0.5)
    cfg = TasksConfig(count=count)

    def chain_w(n):
        return task_plan(cfg, n, cores)["tasks"]

    surv = pool - int(pool * 0.01)
    rows = surv - int(pool * 0.2)
    assert tw["hash dedup"] == chain_w(pool)
    for step in ("index add", "search (dedup)", "verification", "decontaminate"):
        assert tw[step] == chain_w(surv), step
    assert tw["k-means"] == tw["sampling"] == chain_w(rows)  # tasks.launcher local: the tree as W ranks
    assert tw["write shards"] == tw["decisions"] == chain_w(int(rows * 0.5))
    assert tw["index train"] == tw["index merge"] == tw["grouping"] == 1  # one process each
    if count is None:  # the default: 1 up to one block of rows, else min(cores, 8)
        assert tw["hash dedup"] == (1 if pool <= 65536 else min(cores, 8))
    if pool == 66_000:  # the hash dedup sees 66,000 rows (> one block), the kNN 65,340 (one block): W differs
        assert (tw["hash dedup"], tw["search (dedup)"]) == (8, 1)
    # the plan's rows carry these counts
    by = {s.name: s for s in plan(pool, 384, "ivf", nodes=1, gpus_per_node=0, cpus_per_task=cores, tasks=count,
                                  levels=[1000, 10], pairs_per_image=1.0)}
    for step in ("hash dedup", "index add", "search (dedup)", "verification", "decontaminate", "sampling",
                 "write shards", "decisions"):
        assert by[step].tasks == chain_tasks(pool, count, cores, "ivf")[step], step
    assert by["k-means level 2 (10)"].tasks == chain_tasks(pool, count, cores, "ivf")["k-means"]


def test_plan_arrays_gpu_and_flat_builds_follow_the_chain():
    tw = chain_tasks(10_000_000, 4, 8, "ivf", search_tasks=20, kmeans_tasks=64)
    assert (tw["search (dedup)"], tw["decontaminate"], tw["k-means"], tw["hash dedup"]) == (20, 20, 64, 4)
    # a flat index is added in one process and not merged; an IVF on GPUs by W add tasks, merged on disk
    # (curation.knn.shards.KnnJob.build, issue 40)
    gpu = chain_tasks(10_000_000, 4, 8, "ivf", use_gpu=True)
    flat = chain_tasks(10_000_000, 4, 8, "flat")
    assert flat["index add"] == 1 and flat["index merge"] == 0
    assert gpu["index add"] == 4 and gpu["index merge"] == 1
    assert chain_tasks(10_000_000, 4, 8, eval_rows=0)["decontaminate"] == 0
    assert chain_tasks(10_000_000, 4, 8, hierarchical=False)["sampling"] == 0
    assert "index merge" in {s.name for s in plan(10_000_000, 384, "ivf", gpus_per_node=8, tasks=4)}


def test_plan_of_an_srun_finishing_job_gives_every_task_its_own_cores():
    """--finish-tasks N (submit_curation.sh --finish-tasks: tasks.launcher=srun tasks.count=N): every sharded step
    of the finishing job runs N tasks, each with --cpus-per-task cores of its own, so the steps that were bound to
    one machine's cores (verification, hash dedup, shard writing) shrink with N; the k-means tree's ranks are the
    srun tasks."""
    kw = dict(gpus_per_node=0, nodes=4, cpus_per_task=8, pairs_per_image=40, levels=[100_000])
    one = {s.name: s for s in plan(100_000_000, 384, "ivf_sq8", **kw)}
    srun = {s.name: s for s in plan(100_000_000, 384, "ivf_sq8", finish_tasks=32, **kw)}
    for name in ("hash dedup", "index add", "verification", "decontaminate", "sampling", "write shards", "decisions"):
        assert srun[name].tasks == 32, name
    assert srun["k-means level 1 (100,000)"].tasks == 32 and "srun tasks" in srun["k-means level 1 (100,000)"].note
    # one machine of 8 cores ran 8 verification tasks at once; 32 tasks with 8 cores each run all 32 at once
    assert srun["verification"].hours == pytest.approx(one["verification"].hours * 8 / 32)
    assert main(["plan", "--pool", "1M", "--finish-tasks", "-1"]) == 2


def test_rates_measured_from_the_bench_json_else_assumed(tmp_path, capsys):
    """A rate the bench's JSON gives is printed as measured with its source; one it does not give, ASSUMED."""
    run = {"n": 1_000_000, "dim": 384, "tasks": 1, "meta": {"date": "2031-01-02", "machine": "box", "command": "c"},
           "steps": {"dedup": {"runs": [{"fn": "pairs_task", "tasks": 1, "task_s": 4.0}]},
                     "write": {"runs": [{"fn": "_decisions_part_task", "tasks": 1, "task_s": 2.0}]}},
           "step_results": {"dedup": {"hash_duplicates": 10_000}, "rebalance": {"n_pool": 900_000}}}
    run4 = {**run, "tasks": 4, "steps": {"dedup": {"runs": [{"fn": "pairs_task", "tasks": 4, "task_s": 1.5}]}}}
    small = {**run, "n": 1000}
    scale = tmp_path / "scale.json"
    scale.write_text(json.dumps({"runs": [small, run4, run]}))
    rates_path = tmp_path / "rates.json"
    assert rates_from_bench.main(["--scale", str(scale), "--out", str(rates_path)]) == 0
    doc = json.loads(rates_path.read_text())["rates"]
    # the largest N, its W = 1 run: 1M rows / 1 task / 4 s; decisions 1M / 2 s
    assert doc["hash_dedup"]["value"] == 250_000.0 and doc["decisions"]["value"] == 500_000.0
    assert doc["hash_dedup"]["source"]["date"] == "2031-01-02" and "index_add" not in doc
    rates = load_rates(str(rates_path))
    assert rates["hash_dedup"].value == 250_000.0 and rates["hash_dedup"].measured
    assert not rates["write_shards"].measured and rates["write_shards"].mark() == "ASSUMED"
    capsys.readouterr()
    assert main(["plan", "--pool", "10M", "--rates", str(rates_path), "--gpus-per-node", "0"]) == 0
    out = capsys.readouterr().out
    row = {ln.split("|")[1].strip(): ln for ln in out.splitlines() if ln.startswith("| ")}
    assert "2.5e+05 rows/s per task, measured (bench_curation_scale.py, 2031-01-02, N=1,000,000 W=1)" in row["hash dedup"]
    assert "ASSUMED" in row["write shards"] and "measured" not in row["write shards"]
    assert "ASSUMED" in row["grouping"]
    # the hash dedup's time follows the rate: 10M rows over min(W, cores) tasks at 250k rows/s each
    by = {s.name: s for s in plan(10_000_000, 384, "ivf", gpus_per_node=0, cpus_per_task=8, rates=rates)}
    assert abs(by["hash dedup"].hours * 3600 - 10_000_000 / (250_000 * 8)) < 1e-6
    # a run made before the benches recorded where: --stamp adds its meta, leaving runs that have one alone
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"runs": [{k: v for k, v in run.items() if k != "meta"}, run]}))
    assert rates_from_bench.main(["--scale", str(old), "--stamp", "date=2030-05-06", "machine=m", "command=c"]) == 0
    stamped = json.loads(old.read_text())["runs"]
    assert stamped[0]["meta"]["date"] == "2030-05-06" and stamped[1]["meta"] == run["meta"]
    assert rates_from_bench.main(["--scale", str(old), "--stamp", "colour=red"]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"rates": {"hash_dedup": {"value": -1}}}')
    assert main(["plan", "--rates", str(bad)]) == 2 and "bad.json" in capsys.readouterr().err
    assert main(["plan", "--rates", str(tmp_path / "none.json")]) == 2


def test_tables_render_deterministically_into_their_markers_only(tmp_path):
    scale = ROOT / "bench" / "results" / "scale_1m.json"
    doc, readme = tmp_path / "doc.md", tmp_path / "README.md"
    doc.write_text("# Page\n\nkept above\n<!-- begin: scale-table -->\nold typed table\n<!-- end: scale-table -->\n"
                   "between\n<!-- begin: plan-check -->\n<!-- end: plan-check -->\n"
                   "<!-- begin: plan-tables -->\n<!-- end: plan-tables -->\nkept below\n")
    readme.write_text("intro\n<!-- begin: summary-scale-table -->\n<!-- end: summary-scale-table -->\noutro\n")
    rates = str(tmp_path / "rates.json")  # from the same JSON (bench/rates.json may hold later runs)
    assert rates_from_bench.main(["--scale", str(scale), "--out", rates]) == 0
    assert render_tables.render([str(scale)], rates, str(doc), str(readme)) == [str(doc), str(readme)]
    first = doc.read_text()
    assert first.startswith("# Page\n\nkept above\n<!-- begin: scale-table -->\n") and first.endswith("kept below\n")
    assert "old typed table" not in first and "\nbetween\n" in first
    # the growth table: every runner call of the JSON, W = 4 / W = 1 heap, decisions equal across W
    assert "| N=1M W=1 | N=1M W=4 |" in first and "index add" in first and "heap W=4 / W=1 at 1M" in first
    assert "| decisions equal across W | yes | yes |" in first
    assert "curate plan --pool 1.2B" in first and "measured (" in first and "ASSUMED" in first
    # the model beside the bench at the bench's shape: at W = 1 a rows/s step's rate is the bench's own
    assert "| hash dedup (rate: this bench) | 8.4 / 8.4 (x1.00) |" in first
    assert render_tables.render([str(scale)], rates, str(doc), str(readme)) == []  # idempotent
    assert doc.read_text() == first and "d5dd1b51" in readme.read_text()
    # several JSON files: a second size gives the log-log slope per W (here a run at 2N taking twice as long)
    twice = json.loads(scale.read_text())
    for run in twice["runs"]:
        run["total_s"] += 1
        run["n"] *= 2
        for step in run["steps"].values():
            step["task_s"] *= 2
            for call in step["runs"]:
                call["task_s"] *= 2
    # a bench resumed from the 1M file copies its runs (without meta): each (N, W) is one column, with its meta
    copied = json.loads(scale.read_text())["runs"]
    for run in copied:
        run.pop("meta")
    (tmp_path / "scale_2m.json").write_text(json.dumps({"runs": copied + twice["runs"]}))
    runs = rates_from_bench.load_runs([str(scale), str(tmp_path / "scale_2m.json")])
    assert sorted((r["n"], r["tasks"]) for r in runs) == [(10**6, 1), (10**6, 4), (2 * 10**6, 1), (2 * 10**6, 4)]
    assert all(r.get("meta") for r in runs if r["n"] == 10**6)
    table = render_tables.growth_table(runs)
    head = table.splitlines()[0]
    hash_row = next(ln for ln in table.splitlines() if "hash pairs" in ln)
    assert "| slope W=1 | slope W=4 | heap W=4 / W=1 at 2M |" in head
    assert hash_row.split("|")[-4:-2] == [" 1.00 ", " 1.00 "]
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="begin: scale-table"):
        render_tables.render([str(scale)], rates, str(tmp_path / "plain.md"), str(readme))


def test_the_task_memory_table_judges_each_call_against_the_goals(tmp_path):
    """render_tables --tasks-memory: at the largest N, a call split over W tasks meets the goal when its largest
    task at W = 4 holds <= 0.3 x W = 1's heap; a one-process phase when it holds <= 8 B per row; the pool generator
    (the simulation's input) is left out; the region is written between its markers."""
    runs = json.loads((ROOT / "bench" / "results" / "scale_10m_d128.json").read_text())["runs"]
    w1, w4 = (next(r for r in runs if r["tasks"] == w and r["n"] == 10**7) for w in (1, 4))

    def call(run, step, fn):
        return next(c for c in run["steps"][step]["runs"] if c["fn"] == fn)

    call(w1, "dedup", "pairs_task")["task_heap_mb"], call(w4, "dedup", "pairs_task")["task_heap_mb"] = 1000.0, 290.0
    call(w1, "dedup", "add_task")["task_heap_mb"], call(w4, "dedup", "add_task")["task_heap_mb"] = 1000.0, 310.0
    for r, mb in ((w1, 70.0), (w4, 100.0)):  # 100 MB at 10M rows: 10.5 B per row
        call(r, "dedup", "grouping")["task_heap_mb"] = mb
    # an inline W = 1 call's small heap is no baseline (it reused heap freed by an earlier call); a fresh process's
    # (tasks.isolate) is
    call(w1, "dedup", "search_task")["task_heap_mb"], call(w4, "dedup", "search_task")["task_heap_mb"] = 30.0, 100.0
    call(w1, "dedup", "search_task")["inline"] = True
    isolated = json.loads(json.dumps(w1))
    call(isolated, "dedup", "search_task")["inline"] = False
    table = render_tables.task_memory_table([{**w4, "_file": "w4.json"}, {**isolated, "_file": "isolated.json"}])
    assert "| dedup: copy search | 30 MB | 100 MB | 3.33 | no |" in table
    # above the ratio, but no growth from 1M rows at the same W (10x fewer rows per task): a per-task constant
    small = json.loads(json.dumps(next(r for r in runs if r["tasks"] == 4 and r["n"] == 10**6)))
    for r, mb in ((isolated, 100.0), (w4, 90.0), (small, 85.0)):
        call(r, "decontaminate", "search_task")["task_heap_mb"] = mb
    table = render_tables.task_memory_table([{**r, "_file": f"{i}.json"} for i, r in enumerate((isolated, w4, small))])
    assert ("| decontaminate: eval search | 100 MB | 90 MB | 0.90 | yes: constant per task, not rows (85 MB at "
            "1,000,000 rows, 10x fewer, same W) |") in table
    call(small, "decontaminate", "search_task")["task_heap_mb"] = 60.0  # grew 1.5x with 10x the rows: not constant
    table = render_tables.task_memory_table([{**r, "_file": f"{i}.json"} for i, r in enumerate((isolated, w4, small))])
    assert "| decontaminate: eval search | 100 MB | 90 MB | 0.90 | no |" in table
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps({"runs": [w1, w4]}))
    table = render_tables.task_memory_table(rates_from_bench.load_runs([str(path)]))
    row = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in table.splitlines()
           if ln.startswith("| ") and not ln.startswith("| step")}
    assert row["dedup: hash pairs"] == ["1,000 MB", "290 MB", "0.29", "yes"]
    assert row["dedup: index add"] == ["1,000 MB", "310 MB", "0.31", "no"]
    assert row["dedup: copy grouping (one process)"][2:] == ["10.5 B/row", "no"]
    assert row["dedup: copy search"][3].startswith("not measured at W = 1 (inline, 30.0 MB")
    assert not any(k.startswith("generate: generate") for k in row)
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- begin: task-memory-table -->\n<!-- end: task-memory-table -->\n"
                   + "".join(f"<!-- begin: {r} -->\n<!-- end: {r} -->\n" for r in ("scale-table", "plan-check",
                                                                                   "plan-tables")))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- begin: summary-scale-table -->\n<!-- end: summary-scale-table -->\n")
    rates = str(tmp_path / "rates.json")
    assert rates_from_bench.main(["--scale", str(path), "--out", rates]) == 0
    render_tables.render([str(path)], rates, str(doc), str(readme), task_paths=[str(path)])
    assert "| dedup: hash pairs | 1,000 MB | 290 MB | 0.29 | yes |" in doc.read_text()
    with pytest.raises(ValueError, match="W = 1 and W > 1"):
        render_tables.task_memory_table([w1])


@pytest.mark.slow
def test_curate_run_runs_the_task_counts_the_plan_predicts(pool_dir, tmp_path, capsys):
    """End to end: `curate run` on a small pool with tasks.count=2 logs, per step, the task counts `curate plan`
    predicts for that pool (chain_tasks), and 0 where the plan says a step does not run (no eval images)."""
    pool, _ = pool_dir
    out = tmp_path / "out"
    assert main(["run", "--config", QUICKSTART, f"input.paths=[{pool}]", f"output.dir={out}", "progress=false",
                 "embed.num_workers=0", "report.enabled=false", "tasks.count=2", "tasks.launcher=inline"]) == 0
    log = capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    n = manifest["counts"]["input"]
    got = {**json.loads((out / "steps" / "dedup.json").read_text())["tasks"],
           **json.loads((out / "steps" / "decontaminate.json").read_text())["tasks"],
           **json.loads((out / "steps" / "rebalance_report.json").read_text())["tasks"], **manifest["tasks"]}
    want = chain_tasks(n, 2, kind="flat", eval_rows=0, launcher="inline")
    assert got == {"hash": want["hash dedup"], "knn": want["search (dedup)"], "verify": want["verification"],
                   "eval_search": want["decontaminate"], "kmeans": want["k-means"], "sample": want["sampling"],
                   "write": want["write shards"]}
    # inline: the W tasks one after another, and the k-means tree as one rank (the same tree)
    assert got == {"hash": 2, "knn": 2, "verify": 2, "eval_search": 0, "kmeans": 1, "sample": 2, "write": 2}
    assert '"tasks"' in log or "tasks" in log


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


def test_the_default_chain_table_has_the_write_and_the_report(tmp_path):
    """bench/results/scale_default_chain.json (issue 40: `curate simulate` on `curate run`'s default config) renders
    into its own region: the write's and the report's task calls, W = 1 beside W = 4, the config said."""
    runs = ROOT / "bench" / "results" / "scale_default_chain.json"
    doc, readme = tmp_path / "doc.md", tmp_path / "README.md"
    doc.write_text("<!-- begin: scale-table -->\n<!-- end: scale-table -->\n<!-- begin: plan-check -->\n"
                   "<!-- end: plan-check -->\n<!-- begin: plan-tables -->\n<!-- end: plan-tables -->\n"
                   "<!-- begin: default-chain-table -->\n<!-- end: default-chain-table -->\n")
    readme.write_text("<!-- begin: summary-scale-table -->\n<!-- end: summary-scale-table -->\n")
    scale = ROOT / "bench" / "results" / "scale_1m.json"
    rates = str(tmp_path / "rates.json")
    assert rates_from_bench.main(["--scale", str(scale), "--out", rates]) == 0
    render_tables.render([str(scale)], rates, str(doc), str(readme), chain_paths=[str(runs)])
    text = doc.read_text().split("<!-- begin: default-chain-table -->")[1]
    assert "default config (dedup.k=64" in text and "report.enabled=True" in text
    assert "| &nbsp;&nbsp;_write_shards_task |" in text and "report_scan_task" in text
    assert "W=1 | " in text and "W=4 | " in text and "| decisions equal across W | yes | yes" in text


def test_an_installed_copy_plans_with_the_measured_rates(tmp_path):
    """The rates ship as package data: a wheel's copy of curation, away from the repository, finds them."""
    import subprocess
    import sys
    import zipfile

    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(root)], check=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("dinopipe-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        assert "curation/plan_rates.json" in z.namelist()
        z.extractall(tmp_path / "site")
    code = ("import curation.plan_rates as p, sys; r = p.load_rates(); "
            "assert p.__file__.startswith(sys.argv[1]), p.__file__; "
            "print(sum(v.measured for v in r.values()))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], cwd=tmp_path, check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path / "site"),
                                                              "PATH": "/usr/bin:/bin"}, timeout=120).stdout
    shipped = json.loads((root / "curation" / "plan_rates.json").read_text())["rates"]
    assert int(out) >= len(shipped) > 0


def test_plan_levels_auto_plans_the_levels_a_run_would_use(capsys):
    """`--levels auto`: the levels rebalance.levels: auto gives this pool, and the same table as those levels given."""
    from curation.kmeans.hierarchical import auto_levels

    ks = auto_levels(142_000_000)
    assert main(["plan", "--pool", "142M", "--levels", "auto"]) == 0
    auto = capsys.readouterr().out
    assert f"--levels auto: {' '.join(f'{k:,}' for k in ks)} clusters" in auto
    assert main(["plan", "--pool", "142M", "--levels", *map(str, ks)]) == 0
    assert auto.split("\n", 1)[1] == capsys.readouterr().out
    assert main(["plan", "--pool", "142M", "--levels", "auto", "500k"]) == 2
    assert "stands alone" in capsys.readouterr().err
