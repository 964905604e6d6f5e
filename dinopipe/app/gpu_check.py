"""dinopipe gpu-check / make gpu-check: one-command acceptance check of the GPU code paths, on one GPU
in under 10 minutes. Writes OUT/report.json (one entry per check: ok / skipped with the reason / failed with
the error, plus its measurements) and exits 1 if any check failed.

    python -m dinopipe.app.gpu_check [--out gpu-check] [--cpu] [--only attention,block,...]

Checks (CUDA paths are chosen at run time; --cpu runs the subset that makes sense on a CPU, small, so CI
keeps the script from rotting):

- attention: packed crop groups, SDPA (flash kernel forced on CUDA) vs the math reference in bf16, forward +
  backward; xformers when installed (CUDA).
- block: one Block, drop path 0.4, activation checkpointing, compiled with inductor vs eager: same gradients
  within bf16 tolerance; dynamo graph and graph-break counts (CPU smoke: AC + drop path without compile).
- losses: DINO / iBOT / Sinkhorn-Knopp / KoLeo on bf16 device inputs vs a CPU fp32 reference.
- task: SSLTask on a 1-rank FSDP2 mesh (NCCL on CUDA, gloo on CPU), bf16, compile, N steps: teacher
  parameters are fp32 DTensors after its forward, the EMA moves them, collectives get device tensors, host
  syncs per step, DCP save -> load into a fresh task is identical; step time, images/s, MFU against a bf16
  GEMM measured in the same run, peak memory next to dinopipe plan's prediction (gpu_check_train.py).
- trace: dinopipe plan --trace (the real step under fake tensors) at W = 1 vs the same two steps run on the
  GPU: traced peak memory vs torch.cuda.max_memory_allocated (CUDA only).
- cli: the real python -m dinopipe.train.pretrain with 2 phases, data workers and compile; SIGTERM to its
  process group mid-run gives exit 124 and a checkpoint, and the rerun finishes (CUDA only).
- curation: embedding images/s (vit_s14, bf16), faiss flat and IVF recall against a torch brute-force top-k,
  a multi-add, k > 2048 on GPU refused with a clear message, k-means (faiss-gpu when present).

Where only torch and timm are installed and nothing can be downloaded, carry the other wheels in: see README,
"GPU acceptance check".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .gpu_check_train import Skip  # one direction only: gpu_check_train never imports this module


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference's max magnitude."""
    return _max_diff(a, b) / max(float(b.float().abs().max()), 1e-12)


# -- attention ----------------------------------------------------------------------------------------------


def check_attention(dev: torch.device, small: bool) -> dict:
    from ..models.attention import Attention, xformers_ops

    torch.manual_seed(0)
    dim, heads = (64, 2) if small else (384, 6)
    shapes = [(4, 17), (8, 5)] if small else [(64, 257), (256, 50)]  # 2 global 224 px + 8 local 98 px per image
    ref = Attention(dim, heads, backend="math").to(dev)
    x = torch.randn(sum(b * n for b, n in shapes), dim, device=dev)
    out: dict = {"shapes": shapes}

    def run(backend: str, dtype: torch.dtype, kernel=None):
        m = Attention(dim, heads, backend=backend).to(dev, dtype)
        m.load_state_dict(ref.state_dict())
        xi = x.detach().to(dtype).clone().requires_grad_()
        if kernel is not None:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(kernel):
                y = m(xi, shapes)
        else:
            y = m(xi, shapes)
        y.float().square().mean().backward()
        return y.detach(), xi.grad.detach()

    y_ref, g_ref = run("math", torch.float32)
    kernel = None
    if dev.type == "cuda":
        from torch.nn.attention import SDPBackend

        kernel = SDPBackend.FLASH_ATTENTION  # forced: fails loudly if flash cannot run these shapes
    y, g = run("sdpa", torch.bfloat16, kernel)
    y_m, g_m = run("math", torch.bfloat16)
    out["sdpa_bf16_vs_math_fp32"] = {"out_rel": _rel(y, y_ref), "grad_rel": _rel(g, g_ref),
                                     "kernel": "flash (forced)" if kernel is not None else "default (CPU)"}
    out["math_bf16_vs_math_fp32"] = {"out_rel": _rel(y_m, y_ref), "grad_rel": _rel(g_m, g_ref)}
    tol = 3e-2  # bf16: 8 mantissa bits, softmax of a few hundred keys
    ok = out["sdpa_bf16_vs_math_fp32"]["out_rel"] < tol and out["sdpa_bf16_vs_math_fp32"]["grad_rel"] < tol
    if dev.type == "cuda" and xformers_ops() is not None:
        yx, gx = run("xformers", torch.bfloat16)
        out["xformers_bf16_vs_math_fp32"] = {"out_rel": _rel(yx, y_ref), "grad_rel": _rel(gx, g_ref)}
        ok = ok and max(out["xformers_bf16_vs_math_fp32"].values()) < tol
    else:
        out["xformers"] = "skipped: " + ("not installed" if xformers_ops() is None else "no CPU kernel")
    out["ok"] = ok
    return out


# -- one block: compile + AC + drop path vs eager ------------------------------------------------------------


def check_block(dev: torch.device, small: bool) -> dict:
    import copy

    from ..models.block import Block
    from ..train.parallel import apply_activation_checkpointing, compile_block
    from ..utils.torch_compat import dynamo_counters, inductor_fallback_random

    counters = dynamo_counters()
    torch.compiler.reset()
    counters.clear()
    torch.manual_seed(0)
    dim, heads = (64, 2) if small else (384, 6)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    eager = Block(dim, heads, drop_path=0.4, attn_backend="sdpa", init_values=1e-5).to(dev)
    comp = copy.deepcopy(eager)
    apply_activation_checkpointing(comp)
    # The CPU smoke leaves compile out (minutes on 2 cores): tests/models/test_compile.py covers it with aot_eager.
    backend = "inductor" if dev.type == "cuda" else None
    if backend:
        # Inductor draws random numbers with its own generator: the drop-path subsets (randperm) would differ from
        # eager's and the gradients with them (grad_rel 1.13 on an H100). Eager's RNG makes the two comparable.
        inductor_fallback_random(True)
        compile_block(comp, backend)
    # steady batch, ragged last batch, then the high-resolution phase (224 -> 518 px at patch 14: 257 -> 1370)
    sizes = [(4, 17, 5), (3, 17, 5), (2, 37, 5)] if small else [(32, 257, 50), (29, 257, 50), (8, 1370, 50)]
    grads_rel, t_compile = [], time.perf_counter()
    for i, (b, ng, nl) in enumerate(sizes):
        xs = [torch.randn(2 * b, ng, dim, device=dev), torch.randn(8 * b, nl, dim, device=dev)]
        res = []
        for m in (comp, eager):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(i)  # same drop-path subsets
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
                ys = m([x.clone() for x in xs])
            sum(y.float().square().mean() for y in ys).backward()
            res.append({n: p.grad.detach().clone() for n, p in m.named_parameters()})
        grads_rel.append(max(_rel(res[0][n], res[1][n]) for n in res[1]))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    return {"backend": backend or "eager (CPU smoke: AC + drop path only)", "dtype": str(dtype), "sizes": sizes,
            "grad_rel_max": max(grads_rel),
            "unique_graphs": graphs, "graph_breaks": breaks, "seconds": time.perf_counter() - t_compile,
            "ok": max(grads_rel) < tol and breaks == 0 and graphs <= 2}


# -- losses --------------------------------------------------------------------------------------------------


def check_losses(dev: torch.device, small: bool) -> dict:
    from ..ssl.centering import sinkhorn_knopp
    from ..ssl.losses import DINOLoss, IBOTPatchLoss, koleo_loss

    torch.manual_seed(0)
    K, B, M = (256, 8, 40) if small else (65536, 64, 2000)
    s_g, s_l = torch.randn(2 * B, K), torch.randn(8 * B, K)
    t_logits, p_s, p_t = torch.randn(2 * B, K), torch.randn(M, K), torch.randn(M, K)
    feats = torch.randn(B, 384)
    weights = torch.full((M,), 1.0 / (M / (2 * B)))

    def compute(d: torch.device, dtype: torch.dtype) -> dict:
        cast = lambda t: t.to(d, dtype)  # noqa: E731
        out = {}
        for centering in ("centering", "sinkhorn_knopp"):
            dino = DINOLoss(K, centering=centering).to(d)
            ibot = IBOTPatchLoss(K, centering=centering).to(d)
            tp = dino.teacher_probs(cast(t_logits), 0.07)
            out[f"dino_{centering}"] = dino(cast(s_g), tp, cast(s_l)).float().cpu()
            out[f"ibot_{centering}"] = ibot(cast(p_s), ibot.teacher_probs(cast(p_t), 0.07), n_images=2 * B,
                                            masks_weight=weights.to(d)).float().cpu()
        out["sinkhorn_knopp"] = sinkhorn_knopp(cast(t_logits), 0.07).float().cpu()
        out["koleo"] = koleo_loss(cast(feats)).float().cpu()
        return out

    # The reference reads the same bf16-rounded inputs: rounding logits to bf16 before exp(x / 0.07) alone moves
    # Sinkhorn-Knopp's output by ~5% (measured on an H100), which says nothing about the device computation.
    s_g, s_l, t_logits, p_s, p_t, feats = (t.bfloat16().float() for t in (s_g, s_l, t_logits, p_s, p_t, feats))
    ref = compute(torch.device("cpu"), torch.float32)
    got = compute(dev, torch.bfloat16)
    rel = {k: _rel(got[k], ref[k]) for k in ref}
    finite = all(bool(torch.isfinite(v).all()) for v in got.values())
    return {"K": K, "rel_vs_cpu_fp32": rel, "ok": finite and max(rel.values()) < 5e-2}


# -- runner --------------------------------------------------------------------------------------------------


def _checks() -> dict[str, Callable[[torch.device, bool, Path], dict]]:
    from . import gpu_check_train as t

    return {
        "attention": lambda d, s, o: check_attention(d, s),
        "block": lambda d, s, o: check_block(d, s),
        "losses": lambda d, s, o: check_losses(d, s),
        "task": t.check_task,
        "trace": t.check_trace,
        "cli": t.check_cli,
        "curation": t.check_curation,
    }


def environment(dev: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(dev),
           "cuda": torch.version.cuda, "host": platform.node()}
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
    for pkg in ("timm", "xformers", "faiss", "omegaconf", "webdataset", "triton"):
        try:
            mod = __import__(pkg)
            env[pkg] = getattr(mod, "__version__", "installed")
        except Exception:
            env[pkg] = None
    return env


def run_checks(dev: torch.device, out_dir: Path, only: Optional[Sequence[str]] = None) -> dict:
    small = dev.type == "cpu"
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"mode": "cpu-smoke" if small else "gpu", "environment": environment(dev), "checks": {}}
    for name, fn in _checks().items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            res = fn(dev, small, out_dir)
            res["status"] = "ok" if res.pop("ok") else "failed"
        except Skip as exc:
            res = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # a check that crashes is a failed check, not a crashed run
            res = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc(limit=8)}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        report["checks"][name] = res
        print(f"{name:10s} {res['status']:8s} {res['seconds']:7.1f}s  {res.get('reason') or res.get('error') or ''}",
              flush=True)
    report["failed"] = [n for n, r in report["checks"].items() if r["status"] == "failed"]
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="dinopipe gpu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu-check", help="folder for report.json and the check's scratch runs")
    p.add_argument("--cpu", action="store_true", help="CPU smoke subset (small shapes, no CUDA)")
    p.add_argument("--only", default=None, help="comma-separated subset of checks")
    args = p.parse_args(argv)
    from ..config import ConfigError
    from ..utils.exits import check_writable

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not args.cpu and not torch.cuda.is_available():  # the machine, not a failed check: exit 2
        raise ConfigError("no CUDA device visible; run on a GPU node, or use --cpu for the CPU smoke subset")
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    only = [s for s in args.only.split(",") if s] if args.only else None
    unknown = sorted(set(only or ()) - set(_checks()))
    if unknown:
        raise ConfigError(f"--only: no check named {', '.join(unknown)} (checks: {', '.join(_checks())})")
    check_writable(args.out, "--out")
    report = run_checks(dev, Path(args.out), only)
    print(f"report: {Path(args.out) / 'report.json'}; failed: {report['failed'] or 'none'}", flush=True)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    from dinopipe.app.gpu_check import main as _main  # the package's module (its Skip is gpu_check_train's)

    sys.exit(_main())
