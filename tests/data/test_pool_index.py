"""The compact pool index: same images in the same order as listing the pool, every member readable at its
recorded offset, damage counted, ≤ 64 bytes per image, built once and shared by ranks and workers."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from dinopipe.data import pool_index
from dinopipe.data.loader import DataPosition, GlobalBatchSampler, ImagePoolDataset, epoch_permutation, list_pool
from dinopipe.data.pool_index import INDEX_NAME, open_pool


def _png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), i % 256, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_tar(path, names_and_data) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in names_and_data:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


@pytest.fixture
def mixed_pool(tmp_path):
    """A folder (with a subfolder), a file list (with a missing file) and tar shards (one cut short)."""
    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    for i in range(5):
        (folder / f"{i}.png").write_bytes(_png(i))
        (folder / "sub" / f"s{i}.png").write_bytes(_png(10 + i))
    (folder / "notes.txt").write_text("not an image")
    listed = tmp_path / "listed"
    listed.mkdir()
    for i in range(3):
        (listed / f"l{i}.png").write_bytes(_png(20 + i))
    (tmp_path / "list.txt").write_text("listed/l2.png\nlisted/l0.png\n# comment\nlisted/missing.png\nlisted/l1.png\n")
    shards = tmp_path / "web"
    shards.mkdir()
    for s in range(3):  # members out of name order, with webdataset .json companions
        members = []
        for k in (3, 1, 2, 0):
            key = f"{s:02d}{k:04d}"
            members += [(f"{key}.png", _png(30 + 4 * s + k)), (f"{key}.json", b"{}")]
        write_tar(shards / f"web-{s:03d}.tar", members)
    whole = (shards / "web-001.tar").read_bytes()
    (shards / "web-001.tar").write_bytes(whole[: 512 * 9])  # cut inside the 3rd image member's data
    return [str(folder), str(tmp_path / "list.txt"), str(shards)]


def test_index_reads_every_image_of_the_listed_pool_in_the_same_order(mixed_pool, tmp_path):
    with pytest.warns(UserWarning, match="damaged"):
        refs, read = list_pool(mixed_pool)
    with pytest.warns(UserWarning, match="damaged"):
        pool = open_pool(mixed_pool, cache_dir=str(tmp_path / "run" / "pool_index"))
    assert len(pool) == len(refs) == 26  # incl. the missing listed file and the damage placeholder
    for i, ref in enumerate(refs):
        assert pool.read(pool[i]) == read(ref), ref.id
    unreadable = [r.id for i, r in enumerate(refs) if pool.read(pool[i]) is None]
    assert unreadable == ["list/listed/missing.png", "web/web-001.tar/#damaged-after-3-images"]
    # A spawn-started worker receives the file name, not the arrays.
    assert len(pickle.dumps(pool)) < 2000
    again = pickle.loads(pickle.dumps(pool))
    assert [again.read(again[i]) for i in range(len(again))] == [read(r) for r in refs]


def test_index_costs_at_most_64_bytes_per_image(tmp_path):
    n_shards, per_shard = 4, 500
    for s in range(n_shards):
        write_tar(tmp_path / f"p-{s:03d}.tar", [(f"{k:06d}.jpg", b"x") for k in range(per_shard)])
    pool = open_pool([str(tmp_path)], cache_dir=str(tmp_path / "cache"))
    assert len(pool) == n_shards * per_shard
    assert pool.nbytes_per_image() <= 64
    assert pool.read(pool[len(pool) - 1]) == b"x"
    # The epoch order is evaluated for the positions a rank takes, never materialised (issue 20 item 6); it is
    # a bijection of [0, N), differs per epoch, and is what the sampler yields.
    sampler = GlobalBatchSampler(len(pool), 4, 1, 2, seed=3, start=DataPosition())
    perm = epoch_permutation(len(pool), seed=3, epoch=0)
    assert sorted(perm[0:len(pool)].tolist()) == list(range(len(pool)))
    assert perm[0:len(pool)].tolist() != epoch_permutation(len(pool), 3, 1)[0:len(pool)].tolist()
    assert [i for i, _ in next(iter(sampler))] == perm[4:8].tolist()  # rank 1 of 2: positions 4..7
    assert [perm[k] for k in range(4, 8)] == perm[4:8].tolist()


def test_rerun_maps_the_index_without_reading_tar_headers_and_a_changed_shard_rebuilds(tmp_path, monkeypatch):
    shards = tmp_path / "web"
    shards.mkdir()
    for s in range(2):
        write_tar(shards / f"w-{s}.tar", [(f"{k}.png", _png(k)) for k in range(3)])
    cache = tmp_path / "run" / "pool_index"
    first = open_pool([str(shards)], cache_dir=str(cache))
    assert [p.name for p in cache.glob("*.bin")] and len(first) == 6

    def no_header_walk(*a, **k):
        raise AssertionError("a tar header walk on an indexed pool")

    monkeypatch.setattr(pool_index.TarShardSource, "_shard_refs", no_header_walk)
    again = open_pool([str(shards)], cache_dir=str(cache))
    assert [again.read(again[i]) for i in range(6)] == [first.read(first[i]) for i in range(6)]
    monkeypatch.undo()
    write_tar(shards / "w-1.tar", [(f"{k}.png", _png(k)) for k in range(5)])  # re-written with more images
    assert len(open_pool([str(shards)], cache_dir=str(cache))) == 8


def test_curation_written_index_is_used_and_a_broken_one_is_rebuilt(tmp_path, monkeypatch):
    from curation.write.shards import write_shards
    from dinopipe.data.sources import MultiSource

    src_dir = tmp_path / "in"
    src_dir.mkdir()
    for i in range(7):
        (src_dir / f"{i}.png").write_bytes(_png(i))
    source = MultiSource([str(src_dir)])
    ids = [r.id for r in source.refs()]
    out = tmp_path / "curated" / "shards"
    write_shards(source, ids, [{"i": i} for i in range(len(ids))], str(out), shard_size=3)
    assert (out / INDEX_NAME).is_file()
    refs, read = list_pool([str(out)])
    monkeypatch.setattr(pool_index.TarShardSource, "_shard_refs", lambda *a, **k: 1 / 0)
    cache = tmp_path / "run" / "pool_index"
    pool = open_pool([str(out)], cache_dir=str(cache))
    assert not cache.exists(), "the curation index should have been used as is"
    assert [pool.read(pool[i]) for i in range(len(pool))] == [read(r) for r in refs]
    assert sorted(pool.read(pool[i]) for i in range(len(pool))) == sorted((src_dir / f"{i}.png").read_bytes()
                                                                           for i in range(7))
    monkeypatch.undo()
    (out / INDEX_NAME).write_bytes((out / INDEX_NAME).read_bytes()[:100])  # cut short: not fatal
    with pytest.warns(UserWarning, match="not used"):
        pool = open_pool([str(out)], cache_dir=str(cache))
    assert [pool.read(pool[i]) for i in range(len(pool))] == [read(r) for r in refs]


def _mapped_files(_):
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if line.rstrip().endswith(".bin")}


class _MapsDataset(ImagePoolDataset):
    def __getitem__(self, key):
        super().__getitem__(key)
        info = torch.utils.data.get_worker_info()
        return {"worker": info.id, "maps": sorted(_mapped_files(None)),
                "memmap": _is_file_mapping(self.refs.parts[0].arrays["image_offset"])}


def _is_file_mapping(a) -> bool:
    import mmap

    while a is not None and not isinstance(a, mmap.mmap):
        a = getattr(a, "base", None)
    return a is not None


def test_dataloader_workers_share_the_mapped_index(tmp_path):
    write_tar(tmp_path / "s-0.tar", [(f"{k}.png", _png(k)) for k in range(16)])
    pool = open_pool([str(tmp_path)], cache_dir=str(tmp_path / "cache"))
    index_file = pool.parts[0].path
    ds = _MapsDataset(pool, pool.read, lambda img, seed: img)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=GlobalBatchSampler(16, 4, 0, 1, 0, DataPosition()),
                                         num_workers=2, collate_fn=lambda items: items)
    seen = []
    for step, batch in enumerate(loader):
        seen += batch
        if step == 3:
            break
    assert {s["worker"] for s in seen} == {0, 1}
    assert all(s["memmap"] and index_file in s["maps"] for s in seen)


def _open_and_count(args):
    paths, cache, log = args
    real = pool_index.build_index

    def counted(source):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(source)

    pool_index.build_index = counted
    return len(open_pool(paths, cache_dir=cache))


def test_concurrent_ranks_build_the_index_once(tmp_path):
    for s in range(3):
        write_tar(tmp_path / f"s-{s}.tar", [(f"{k}.png", _png(k)) for k in range(50)])
    log = tmp_path / "builds.log"
    args = ([str(tmp_path)], str(tmp_path / "run" / "pool_index"), str(log))
    with mp.get_context("fork").Pool(3) as procs:
        assert procs.map(_open_and_count, [args] * 3) == [150] * 3
    assert len(log.read_text().split()) == 1, "every rank but one should map the index the first one built"


def test_an_empty_pool_is_an_error_that_leaves_no_run_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images found"):
        open_pool([str(tmp_path / "empty")], cache_dir=str(tmp_path / "run" / "pool_index"))
    assert not (tmp_path / "run").exists()
