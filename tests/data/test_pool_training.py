"""Pretraining over curated shards goes through their pool index and resumes exactly at another world size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.dist]

_spec = importlib.util.spec_from_file_location("train_conftest", Path(__file__).parents[1] / "train" / "conftest.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)

# As tests/train/test_pretrain_dist.py: the same global batch of 8 either way, per-rank randomness off.
SAME = ("train.epochs=2", "train.checkpoint_every=4", "dino.koleo_loss_weight=0.0", "ibot.mask_sample_probability=0.0")
PHASE = "phases=[{{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: {b}}}]"


@pytest.fixture(scope="module")
def curated_shards(tmp_path_factory):
    from tests._photos import write_pool

    from curation.write.shards import write_shards
    from dinopipe.data.pool_index import INDEX_NAME
    from dinopipe.data.sources import MultiSource

    root = tmp_path_factory.mktemp("curated")
    write_pool(str(root / "photos"))
    source = MultiSource([str(root / "photos")])
    ids = [r.id for r in source.refs()]
    write_shards(source, ids, [{} for _ in ids], str(root / "shards"), shard_size=8)
    assert (root / "shards" / INDEX_NAME).is_file()
    return root / "shards"


def test_pretraining_on_indexed_shards_resumes_exactly_at_another_world_size(tmp_path, curated_shards):
    ref, run = tmp_path / "ref", tmp_path / "grow"
    train.run_pretrain(ref, curated_shards, *SAME, PHASE.format(b=8))
    train.run_pretrain(run, curated_shards, *SAME, PHASE.format(b=8), "train.stop_after=4")
    r = train.run_pretrain(run, curated_shards, *SAME, PHASE.format(b=4), nproc=2)
    assert "resuming from checkpoint at step 4" in r.stderr
    # Curation's index was valid: no rank walked the tar headers to build its own.
    assert not (ref / "pool_index").exists() and not (run / "pool_index").exists()
    want, got = train.losses(ref), train.losses(run)
    assert sorted(got) == sorted(want) == list(range(8))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-4), step
