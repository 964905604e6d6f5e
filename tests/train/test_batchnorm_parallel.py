"""BatchNorm students (timm:resnet10t) under the train layer's policies: activation checkpointing updates the
running statistics once per forward (the recompute does not update them again), eager and compiled; with several
ranks on a device that has SyncBatchNorm kernels, BatchNorm becomes SyncBatchNorm without changing parameters,
buffers or state-dict keys; on CPU (torch has no SyncBatchNorm kernel there) nothing is converted."""

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from dinopipe.config import ParallelConfig
from dinopipe.data.samples import real_photos
from dinopipe.data.transforms import eval_transform
from dinopipe.models import create_model
from dinopipe.train.dist import DistInfo
from dinopipe.train.parallel import _blocks, apply_activation_checkpointing, compile_block, parallelize, sync_batchnorm_


@pytest.fixture(scope="module")
def photos():
    t = eval_transform(64)
    arrs = [a for _, a in sorted(real_photos().items())][:8]
    return torch.stack([t(Image.fromarray(np.asarray(a))) for a in arrs])  # (8, 3, 64, 64)


def _pair():
    torch.manual_seed(0)
    ref = create_model("timm:resnet10t", img_size=64).train()
    other = create_model("timm:resnet10t", img_size=64).train()
    other.load_state_dict(ref.state_dict())
    return ref, other


def _steps(model, photos, n=2):
    for i in range(n):  # two steps on different images: the second normalises with the first's statistics too
        model.forward_features(photos[4 * i:4 * i + 4])["x_norm_patchtokens"].square().mean().backward()


def _assert_same_buffers(a, b):
    bufs = dict(b.named_buffers())
    names = [n for n, _ in a.named_buffers() if "running" in n or "num_batches" in n]
    assert names, "resnet10t has BatchNorm running statistics"
    for name, buf in a.named_buffers():
        assert torch.equal(buf, bufs[name]), name


@pytest.mark.parametrize("compiled", [False, True])
def test_activation_checkpointing_updates_running_stats_once(photos, compiled):
    ref, ac = _pair()
    for blk in _blocks(ac):
        apply_activation_checkpointing(blk)
        if compiled:
            compile_block(blk, backend="aot_eager")  # the graph path without a C++ toolchain's compile time
    _steps(ref, photos)
    _steps(ac, photos)
    _assert_same_buffers(ref, ac)
    assert int(ac.model.layer1[0].bn1.num_batches_tracked) == 2
    for (name, a), (_, b) in zip(ref.named_parameters(), ac.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)
    for m in ac.modules():  # the recompute's freeze is undone
        if isinstance(m, nn.BatchNorm2d):
            assert m.momentum == 0.1


def test_sync_batchnorm_only_where_torch_has_kernels(photos):
    ref, sbn = _pair()
    cpu = DistInfo(rank=0, world_size=2, device=torch.device("cpu"), backend="gloo")
    assert sync_batchnorm_([sbn], cpu) == 0 and sync_batchnorm_([sbn], DistInfo()) == 0
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in sbn.modules())
    cuda = DistInfo(rank=0, world_size=2, device=torch.device("cuda", 0), backend="nccl")  # nothing runs on it
    params = {n: p for n, p in sbn.named_parameters()}
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in sbn.modules())
    assert sync_batchnorm_([sbn], cuda) == n_bn > 0
    assert not any(type(m) is nn.BatchNorm2d for m in sbn.modules())
    assert all(p is params[n] for n, p in sbn.named_parameters())  # the optimizer's and FSDP's tensors stay
    assert list(sbn.state_dict()) == list(ref.state_dict())  # checkpoints, EMA and exports see the same keys
    # one process (no process group): SyncBatchNorm computes what BatchNorm computes
    _steps(ref, photos)
    _steps(sbn, photos)
    _assert_same_buffers(ref, sbn)


def test_checkpointed_stages_stay_frozen_after_conversion(photos):
    """AC found the layers at run time: SyncBatchNorm layers that replaced them after wrapping are frozen too."""
    ref, both = _pair()
    for blk in _blocks(both):
        apply_activation_checkpointing(blk)
    assert sync_batchnorm_([both], DistInfo(world_size=2, device=torch.device("cuda", 0), backend="nccl")) > 0
    _steps(ref, photos)
    _steps(both, photos)
    _assert_same_buffers(ref, both)


def test_parallelize_converts_trained_modules_only(monkeypatch):
    """The switch (parallel.sync_batchnorm) and the frozen models (EMA, teacher): never converted."""
    calls = []
    monkeypatch.setattr("dinopipe.train.parallel.sync_batchnorm_", lambda mods, info: calls.append(len(mods)) or 0)
    m = create_model("timm:resnet10t", img_size=64)
    parallelize([m], DistInfo(), ParallelConfig(param_dtype="fp32"))
    parallelize([m], DistInfo(), ParallelConfig(param_dtype="fp32"), frozen=True)
    parallelize([m], DistInfo(), ParallelConfig(param_dtype="fp32", sync_batchnorm=False))
    assert calls == [1]
