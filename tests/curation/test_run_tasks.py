"""`curate run` on the sharded steps: the IVF trained once, filled by W add tasks into separate
inverted-list files and merged on disk; the kNN search and the hierarchical sampling as W tasks.
Decisions identical for tasks.count=1 and 3 (real processes) on one pool of real photos."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests._photos import encode

from curation.cli import main
from curation.config import CurationConfig, task_plan, validate
from curation.knn.index import Rows
from curation.knn.shards import KnnJob, RowSource, run_search
from curation.core import runner
from curation.kmeans import sampling

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")


@pytest.fixture(scope="module")
def big_pool(pool_dir, photos, tmp_path_factory):
    """pool_dir (photos + planted copies) and three corner crops of every photo: > 78 rows, so the pool
    index is an IVF (fewer rows fall back to flat)."""
    root = tmp_path_factory.mktemp("run_tasks") / "pool"
    shutil.copytree(pool_dir[0], root)
    (root / "tiles").mkdir()
    for name, arr in sorted(photos.items()):
        h, w = arr.shape[:2]
        for i, (y, x) in enumerate(((0, 0), (h // 2, 0), (0, w // 2))):
            (root / "tiles" / f"{name}-{i}.jpg").write_bytes(encode(np.ascontiguousarray(arr[y:y + h // 2, x:x + w // 2])))
    return root


def _args(pool, out, *extra) -> list[str]:
    return ["run", "--config", QUICKSTART, f"input.paths=[{pool}]", f"output.dir={out}", "progress=false",
            "embed.num_workers=0", "embed.batch_size=16", "report.enabled=false", "dedup.index=ivf",
            "knn.nlist=4", "knn.chunk_size=16", "dedup.nprobe=4", *extra]


@pytest.mark.slow
def test_run_one_and_three_tasks_identical(big_pool, tmp_path, monkeypatch, capsys):
    from curation.kmeans import dist as dist_kmeans
    from curation.kmeans import hierarchical as kmeans

    monkeypatch.setattr(runner, "BLOCK", 16)  # sampling blocks: the 3 tasks each own rows
    monkeypatch.setattr(kmeans, "BLOCK", 16)  # k-means blocks: the 3 ranks each own rows
    monkeypatch.setattr(dist_kmeans, "PIECE_BYTES", 1)  # one centroid per piece: every rank owns some
    one, three = tmp_path / "one", tmp_path / "three"
    assert main(_args(big_pool, one, "tasks.count=1")) == 0
    said = capsys.readouterr().out
    # the same embeddings (W embedding tasks batch other images together: floats equal up to rounding only,
    # tests/curation/test_embed_tasks.py), so every step after them must be bit-identical; a folder embedded by
    # one task is resumed as one (curation.embed.tasks.embed_tasks)
    shutil.copytree(one / "embeddings", three / "embeddings", ignore=shutil.ignore_patterns("table"))
    shutil.copy(one / "descriptor.npz", three / "descriptor.npz")
    assert main(_args(big_pool, three, "tasks.count=3", "tasks.launcher=local")) == 0
    said = [said, capsys.readouterr().out]
    # the path table, right after embedding: as W tasks (the embed step says so), the same files
    for w, text in zip((1, 3), said):
        embed_line = next(line for line in text.splitlines() if line.startswith("embed: "))
        assert json.loads(embed_line[len("embed: "):])["tasks"] == {"table": w, "embed": 1}
    tables = [o / "embeddings" / "descriptor" / "table" for o in (one, three)]
    for f in sorted(os.listdir(tables[0])):
        if f.endswith(".npy"):
            assert (tables[0] / f).read_bytes() == (tables[1] / f).read_bytes(), f
    metas = [json.loads((t / "meta.json").read_text()) for t in tables]
    assert [{k: v for k, v in m.items() if k != "parts"} for m in metas][0] == \
        {k: v for k, v in metas[1].items() if k != "parts"}  # "parts": the part files' times differ
    for out, w in ((one, 1), (three, 3)):
        meta = json.loads((out / "knn" / "pool" / "meta.json").read_text())
        assert meta["kind"] == "ivf" and meta["ondisk"] and meta["add_tasks"] == w
        assert (out / "knn" / "pool" / "index.faiss.ivfdata").exists()
        assert not (out / "knn" / "pool" / "add").exists()  # parts merged, then removed
    assert len(os.listdir(three / "steps" / "sample")) == 2 + 3 * 3  # labels, picks + 3 passes x 3 parts
    # the k-means tree: 3 gloo ranks in local processes, the same files as one rank
    report = json.loads((three / "steps" / "rebalance_report.json").read_text())
    assert [t["task"] for t in report["kmeans_tasks"]] == [0, 1, 2]
    km1, km3 = (json.loads((o / "steps" / "kmeans" / "kmeans.json").read_text()) for o in (one, three))
    assert (km1["world_size"], km3["world_size"]) == (1, 3) and km3["level1"]["pieces"] == km3["levels"][0]
    for f in sorted(os.listdir(one / "steps" / "kmeans")):
        if f.endswith(".npy"):
            np.testing.assert_array_equal(np.load(one / "steps" / "kmeans" / f), np.load(three / "steps" / "kmeans" / f))
    # hash dedup, verification and shard writing ran as 3 tasks too (issue 30), each saying so
    assert sorted(os.listdir(three / "steps" / "hash" / "parts")) == [f"pairs-{t:05d}-of-00003.npz" for t in range(3)]
    assert {f.rsplit("-of-", 1)[1] for f in os.listdir(three / "steps" / "verify") if "-part-" in f} == {"00003.npz"}
    dedup = json.loads((three / "steps" / "dedup.json").read_text())
    assert dedup["tasks"] == {"hash": 3, "knn": 3, "verify": 3}
    m1, m3 = (json.loads((o / "manifest.json").read_text()) for o in (one, three))
    assert (m1["tasks"], m3["tasks"]) == ({"write": 1}, {"write": 3}) and m1["shards"] == m3["shards"]
    for name in m1["shards"]:
        assert (one / name).read_bytes() == (three / name).read_bytes()
    d1, d3 = (one / "decisions.tsv").read_text(), (three / "decisions.tsv").read_text()
    assert d1 == d3
    statuses = [line.split("\t")[2] for line in d1.splitlines()[1:]]
    assert len(statuses) > 78
    assert statuses.count("copy_duplicates") + statuses.count("hash_duplicates") >= 8
    assert statuses.count("not_selected") >= 10


def test_ondisk_index_equals_one_process_build(big_pool, tmp_path):
    """W = 3 add tasks + on-disk merge search exactly like the index one process filled."""
    from curation.embed.embeddings import embed_pool
    from curation.core.embstore import open_embeddings
    from curation.embed.copyspace import get_descriptor

    desc = get_descriptor(str(tmp_path / "d"))
    emb_dir = str(tmp_path / "emb")
    embed_pool([str(big_pool)], desc, emb_dir, batch_size=32, num_workers=0, transform=desc.transform(),
               hash_name=None, progress=False)
    emb = open_embeddings(emb_dir)
    rows = Rows(emb)
    params = {"kind": "ivf", "nlist": 4, "nprobe": 4, "k": 8, "threshold": 0.3, "chunk_size": 16}
    got = {}
    for w in (1, 3):
        job = KnnJob(str(tmp_path / f"w{w}"), "pool")
        meta = job.build(rows, params, use_gpu=False, source=RowSource(emb_dir),
                         tasks={"tasks": w, "launcher": "inline"})
        assert meta["ondisk"] and meta["n"] == len(rows)
        run_search(str(tmp_path / f"w{w}"), "pool", "pairs", rows, tasks={"tasks": w, "launcher": "inline"})
        got[w] = job.read(len(rows))
        index, _ = job.load()
        sims, idx = index.search(rows.take(np.arange(len(rows))), 8)
        got[w]["raw"] = np.concatenate([sims, idx.astype(np.float32)], 1)
    # the same index filled in one process, in memory (the old path)
    from curation.knn.index import build_index

    ref = build_index(rows, kind="ivf", nlist=4, nprobe=4, use_gpu=False)
    sims, idx = ref.search(rows.take(np.arange(len(rows))), 8)
    np.testing.assert_array_equal(got[1]["raw"], np.concatenate([sims, idx.astype(np.float32)], 1))
    for key in got[1]:
        np.testing.assert_array_equal(got[1][key], got[3][key])
    assert len(got[1]["a"]) > 0


@pytest.mark.parametrize("w", [1, 3])
def test_sharded_pick_is_the_one_process_pick(tmp_path, w):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 7, 500)
    sizes = np.bincount(labels, minlength=7)
    q = np.minimum(sizes, rng.integers(0, 40, 7))
    q[3] = 0
    q[5] = sizes[5]  # all of one cluster
    want = sampling.pick(labels, q, seed=3)
    np.testing.assert_array_equal(np.bincount(labels[want], minlength=7), q)
    got = sampling.sharded_pick(labels, q, 3, str(tmp_path / "s"), tasks=w, launcher="inline", block=64)
    np.testing.assert_array_equal(got, want)


def test_tasks_config_validated_and_auto():
    cfg = CurationConfig()
    cfg.output.dir, cfg.input.paths = "/tmp/x", [str(ROOT)]
    cfg.tasks.count = 0
    with pytest.raises(Exception, match="tasks.count"):
        validate(cfg)
    cfg.tasks.count = None
    assert task_plan(cfg, 1000) == {"tasks": 1, "launcher": "inline"}
    assert task_plan(cfg, 10_000_000)["tasks"] == min(len(os.sched_getaffinity(0)), 8)
    # a process allowed one core (as a Slurm allocation or taskset gives it on a bigger node): one task, not
    # the node's count
    one = subprocess.run([sys.executable, "-c", "from curation.config import CurationConfig, task_plan; "
                          "print(task_plan(CurationConfig(), 10_000_000)['tasks'])"], cwd=ROOT, text=True,
                         capture_output=True, check=True, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    assert one.stdout.strip() == "1"
    cfg.tasks.count = 3
    assert task_plan(cfg, 10) == {"tasks": 3, "launcher": "local"}
    # tasks.isolate: W = 1 in one fresh process (launcher local), not inline; launcher=inline stays inline
    cfg.tasks.count, cfg.tasks.isolate = 1, True
    assert task_plan(cfg, 10_000_000) == {"tasks": 1, "launcher": "local"}
    assert runner.launch("local", 1) == {"launcher": "local", "processes": None}
    cfg.tasks.launcher = "inline"
    assert task_plan(cfg, 10_000_000) == {"tasks": 1, "launcher": "inline"}
    assert runner.launch("inline", 1)["processes"] == 0 and runner.launch("srun", 1)["processes"] == 0


@pytest.mark.slow
def test_eval_and_retrieval_searches_in_local_processes(big_pool, tmp_path):
    """The nearest-eval and retrieval searches as W = 2 local processes (rows reopened from RowSources) give
    the chunks one inline task gives."""
    from curation.embed.embeddings import embed_pool
    from curation.core.embstore import open_embeddings
    from curation.embed.copyspace import get_descriptor

    desc = get_descriptor(str(tmp_path / "d"))
    emb_dir = str(tmp_path / "emb")
    embed_pool([str(big_pool)], desc, emb_dir, batch_size=32, num_workers=0, transform=desc.transform(),
               hash_name=None, progress=False)
    emb = open_embeddings(emb_dir)
    sub = np.arange(0, len(emb), 5)  # the "eval" / "seed" rows
    sub_src = RowSource.save(emb_dir, sub, str(tmp_path / "sub.npy"))
    got = {}
    for w, launcher in ((1, "inline"), (2, "local")):
        out = str(tmp_path / f"w{w}")
        plan = {"tasks": w, "launcher": launcher}
        ev = KnnJob(out, "eval")
        ev.build(Rows(emb, sub), {"kind": "flat", "k": 4, "chunk_size": 16}, use_gpu=False)
        run_search(out, "eval", "nearest", Rows(emb), Rows(emb, sub), False, plan, (RowSource(emb_dir), sub_src))
        rt = KnnJob(out, "retrieval")
        rt.build(Rows(emb), {"kind": "flat", "k": 3, "chunk_size": 4}, use_gpu=False)
        run_search(out, "retrieval", "retrieval", Rows(emb, sub), Rows(emb), False, plan,
                   (sub_src, RowSource(emb_dir)))
        got[w] = {**{f"eval_{k}": v for k, v in ev.read(len(emb)).items()},
                  **{f"ret_{k}": v for k, v in rt.read(len(sub)).items()}}
    for key in got[1]:
        np.testing.assert_array_equal(got[1][key], got[2][key], err_msg=key)
    assert (got[1]["eval_sim"][sub] > 0.999).all()  # each eval row finds itself
    assert len(got[1]["ret_pos"]) == 3 * len(sub)


MEASURE_TREE = r"""
import json, sys
import numpy as np
from curation.kmeans.dist import curate_settings
from curation.core.embstore import open_embeddings
from curation.kmeans.tree import fit_tree
emb_dir, out, w = sys.argv[1], sys.argv[2], int(sys.argv[3])
emb = open_embeddings(emb_dir)
rows = np.arange(len(emb))
record = curate_settings(len(rows), emb.ids, [64, 8], n_resampling_steps=1, sample_size=4, block=2048,
                         kmeans={"niter": 5, "init": "random"})
_, res = fit_tree(out, emb_dir, rows, record, tasks=w, launcher="local", piece_bytes=16 * 48 * 4)
print(json.dumps([{"heap": r["peak_anon"] - r["start_anon"], "hwm": r["peak_rss"] - r["start_rss"],
                   "reset": r["hwm_reset"], "held": r["result"]["centroid_bytes_per_rank"]} for r in res]))
"""


def _patch_embeddings(path, photos, n):
    """fp16 rows of real photos: L2-normalised 4x4 RGB patches (48-d) at every pixel offset, n of them."""
    from curation.core.embstore import mark_task_done, save_shard, shard_stem

    rows = []
    for name in sorted(photos):
        a = photos[name].astype(np.float32)
        a = a if a.ndim == 3 else np.repeat(a[..., None], 3, 2)
        p = np.lib.stride_tricks.sliding_window_view(a[..., :3], (4, 4, 3))[:, :, 0]
        rows.append(p.reshape(-1, 48)[:: 7])
    x = np.concatenate(rows)[:n]
    assert len(x) == n
    x = x - x.mean(1, keepdims=True) + 1e-3
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)
    for i, s in enumerate(range(0, n, 8192)):
        ids = [f"p{j:08d}" for j in range(s, min(s + 8192, n))]
        save_shard(path, shard_stem(0, i), x[s:s + 8192], {"ids": ids, "sources": ["photos"] * len(ids),
                                                           "hashes": ["0"] * len(ids), "unreadable": []})
    mark_task_done(path, 0, 1, {"n": n})


@pytest.mark.slow
def test_kmeans_tree_task_memory_follows_rows_per_task_not_n(photos, tmp_path):
    """The tree of `curate run` at N and 4N rows of real-photo patches with W = 1 and W = 4 local ranks (the
    same rows per task): the heap a task allocates grows by less than the extra rows would take (a task
    holding all rows would grow by more), and each rank holds its centroid pieces only."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    got = {}
    for n, w in ((16384, 1), (65536, 4)):
        emb = str(tmp_path / f"emb{n}")
        _patch_embeddings(emb, photos, n)
        proc = subprocess.run([sys.executable, "-c", MEASURE_TREE, emb, str(tmp_path / f"km{n}"), str(w)], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[n] = json.loads(proc.stdout.strip().splitlines()[-1])
    small, big = got[16384], got[65536]
    assert len(small) == 1 and len(big) == 4
    heap_small, heap_big = small[0]["heap"], max(t["heap"] for t in big)
    # The growth from N to 4N, against what holding the extra 3N rows would cost even in their fp16 (4.7 MB;
    # fp32: 9.4 MB): a ratio of the small case's figure would depend on the allocator's small-case heap, which
    # varies by machine (measured at N, W=1 / 4N, W=4 per task: 2.0 / 3.3-3.4 MB where the test was written,
    # 0.99 / 3.69 MB and 1.6 / 3.2-3.6 MB on two AMD EPYC machines: growth 1.4-2.7 MB, the gloo group's buffers).
    # A task holding all 4N rows would grow by >= 4.7 MB plus those buffers. (VmHWM also counts the pages of the
    # memory-mapped rows each task touched, which the kernel shares and evicts: 10 MB vs 15-20 MB here.)
    extra_rows_fp16 = (65536 - 16384) * 48 * 2
    assert heap_big - heap_small < extra_rows_fp16, (small, big)
    # 64 centroids in 4 pieces of 16: its pieces + one received piece (fp32) + one piece of sums (8 B a value)
    assert small[0]["held"] == (64 + 16 * 3) * 48 * 4
    assert {t["held"] for t in big} == {(16 + 16 * 3) * 48 * 4}


def test_save_blocks_writes_the_array_a_block_at_a_time_and_a_failed_write_leaves_no_file(tmp_path):
    """runner.save_blocks: the same .npy as np.save (from a mapped array, in any block size, with a per-block
    transform), and a write that fails half-way leaves no file at the path (the readers take a file as done)."""
    from curation.core.runner import save_blocks

    src = tmp_path / "src.npy"
    np.save(src, np.arange(2500, dtype=np.int64)[::-1].copy())
    mapped = np.load(src, mmap_mode="r")
    for block in (1000, 4096):
        save_blocks(str(tmp_path / "copy.npy"), mapped, block=block)
        assert np.array_equal(np.load(tmp_path / "copy.npy"), np.load(src))
        save_blocks(str(tmp_path / "odd.npy"), mapped, bool, block, fn=lambda v, s: v % 2 == 1)
        assert np.array_equal(np.load(tmp_path / "odd.npy"), np.load(src) % 2 == 1)

    def fail(v, s):
        if s >= 1000:
            raise OSError("disk full")
        return v

    with pytest.raises(OSError):
        save_blocks(str(tmp_path / "half.npy"), mapped, block=1000, fn=fail)
    assert not (tmp_path / "half.npy").exists()
