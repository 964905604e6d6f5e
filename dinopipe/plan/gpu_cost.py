"""A training step's GPU cost, estimated on a CPU from its aten op stream (``make gpu-proxy``).

A :class:`CostRecorder` (a ``TorchDispatchMode``) sits under a step that runs on fake tensors (no storage, no
compute) and records, per aten op that reaches the dispatcher:

- FLOPs from ``torch.utils.flop_counter``'s registry (GEMMs, convolutions, attention), with the CPU SDPA kernels
  registered under the CUDA flash formulas (same math; the CPU kernel is what runs under fake tensors on ``cpu``);
- bytes read and written: every tensor argument read, every returned tensor (and ``out=``) written; views and
  metadata ops move nothing; a broadcast (stride 0) dimension is read once; an in-place scatter (``index_add_``,
  ``index_put_``, ...) reads its source and index and updates only the rows they name, a gather (``index_select``,
  ``gather``, ...) reads the rows it selects and its index;
- kernels: one per op that moves data, none for views; multi-tensor ``_foreach_*`` and fused optimizer ops as
  CUDA's ``multi_tensor_apply`` launches them (a launch per 320 blocks of 64 Ki elements or per 36..110 tensors,
  by the number of tensor lists); FSDP2's custom copy ops as their CUDA implementations launch.

:func:`estimate` costs each op on a datasheet roofline -- ``max(FLOPs / (eff * peak), bytes / (eff * bandwidth),
floor)`` -- for the GPUs of :data:`GPUS` and sums per category. What it cannot see: host time between launches,
the CUDA caching allocator, small-GEMM efficiency below the datasheet, and (for an eager step) inductor's fusion,
which bench/gpu_proxy_compiled.py estimates from inductor's own generated kernels.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Iterable, Optional

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..utils import torch_compat as compat

CATEGORIES = ("gemm", "attention", "copy/cast/cat", "index", "elementwise", "reduce/norm", "optimizer", "comm",
              "fused", "extern")
"""``fused``: an inductor-generated Triton kernel; ``extern``: another extern kernel of a compiled region
(plan/inductor_cost.py); both are empty in an eager step."""


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float
    """Dense bf16 tensor-core peak (datasheet, SXM)."""
    tb_per_s: float
    """HBM bandwidth (datasheet)."""
    link_gb_per_s: float = 450.0
    """NVLink bandwidth per direction (datasheet: H100/H200 SXM 900 GB/s, A100 600 GB/s, both directions)."""


GPUS = {
    "H100": GPU("H100 SXM 80GB", 989.0, 3.35, 450.0),
    "H200": GPU("H200 SXM 141GB", 989.0, 4.8, 450.0),
    "A100": GPU("A100 SXM 80GB", 312.0, 2.039, 300.0),
}
# Fractions of the datasheet a well-shaped kernel reaches (CUTLASS/cuBLAS bf16 GEMMs, flash attention, streaming
# elementwise kernels), and the shortest kernel (launch to completion on the device).
EFF = {"gemm": 0.70, "attention": 0.45, "memory": 0.80, "link": 0.80}
FLOOR_S = 2.5e-6

# -- what an op does ---------------------------------------------------------------------------------------------

_FREE = {"_unsafe_view", "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "lift_fresh",
         "set_", "resize_", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
         "is_same_size", "_has_compatible_shallow_copy_type", "record_stream", "_to_copy_noop", "wait_tensor",
         "_reshape_alias", "resize_storage_bytes_", "dim", "is_nonzero", "equal"}
# ops whose first (mutated) argument is written, not read
_WRITE_ONLY_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
                    "index_copy_", "_foreach_copy_", "_foreach_zero_"}
_GEMM = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_convolution", "convolution_backward",
         "cudnn_convolution", "convolution_overrideable", "_slow_conv2d_forward", "_slow_conv2d_backward", "addbmm"}
_COPY = {"copy_", "_to_copy", "clone", "cat", "stack", "split_with_sizes_copy", "_chunk_cat", "chunk_cat",
         "constant_pad_nd", "all_gather_copy_in", "contiguous", "_foreach_copy_", "unsafe_split", "repeat",
         "slice_backward", "select_backward", "new_zeros", "zeros_like", "zeros", "fill_", "zero_", "full",
         "new_full", "ones", "ones_like", "full_like", "expand_copy", "permute_copy", "transpose_copy", "flip"}
_INDEX = {"index_select", "index_add", "index_add_", "index_copy", "index_copy_", "index", "index_put",
          "index_put_", "_index_put_impl_", "gather", "scatter", "scatter_add", "scatter_add_", "embedding",
          "embedding_dense_backward", "masked_select", "nonzero", "randperm", "masked_scatter", "take",
          "index_fill", "index_fill_", "masked_fill_", "masked_fill", "where"}
_REDUCE = {"native_layer_norm", "native_layer_norm_backward", "_softmax", "_log_softmax", "_softmax_backward_data",
           "_log_softmax_backward_data", "sum", "mean", "amax", "amin", "max", "min", "norm", "linalg_vector_norm",
           "var", "var_mean", "std", "logsumexp", "argmax", "argmin", "cumsum", "sort", "topk", "prod", "any", "all",
           "nll_loss_forward", "nll_loss_backward", "native_group_norm", "native_group_norm_backward"}
# ops that read only their first argument's metadata (shape, dtype, device), not its data
# in-place scatters: the kernel reads the source (and the index) and updates only the rows it names, never the rest
# of ``self`` (CUDA's index_add_ / index_put_ loop over the source); the position of the source argument
_SCATTER_INPLACE = {"index_add_": 3, "index_copy_": 3, "index_put_": 2, "_index_put_impl_": 2, "scatter_add_": 3,
                    "scatter_": 3}
# gathers: the kernel reads the rows it selects (as many bytes as it writes) and the index, not all of ``self``
_GATHER = {"index_select", "gather", "index", "embedding", "take"}
_META_SELF = {"new_full", "new_zeros", "new_ones", "new_empty", "new_empty_strided", "zeros_like", "ones_like",
              "full_like", "empty_like", "rand_like", "randn_like", "randint_like"}
# CUDA multi_tensor_apply: tensors per launch by the number of tensor lists (depth_to_max_tensors), blocks per launch
_MTA_TENSORS = (110, 64, 48, 36, 30)
_MTA_BLOCKS, _MTA_CHUNK = 320, 65536


def multi_tensor_launches(numels: Iterable[int], depth: int) -> int:
    """Kernel launches of one CUDA ``multi_tensor_apply`` call over tensors of ``numels`` with ``depth`` lists."""
    max_t = _MTA_TENSORS[min(max(depth, 1), len(_MTA_TENSORS)) - 1]
    launches, tensors, blocks = 0, 0, 0
    for n in numels:
        if n == 0:
            continue
        tensors += 1
        chunks = -(-n // _MTA_CHUNK)
        for c in range(chunks):
            blocks += 1
            last = c == chunks - 1
            if (tensors == max_t and last) or blocks == _MTA_BLOCKS:
                launches += 1
                blocks = 0
                tensors = 0 if last else 1
    return launches + (1 if blocks else 0)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for ``t``: its elements, a broadcast (stride 0) dimension once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def category(name: str, namespace: str) -> str:
    if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
        return "comm"
    if name in _GEMM:
        return "gemm"
    if "attention" in name or name.startswith("_flash") or name.startswith("_efficient"):
        return "attention"
    if name.startswith("_fused_adam") or name.startswith("_fused_sgd") or (
            name.startswith("_foreach_") and name != "_foreach_copy_"):
        return "optimizer"
    if name in _COPY:
        return "copy/cast/cat"
    if name in _INDEX:
        return "index"
    if name in _REDUCE:
        return "reduce/norm"
    return "elementwise"


def _cpu_sdpa(q, k, v, *a, out_val=None, **kw) -> int:
    return sdpa_flop_count(q.shape, k.shape, v.shape)


def _cpu_sdpa_backward(grad, q, k, v, *a, out_val=None, **kw) -> int:
    return sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)


def flop_formulas() -> dict:
    """torch's FLOP registry plus the CPU SDPA kernels under the CUDA flash formulas (forward, backward)."""
    reg = dict(flop_registry)
    aten = torch.ops.aten
    for name, fn in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward)):
        if hasattr(aten, name):
            reg[getattr(aten, name)] = fn
    return reg


@dataclasses.dataclass
class OpCost:
    name: str
    category: str
    flops: int
    read: int
    written: int
    kernels: int

    @property
    def bytes(self) -> int:
        return self.read + self.written


class CostRecorder(compat.torch_dispatch_mode_cls()):
    """Records an :class:`OpCost` per aten op while ``active`` (see the module's text)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpCost] = []
        self.active = True
        self._flops = flop_formulas()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.active:
            cost = self.cost(func, args, kwargs, out)
            if cost is not None:
                self.ops.append(cost)
        return out

    def cost(self, func, args, kwargs, out) -> Optional[OpCost]:
        name = func._schema.name.split("::")[-1]
        ns = getattr(func, "namespace", "")
        if ns == "prim" or name in _FREE or getattr(func, "is_view", False) or name.startswith("sym_"):
            return None
        outs = _tensors(out)
        # mutated arguments are written (in-place ops, ``out=``, foreach ops that return nothing)
        for a, v in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                            func._schema.arguments[len(args):]]):
            if a.alias_info is not None and a.alias_info.is_write:
                outs += _tensors(v)
        ins = _tensors(args) + _tensors({k: v for k, v in kwargs.items() if k != "out"})
        if name in _META_SELF and args:
            ins = _tensors(args[1:]) + _tensors({k: v for k, v in kwargs.items() if k != "out"})
        if name in _WRITE_ONLY_SELF and args:
            first = {id(t) for t in _tensors(args[0])}
            ins = [t for t in ins if id(t) not in first]
            outs = outs or _tensors(args[0])
        if name == "all_gather_copy_in":  # returns (the gather input: a view into the output, the output)
            outs = outs[-1:]
        written = sum(tensor_bytes(t) for t in {id(t): t for t in outs}.values())
        read = sum(tensor_bytes(t) for t in ins)
        if name in _SCATTER_INPLACE and len(args) > _SCATTER_INPLACE[name] and isinstance(args[0], torch.Tensor):
            src = _tensors(args[_SCATTER_INPLACE[name]])
            rows = sum(t.numel() for t in src) * args[0].element_size()  # the part of self the kernel touches
            read = sum(tensor_bytes(t) for t in ins if t is not args[0]) + rows
            written = rows
        elif name in _GATHER and args and isinstance(args[0], torch.Tensor):
            read = sum(tensor_bytes(t) for t in ins if t is not args[0]) + min(written, tensor_bytes(args[0]))
        packet = func._overloadpacket
        flops = 0
        fn = self._flops.get(packet) or self._flops.get(func)
        if fn is not None:
            flops = int(fn(*args, **kwargs, out_val=out))
        cat = category(name, ns)
        kernels = self._kernels(name, ns, args, ins, outs)
        if kernels == 0 and written == 0 and flops == 0:
            return None
        return OpCost(name if ns == "aten" else f"{ns}.{name}", cat, flops, read, written, kernels)

    @staticmethod
    def _kernels(name: str, ns: str, args, ins, outs) -> int:
        if not ins and not outs:
            return 0
        if name.startswith("_foreach_") or name.startswith("_fused_"):
            lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
            if not lists:
                return 1
            depth = len(lists) + (0 if name.endswith("_") else 1)
            n = multi_tensor_launches((t.numel() for t in lists[0]), depth)
            return n + (1 if name == "_foreach_norm" else 0)  # norm: the per-chunk partials, then one cleanup
        if name == "all_gather_copy_in":  # FSDP2: a foreach copy of the shards into the gather buffer
            return multi_tensor_launches((t.numel() for t in _tensors(args[0])), 2)
        if name == "split_with_sizes_copy":  # CUDA: one kernel for all outputs
            return 1
        if ns in ("c10d", "_c10d_functional") and not any(k in name for k in ("gather", "scatter", "reduce",
                                                                              "broadcast", "all_to_all")):
            return 0  # wait, barrier, ...
        return 1


# -- costing ----------------------------------------------------------------------------------------------------


def wire_bytes(op: OpCost, world: int) -> float:
    """Bytes a rank sends over the link for a collective, as NCCL's ring moves them: an all-gather or a
    reduce-scatter (W-1)/W of the full buffer (the output, the input), an all-reduce twice that; 0 at one rank."""
    if world <= 1 or op.category != "comm":
        return 0.0
    share = (world - 1) / world
    if "reduce_scatter" in op.name:
        return op.read * share
    if "gather" in op.name:
        return op.written * share
    if "reduce" in op.name:  # all-reduce: in place, reduce-scatter then all-gather
        return 2 * op.written * share
    return op.written * share  # broadcast, all-to-all


def op_seconds(op: OpCost, gpu: GPU, eff: Optional[dict] = None, floor: float = FLOOR_S, world: int = 1) -> float:
    """The op's time on ``gpu``'s roofline; a collective at ``world`` > 1 ranks on its NVLink bandwidth instead of
    HBM (one node of 8: every rank on NVLink)."""
    if op.kernels == 0:
        return 0.0
    e = eff or EFF
    if world > 1 and op.category == "comm":
        return max(wire_bytes(op, world) / (e["link"] * gpu.link_gb_per_s * 1e9), floor * op.kernels)
    compute = 0.0
    if op.flops:
        compute = op.flops / ((e["attention"] if op.category == "attention" else e["gemm"]) * gpu.bf16_tflops * 1e12)
    memory = op.bytes / (e["memory"] * gpu.tb_per_s * 1e12)
    return max(compute, memory, floor * op.kernels)


def summarise(ops: list[OpCost], gpu: GPU, world: int = 1) -> dict:
    """Per category: ms, kernels, GFLOP, GB; and the totals. At ``world`` > 1 the totals also give the compute
    time (all but comm) and the step's bounds: comm fully exposed (``ms``, the sum) and fully overlapped with
    compute (``ms_overlapped``: max of the two), as FSDP's prefetching aims for."""
    cats: dict[str, dict] = {c: {"ms": 0.0, "kernels": 0, "gflop": 0.0, "gb": 0.0} for c in CATEGORIES}
    for op in ops:
        c = cats[op.category]
        c["ms"] += op_seconds(op, gpu, world=world) * 1e3
        c["kernels"] += op.kernels
        c["gflop"] += op.flops / 1e9
        c["gb"] += op.bytes / 1e9
    total = {k: sum(c[k] for c in cats.values()) for k in ("ms", "kernels", "gflop", "gb")}
    model_flops = sum(op.flops for op in ops if op.category in ("gemm", "attention"))
    total["mfu"] = model_flops / (total["ms"] / 1e3) / (gpu.bf16_tflops * 1e12) if total["ms"] else 0.0
    if world > 1:
        compute = total["ms"] - cats["comm"]["ms"]
        total.update(world=world, compute_ms=compute, ms_overlapped=max(compute, cats["comm"]["ms"]))
    return {"categories": cats, "total": total}


def top_ops(ops: list[OpCost], gpu: GPU, n: int = 12) -> list[dict]:
    agg: dict[tuple, list] = defaultdict(lambda: [0.0, 0, 0])
    for op in ops:
        a = agg[(op.name, op.category)]
        a[0] += op_seconds(op, gpu) * 1e3
        a[1] += op.kernels
        a[2] += op.bytes
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"op": k[0], "category": k[1], "ms": round(v[0], 3), "kernels": v[1], "gb": round(v[2] / 1e9, 3)}
            for k, v in rows]


__all__ = ["CostRecorder", "OpCost", "GPU", "GPUS", "EFF", "CATEGORIES", "category", "multi_tensor_launches",
           "tensor_bytes", "flop_formulas", "op_seconds", "wire_bytes", "summarise", "top_ops"]
