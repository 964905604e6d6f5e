"""Listing a prefix of many tiny shards keeps a few dozen bytes per shard, not a Python object per key.

The objects are planted straight into the loopback server's store (10^4 PUTs over HTTP would dominate the test);
the listing itself goes over the S3 API, page by page, in a separate process whose Python heap is measured alone
(the server shares this process). The 10^5-shard figure is measured by bench/bench_remote.py (docs/storage.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from tests.storage.conftest import BUCKET

N = 10_000
GOAL = 64  # bytes per shard per rank (issue 41)

_CHILD = r"""
import json, sys, tracemalloc
import numpy as np
import pytest
from dinopipe.utils import storage


pytestmark = pytest.mark.memory  # measured in a session of its own (`make test`'s second pytest run)
storage.list_prefix(sys.argv[1] + "-warm-up")  # the client's session and S3 service model are not the listing's
tracemalloc.start()
listing = storage.list_prefix(sys.argv[1], recursive=False, suffixes=(".tar",))
arrays = listing.arrays()
del listing
kept, peak = tracemalloc.get_traced_memory()
print(json.dumps({"n": len(arrays["size"]), "kept": kept, "peak": peak,
                  "arrays": sum(a.nbytes for a in arrays.values())}))
"""


def test_listing_ten_thousand_shards_keeps_under_64_bytes_each(s3, tmp_path):
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    backend.create_bucket("many", "us-east-1") if "many" not in backend.buckets else None
    for i in range(N):
        backend.put_object("many", f"tiny/shard-{i:06d}.tar", b"\0" * 1024)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), AWS_ENDPOINT_URL_S3=s3.direct)
    r = subprocess.run([sys.executable, "-c", _CHILD, "s3://many/tiny"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["n"] == N
    # What a rank keeps: the arrays (names, sizes, ETags: 52 B a shard here), every page's dicts gone; the rest
    # is the client's fixed state (~100 KB measured), not per shard.
    assert m["arrays"] / N <= GOAL and m["kept"] - m["arrays"] < 2**18, m
    # While listing: one page (1,000 keys) of the client's objects at a time, never the whole prefix's.
    assert m["peak"] < 8 * 2**20, m
    assert BUCKET  # the session's bucket is untouched by this test
