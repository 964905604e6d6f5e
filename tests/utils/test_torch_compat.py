"""Each private torch API dinopipe uses, through dinopipe/utils/torch_compat.py, on the installed torch.

This file runs on the development torch (``make test``) and on the floor torch 2.9.1 (``make test-floor``,
FLOOR_TESTS in the Makefile): an internal renamed between the two fails here, by name, not in a run."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dinopipe.train import dist as tdist
from dinopipe.utils import torch_compat as compat


@pytest.fixture
def fake_group():
    """Rank 1 of a 4-rank fake process group (collectives return at once), removed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=compat.fake_store(), rank=1, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_device_constructors_and_the_function_mode_stack():
    assert torch.empty in compat.device_constructors() and torch.zeros in compat.device_constructors()
    assert not any(isinstance(m, compat.device_context_cls()) for m in compat.function_mode_stack())
    with torch.device("meta"):
        [ctx] = [m for m in compat.function_mode_stack() if isinstance(m, compat.device_context_cls())]
        assert ctx.device == torch.device("meta") and torch.empty(2).is_meta


def test_storage_key_is_one_per_storage_meta_included():
    a, b = torch.empty(4, 4, device="meta"), torch.empty(4, 4, device="meta")
    assert compat.storage_key(a) == compat.storage_key(a[1:].t()) != compat.storage_key(b)
    c = torch.zeros(3)
    assert compat.storage_key(c.view(3, 1)) == compat.storage_key(c)


def test_a_dispatch_mode_sees_ops_and_pytree_walks_arguments():
    seen = []

    class Names(compat.torch_dispatch_mode_cls()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            leaves, _ = compat.tree_flatten((args, kwargs or {}))
            seen.append((func.__name__.split(".")[0], sum(isinstance(x, torch.Tensor) for x in leaves)))
            return func(*args, **(kwargs or {}))

    with Names():
        torch.ones(2) + torch.ones(2)
    assert ("add", 2) in seen
    assert compat.tree_map(lambda x: x * 2, {"a": [1, (2, 3)]}) == {"a": [2, (4, 6)]}


def test_local_shape_and_offset_of_an_uneven_shard(fake_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (4,))
    # 10 rows over 4 ranks: 3, 3, 3, 1; this is rank 1
    t = DTensor.from_local(torch.empty(3, 5), mesh, [Shard(0)], run_check=False, shape=(10, 5), stride=(5, 1))
    assert compat.local_shape_and_global_offset(t) == ((3, 5), (3, 0))
    r = DTensor.from_local(torch.empty(10, 5), mesh, [Replicate()], run_check=False)
    assert compat.local_shape_and_global_offset(r) == ((10, 5), (0, 0))


def test_fake_tensors_have_shapes_and_no_storage():
    with compat.fake_tensor_mode():
        x = torch.empty(1 << 20, 1 << 20)  # 4 TiB: would not fit anywhere
        y = x @ x
    assert y.shape == (1 << 20, 1 << 20) and type(y).__name__ == "FakeTensor"


def test_sharding_propagation_patch_is_undone_even_on_error():
    import importlib

    prop = importlib.import_module("torch.distributed.tensor._sharding_prop")
    before = getattr(prop, "detect_fake_mode", None)
    with pytest.raises(KeyError):
        with compat.own_fake_mode_for_sharding_propagation():
            if before is not None:  # torch >= 2.10: the trace's fake mode is hidden from the propagation
                with compat.fake_tensor_mode():
                    assert prop.detect_fake_mode() is None
            raise KeyError("boom")
    assert getattr(prop, "detect_fake_mode", None) is before


def test_fsdp_mem_tracker_counts_a_sharded_step_under_fake_tensors(fake_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (4,))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    with compat.fake_tensor_mode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        tracker = compat.fsdp_mem_tracker(model, opt, roots=model)
        x = torch.randn(8, 64)
        tracker.track_inputs((x,))
        with compat.own_fake_mode_for_sharding_propagation(), tracker:
            for _ in range(2):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
                tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")
    total = peak[next(iter(peak))]["Total"]
    params = sum(p.numel() for p in model.parameters()) * 4  # global fp32 bytes
    # at least this rank's parameters, gradients and two AdamW moments; well under the full model's four copies
    assert params / 4 * 4 <= total < params * 4


def test_dcp_set_element_fills_a_nested_state_dict():
    root: dict = {}
    compat.dcp_set_element(root, ("optim", "state", 0, "exp_avg"), 1)
    compat.dcp_set_element(root, ("model", "w"), 2)
    assert root == {"optim": {"state": [{"exp_avg": 1}]}, "model": {"w": 2}}  # an int step makes a list


def test_deepcopies_share_parameters_only_inside_the_block_and_this_thread():
    m = nn.Linear(3, 3)
    had_own = "__deepcopy__" in nn.Parameter.__dict__
    original = nn.Parameter.__deepcopy__
    other = {}
    with compat.deepcopies_share_parameters():
        c = copy.deepcopy(m)
        t = threading.Thread(target=lambda: other.setdefault("copy", copy.deepcopy(m)))
        t.start()
        t.join()
    assert c.weight is not m.weight and c.weight.data_ptr() == m.weight.data_ptr()  # new Parameter, same memory
    assert other["copy"].weight.data_ptr() != m.weight.data_ptr()  # another thread: a real copy
    assert copy.deepcopy(m).weight.data_ptr() != m.weight.data_ptr()  # after the block: a real copy
    assert ("__deepcopy__" in nn.Parameter.__dict__) == had_own and nn.Parameter.__deepcopy__ is original
    with pytest.raises(RuntimeError), compat.deepcopies_share_parameters():
        raise RuntimeError("a failed build")
    assert nn.Parameter.__deepcopy__ is original


def test_use_info_puts_the_train_layers_view_back():
    before = tdist.get_info()
    info = tdist.DistInfo(rank=3, world_size=8, backend="fake")
    with pytest.raises(ValueError), tdist.use_info(info):
        assert tdist.get_info() is info
        raise ValueError
    assert tdist.get_info() == before


def test_a_missing_internal_is_named_with_the_torch_version(monkeypatch):
    import torch.utils._device as device_mod

    compat._attr.cache_clear()
    monkeypatch.delattr(device_mod, "_device_constructors")
    try:
        with pytest.raises(compat.TorchCompatError) as err:
            compat.device_constructors()
        assert f"torch {torch.__version__} has no torch.utils._device._device_constructors" in str(err.value)
    finally:
        compat._attr.cache_clear()


def test_tensor_version_counts_in_place_writes_through_views():
    t = torch.zeros(4)
    v = compat.tensor_version(t)
    t[1:].add_(1)
    assert compat.tensor_version(t) == v + 1


def test_compile_counters_and_inductor_random_setting():
    import importlib

    counters = compat.dynamo_counters()
    counters.clear()
    assert sum(counters["graph_break"].values()) == 0
    config = importlib.import_module("torch._inductor.config")
    before = config.fallback_random
    try:
        compat.inductor_fallback_random(True)
        assert config.fallback_random is True
    finally:
        config.fallback_random = before


def test_a_wrapper_tensor_has_a_shape_and_its_class_sees_every_op():
    seen = []

    class Probe(torch.Tensor):
        __torch_function__ = compat.disabled_torch_function()

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return torch.ones(2, 3)

    t = compat.wrapper_tensor(Probe, (2, 3), torch.float16)
    assert isinstance(t, Probe) and t.shape == (2, 3) and t.dtype == torch.float16 and t.device.type == "cpu"
    out = t + 1
    assert type(out) is torch.Tensor and torch.equal(out, torch.ones(2, 3)) and seen == [torch.ops.aten.add.Tensor]


def test_adams_private_pair_takes_one_adamw_step_as_torchs_adamw_does():
    """``Adam._init_group`` fills the lists (and creates the moments), the functional ``adam`` updates them: the
    pair ssl/adamw.py drives gives the stock AdamW's weights bit for bit."""
    torch.manual_seed(0)
    w0, g = torch.randn(5, 3), torch.randn(5, 3)
    ref, mine = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    ref.grad, mine.grad = g.clone(), g.clone()
    stock = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.05)
    stock.step()
    opt = torch.optim.AdamW([mine], lr=0.1, weight_decay=0.05)
    (group,) = opt.param_groups
    lists = [[] for _ in range(6)]  # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
    has_complex = compat.adam_init_group()(opt, group, *lists)
    assert lists[0] == [mine] and set(opt.state[mine]) >= {"exp_avg", "exp_avg_sq", "step"}
    beta1, beta2 = group["betas"]
    with torch.no_grad():
        compat.functional_adam()(*lists, amsgrad=False, has_complex=has_complex, beta1=beta1, beta2=beta2, lr=0.1,
                                 weight_decay=0.05, eps=group["eps"], maximize=False, foreach=group["foreach"],
                                 capturable=False, differentiable=False, fused=group["fused"], grad_scale=None,
                                 found_inf=None, decoupled_weight_decay=True)
    assert torch.equal(mine.detach(), ref.detach()) and not torch.equal(mine.detach(), w0)


def test_the_default_process_group_is_the_world_group(fake_group):
    assert compat.default_process_group() is dist.group.WORLD


def test_norm_base_classes_tell_norms_with_running_statistics_apart():
    bn, sync, inorm, ln = nn.BatchNorm2d(3), nn.SyncBatchNorm(3), nn.InstanceNorm2d(3), nn.LayerNorm(3)
    assert all(isinstance(m, compat.batchnorm_base()) for m in (bn, sync, nn.BatchNorm1d(3)))
    assert not isinstance(inorm, compat.batchnorm_base()) and not isinstance(ln, compat.batchnorm_base())
    assert all(isinstance(m, compat.norm_base()) for m in (bn, sync, inorm))
    assert not isinstance(ln, compat.norm_base()) and not isinstance(nn.GroupNorm(1, 3), compat.norm_base())
