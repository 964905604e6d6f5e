"""The GPU cost of *compiled* code, estimated on a CPU from the Triton kernels inductor generates for a pretend GPU.

``torch.compile`` is given :func:`cost_backend` instead of inductor. It lets AOTAutograd trace each compiled region
into a forward and a backward graph (inductor's decompositions and min-cut partitioner, as ``compile_fx`` does),
then hands each graph, moved to a pretend ``cuda`` device, to inductor's own ``compile_fx_inner``: lowering, fusion
and Triton code generation run for a Hopper GPU (:func:`pretend_gpu` patches the device queries and the Triton
driver's target; loading the kernels would need a GPU, so code generation stops there). Each scheduler node of the
generated code is one kernel:

- a fused Triton kernel: the bytes inductor reads and writes for it (``get_read_write_buffers_sizes``: each buffer
  once, what the kernel's loads and stores touch), costed at the memory roofline;
- an extern kernel (GEMM, attention, an aten fallback): the aten formulas of plan/gpu_cost.py on the node's FLOPs
  (inductor's ``estimate_flops``) and bytes;
- a no-op node (a view, a reuse): nothing.

The graphs themselves then run eagerly on the fake tensors (their outputs feed the rest of the step), with the
eager recorder (:class:`~dinopipe.plan.gpu_cost.CostRecorder`) paused and the region's kernels recorded instead, so
the code outside compiled regions (FSDP, the optimizer, the EMA) keeps its eager op stream.

What it cannot see: inductor's autotuning (the GEMM templates it may pick over cuBLAS: every extern GEMM gets the
aten formula), CUDA graphs, and a kernel's real efficiency below the roofline (register pressure, split reductions'
second passes are costed as kernels of their own).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import sys
import types
from typing import Any, Callable, Iterator, Optional
from unittest import mock

import torch

from .gpu_cost import OpCost

# H100 SXM as torch.cuda reports it (the H200 differs in memory size only: the same SM 9.0 code is generated)
HOPPER = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3 (pretend)", major=9, minor=0, multi_processor_count=132, total_memory=80 * 2**30,
    warp_size=32, max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536, max_threads_per_block=1024,
    shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472, L2_cache_size=50 * 2**20,
    gcnArchName="", uuid="pretend", is_integrated=False, clock_rate=1980000)


class _Abort(Exception):
    """Raised after code generation, before the kernels are loaded."""


class _PretendDriver:
    """The Triton driver inductor queries for its target (no GPU: triton finds no active driver)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, *_: Any) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cuda", 0)

    def get_benchmarker(self):
        raise RuntimeError("no GPU to benchmark on (code generation only)")


@contextlib.contextmanager
def pretend_gpu(props: Any = HOPPER) -> Iterator[None]:
    """torch.cuda, dynamo's CUDA device interface and Triton's driver report one GPU with ``props``."""
    import triton
    from torch._dynamo.device_interface import CudaInterface
    from torch.utils import _triton

    fakes: dict[str, Callable] = dict(
        get_device_properties=lambda *a, **k: props, current_device=lambda: 0, device_count=lambda: 1,
        set_device=lambda *a: None, synchronize=lambda *a: None, exchange_device=lambda i: 0,
        maybe_exchange_device=lambda i: 0, is_bf16_supported=lambda *a, **k: True, get_raw_stream=lambda *a: 0)
    cuda = dict(is_available=lambda: True, get_device_capability=lambda *a, **k: (props.major, props.minor),
                get_rng_state=lambda *a, **k: torch.zeros(16, dtype=torch.uint8), set_rng_state=lambda *a, **k: None,
                _exchange_device=lambda i: 0, _maybe_exchange_device=lambda i: 0, **{
                    k: v for k, v in fakes.items() if k in ("get_device_properties", "current_device",
                                                            "device_count", "set_device", "synchronize")})
    patches = [mock.patch.object(torch.cuda, k, v) for k, v in cuda.items()]
    patches += [mock.patch.object(CudaInterface, k, staticmethod(v)) for k, v in fakes.items()]
    patches += [mock.patch.object(CudaInterface.Worker, k, staticmethod(fakes[k]))
                for k in ("get_device_properties", "current_device")]
    for name in ("torch._inductor.codegen.triton", "torch._inductor.scheduler"):  # has_triton, patched below
        importlib.import_module(name)
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch") and getattr(mod, "has_triton", None) is _triton.has_triton:
            patches.append(mock.patch.object(mod, "has_triton", lambda: True))
    drv = triton.runtime.driver
    saved = drv._active
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        drv.set_active(_PretendDriver())
        try:
            yield
        finally:
            drv._active = saved


def _category(node: Any) -> str:
    """The eager categories of plan/gpu_cost.py, for an extern node; ``fused`` for a Triton kernel."""
    from .gpu_cost import category

    if not node.is_extern():
        return "fused"
    kernel = getattr(node.node, "python_kernel_name", "") or ""
    name = kernel.rsplit(".", 1)[-1].split(".")[0]
    name = {"extern_kernels": "mm"}.get(name, name)
    cat = category(name, "aten")
    return cat if cat != "elementwise" else ("gemm" if "mm" in kernel else "extern")


def kernel_costs(graph: Any) -> list[OpCost]:
    """One :class:`OpCost` per kernel of an inductor graph after code generation (inside its graph handler)."""
    from torch._inductor.scheduler import NopKernelSchedulerNode

    out = []
    for node in graph.scheduler.nodes:
        if isinstance(node, NopKernelSchedulerNode):
            continue
        nbytes = int(node.get_read_write_buffers_sizes())
        flops = 0
        if node.is_extern():
            try:
                flops = int(node.estimate_flops() or 0)
            except Exception:  # an extern op without a FLOP formula moves memory only
                flops = 0
        kernel = (getattr(node.node, "python_kernel_name", None) if node.is_extern() else None) or node.get_name()
        # bytes split evenly between read and written: only their sum enters the roofline
        out.append(OpCost(str(kernel), _category(node), flops, nbytes // 2, nbytes - nbytes // 2, 1))
    return out


def lower(gm: torch.fx.GraphModule, example_inputs: list, is_backward: bool) -> list[OpCost]:
    """``gm`` (an AOTAutograd forward or backward graph traced on CPU fake tensors) lowered by inductor for the
    pretend GPU: its kernels' costs."""
    from torch._inductor import compile_fx
    from torch._inductor.exc import InductorError
    from torch._inductor.graph import GraphLowering

    gm = _to_cuda(gm)
    mode = torch._guards.detect_fake_mode(example_inputs)
    with mode:
        ins = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
               if isinstance(t, torch.Tensor) else t for t in example_inputs]
    got: list = []

    def stop(self):
        self.codegen()
        got.extend(kernel_costs(self))
        raise _Abort

    with mock.patch.object(GraphLowering, "compile_to_module", stop), \
            mock.patch.object(torch._inductor.config, "fx_graph_cache", False):
        try:
            compile_fx.compile_fx_inner(gm, ins, is_backward=is_backward)
        except InductorError as e:
            if not isinstance(e.inner_exception, _Abort):
                raise
    return got


def _to_cuda(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph with every ``device=cpu`` argument (factory ops: zeros, arange, ...) on the pretend GPU."""
    cpu = torch.device("cpu")
    for n in gm.graph.nodes:
        if n.kwargs.get("device") in (cpu, "cpu"):
            n.kwargs = {**n.kwargs, "device": torch.device("cuda", 0)}
    gm.recompile()
    return gm


class CompiledCost:
    """A ``torch.compile`` backend that costs each compiled region's inductor kernels into a recorder's op list
    (see the module's text). ``regions``: per compiled graph, (forward or backward, its kernels)."""

    def __init__(self, recorder: Optional[Any] = None) -> None:
        self.recorder = recorder
        self.regions: list[tuple[str, list[OpCost]]] = []

    def backend(self):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.decomposition import select_decomp_table

        return aot_autograd(fw_compiler=functools.partial(self._compile, kind="forward"),
                            bw_compiler=functools.partial(self._compile, kind="backward"),
                            inference_compiler=functools.partial(self._compile, kind="inference"),
                            decompositions=select_decomp_table(),
                            partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str):
        from functorch.compile import make_boxed_func

        with pretend_gpu():
            costs = lower(copy.deepcopy(gm), example_inputs, is_backward=kind == "backward")
        self.regions.append((kind, costs))
        run = make_boxed_func(gm.forward)
        rec = self.recorder

        def call(args):
            if rec is None or not rec.active:
                return run(args)
            rec.active = False  # the graph's aten ops are not what the GPU runs: its kernels are
            try:
                out = run(args)
            finally:
                rec.active = True
            rec.ops.extend(costs)
            return out

        call._boxed_call = True
        return call


@contextlib.contextmanager
def user_modes_off() -> Iterator[None]:
    """The user dispatch modes (the cost recorder, the memory tracker, the collective counter) off the stack, as
    dynamo needs to trace ("non-infra torch dispatch mode present" otherwise); put back after. The fake tensor
    mode is an infra mode and stays."""
    from torch.utils import _python_dispatch as pd

    popped = []
    while pd._len_torch_dispatch_stack() > 0:
        popped.append(pd._pop_mode())
    try:
        yield
    finally:
        for m in reversed(popped):
            pd._push_mode(m)


def compile_outside_modes(compile_fn: Callable = torch.compile) -> Callable:
    """A ``torch.compile`` whose compiled functions run with :func:`user_modes_off` (a traced step's recorders
    stay on the stack around them; what the compiled regions cost, :class:`CompiledCost` reports)."""

    def compile_(fn=None, **kwargs):
        if fn is None:
            return functools.partial(compile_, **kwargs)
        compiled = compile_fn(fn, **kwargs)

        @functools.wraps(fn)
        def run(*args, **kw):
            with user_modes_off():
                return compiled(*args, **kw)
        return run
    return compile_


__all__ = ["CompiledCost", "user_modes_off", "compile_outside_modes", "pretend_gpu", "lower", "kernel_costs", "HOPPER"]
