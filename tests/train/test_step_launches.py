"""A training step with few launches and one host sync (issue 29): the EMA as multi-tensor ops equals the
per-parameter update, AdamW is fused on CUDA and foreach elsewhere, the heads and the losses compile with the
blocks without a graph break, and the real step (loop + SSLTask) reads the device once and copies no Python
data to it on the way. Counted on CPU: ``bench/bench_step_ops.py`` prints the numbers."""

import copy
import tempfile

import numpy as np
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile, record_function

from dinopipe.config import load_config
from dinopipe.plan.trace import synthetic_batch
from dinopipe.ssl.base import adamw_impl
from dinopipe.ssl.config import PretrainConfig
from dinopipe.ssl.ema import ema_update_
from dinopipe.ssl.param_groups import build_param_groups
from dinopipe.ssl.task import SSLTask
from dinopipe.train.dist import DistInfo
from dinopipe.train.loop import LoopConfig, Phase, Trainer
from dinopipe.train.run import LoopTask, parallelize_task
from dinopipe.train.step_data import REPORT_SIZE, DataReport
from tests.train.conftest import REPO, TINY


def _task(*overrides):
    torch.manual_seed(0)
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/quickstart.yaml", [*TINY, "data.paths=[x]", *overrides])
    return SSLTask(cfg), cfg


def _batch(cfg, seed=0):
    b = synthetic_batch(cfg, cfg.phases[0], 14, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for k in ("global_crops", "local_crops"):
        b[k] = torch.randn(b[k].shape, generator=g)
    return b


def test_multi_tensor_ema_equals_the_per_parameter_update():
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    teacher = copy.deepcopy(student)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p))
    want = [t.detach().clone().mul_(0.996).add_(s.detach(), alpha=1 - 0.996)  # DINOv2's update, one by one
            for t, s in zip(teacher.parameters(), student.parameters())]
    ema_update_(teacher, student, 0.996)
    for got, w in zip(teacher.parameters(), want):
        torch.testing.assert_close(got.detach(), w, rtol=0, atol=0)  # the same arithmetic, bit for bit


def test_adamw_is_fused_on_cuda_and_foreach_elsewhere():
    assert adamw_impl(torch.device("cuda", 0)) == {"fused": True}
    assert adamw_impl(torch.device("cpu")) == {"foreach": True}
    task, _ = _task()
    opt = task.build_optimizer(build_param_groups)
    adamw = task.optimizers["student"]
    assert adamw.defaults["foreach"] is True and not adamw.defaults.get("fused")
    assert len(opt.param_groups) == len(adamw.param_groups)


@pytest.mark.slow  # dynamo tracing: ~25 s of CPU, minutes of wall time on a loaded machine
def test_heads_and_losses_compile_without_a_graph_break(dynamo_reset):
    task, cfg = _task("parallel.compile=true", "ibot.separate_head=true")
    eager = copy.deepcopy(task)
    parallelize_task(task, DistInfo(), cfg.parallel, compile_backend="aot_eager")
    assert getattr(task.loss_terms, "_dinopipe_compiled", False)
    assert all(getattr(task.student[h], "_dinopipe_compiled", False) for h in ("dino_head", "ibot_head"))
    values = {"teacher_temp": 0.05, "momentum": 0.99, "dino_local_weight": 1.0}
    for seed in (0, 1):  # another mask count (dynamic shapes): the same graphs
        batch = _batch(cfg, seed)
        got, want = task(batch, values)[0], eager(batch, values)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        got.backward()
        want.backward()
    for (name, a), b in zip(task.student.named_parameters(), eager.student.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert dict(counters["graph_break"]) == {}
    graphs = counters["stats"]["unique_graphs"]
    print(f"graphs {graphs}, breaks {sum(counters['graph_break'].values())}")
    assert graphs <= 12, graphs  # blocks, heads and the loss, train + no-grad: nothing recompiled per step


def test_real_step_reads_the_device_once_and_copies_no_python_data_to_it():
    """The loop's step around SSLTask (forward, backward, the one all-reduce, clip, AdamW, EMA): one host read
    (the reduced vector's ``.tolist()``), no ``torch.tensor(python data)`` landing on the device (a blocking copy
    on CUDA: before issue 29 there were 10 per step: centring counts, clip divisors, metric slots, flags)."""
    import dinopipe.train.loop as loop_mod
    import dinopipe.train.metrics as metrics_mod

    task, cfg = _task("parallel.param_dtype=bf16")
    info = DistInfo()
    parallelize_task(task, info, cfg.parallel)
    opt = task.build_optimizer(build_param_groups)
    n = 3
    sched = {k: np.full(n, v) for k, v in (("lr", 1e-4), ("wd", 0.04), ("momentum", 0.99), ("teacher_temp", 0.05))}
    batch = _batch(cfg)
    reads = []
    saved = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__float__", "__int__", "__bool__")}
    host_counters: set = set()

    def counting(name, fn):
        def inner(*a, **k):
            if a and id(a[0]) not in host_counters:
                reads.append(name)
            return fn(*a, **k)
        return inner

    def ranged(fn):
        def inner(*a, **k):
            with record_function("host_tensor"):  # pinned + asynchronous on CUDA: not a sync
                return fn(*a, **k)
        return inner

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        trainer = Trainer(LoopTask(task), opt, sched, [Phase("base", 0, n, 4, 4, 4)], tmp, info,
                          LoopConfig(progress=False), pool_size=10**6, step_hooks=[])
        trainer._preempt = False
        for mod in (loop_mod, metrics_mod):
            mp.setattr(mod, "host_tensor", ranged(mod.host_tensor))
        report, it = DataReport.from_reduced([0.0] * REPORT_SIZE), iter(lambda: batch, None)
        for step in range(n):
            if step == n - 1:  # after the first steps (AdamW state made, metric index cached)
                host_counters = {id(st["step"]) for o in task.optimizers.values() for st in o.state.values()}
                for name, fn in saved.items():
                    mp.setattr(torch.Tensor, name, counting(name, fn))
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    report = trainer._train_step([batch], report, it, step, 1)[3]
            else:
                report = trainer._train_step([batch], report, it, step, 1)[3]
    lifts = []
    for e in prof.events():
        if e.name == "aten::lift_fresh":
            chain, p = [], e.cpu_parent
            while p is not None:
                chain.append(p.name)
                p = p.cpu_parent
            if not any(c == "host_tensor" or c.startswith("Optimizer.") for c in chain):
                lifts.append(chain[:3])
    assert reads == ["tolist"], reads
    assert lifts == [], lifts
