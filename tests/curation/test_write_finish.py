"""The write step's finish (curation.write.shards.finish_shard_tasks): the pool index is merged from the write tasks'
per-shard location parts as arrays, a shard at a time, with nothing per kept image in the orchestrating process
(issue 40: it used to gather every kept image's member record into one Python list, ~142M at LVD-142M size).
The index it writes is byte for byte the one built from every member at once, whatever the number of tasks."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np

from dinopipe.data.pool_index import INDEX_NAME, PoolIndex, member_locations, tar_index, write_index
from dinopipe.data.sources import TarWalk
from curation.write.shards import finish_shard_tasks, write_shard_task


def _items(start: int, stop: int, every: int = 17):
    for i in range(start, stop):
        data = b"" if i % every == 5 else f"image {i} ".encode() * (1 + i % 7)  # every 17th unreadable now
        yield f"{i:09d}", f"src/img{i:07d}.jpg", (lambda d=data: d), {"id": f"src/img{i:07d}.jpg"}


def _write(out: str, n: int, shard_size: int, w: int) -> dict:
    shards = os.path.join(out, "shards")
    for t in range(w):
        write_shard_task(out, shards, n, shard_size, _items, "sel", t, w)
    return finish_shard_tasks(out, shards, n, shard_size, "sel")


def test_the_merged_index_is_the_whole_pool_index_for_one_or_three_tasks(tmp_path):
    n, size = 103, 10
    res = {w: _write(str(tmp_path / f"w{w}"), n, size, w) for w in (1, 3)}
    idx = {w: (tmp_path / f"w{w}" / "shards" / INDEX_NAME).read_bytes() for w in (1, 3)}
    one, three = (PoolIndex(str(tmp_path / f"w{w}" / "shards" / INDEX_NAME)) for w in (1, 3))
    assert one.header == three.header and set(one.arrays) == set(three.arrays)
    for name in one.arrays:  # the shards' mtimes differ between the two folders, nothing else
        assert name == "shard_mtime_ns" or np.array_equal(one.arrays[name], three.arrays[name]), name
    assert res[1]["written"] == res[3]["written"] == n - len(range(5, n, 17))
    assert res[1]["failed"] == res[3]["failed"] == [(f"src/img{i:07d}.jpg", "read_error") for i in range(5, n, 17)]
    # the reference: every member of every shard at once (tar_index), as the finish used to build it
    shards = res[1]["shards"]
    locs = []
    for s in shards:
        walk = TarWalk(s)
        locs.append(member_locations([(m.name, m.offset_data, m.size) for m in walk if not m.name.endswith(".json")]))
    header, arrays = tar_index(shards, locs, root=None)
    write_index(str(tmp_path / "ref.bin"), header, arrays)
    assert idx[1] == (tmp_path / "ref.bin").read_bytes()
    pool = PoolIndex(str(tmp_path / "w3" / "shards" / INDEX_NAME))
    loc = pool[6]
    with open(loc.path, "rb") as f:
        f.seek(loc.offset)
        assert f.read(loc.size) == b"image 7 " * 1  # row 6 is image 7 (image 5 failed): its own bytes


def _finish_peak(out: str, n: int) -> int:
    shards = os.path.join(out, "shards")
    write_shard_task(out, shards, n, 250, lambda a, b: _items(a, b, every=1000), "sel", 0, 1)
    tracemalloc.start()
    try:
        res = finish_shard_tasks(out, shards, n, 250, "sel")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(PoolIndex(os.path.join(shards, INDEX_NAME))) == res["written"]
    return peak


def test_the_finish_holds_nothing_per_kept_image(tmp_path):
    """10k vs 40k images in shards of 250: the finish's peak grows by < 4 bytes per kept image (per shard: its
    path, count, record and stat, ~700 B / 250 images; the failed reads, 1 in 1000, are few by nature).
    Holding a member record per kept image (a list [name, offset, size]) is >= 150."""
    small, large = _finish_peak(str(tmp_path / "s"), 10_000), _finish_peak(str(tmp_path / "l"), 40_000)
    per_image = (large - small) / 30_000
    assert per_image < 4, f"the finish holds {per_image:.1f} B per kept image ({small} -> {large} B)"
    assert np.isfinite(per_image)
