"""The GPU cost estimate's counter (dinopipe/plan/gpu_cost.py): FLOPs, bytes and kernels of a known op sequence,
CUDA's multi-tensor launch chunking, and bench/gpu_proxy.py's smoke (vit_test) with the
official side where its source is here (``make official-src``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dinopipe.plan import gpu_cost as gc

REPO = Path(__file__).resolve().parents[1]
HAVE_OFFICIAL = (REPO / ".official" / "dinov2" / "dinov2").is_dir()


def _record(fn):
    rec = gc.CostRecorder()
    with rec:
        fn()
    return rec.ops


def test_gemm_cast_broadcast_and_views_are_counted_as_a_gpu_runs_them():
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    w = torch.randn(32, 16, dtype=torch.bfloat16)
    b = torch.randn(16, dtype=torch.bfloat16)
    dst = torch.empty(64, 32, dtype=torch.float32)

    def seq():
        y = x @ w                      # mm: 2*64*32*16 FLOPs
        y.view(-1).view(16, 64).t()[2:]  # views: nothing moves
        y + b                          # b broadcast over 64 rows: read once
        x.to(torch.float32)            # cast: bf16 in, fp32 out
        dst.copy_(x)                   # copy_: dst is written, not read

    ops = _record(seq)
    assert [o.name for o in ops] == ["mm", "add", "_to_copy", "copy_"]
    mm, add, cast, copy = ops
    assert (mm.category, mm.flops, mm.kernels) == ("gemm", 2 * 64 * 32 * 16, 1)
    assert (mm.read, mm.written) == ((64 * 32 + 32 * 16) * 2, 64 * 16 * 2)
    assert (add.category, add.flops, add.read, add.written) == ("elementwise", 0, (64 * 16 + 16) * 2, 64 * 16 * 2)
    assert (cast.category, cast.read, cast.written) == ("copy/cast/cat", 64 * 32 * 2, 64 * 32 * 4)
    assert (copy.category, copy.read, copy.written) == ("copy/cast/cat", 64 * 32 * 2, 64 * 32 * 4)


def test_cpu_attention_is_costed_with_the_cuda_flash_formulas():
    q, k, v = (torch.randn(2, 3, 10, 8, requires_grad=True) for _ in range(3))
    ops = _record(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    att = [o for o in ops if o.category == "attention"]
    assert len(att) == 2, [o.name for o in ops]
    fwd, bwd = att
    assert fwd.flops == 4 * 2 * 3 * 10 * 10 * 8  # QK^T and AV: 2 x (2 * B*H*N*N*d)
    assert bwd.flops == 2 * fwd.flops + 2 * 2 * 3 * 10 * 10 * 8  # torch's backward formula: 5 GEMMs of N x N x d


def test_multi_tensor_ops_count_one_launch_per_chunk():
    # CUDA multi_tensor_apply: 64 tensors per launch at depth 2, 320 blocks of 65,536 elements per launch
    assert gc.multi_tensor_launches([10] * 64, 2) == 1
    assert gc.multi_tensor_launches([10] * 65, 2) == 2
    assert gc.multi_tensor_launches([320 * 65536], 2) == 1
    assert gc.multi_tensor_launches([320 * 65536 + 1], 2) == 2
    assert gc.multi_tensor_launches([10] * 37, 4) == 2  # fused AdamW: 4 lists, 36 tensors per launch
    a = [torch.zeros(10) for _ in range(120)]
    ops = _record(lambda: torch._foreach_add_(a, a))
    assert [(o.name, o.category, o.kernels) for o in ops] == [("_foreach_add_", "optimizer", 2)]
    assert ops[0].read == 2 * 120 * 40 and ops[0].written == 120 * 40


def test_roofline_takes_the_slower_of_compute_and_memory_and_a_floor():
    gpu = gc.GPU("test", bf16_tflops=100.0, tb_per_s=1.0)
    eff = {"gemm": 1.0, "attention": 1.0, "memory": 1.0}
    big_gemm = gc.OpCost("mm", "gemm", flops=10**12, read=10**6, written=0, kernels=1)
    copy = gc.OpCost("copy_", "copy/cast/cat", flops=0, read=10**9, written=10**9, kernels=1)
    tiny = gc.OpCost("add", "elementwise", flops=0, read=8, written=4, kernels=3)
    assert gc.op_seconds(big_gemm, gpu, eff) == pytest.approx(0.01)
    assert gc.op_seconds(copy, gpu, eff) == pytest.approx(2e-3)
    assert gc.op_seconds(tiny, gpu, eff, floor=1e-6) == pytest.approx(3e-6)


def test_gpu_proxy_smoke_writes_both_steps_costs(tmp_path):
    out = tmp_path / "proxy.json"
    args = [sys.executable, str(REPO / "bench" / "gpu_proxy.py"), "--small", "--out", str(out)]
    if not HAVE_OFFICIAL:
        r = subprocess.run(args + ["--official", str(tmp_path / "none")], capture_output=True, text=True,
                           cwd=REPO, timeout=300)
        assert r.returncode == 2 and "make official-src" in r.stderr and not out.exists()
        pytest.skip("no official source here (make official-src)")
    r = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    case = rep["cases"]["vit_test_b4"]
    for side in ("dinopipe", "official"):
        t = case[side]["H200"]["total"]
        assert t["kernels"] > 100 and t["gflop"] > 0 and t["gb"] > 0
        # the same model, heads and crops: the same GEMM work within the heads' small differences
    g_d, g_o = (case[s]["H200"]["categories"]["gemm"]["gflop"] for s in ("dinopipe", "official"))
    assert g_d == pytest.approx(g_o, rel=0.2)


def test_profile_groups_kernels_by_the_estimates_categories(tmp_path):
    """bench/gpu_profile_step.py names the launching op's category as the estimate does; its CPU smoke runs the
    eager and official kinds (official only where its source is here) and writes per-category figures."""
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_profile_step import op_category

    assert [op_category(n) for n in ("aten::mm", "aten::_fused_adamw_", "aten::cat", "aten::index_add",
                                     "c10d::allreduce_", "triton_poi_fused_add_0", "aten::native_layer_norm")] == [
        "gemm", "optimizer", "copy/cast/cat", "index", "comm", "fused", "reduce/norm"]
    kinds = "vit_s14:64:eager" + (",vit_s14:64:official" if HAVE_OFFICIAL else "")
    r = subprocess.run([sys.executable, "-W", "ignore", str(REPO / "bench" / "gpu_profile_step.py"), str(tmp_path),
                        "--cpu", "--cases", kinds], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "profile.json").read_text())
    for name in ["vit_test_b4_eager"] + (["vit_test_b4_official"] if HAVE_OFFICIAL else []):
        case = rep["cases"][name]
        assert {"gemm", "attention"} <= set(case["categories"]) and case["kernel_ms"] > 0, case
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_profile_step.py"), str(tmp_path / "x"),
                          "--cases", "vit_s14:64:fast"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "kind" in bad.stderr and not (tmp_path / "x").exists()


def test_gathers_and_in_place_scatters_move_only_the_rows_they_name():
    """CUDA's index_select reads the rows it selects; index_add_ reads its source and updates only the rows it
    names (the packed crops' stochastic depth gathers from and adds into a pack of all groups)."""
    x, idx, src = torch.randn(100, 8), torch.tensor([1, 5, 7]), torch.randn(3, 8)
    y = x.clone()
    ops = _record(lambda: (x.index_select(0, idx), y.index_add_(0, idx, src)))
    sel, add = ops
    rows = 3 * 8 * 4
    assert (sel.name, sel.read, sel.written) == ("index_select", rows + 3 * 8, rows)
    assert (add.name, add.read, add.written) == ("index_add_", rows + 3 * 8 + rows, rows)
