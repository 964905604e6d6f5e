"""The path table built by W tasks and merged on disk (curation.core.pathtable.build_table, curation.core.table):
the same bytes as one process's whole build for any W, rerun-safe, the duplicate-id error kept, and a task's
heap flat in the pool size at N/W inputs per task."""

from __future__ import annotations

import filecmp
import glob
import json
import os
import shutil
import tracemalloc

import numpy as np
import pytest
from tests._photos import bad_file_kinds

from curation.core import pathtable
from curation.embed.descriptor import PCADescriptor
from curation.embed.embeddings import embed_pool
from curation.core.embstore import open_embeddings
from curation.core import table as tt
from dinopipe.config import InputError

from ._pathtable_whole import build_whole

FILES = [f"{n}.npy" for n in pathtable._FINAL] + ["meta.json"]


def _parts(emb_dir) -> tuple[list[str], list[int]]:
    metas = sorted(glob.glob(os.path.join(emb_dir, "part-*.ids.json")))
    return metas, [len(np.load(m[: -len(".ids.json")] + ".npy", mmap_mode="r")) for m in metas]


def _same_files(a: str, b: str) -> None:
    for name in FILES:
        assert filecmp.cmp(os.path.join(a, name), os.path.join(b, name), shallow=False), name


def _build(emb_dir, w: int, launcher: str = "inline") -> str:
    metas, rows = _parts(emb_dir)
    pathtable.build_table(str(emb_dir), metas, rows, num_tasks=w, launcher=launcher)
    assert not os.path.exists(os.path.join(emb_dir, "table", "work"))  # the work files go once complete
    return os.path.join(emb_dir, "table")


@pytest.fixture(scope="module")
def real_pool(pool_dir, photos, tmp_path_factory):
    """Real photos in two sources, unreadable files among them, in 7 small parts (embedded once)."""
    root = tmp_path_factory.mktemp("ptable")
    bad = root / "bad"
    for name, (data, _) in bad_file_kinds(photos["chelsea"]).items():
        (bad / name).parent.mkdir(parents=True, exist_ok=True)
        (bad / name).write_bytes(data)
    out = root / "emb"
    embed_pool([str(pool_dir[0]), str(bad)], PCADescriptor(), str(out), transform=PCADescriptor().transform(),
               shard_size=8, batch_size=8, num_workers=0, progress=False)
    metas, rows = _parts(out)
    assert len(metas) >= 6, metas
    ref = str(root / "whole")
    build_whole(str(out), metas, rows, ref)
    return out, ref


def test_tasks_build_the_same_table_bytes_for_any_w(real_pool, tmp_path):
    out, ref = real_pool
    meta = json.load(open(os.path.join(ref, "meta.json")))
    assert len(meta["sources"]) == 2 and meta["reasons"] and meta["n_inputs"] > meta["n_rows"]
    for w in (1, 3, len(_parts(out)[0]) + 2):  # several parts per task; tasks without any part
        d = tmp_path / f"w{w}"
        shutil.copytree(out, d, ignore=shutil.ignore_patterns("table"))
        _same_files(_build(d, w), ref)
    emb = open_embeddings(str(d))  # and the reader reads it: every row, location and reason
    assert emb.id_strings(np.arange(len(emb))) == sorted(emb.id_strings(np.arange(len(emb))))
    assert all(emb.ref(i) is not None for i in range(len(emb)))
    assert {u[1] for u in emb.unreadable} == {meta["sources"][1]} and len(emb.unreadable) > 0


def test_a_killed_task_is_rerun_and_the_table_is_the_same(real_pool, tmp_path, monkeypatch):
    out, ref = real_pool
    d = tmp_path / "emb"
    shutil.copytree(out, d, ignore=shutil.ignore_patterns("table"))
    real_copy = tt.copy_task

    def dies_in_task_2(t, w, **kw):
        if t == 2:
            raise KeyboardInterrupt("killed")
        return real_copy(t, w, **kw)

    monkeypatch.setattr(tt, "copy_task", dies_in_task_2)
    with pytest.raises(KeyboardInterrupt):
        _build(d, 3)
    monkeypatch.undo()
    work = d / "table" / "work"
    assert not (d / "table" / "meta.json").exists() and os.path.exists(tt.copy_mark(str(work), 1, 3))
    shutil.rmtree(tt.run_dir(str(work), 1))  # and one task's run is lost too: that task alone is redone
    os.remove(tt.rank_part(str(work), 1, 3))
    seen = []
    real_rank = tt.rank_task
    monkeypatch.setattr(tt, "rank_task", lambda t, w, **kw: seen.append(real_rank(t, w, **kw)))

    def killed(path):
        raise KeyboardInterrupt("killed after the files moved into place, before meta.json")

    monkeypatch.setattr(pathtable, "_sha1", killed)
    with pytest.raises(KeyboardInterrupt):
        _build(d, 3)
    assert [s.get("skipped", False) for s in seen] == [True, False, True]
    assert not (d / "table" / "meta.json").exists()
    monkeypatch.undo()
    _same_files(_build(d, 3), ref)


def test_an_id_in_two_parts_is_refused_naming_it(real_pool, tmp_path):
    out, _ = real_pool
    d = tmp_path / "emb"
    shutil.copytree(out, d, ignore=shutil.ignore_patterns("table"))
    metas, _ = _parts(d)
    meta = json.load(open(metas[1]))
    keep = list(range(1, len(meta["ids"])))  # a copy of a part less its first id, in a part of another run
    smallest = min(meta["ids"][i] for i in keep)
    np.save(d / "part-00001-00000.npy", np.load(metas[1][: -len(".ids.json")] + ".npy")[keep])
    meta = {**meta, "unreadable": [], **{k: [meta[k][i] for i in keep] for k in ("ids", "sources", "hashes", "locs")}}
    (d / "part-00001-00000.ids.json").write_text(json.dumps(meta))
    for w in (1, 3):
        with pytest.raises(InputError, match=f"image id {smallest!r} is in two embedding parts"):
            _build(d, w)
    with pytest.raises(InputError, match=f"image id {smallest!r} is in two embedding parts"):
        build_whole(str(d), *_parts(d), str(tmp_path / "whole"))


def synthetic_parts(folder, n: int, parts: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """``parts`` ``.ids.json`` files of ``n`` inputs in all (ids of ~40 characters in random order across the
    parts, locations, hashes, 1 in 50 unreadable), as the embed step writes them."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    names = np.char.add(np.char.add("src/dir/", rng.permutation(n).astype("U")), "-image-abcdefghijklmnopq.jpg")
    metas, rows = [], []
    for p, chunk in enumerate(np.array_split(names, parts)):
        bad = rng.random(len(chunk)) < 0.02
        good = chunk[~bad].tolist()
        meta = {"ids": good, "sources": ["src"] * len(good),
                "hashes": [f"{h:016x}" for h in rng.integers(0, 2**63, len(good))],
                "locs": [f"/data/{s}" if i % 3 else [f"/data/shard{p}.tar", i * 1000, 999]
                         for i, s in enumerate(good)],
                "unreadable": [[s, "src", "corrupt"] for s in chunk[bad].tolist()]}
        metas.append(os.path.join(folder, f"part-00000-{p:05d}.ids.json"))
        with open(metas[-1], "w") as f:
            json.dump(meta, f)
        rows.append(len(good))
    return metas, rows


def _peak(fn, *args, **kw) -> int:
    tracemalloc.start()
    try:
        fn(*args, **kw)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_task_holds_its_share_of_the_inputs_not_the_pool(tmp_path, monkeypatch):
    """Inline, the build's peak is its largest task's (or a chunked single-process pass): at 4N inputs in
    4 tasks it stays within a small bound of N inputs in 1 task, while the whole build at 4N takes ~4x N's."""
    monkeypatch.setattr(tt, "CHUNK", 1024)  # the chunk constant small next to the share of a tiny pool
    monkeypatch.setattr(pathtable, "_CHUNK", 1024)
    n = 20_000
    small, big = tmp_path / "small", tmp_path / "big"
    m1, r1 = synthetic_parts(small, n, 4)
    m4, r4 = synthetic_parts(big, 4 * n, 16, seed=1)
    one = _peak(pathtable.build_table, str(small), m1, r1, num_tasks=1)
    four = _peak(pathtable.build_table, str(big), m4, r4, num_tasks=4)
    whole_1 = _peak(build_whole, str(small), m1, r1, str(tmp_path / "w1"))
    whole_4 = _peak(build_whole, str(big), m4, r4, str(tmp_path / "w4"))
    _same_files(str(big / "table"), str(tmp_path / "w4"))
    per_row = 40  # bytes per input of the small pool: noise of the allocator and the chunks, not a share
    assert four <= one + per_row * n, (one, four, whole_1, whole_4)
    assert whole_4 > 2.5 * whole_1, (whole_1, whole_4)
    assert four < whole_4 / 3, (four, whole_4)


def test_the_embed_step_builds_the_table_as_w_tasks(real_pool, pool_dir, tmp_path):
    """`curate run`'s embed step builds the descriptors' path table right after embedding as tasks.count W
    tasks (its summary says how many); the next step finds it current and builds nothing."""
    from curation.config import EmbedConfig, TasksConfig
    from curation.embed.step import build_tables, step_embed

    out = tmp_path / "out"
    pool = tmp_path / "pool"
    shutil.copytree(os.path.join(os.path.dirname(real_pool[0]), "bad"), pool)  # unreadable files ...
    for f in sorted(pool_dir[0].glob("*.jpg"))[:7]:  # ... and a few photos
        shutil.copy(f, pool / f.name)
    res = step_embed([str(pool)], str(out), EmbedConfig(batch_size=4, num_workers=0, shard_size=2), progress=False,
                     tasks=TasksConfig(count=3, launcher="inline"))
    assert res["tasks"] == {"table": 3, "embed": 3}  # the embedding too (issue 40)
    d = out / "embeddings" / "descriptor"
    assert (d / "table" / "meta.json").exists()
    build_whole(str(d), *_parts(d), str(tmp_path / "whole"))
    _same_files(str(d / "table"), str(tmp_path / "whole"))
    assert build_tables(str(out), TasksConfig(count=3)) == 0
    emb = open_embeddings(str(d))
    assert len(emb) == 7 and len(emb.unreadable) == 4 and emb.n_inputs == 11


@pytest.mark.parametrize("w", [3, 9])
def test_srun_tasks_write_each_output_slice_by_its_owner_the_same_bytes(real_pool, tmp_path, monkeypatch, w):
    """tasks.launcher=srun (tasks on several nodes): no task writes the shared outputs through a mapping; the
    writes go as parts to the owner of each slice (curation.core.table_owned), which writes it whole: the same
    table bytes. The srun tasks run inline here (tests/curation/test_srun_slurm.py runs them under Slurm)."""
    from curation.core.embstore import build_path_table
    from curation.core import runner
    from curation.core import table_owned

    out, ref = real_pool
    d = tmp_path / "emb"
    shutil.copytree(out, d, ignore=shutil.ignore_patterns("table"))
    real_launch, calls = runner.launch, []
    monkeypatch.setattr(runner, "launch", lambda launcher, n: real_launch("inline", n))

    def no_mapped_writes(*a, **k):
        raise AssertionError("an srun task wrote a shared output through a mapping")

    monkeypatch.setattr(tt, "put", no_mapped_writes)
    monkeypatch.setattr(tt, "open_rw", no_mapped_writes)
    real_place = table_owned.place_task

    def place(u, n, **kw):
        calls.append((kw["kind"], u, n))
        return real_place(u, n, **kw)

    monkeypatch.setattr(table_owned, "place_task", place)
    assert build_path_table(str(d), lambda rows: {"tasks": w, "launcher": "srun"}) == w  # W srun tasks, not fewer
    _same_files(os.path.join(d, "table"), ref)
    assert sorted(calls) == sorted((k, u, w) for k in ("copy", "rank") for u in range(w))
