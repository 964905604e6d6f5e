"""Every step after embedding as W tasks (curation.core.runner, curation.simulate): W=1 and W=3 give identical
decisions, a killed task is rerun and finished parts are skipped, per-task memory follows the rows a
task owns (not N), and the planted answer is found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from curation.dedup.hashdedup import brute_force_pairs, group_pairs, hash_dedup, merge_pair_parts, near_pairs_task
from curation.kmeans.hierarchical import lloyd
from curation.simulate.run import differing, simulate
from curation.core import runner
from dinopipe.utils.exits import UnfinishedError
from dinopipe.utils import debug_hooks

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(n_clusters=20, n_eval=200, overlap=40, levels=(20, 5, 2), nlist=32, processes=0,
             overrides=("rebalance.mode=hierarchical",))


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(runner, "BLOCK", 1024)


def _planted_hashes(n=4000, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.integers(0, np.iinfo(np.int64).max, n, dtype=np.int64).astype(np.uint64)
    for s, d in zip(rng.integers(0, n, 800), rng.integers(0, n, 800)):
        flips = sum(1 << int(b) for b in rng.choice(64, rng.integers(0, 6), replace=False))
        h[d] = h[s] ^ np.uint64(flips)
    h[:300] = h[1000]  # a flood of identical hashes
    return h


@pytest.mark.parametrize("t", [0, 2, 4])
def test_hash_dedup_by_tasks_is_exact_and_independent_of_w(t):
    h = _planted_hashes()
    truth = np.array(sorted(brute_force_pairs(h, t)))
    want, _ = group_pairs(len(h), truth[:, 0], truth[:, 1])
    groups = []
    for w in (1, 3):
        a, b = merge_pair_parts([near_pairs_task(h, i, w, t) for i in range(w)])
        groups.append(group_pairs(len(h), a, b)[0])
    np.testing.assert_array_equal(groups[0], want)  # every pair within t found (no false negative)
    np.testing.assert_array_equal(groups[1], want)
    assert hash_dedup(h, None, t).n_duplicates == int((want != np.arange(len(h))).sum()) > 300


def test_lloyd_sums_reduced_in_chunks_give_the_same_centroids():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3000, 16)) / 4).astype(np.float16).astype(np.float32)
    c0 = x[:50].copy()

    def blocks():
        return (x[s:s + 512] for s in range(0, len(x), 512))

    whole = lloyd(blocks, c0, 5, tol=0, device="cpu")
    chunked = lloyd(blocks, c0, 5, tol=0, device="cpu", reduce_bytes=7 * 16 * 8)  # 7 centroids a chunk
    np.testing.assert_array_equal(whole.centroids, chunked.centroids)
    assert whole.history == chunked.history


def test_simulate_runs_the_chain_of_curate_run_w1_and_w3_identical_with_planted_recall(tmp_path, small_blocks):
    """`curate simulate` is `curate run`'s chain after embedding (the same step list, the same task functions),
    on generated inputs; W=1 and W=3 write the same decisions.tsv and find what was planted."""
    from curation.config import CurationConfig
    from curation.pipeline import steps_of

    one = simulate(str(tmp_path / "w1"), 6000, 32, tasks=1, **SMALL)
    three = simulate(str(tmp_path / "w3"), 6000, 32, tasks=3, **SMALL)
    cfg = CurationConfig()  # the default chain: write shards and the report included
    assert one["chain"] == [s for s in steps_of("run", cfg) if s != "embed"]
    assert list(three["steps"]) == ["generate", *three["chain"]]
    ran: dict[str, int] = {}  # the most tasks each task function ran as (the small eval set's table: 1)
    for r in (r for step in three["steps"].values() for r in step["runs"]):
        ran[r["fn"]] = max(ran.get(r["fn"], 0), r["tasks"])
    # the hash dedup, kNN search, verification, sampling and decisions tasks of `curate run`, each as W=3
    for fn in ("run_task", "rank_task", "copy_task",  # the path table, right after the pool's parts
               "pairs_task", "search_task", "verify_candidates_task", "hist_task", "select_task", "_decisions_part_task"):
        assert ran.get(fn) == 3, (fn, ran)
    # and its single-process parts (curation.core.runner.phase), so the growth bench's JSON times them too
    for fn in ("hash_grouping", "grouping"):
        assert ran.get(fn) == 1, (fn, ran)
    assert one["decisions_sha256"] == three["decisions_sha256"]
    assert differing([one["arrays_sha256"], three["arrays_sha256"]]) == []  # every step array, bit for bit
    assert one["counts"] == three["counts"]
    for res in (one, three):
        assert min(res["recall"].values()) >= 0.98, res["recall"]
        c = res["counts"]
        assert c["input"] == 6000
        assert c["hash_duplicates"] >= 55 and c["copy_duplicates"] >= 50 and c["decontaminated"] >= 38
        assert 0 < c["not_selected"] and 0 < c["kept"]


def test_simulate_with_a_query_fraction_finds_the_planted_copies_that_have_a_queried_end(tmp_path, small_blocks):
    """The growth bench's 10M stand-in (`curate simulate --query-fraction`): the same chain, only a fraction of
    the rows query the copy search; the planted copies with a queried end are found, about 1 - (1 - F)^2 of all."""
    res = simulate(str(tmp_path / "f"), 6000, 32, tasks=2, query_fraction=0.3, **SMALL)
    assert res["query_fraction"] == 0.3 and res["recall"]["copies"] >= 0.98, res["recall"]
    p = res["planted"]
    assert 0.40 * p["copies"] < p["copies_with_a_queried_end"] < 0.62 * p["copies"]  # 1 - 0.7^2 = 0.51
    assert res["counts"]["copy_duplicates"] <= p["copies_with_a_queried_end"] + 5
    assert res["step_results"]["dedup"]["tasks"]["knn"] == 2


@pytest.mark.slow
def test_w3_task_processes_of_one_thread_write_the_arrays_of_one_process_of_all_cores(tmp_path, small_blocks):
    """W = 1 inline (this process: every core's BLAS / faiss threads) against W = 3 local task processes (one
    thread each, as the runner shares the cores out): every step array bit-identical, not only decisions.tsv.
    faiss's similarities move in the last bit with the thread count: the copy search's nn_sim differed here until
    it was rescored exactly; the k-means assignment's distances (which changed the tree's "closest" rows and, at
    3M rows, the decisions) need more centroids than this pool's 20 to differ -- test_kmeans.py's
    nearest-centroid test has them."""
    one = simulate(str(tmp_path / "w1"), 6000, 32, tasks=1, **SMALL)
    three = simulate(str(tmp_path / "w3"), 6000, 32, tasks=3, **{**SMALL, "processes": None})
    assert len(one["arrays_sha256"]) > 20 and any(p.startswith("steps/kmeans/") for p in one["arrays_sha256"])
    assert differing([one["arrays_sha256"], three["arrays_sha256"]]) == []
    assert one["decisions_sha256"] == three["decisions_sha256"]
    # tasks.isolate (the growth bench's W = 1 baseline): the one task of every runner call in a fresh process of
    # all cores, reopening its inputs from files as W processes do; the same arrays again
    alone = simulate(str(tmp_path / "i1"), 6000, 32, tasks=1, **{**SMALL, "processes": None}, isolate=True)
    runs = [r for step in alone["steps"].values() for r in step["runs"]]
    tasked = [r for r in runs if r["fn"] not in ("hash_grouping", "grouping", "index_train", "index_merge")]
    assert {r["tasks"] for r in runs} == {1} and len(tasked) > 8
    # inline only: the small generated eval set's path table, built where the chain first opens it (one task)
    assert sorted(r["fn"] for r in tasked if r["inline"]) == ["copy_task", "rank_task", "run_task"]
    assert sum(not r["inline"] for r in tasked) > 8
    assert differing([one["arrays_sha256"], alone["arrays_sha256"]]) == []
    assert one["decisions_sha256"] == alone["decisions_sha256"]


def test_decontamination_removes_the_kept_rows_of_every_component_with_a_direct_eval_match(tmp_path, small_blocks):
    """decontaminate_step.step_decontaminate (the direct matches' components flagged in a mapped array, then every alive row
    tested a block at a time) against curation.decontaminate.remove.expand_to_components over the whole pool at once,
    the step's reference: the same rows go, one reason per image (a copy duplicate stays one), as W = 2 tasks;
    and the step leaves no scratch file behind."""
    from curation.decontaminate.remove import expand_to_components
    from curation.core.stepfiles import load_step
    from curation.core.status import DECONTAM, KEPT

    work = tmp_path / "w"
    res = simulate(str(work), 6000, 32, tasks=2, **{**SMALL, "n_eval": 400, "overlap": 150})
    dd, dc = load_step(str(work), "dedup"), load_step(str(work), "decontaminate")
    sim = dc["eval_sim"]  # NaN for the hash duplicates: never searched, never a direct match
    used = json.loads((work / "steps" / "decontaminate.json").read_text())["threshold"]  # no pixels: the cosine's
    ref = expand_to_components(sim, np.zeros(len(sim), np.int64), used,
                               dd["component"])
    want = ref.removed & (dd["status"] == KEPT)
    np.testing.assert_array_equal(dc["status"] == DECONTAM, want)
    np.testing.assert_array_equal(dc["status"][~want], dd["status"][~want])
    assert res["counts"]["decontaminated"] == int(want.sum()) >= 150
    assert (ref.removed & (dd["status"] != KEPT)).any()  # copy / hash duplicates in those components stay as they were
    assert not list((work / "steps" / "decontaminate").glob("*.scratch.npy"))


def test_killed_task_is_rerun_and_finished_parts_skipped(tmp_path, small_blocks):
    work = tmp_path / "w"
    first = simulate(str(work), 5000, 32, tasks=3, **SMALL)
    hparts = work / "steps" / "hash" / "parts"
    lost = hparts / "pairs-00001-of-00003.npz"
    lost.unlink()  # task 1 of the hash pairs was killed before its part was written ...
    (hparts / "pairs-00001-of-00003.npz.tmp-999.npz").write_bytes(b"torn")  # ... leaving a torn temp file
    (work / "steps" / "hash" / "result.json").unlink()  # and everything after it has to be redone
    for p in (work / "decisions").glob("part-00002-*"):
        p.unlink()
    kept = {p: p.stat().st_mtime_ns for p in hparts.glob("pairs-*-of-00003.npz")}
    kept.update({p: p.stat().st_mtime_ns for p in (work / "decisions").glob("part-0000[01]-*")})
    again = simulate(str(work), 5000, 32, tasks=3, **SMALL)
    assert lost.exists() and (work / "decisions" / "part-00002-of-00003.tsv").exists()
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # finished tasks were not run again
    assert again["decisions_sha256"] == first["decisions_sha256"]
    assert not (ROOT / "curation" / "simulate" / "tasks.py").exists()  # no second implementation of the steps


MEASURE = r"""
import glob, json, os, shutil, sys
import numpy as np
from curation.dedup.hash_step import pairs_task
from curation.knn.shards import search_task
from curation.knn.jobs import row_source
from curation.write.tasks import _decisions_part_task
from curation.simulate.run import simulate
from curation.core import runner
from dinopipe.utils.exits import UnfinishedError
work, n, w = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
simulate(work, n, 32, tasks=w, n_clusters=20, n_eval=200, overlap=40, levels=(20, 5, 2), nlist=512, processes=0,
         overrides=("rebalance.mode=hierarchical",), chunk_size=n // w)  # the same rows per search task at N, W=1 and 4N, W=4


def heap(res):  # what a task itself allocated, in its own fresh process (peak minus start)
    return max(r["peak_anon"] - r["start_anon"] for r in res)


out = {}
h = os.path.join(work, "steps", "hash")
shutil.rmtree(os.path.join(h, "parts"))  # the step's tasks again, each in a fresh process
out["hash_pairs"] = heap(runner.run_step(pairs_task, w, processes=1, folder=h, max_distance=4))
with open(sorted(glob.glob(os.path.join(work, "decisions", "part-*.json")))[0]) as f:
    digest = json.load(f)["digest"]
shutil.rmtree(os.path.join(work, "decisions"))
out["decisions"] = heap(runner.run_step(_decisions_part_task, w, processes=1, out_dir=work,
                                        failed=np.zeros(0, np.int64), digest=digest))
shutil.rmtree(os.path.join(work, "knn", "pool", "chunks"))
desc = os.path.join(work, "embeddings", "descriptor")
surv = np.load(os.path.join(work, "knn", "pool-pool_rows.npy"))
out["search"] = heap(runner.run_step(search_task, w, processes=1, out_dir=work, name="pool", mode="pairs",
                                     queries=row_source(work, "pool", desc, surv, "pool")))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_per_task_memory_follows_rows_per_task_not_n(tmp_path):
    """The same rows per task at N and 4N (W=1 vs W=4): the heap a task allocates (peak minus the
    interpreter's) within 1.5x (it would be ~4x if a task held all N rows). Each task runs in a fresh
    process; memory, not time, is compared."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **debug_hooks.env(curate_block=8192))
    got = {}
    for n, w in ((32768, 1), (131072, 4)):
        proc = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / f"n{n}"), str(n), str(w)], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[n] = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    small, big = got[32768], got[131072]
    for step in ("hash_pairs", "decisions", "search"):
        assert big[step] <= 1.5 * small[step] + 2**21, (step, small[step], big[step])


def test_plan_covers_every_step_and_marks_assumptions():
    from curation.plan import plan

    steps = plan(1_200_000_000, 1024, "ivf_pq", 64, nodes=20, gpus_per_node=0, pairs_per_image=40, tasks=64,
                 cores=64, kmeans_tasks=160, levels=[10_000_000, 500_000, 50_000, 10_000])
    names = [s.name for s in steps]
    for want in ("embed", "hash dedup", "index train", "index add", "index merge", "search (dedup)", "verification",
                 "grouping", "decontaminate", "k-means level 1 (10,000,000)", "k-means level 4 (10,000)",
                 "sampling", "write shards", "decisions"):
        assert want in names, want
    by = {s.name: s for s in steps}
    # no task holds the 85 GiB index: its codes / 64 + the trained index's 300k x 1024 fp32 centroids (1.1 GiB)
    assert by["index add"].tasks == 64 and by["index add"].host_gib < 3
    assert by["k-means level 1 (10,000,000)"].host_gib < 2  # centroids sharded: not 41 GB (nor 82 GB of sums) per rank
    # level 2's rows are level 1's 10M centroids (41 GB): sharded over the same ranks, not on rank 0
    assert by["k-means level 2 (500,000)"].tasks == 160 and by["k-means level 2 (500,000)"].host_gib < 2
    # verification at the rate bench_verify measured (named as such), the shard writing's rate an assumption
    assert "bench_verify" in by["verification"].rate and by["verification"].hours > by["search (dedup)"].hours
    assert by["write shards"].rate.endswith("ASSUMED")


def _record(t, w, folder):
    runner.write_part(runner.part_path(folder, "rec", t, w), t=np.int64(t))
    return {"t": t}


def test_slurm_array_task_runs_its_own_part_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "10")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    (res,) = runner.run_step(_record, 3, launcher="slurm", folder=str(tmp_path))
    assert res["task"] == 2 and sorted(os.listdir(tmp_path)) == ["rec-00002-of-00003.npz"]
    with pytest.raises(RuntimeError, match="has 3 tasks, the step was asked for 4"):
        runner.run_step(_record, 4, launcher="slurm", folder=str(tmp_path))
    with pytest.raises(UnfinishedError, match="2 of 3 parts of 'rec' are missing"):  # a killed task: exit 75
        runner.parts(str(tmp_path), "rec", 3)
    assert [runner.task_rows(10, t, 3, block=2) for t in range(3)] == [(0, 2), (2, 6), (6, 10)]
