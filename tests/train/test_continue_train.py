"""Continued pretraining end to end (``dinopipe pretrain`` processes, issue 23): a head warm-up run keeps the
release bit for bit in its checkpoints, logs the backbone's lr ramp, resumes exactly from inside the warm-up,
and a second adaptation starts from the first one's heads (wrong shapes: exit 2 naming the key)."""

import pytest
import torch

from dinopipe import hub
from tests.train.conftest import metrics, run_pretrain

pytestmark = pytest.mark.slow

WARMUP = ["train.head_warmup_steps=4", "optim.backbone_warmup_steps=4", "train.epochs=3", "train.checkpoint_every=2",
          "train.keep_last=10", "model.pretrained_heads=null"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, photo_pool):
    root = tmp_path_factory.mktemp("continue")
    run_pretrain(root / "release", photo_pool, "train.epochs=2")
    run_pretrain(root / "a", photo_pool, f"model.pretrained={root / 'release'}", *WARMUP)
    return root


def _sd(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_warmup_checkpoint_holds_the_release_and_the_lr_ramps(runs):
    released = _sd(hub.load(runs / "release"))
    step4 = runs / "a" / "checkpoints" / "step_00000004"
    n = hub.load(runs / "release").arch_config()["num_heads"]
    for which in ("teacher", "student"):  # after 4 warm-up steps both backbones are still the release
        assert _equal(_sd(hub.load(step4, which=which, num_heads=n)), released), which
    assert not _equal(_sd(hub.load(runs / "a")), released)  # afterwards the backbone trained
    rows = {r["step"]: r for r in metrics(runs / "a") if "backbone_lr_scale" in r}
    assert [rows[s]["backbone_frozen"] for s in range(6)] == [1, 1, 1, 1, 0, 0]
    assert [round(rows[s]["backbone_lr_scale"], 4) for s in range(3, 10)] == [0, 0, 0.3333, 0.6667, 1, 1, 1]
    # the heads trained during the warm-up: the checkpoint's teacher heads are no longer the fresh ones
    assert set(hub.load_heads(step4)) == {"dino_head"}
    final = hub.load_heads(runs / "a" / "checkpoints" / "step_00000012")
    exported = hub.load_heads(runs / "a")
    assert all(_equal(final[k], exported[k]) for k in exported)  # a DCP folder's heads = the export's


def test_resume_inside_the_warmup_is_exact(runs, photo_pool):
    b = runs / "b"
    run_pretrain(b, photo_pool, f"model.pretrained={runs / 'release'}", *WARMUP, "train.stop_after=3")
    run_pretrain(b, photo_pool, f"model.pretrained={runs / 'release'}", *WARMUP)
    assert _equal(_sd(hub.load(b)), _sd(hub.load(runs / "a")))
    assert all(_equal(hub.load_heads(b)[k], v) for k, v in hub.load_heads(runs / "a").items())


def test_second_adaptation_starts_from_the_first_ones_heads(runs, photo_pool):
    c = runs / "c"
    first = hub.load_heads(runs / "a")
    run_pretrain(c, photo_pool, f"model.pretrained={runs / 'a'}", "model.pretrained_heads=auto", "train.epochs=1",
                 "optim.base_lr=0.0", "optim.min_lr=0.0", "teacher.momentum_teacher=1.0",
                 "teacher.final_momentum_teacher=1.0")
    # lr 0, momentum 1: the exported heads must be exactly the ones loaded
    assert all(_equal(hub.load_heads(c)[k], v) for k, v in first.items())
    bad = runs / "d"
    r = run_pretrain(bad, photo_pool, f"model.pretrained={runs / 'a'}", "model.pretrained_heads=auto",
                     "dino.head.n_prototypes=64", check=False)
    assert r.returncode == 2 and "dino_head.last_layer.weight" in r.stderr, r.stderr[-2000:]
    assert not bad.exists()  # refused before anything was written


def test_two_fsdp2_ranks_keep_the_release_and_resume_exactly(runs, photo_pool):
    """The same on 2 gloo ranks (FSDP2): the sharded student backbone's no-grad forward, its AdamW state without
    gradients, the heads-only EMA on shards; the release's own heads loaded (auto) on rank 0 and broadcast."""
    rel = runs / "release"
    two = [f"model.pretrained={rel}", *WARMUP[:-1], "train.epochs=2", "model.pretrained_heads=auto"]
    run_pretrain(runs / "fsdp", photo_pool, *two, nproc=2)
    released, n = _sd(hub.load(rel)), hub.load(rel).arch_config()["num_heads"]
    for which in ("teacher", "student"):
        assert _equal(_sd(hub.load(runs / "fsdp" / "checkpoints" / "step_00000004", which=which, num_heads=n)),
                      released), which
    run_pretrain(runs / "fsdp_b", photo_pool, *two, "train.stop_after=3", nproc=2)
    run_pretrain(runs / "fsdp_b", photo_pool, *two, nproc=2)
    final = _sd(hub.load(runs / "fsdp"))
    assert not _equal(final, released) and _equal(_sd(hub.load(runs / "fsdp_b")), final)
