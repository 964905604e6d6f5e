"""Launches and host syncs of one training step (issue 29, deliverable 3), counted on CPU.

    python bench/bench_step_ops.py                          # vit_s14, b=8, 2x224 + 8x98 crops, FSDP2 1 rank
    python bench/bench_step_ops.py --model vit_test --batch 4 --global-size 56 --local-size 28 --n-local 2
    python bench/bench_step_ops.py --json out.json          # also write the numbers
    python bench/bench_step_ops.py --quick                  # the vit_test line (make bench)

The step is the trainer's own (``Trainer._train_step``: schedules -> zero_grad -> task forward/backward -> the
loop's one all-reduce -> finite check -> clip -> AdamW step -> teacher EMA) around the real ``SSLTask`` (student
with DINO + iBOT heads, EMA teacher, losses with centring), sharded by ``parallelize_task`` on a 1-rank gloo
FSDP2 mesh (the multi-GPU code path; at world size 1 FSDP2 issues no collective), on a fixed synthetic batch
from the real collator. Steps 0-1 warm up; the later ones are counted and the median is printed:

- ``aten_ops``: every ``aten::`` op the profiler records in the step (composite ops and what they call);
  ``leaf_aten_ops``: those without an ``aten::`` op under them, i.e. the kernels a GPU would launch (an upper
  bound: the fused optimizer's and the compiled blocks' kernels each count once).
- ``kernel_ops``: leaf ops less those that only make metadata or memory (views, empty, ``to`` as a no-op): what a GPU
  would launch, a multi-tensor op (``_foreach_*``, ``_fused_*``: a per-tensor loop on CPU) counted once; per part of
  the step (forward+backward, reduce, clip, optimizer, ema).
- ``host_reads``: reads of tensor values by the host (``.item() .tolist() float() int() bool() .numpy()`` on a
  tensor, and ``aten::_local_scalar_dense``/``nonzero`` reached from C++), AdamW's host step counters excluded:
  on CUDA each one waits for the GPU.
- ``tensors_from_python``: tensors made from Python data inside the step (``aten::lift_fresh``: ``torch.tensor``,
  ``new_tensor``, indexing with a list): on CUDA each is a blocking host-to-device copy when it lands on the
  device (those of AdamW's host counters excluded).
- ``host_syncs``: host_reads + tensors_from_python that go to the step's device, the CUDA-equivalent count
  (``dinopipe gpu-check`` counts the real ones with ``torch.cuda.set_sync_debug_mode``).

The op counts do not depend on the batch or crop sizes (each op runs on the whole packed batch), so a smaller
batch than the recipe's b=64 gives the same counts on 2 shared cores (vit_s14 b=64 takes minutes per step
here). ``--compile aot_eager`` compiles as ``parallel.compile=true`` does, with the eager-kernel backend (no
fusion: op counts stay; it shows the graphs); inductor on CPU needs minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from dinopipe.config import load_config  # noqa: E402
from dinopipe.ssl.config import PretrainConfig  # noqa: E402
from dinopipe.ssl.param_groups import build_param_groups  # noqa: E402
from dinopipe.ssl.task import SSLTask  # noqa: E402
from dinopipe.train import dist as tdist  # noqa: E402
from dinopipe.train.dist import DistInfo  # noqa: E402
from dinopipe.train.loop import LoopConfig, Phase, Trainer  # noqa: E402
from dinopipe.train.run import LoopTask, parallelize_task  # noqa: E402
from dinopipe.train.step_data import REPORT_SIZE, DataReport  # noqa: E402

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy")


def config(args) -> PretrainConfig:
    over = [f"model.name={args.model}", f"model.img_size={args.global_size}",
            f"crops.local_crops_number={args.n_local}", "data.paths=[unused]", f"parallel.param_dtype={args.dtype}",
            f"parallel.compile={'true' if args.compile != 'none' else 'false'}",
            "phases=[{name: base, fraction: 1.0, global_crops_size: %d, local_crops_size: %d, batch_size_per_gpu: %d}]"
            % (args.global_size, args.local_size, args.batch)]
    if args.model == "vit_test":
        over += ["dino.head.n_prototypes=128", "dino.head.hidden_dim=64", "dino.head.bottleneck_dim=32",
                 "ibot.head.n_prototypes=128", "ibot.head.hidden_dim=64", "ibot.head.bottleneck_dim=32"]
    return load_config(PretrainConfig, None, over + list(args.set))


def batch(cfg, patch: int) -> dict:
    from dinopipe.plan.trace import synthetic_batch

    out = synthetic_batch(cfg, cfg.phases[0], patch, seed=0)
    g = torch.Generator().manual_seed(0)
    for k in ("global_crops", "local_crops"):
        out[k] = torch.randn(out[k].shape, generator=g)
    return out


class Counting:
    """Python-level host reads of tensors during ``active``; AdamW's host step counters are no device wait."""

    def __init__(self, optimizer) -> None:
        self.optimizer, self.active, self.n = optimizer, False, Counter()
        self._saved = {}

    def _host_counter(self, t) -> bool:
        opts = getattr(self.optimizer, "optimizers", {"": self.optimizer}).values()
        return any(t is st.get("step") for o in opts for st in o.state.values())

    def __enter__(self):
        for name in READS:
            fn = getattr(torch.Tensor, name)
            self._saved[name] = fn

            def wrapper(*a, _fn=fn, _name=name, **k):
                if self.active and not (a and self._host_counter(a[0])):
                    self.n[_name] += 1
                return _fn(*a, **k)
            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)


PARTS = ("forward+backward", "reduce", "clip", "optimizer", "ema")
# Ops that only make a tensor's metadata or memory (no kernel on a GPU): left out of ``kernel_ops``.
NO_KERNEL = {f"aten::{n}" for n in (
    "view", "as_strided", "view_as", "reshape", "_reshape_alias", "transpose", "t", "permute", "alias", "detach",
    "expand", "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "narrow",
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_", "lift_fresh", "flatten",
    "unflatten", "_unsafe_view", "resolve_conj", "resolve_neg", "set_", "to", "contiguous", "detach_", "is_pinned",
    "_has_compatible_shallow_copy_type", "result_type", "is_nonzero", "item", "_local_scalar_dense", "size",
    "stride", "numel", "dim", "record_stream", "_to_copy_nocopy")}


def _part(e) -> str:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("part:"):
            return p.name[5:]
        p = p.cpu_parent
    return "other"


def mark_parts(trainer, opt, task) -> None:
    """record_function ranges around the parts of the step, so each op is counted under its part."""
    from torch.profiler import record_function

    def wrap(obj, attr, label):
        fn = getattr(obj, attr)

        def inner(*a, **k):
            with record_function("part:" + label):
                return fn(*a, **k)
        setattr(obj, attr, inner)

    wrap(trainer, "_forward_backward", "forward+backward")
    wrap(trainer, "_reduce", "reduce")
    wrap(trainer, "_clip", "clip")
    wrap(opt, "step", "optimizer")
    wrap(trainer.task, "after_step", "ema")


def patch_host_tensor(counter: Counter) -> None:
    """``dinopipe.utils.device.host_tensor`` (after issue 29) copies asynchronously from pinned memory on CUDA:
    its one ``lift_fresh`` is no sync. Count its calls to take them out."""
    import dinopipe.train.loop as loop_mod
    import dinopipe.train.metrics as metrics_mod

    for mod in (loop_mod, metrics_mod):
        fn = getattr(mod, "host_tensor", None)
        if fn is not None and not getattr(fn, "_counted", False):
            def inner(*a, _fn=fn, **k):
                counter["host_tensor"] += 1
                return _fn(*a, **k)
            inner._counted = True
            setattr(mod, "host_tensor", inner)


def _multi(e) -> bool:
    return e.name.startswith(("aten::_foreach_", "aten::_fused_"))


def _under_multi(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if _multi(p):
            return True
        p = p.cpu_parent
    return False


def count_events(prof) -> dict:
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    leaf = [e for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    names = Counter(e.name for e in events)
    # lift_fresh under the optimizer's own init / host counters is not a device copy: count those from the
    # task and the loop only (the optimizer step runs under "Optimizer.step#..." record_function ranges).
    lifts = 0
    for e in events:
        if e.name != "aten::lift_fresh":
            continue
        p, in_opt = e.cpu_parent, False
        while p is not None:
            in_opt = in_opt or p.name.startswith("Optimizer.")
            p = p.cpu_parent
        lifts += not in_opt
    # A multi-tensor op (``_foreach_*``, ``_fused_*``) is one launch per chunk of tensors on CUDA; on CPU it runs
    # a per-tensor loop: count it once, not what it runs.
    multi = [e for e in events if _multi(e) and not _under_multi(e)]
    kernels = [e for e in leaf if e.name not in NO_KERNEL and not _under_multi(e)] + multi
    by_part = Counter(_part(e) for e in kernels)
    return {"aten_ops": len(events), "leaf_aten_ops": len(leaf), "kernel_ops": len(kernels),
            "kernels_by_part": dict(by_part), "top_kernels": Counter(e.name for e in kernels).most_common(10),
            "local_scalar_dense": names["aten::_local_scalar_dense"],
            "nonzero": names["aten::nonzero"], "tensors_from_python": lifts, "top": names.most_common(12)}


def run(args) -> dict:
    C.setup(threads=args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    info = DistInfo(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    tdist._INFO = info
    try:
        cfg = config(args)
        torch.manual_seed(0)
        task = SSLTask(cfg)
        parallelize_task(task, info, cfg.parallel) if args.compile == "none" else _parallelize(task, info, cfg, args)
        if args.adamw != "auto":  # e.g. fused on CPU: the kernel count CUDA's choice gives
            import dinopipe.ssl.base as base

            base.adamw_impl = lambda device: {"fused": {"fused": True}, "foreach": {"foreach": True},
                                              "for-loop": {"foreach": False}}[args.adamw]
        opt = task.build_optimizer(build_param_groups)
        n = args.steps
        sched = {"lr": np.full(n, 1e-4), "wd": np.full(n, 0.04), "momentum": np.full(n, 0.994),
                 "teacher_temp": np.full(n, 0.05)}
        b = batch(cfg, task.data_patch_size)
        phase = Phase("base", 0, n, args.batch, args.batch, args.batch, build_loader=None)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(LoopTask(task), opt, sched, [phase], tmp, info,
                              LoopConfig(progress=False, clip_grad=3.0), pool_size=10**6, step_hooks=[])
            trainer._preempt = False
            mark_parts(trainer, opt, task)
            async_copies = Counter()
            patch_host_tensor(async_copies)
            it = iter(lambda: b, None)
            report = DataReport.from_reduced([0.0] * REPORT_SIZE)
            rows, times = [], []
            with Counting(opt) as counting:
                for step in range(n):
                    counting.active, counting.n = True, Counter()
                    async_copies.clear()
                    t = time.perf_counter()
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        logs, _, _, report, _ = trainer._train_step([b], report, it, step, 1)
                    times.append(time.perf_counter() - t)
                    counting.active = False
                    if step >= 2:
                        row = count_events(prof)
                        row["python_reads"] = dict(counting.n)
                        py = sum(counting.n.values())
                        row["host_reads"] = py + row["nonzero"]
                        row["async_host_copies"] = async_copies["host_tensor"]
                        row["tensors_from_python"] -= row["async_host_copies"]
                        row["host_syncs"] = row["host_reads"] + row["tensors_from_python"]
                        rows.append(row)
        keys = ("aten_ops", "leaf_aten_ops", "kernel_ops", "host_reads", "tensors_from_python", "async_host_copies", "host_syncs")
        out = {k: statistics.median(r[k] for r in rows) for k in keys}
        out.update(model=args.model, batch=args.batch, compile=args.compile, dtype=args.dtype,
                   python_reads=rows[-1]["python_reads"], top_ops=rows[-1]["top"], loss=logs["loss"],
                   kernels_by_part=rows[-1]["kernels_by_part"], top_kernels=rows[-1]["top_kernels"],
                   step_s=statistics.median(times[2:]),
                   optimizer=[type(o).__name__ + ("(fused)" if o.defaults.get("fused") else "(foreach)"
                                                  if o.defaults.get("foreach") else "(for-loop)")
                              for o in task.optimizers.values()])
        return out
    finally:
        tdist._INFO = None
        dist.destroy_process_group()


def _parallelize(task, info, cfg, args):
    import inspect

    from dinopipe.train import parallel

    if "compile_backend" in inspect.signature(parallelize_task).parameters:
        return parallelize_task(task, info, cfg.parallel, compile_backend=args.compile)
    saved = parallel.compile_block  # before issue 29: blocks only, backend fixed
    parallel.compile_block = lambda blk, backend="inductor": saved(blk, args.compile)
    try:
        return parallelize_task(task, info, cfg.parallel)
    finally:
        parallel.compile_block = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vit_s14")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--global-size", type=int, default=224)
    p.add_argument("--local-size", type=int, default=98)
    p.add_argument("--n-local", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--compile", default="none", choices=["none", "aot_eager", "inductor"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--adamw", default="auto", choices=["auto", "fused", "foreach", "for-loop"],
                   help="AdamW kernels (auto: dinopipe's choice for the device; before issue 29 the for-loop on CPU)")
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides key=value")
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="vit_test, b=4, 2x56 + 2x28 px, 3 steps (make bench)")
    args = p.parse_args()
    if args.quick:
        args.model, args.batch, args.global_size, args.local_size, args.n_local, args.steps = "vit_test", 4, 56, 28, 2, 3
    res = run(args)
    print(f"{res['model']} b={res['batch']} {res['dtype']} compile={res['compile']} optimizer={res['optimizer']}")
    for k in ("aten_ops", "leaf_aten_ops", "kernel_ops", "host_reads", "tensors_from_python", "async_host_copies", "host_syncs",
              "step_s"):
        print(f"{k}: {res[k]}")
    print("kernel_ops by part: " + ", ".join(f"{p} {res['kernels_by_part'].get(p, 0)}" for p in PARTS + ("other",)))
    print(f"top_kernels: {res['top_kernels']}")
    print(f"python_reads: {res['python_reads']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
