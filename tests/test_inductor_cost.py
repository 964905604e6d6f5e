"""plan/inductor_cost.py: inductor's Triton kernels for a pretend GPU, generated on this CPU and costed per kernel,
on small compiled graphs whose fused kernels and bytes are known by hand."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dinopipe.plan.inductor_cost import CompiledCost

pytest.importorskip("triton")


def _compile_and_run(fn, *shapes, grad=False):
    cc = CompiledCost()
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.randn(*s, requires_grad=grad) for s in shapes]
        out = torch.compile(fn, backend=cc.backend(), fullgraph=True)(*args)
        if grad:
            out.backward()
    return cc.regions


@pytest.mark.slow
def test_a_gemm_then_its_epilogue_is_one_extern_and_one_fused_kernel():
    m, k, n = 1024, 512, 256
    (kind, kernels), = _compile_and_run(lambda x, w: torch.relu(x @ w + 1.0) * 2.0, (m, k), (k, n))
    assert kind == "inference"
    mm, fused = kernels
    # the GEMM an extern kernel on the aten formulas: 2 m k n FLOPs, its operands and result once (fp32)
    assert (mm.category, mm.flops, mm.bytes) == ("gemm", 2 * m * k * n, 4 * (m * k + k * n + m * n))
    # +1, relu and *2 fused into one Triton kernel: the GEMM's result read once, the output written once
    assert (fused.category, fused.flops, fused.bytes) == ("fused", 0, 2 * 4 * m * n)


@pytest.mark.slow
def test_backward_of_a_pointwise_chain_is_one_fused_kernel():
    n = 1024 * 512
    regions = _compile_and_run(lambda x: (torch.nn.functional.gelu(x) * 3.0).sum(), (1024, 512), grad=True)
    (fwd_kind, _), (bwd_kind, bwd) = regions
    assert (fwd_kind, bwd_kind) == ("forward", "backward")
    # gelu's derivative recomputed from x (the partitioner saves x, not gelu(x)): read x and the scalar gradient,
    # write dx, in one kernel
    assert [(k.category, k.bytes) for k in bwd] == [("fused", 4 * n + 4 + 4 * n)]
