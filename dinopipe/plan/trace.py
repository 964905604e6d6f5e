"""The real training step at world size W, in one process, without the hardware (``dinopipe plan --trace``).

torchtitan's memory-estimation recipe applied to dinopipe's own code: the task (``SSLTask``: student with its
DINO / iBOT heads, EMA teacher, losses with Sinkhorn-Knopp centring, the Gram teacher of DINOv3 configs) is
built on the ``meta`` device by the same ``build_task`` the trainer uses, sharded by the same
``parallelize_task`` (FSDP2 per block and at the root, mixed precision, activation checkpointing, frozen modules
resharded after forward) over torch's fake process group (``FakeStore``, backend ``fake``) of W ranks, then
materialised with ``to_empty`` under ``FakeTensorMode`` (tensors carry shapes, dtypes and devices, no storage,
no compute). One or two real steps then run in the loop's order: zero_grad -> task forward (teacher, student,
losses) -> backward -> clip -> AdamW step -> EMA; the Gram teacher is refreshed at the traced step as at
``gram.first_step``. ``FSDPMemTracker`` records rank 0's peak memory, ``CommDebugMode`` and a byte counter the
collectives; every rank of an FSDP2 job holds the same shapes, so rank 0 stands for all. At W = 1 in bf16 nothing
is sharded (``train/mirror.py``) and torch's ``MemTracker`` records the peak instead.

What stays untraced (the fake device is ``cpu``: the ``cuda`` device type needs a driver): the CUDA caching
allocator's rounding and fragmentation, NCCL's own buffers, the CUDA context, ``torch.compile`` (blocks run
eagerly: the compiled kernels may keep fewer intermediates), the CUDA SDPA kernels (the CPU flash kernel keeps
the same output + logsumexp) and separate CUDA streams (FSDP2's all-gather stream can hold the next unit while
the current one computes; the trace sees the same prefetch but on one timeline). ``dinopipe gpu-check --only
trace`` compares a traced peak with ``torch.cuda.max_memory_allocated`` on a real GPU.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections import defaultdict
from functools import partial
from typing import Any, Optional

import torch

from ..config import phase_steps, reduce_dtypes
from ..utils import torch_compat as compat
from .analytic import DTYPE_BYTES, describe, state_memory, step_memory
from .gram import gram_state_bytes, largest_variant

log = logging.getLogger(__name__)

GiB = 1024**3

# collective -> which tensor's bytes one rank sends or receives (the c10d op names seen under a process group)
_COLLECTIVES = ("allgather", "all_gather", "reduce_scatter", "allreduce", "all_reduce", "broadcast", "alltoall",
                "all_to_all")


class CollectiveBytes(compat.torch_dispatch_mode_cls()):
    """Bytes per collective kind that pass through the dispatcher (c10d and functional collectives): the output
    of gathers, the input of reduce-scatters, the tensor of all-reduces; per rank, per call."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.fp32_bytes: dict[str, int] = defaultdict(int)
        """The same collectives with every floating-point tensor in fp32 (the reference of the ratio)."""
        self.calls: dict[str, int] = defaultdict(int)

    @staticmethod
    def _nbytes(x: Any, fp32: bool = False) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * (4 if fp32 and x.dtype.is_floating_point else x.element_size())
        if isinstance(x, (list, tuple)):
            return sum(CollectiveBytes._nbytes(t, fp32) for t in x)
        return 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        ns = getattr(func, "namespace", "")
        if ns in ("c10d", "_c10d_functional") and any(c in name for c in _COLLECTIVES):
            kind = ("all_gather" if "gather" in name else "reduce_scatter" if "scatter" in name
                    else "all_reduce" if "reduce" in name else name.split(".")[0])
            # gathers: the first argument is the (pre-allocated) output; reduce-scatters: (output, input, ...)
            which = (args[1] if kind == "reduce_scatter" and "base" in name else args[0]) if args else None
            self.bytes[kind] += self._nbytes(which)
            self.fp32_bytes[kind] += self._nbytes(which, fp32=True)
            self.calls[kind] += 1
        return out


@dataclasses.dataclass
class TraceResult:
    config: str
    world_size: int
    batch_per_rank: int
    phase: str
    steps: int
    peak_bytes: int
    """Rank 0's peak tensor memory over the traced steps (FSDPMemTracker, all categories)."""
    peak_by_category: dict[str, int]
    collective_bytes_per_step: dict[str, int]
    collective_calls_per_step: dict[str, int]
    comm_counts: dict[str, int]
    planner: dict[str, int]
    """The analytic planner's counted bytes for the same config, phase and W (no margin, no overhead)."""
    seconds: float
    accumulate: int = 1
    """Micro-batches per optimizer step (``train.accumulate``); ``batch_per_rank`` is one micro-batch."""
    collective_fp32_bytes_per_step: dict[str, int] = dataclasses.field(default_factory=dict)
    """The same collectives had every floating-point tensor been fp32."""

    @property
    def planner_ratio(self) -> float:
        return self.planner["counted"] / self.peak_bytes

    @property
    def comm_ratio(self) -> float:
        """Bytes through the collectives over the same step's bytes with every collective in fp32."""
        fp32 = sum(self.collective_fp32_bytes_per_step.values())
        return sum(self.collective_bytes_per_step.values()) / fp32 if fp32 else 1.0

    def report(self) -> str:
        lines = [f"traced {self.steps} real step(s) of {self.config}, phase {self.phase}, W={self.world_size}, "
                 f"{self.batch_per_rank} images per rank"
                 + (f" x {self.accumulate} micro-batches" if self.accumulate > 1 else "")
                 + f", in {self.seconds:.0f} s (fake tensors, fake process group)",
                 f"  peak memory per rank (FSDPMemTracker): {self.peak_bytes / GiB:.2f} GiB"]
        for k, v in sorted(self.peak_by_category.items(), key=lambda kv: -kv[1]):
            if v:
                lines.append(f"    {k:<18} {v / GiB:8.2f} GiB")
        p = self.planner
        lines.append(f"  analytic planner: {p['counted'] / GiB:.2f} GiB counted (state {p['state'] / GiB:.2f}, step "
                     f"{p['activations'] / GiB:.2f}; gradients and the backward's gathered units count after the activation peak"
                     f"); planner / trace = {self.planner_ratio:.3f}")
        lines.append("  collectives per step and rank (bytes moved through c10d):")
        for k in sorted(self.collective_bytes_per_step):
            lines.append(f"    {k:<15} {self.collective_bytes_per_step[k] / GiB:8.3f} GiB in "
                         f"{self.collective_calls_per_step[k]} calls")
        if self.collective_fp32_bytes_per_step:
            lines.append(f"    = {self.comm_ratio:.3f} of the same collectives in fp32")
        return "\n".join(lines)


def _phase(cfg: Any, name: Optional[str]):
    phases = list(cfg.phases)
    if name is None:
        return 0, phases[0]
    for i, ph in enumerate(phases):
        if ph.name == name:
            return i, ph
    raise ValueError(f"no phase '{name}' (phases: {', '.join(p.name for p in phases)})")


def synthetic_batch(cfg: Any, phase: Any, patch_size: int, seed: int = 0) -> dict:
    """A batch as the real collator makes it (iBOT masks drawn by it), from blank images of the phase's sizes."""
    from ..data.multires import GramCropCollator

    b, n_l = phase.batch_size_per_gpu, cfg.crops.local_crops_number
    g, loc = phase.global_crops_size, phase.local_crops_size
    gram = getattr(phase, "gram_crops_size", None) if getattr(cfg, "gram", None) is not None and cfg.gram.enabled else None
    glob, local = torch.zeros(3, g, g), torch.zeros(3, loc, loc)
    samples = []
    for _ in range(b):
        s = {"global_crops": [glob, glob], "local_crops": [local] * n_l}
        if gram:
            s["gram_crops"] = [torch.zeros(3, gram, gram)] * 2
        samples.append(s)
    import numpy as np

    collate = GramCropCollator(patch_size, cfg.ibot.mask_ratio_min_max, cfg.ibot.mask_sample_probability)
    return collate(samples, rng=np.random.default_rng(seed))


def planner_figures(cfg: Any, world_size: int, phase: Any, n_masked: int) -> dict[str, int]:
    """The analytic planner's per-rank bytes for this config, phase and W, as ``plan`` counts them."""
    arch, heads = describe(cfg)
    p = cfg.parallel
    c = DTYPE_BYTES[p.param_dtype]
    state = state_memory(arch, heads, world_size, p.param_dtype, *reduce_dtypes(p))
    from .analytic import counted_peak, sharded_numel

    gram = gram_state_bytes(cfg, arch, world_size, sharded_numel)
    state = {**state, "total": state["total"] + gram}
    attn = "math" if str(cfg.model.attn_backend) == "math" else "sdpa"
    act = step_memory(cfg, arch, heads, phase, phase.batch_size_per_gpu, c, attn, p.activation_checkpointing,
                      n_masked=n_masked, n_gpus=world_size)["peak"]
    return {"state": state["total"], "activations": act, "counted": counted_peak(state, act)}


def trace(cfg: Any, world_size: int, steps: int = 2, phase: Optional[str] = None, seed: int = 0,
          comm_debug: bool = True, recorder: Any = None, compile_backend: Any = None) -> TraceResult:
    """Run ``steps`` real training steps of the PretrainConfig ``cfg`` as rank 0 of ``world_size`` ranks.
    ``comm_debug``: also attach torch's ``CommDebugMode`` (op counts; the byte counter runs regardless).
    ``recorder``: a dispatch mode (plan/gpu_cost.py's ``CostRecorder``) entered innermost, its ``active`` set
    for the last step only (the first one also creates the optimizer's state). ``compile_backend``: a
    ``torch.compile`` backend that runs on fake tensors (plan/inductor_cost.py's); the recipe's ``parallel.compile``
    then compiles as in training, with it, instead of running eagerly."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from ..ssl.param_groups import build_param_groups
    from ..ssl.task import SSLTask
    from ..train import dist as tdist
    from ..train.builders import build_schedules
    from ..train.dist import DistInfo, all_reduce_sum_fn
    from ..train.parallel import device_mesh
    from ..train.run import build_task, parallelize_task

    if dist.is_initialized():
        raise RuntimeError("plan --trace runs in a process without a process group")
    t0 = time.perf_counter()
    cfg = copy.deepcopy(cfg)
    # The traced model is the registry variant (a released file's weights do not change memory), compiled
    # blocks run eagerly (no inductor under fake tensors).
    cfg.model.pretrained = None
    cfg.parallel.compile = bool(cfg.parallel.compile) and compile_backend is not None
    index, ph = _phase(cfg, phase)
    ph = largest_variant(ph)  # a high-res adaptation phase: the largest size triple it draws
    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=world_size)
    info = DistInfo(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), backend="fake")
    scope = contextlib.ExitStack()
    scope.enter_context(tdist.use_info(info))  # the train layer's view of the (fake) process group, put back after
    try:
        device_mesh(info)  # outside the fake mode (building a mesh reads tensor values)
        torch.manual_seed(seed)
        with torch.device("meta"):
            task = build_task(SSLTask, cfg, all_reduce_fn=all_reduce_sum_fn())
        k_acc = max(1, int(getattr(cfg.train, "accumulate", 1)))
        micro = [synthetic_batch(cfg, ph, task.data_patch_size, seed + i) for i in range(k_acc)]
        n_masked = max(int(b["mask_indices"].numel()) for b in micro)
        # Step values at the first step every part of the loss is on (the Gram teacher's first refresh).
        bounds = phase_steps(cfg)
        first = bounds[index][0]
        if getattr(cfg, "gram", None) is not None and cfg.gram.enabled:
            first = max(first, min(cfg.gram.first_step, bounds[-1][1] - steps))
        sched = build_schedules(cfg, world_size)
        fake = compat.fake_tensor_mode(allow_non_fake_inputs=True)
        with fake:
            parallelize_task(task, info, cfg.parallel, **({} if compile_backend is None else
                                                            {"compile_backend": compile_backend}))
            task.to_empty(device="cpu")
            o = cfg.optim
            optimizer = task.build_optimizer(partial(build_param_groups, lr_decay_rate=o.layerwise_decay,
                                                     patch_embed_lr_mult=o.patch_embed_lr_mult),
                                             betas=(o.adamw_beta1, o.adamw_beta2))
            first_opt = next(iter(task.optimizers.values()))
            roots = [m for m in task.modules() if hasattr(m, "unshard")]
            # every FSDP root of the task (student, heads, teacher, Gram teacher)
            tracker = (compat.fsdp_mem_tracker(roots[0], first_opt, roots=task) if roots
                       else compat.mem_tracker(task, first_opt))  # one rank: no FSDP2 (train/mirror.py)
            tracker.track_inputs((micro,))
            comm, counter = (CommDebugMode() if comm_debug else contextlib.nullcontext()), CollectiveBytes()
            per_step: list[dict[str, int]] = []
            per_step32: list[dict[str, int]] = []
            calls: list[dict[str, int]] = []
            rec = recorder if recorder is not None else contextlib.nullcontext()
            with compat.own_fake_mode_for_sharding_propagation(), tracker, comm, counter, rec:
                for k in range(steps):
                    if recorder is not None:
                        recorder.active = k == steps - 1
                    before, before_calls = dict(counter.bytes), dict(counter.calls)
                    before32 = dict(counter.fp32_bytes)
                    s = min(first + k, len(sched["lr"]) - 1)
                    values = {name: float(arr[s]) for name, arr in sched.items()}
                    _step(task, optimizer, micro, values, cfg.optim.clip_grad)
                    per_step.append({kk: v - before.get(kk, 0) for kk, v in counter.bytes.items()})
                    per_step32.append({kk: v - before32.get(kk, 0) for kk, v in counter.fp32_bytes.items()})
                    calls.append({kk: v - before_calls.get(kk, 0) for kk, v in counter.calls.items()})
                    tracker.reset_mod_stats()
            peak = tracker.get_tracker_snapshot("peak")
        dev = next(iter(peak))
        by_cat = {str(k): int(v) for k, v in peak[dev].items() if k != "Total"}
        result = TraceResult(
            config=str(cfg.model.name), world_size=world_size, batch_per_rank=ph.batch_size_per_gpu,
            phase=ph.name, steps=steps, peak_bytes=int(peak[dev]["Total"]), peak_by_category=by_cat,
            collective_bytes_per_step=per_step[-1], collective_calls_per_step=calls[-1],
            comm_counts={str(k): int(v) for k, v in comm.get_comm_counts().items()} if comm_debug else {},
            planner=planner_figures(cfg, world_size, ph, n_masked), seconds=time.perf_counter() - t0,
            accumulate=k_acc, collective_fp32_bytes_per_step=per_step32[-1])
        return result
    finally:
        scope.close()
        from ..train import parallel as tpar

        tpar._MESHES.clear()
        dist.destroy_process_group()


def _step(task, optimizer, micro: list[dict], values: dict, clip: float) -> None:
    """The loop's step order (train/loop.py): zero_grad -> [teacher targets of all K micro-batches] -> forward
    and backward of each micro-batch (loss / K) -> clip -> step -> EMA."""
    optimizer.zero_grad(set_to_none=True)
    k = len(micro)
    if k > 1 and hasattr(task, "begin_accumulation"):
        task.begin_accumulation(micro, values)
    for batch in micro:
        loss, _ = task(batch, values)
        (loss / k if k > 1 else loss).backward()
    for group in task.clip_groups():
        params = [p for p in group if p.grad is not None]
        if params and clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    optimizer.step()
    task.after_step(values)


__all__ = ["trace", "TraceResult", "CollectiveBytes", "planner_figures", "synthetic_batch"]
