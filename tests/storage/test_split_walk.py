"""The pool index of a bucket, built by a process group: the tar-header walk is split over the ranks (each walks
every W-th shard), and the index is the one a single process builds."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _ranks(world: int):
    """Ranks of ``world`` threads: a barrier and an any-rank all-reduce, as the train layer's process group."""
    from dinopipe.data.pool_index import Ranks

    barrier, flags = threading.Barrier(world, timeout=120), [False] * world

    def any_rank(r):
        def reduce(flag: bool) -> bool:
            flags[r] = flag
            barrier.wait()
            out = any(flags)
            barrier.wait()  # nobody overwrites a flag before every rank has read them
            return out
        return reduce

    return [Ranks(r, world, any_rank(r), barrier.wait) for r in range(world)]


def test_the_header_walk_is_split_over_the_ranks(s3, shards, tmp_path, monkeypatch):
    from dinopipe.data import remote_index
    from dinopipe.data.pool_index import open_pool

    _, url = shards
    alone = open_pool([url], str(tmp_path / "alone"))  # one process walks every shard
    walked, real = {}, remote_index.walk_shards

    def recording(source, rows):
        walked[threading.current_thread().name] = list(rows)
        return real(source, rows)

    monkeypatch.setattr(remote_index, "walk_shards", recording)
    cache, world = str(tmp_path / "run" / "pool_index"), 2
    pools = [None] * world

    def rank(r, ranks):
        pools[r] = open_pool([url], cache, ranks)

    threads = [threading.Thread(target=rank, args=(r, ranks), name=f"rank{r}") for r, ranks in enumerate(_ranks(world))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(p is not None for p in pools), "a rank failed to open the pool"
    n_shards = len(alone.parts[0].arrays["path_start"]) - 1
    assert sorted(walked) == ["rank0", "rank1"]  # every rank walked, each its own half of the shards, once
    assert sorted(walked["rank0"] + walked["rank1"]) == list(range(n_shards))
    assert abs(len(walked["rank0"]) - len(walked["rank1"])) <= 1
    for pool in pools:  # the index every rank maps is the single process's
        for key in ("image_path", "image_offset", "image_size", "shard_etag"):
            assert np.array_equal(pool.parts[0].arrays[key], alone.parts[0].arrays[key]), key
        assert [pool.read(pool[i]) for i in range(len(pool))] == [alone.read(alone[i]) for i in range(len(alone))]
    assert not [f for f in os.listdir(cache) if ".walk-" in f]  # the part files are gone
