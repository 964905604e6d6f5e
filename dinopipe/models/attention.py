"""Multi-head self-attention over *packed* crops.

Multi-crop SSL feeds crops of two sizes (e.g. 2 x 224 px and 8 x 98 px). Following DINOv3, tokens of all
crops are concatenated for the linear layers (one GEMM instead of one per crop size), while attention is
computed per crop-size group. Backends:

- ``sdpa``: ``F.scaled_dot_product_attention`` per group (flash / mem-efficient kernels on GPU, a fused
  kernel on CPU).
- ``xformers``: ``memory_efficient_attention`` on the whole pack with a ``BlockDiagonalMask`` (one kernel
  launch for all crops). CUDA only: xformers has no CPU kernel. Inside ``torch.compile`` the mask (a Python
  object built from the batch sizes) cannot be traced without a graph break and a recompile per batch size,
  so there the call goes per crop-size group, dense, through the custom op ``dinopipe::xformers_attention``,
  which dynamo treats as one opaque node (shapes from its fake implementation).
- ``math``: explicit softmax(Q Kᵀ / sqrt(d)) V, the reference the others are tested against.
- ``auto``: xformers when it is installed and the tensors are on CUDA, SDPA otherwise.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .rope import RopeSinCos, rope_qkv

BACKENDS = ("auto", "sdpa", "xformers", "math")

# (batch, tokens) of each crop-size group in a pack; the pack holds sum(b * n) token rows.
GroupShapes = Sequence[tuple[int, int]]


_XOPS: dict = {}  # {"ops": module or None} once looked up


def xformers_ops():
    """The ``xformers.ops`` module, or None when xformers is not installed (imported once, lazily).

    ``Attention.__init__`` looks it up, so a compiled forward only reads the cached global: dynamo cannot trace
    an import ("Unsupported: Import failure", seen under torch.compile on an H100 without xformers).
    """
    if "ops" not in _XOPS:
        try:
            import xformers.ops as xops  # type: ignore[import-not-found]
        except Exception:  # ImportError, or a broken build that fails at import
            xops = None
        _XOPS["ops"] = xops
    return _XOPS["ops"]


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attn_backend must be one of {BACKENDS}, got '{backend}'")
    if backend == "auto":
        return "xformers" if device.type == "cuda" and xformers_ops() is not None else "sdpa"
    if backend == "xformers":
        if device.type != "cuda":
            raise RuntimeError("attn_backend='xformers' needs CUDA tensors: xformers has no CPU kernel; use 'sdpa'")
        if xformers_ops() is None:
            raise RuntimeError("attn_backend='xformers' but xformers is not installed; install the xformers wheel "
                               "built for your torch (README, Install) or use 'sdpa'")
    return backend


def math_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Reference attention. q, k, v: (B, H, N, hd) -> (B, H, N, hd). Softmax in fp32 for stability."""
    scale = q.shape[-1] ** -0.5
    attn = (q * scale) @ k.transpose(-2, -1)  # (B, H, N, N)
    attn = attn.float().softmax(dim=-1).to(q.dtype)
    return attn @ v


@functools.lru_cache(maxsize=64)
def _block_diagonal_mask(shapes: tuple[tuple[int, int], ...]):
    seqlens = [n for b, n in shapes for _ in range(b)]
    return xformers_ops().fmha.BlockDiagonalMask.from_seqlens(seqlens)


# -- xformers as a custom op: opaque to torch.compile ----------------------------------------------------------
# Backward recomputes the forward to get the softmax log-sum-exp (its padded shape depends on the kernel xformers
# picks, which a fake implementation cannot state): one extra attention forward per step, only under compile.


@torch.library.custom_op("dinopipe::xformers_attention", mutates_args=())
def xformers_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Dense attention, q, k, v (B, N, H, hd) -> (B, N, H, hd), by xformers' memory-efficient kernel."""
    return xformers_ops().memory_efficient_attention(q, k, v).contiguous()  # the fake's layout


@xformers_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return q.new_empty(q.shape)  # contiguous (B, N, H, hd)


@torch.library.custom_op("dinopipe::xformers_attention_backward", mutates_args=())
def xformers_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # xformers' non-autograd entry points (autograd is off inside a custom op's implementation).
    fmha = xformers_ops().fmha
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v)
    dq, dk, dv = fmha.memory_efficient_attention_backward(grad.contiguous(), out, lse, q, k, v)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@xformers_attention_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _xf_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _xf_backward(ctx, grad: Tensor):
    return xformers_attention_backward(grad, *ctx.saved_tensors)


xformers_attention.register_autograd(_xf_backward, setup_context=_xf_setup_context)


class Attention(nn.Module):
    """qkv / proj names and layout match DINOv2 and timm, so their weights load as they are."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed dim {dim} is not divisible by num_heads {num_heads}")
        if backend not in BACKENDS:
            raise ValueError(f"attn_backend must be one of {BACKENDS}, got '{backend}'")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.backend = backend
        if backend in ("auto", "xformers"):
            xformers_ops()  # look it up outside any compiled region
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)

    def forward(self, x: Tensor, shapes: GroupShapes, rope: Optional[Sequence[Optional[RopeSinCos]]] = None) -> Tensor:
        """x: (T, D) packed tokens of all groups, T = sum(b * n) -> (T, D). ``rope``: (sin, cos) per group (DINOv3)."""
        T, D = x.shape
        H, hd = self.num_heads, self.head_dim
        qkv = self.qkv(x)  # (T, 3D)
        if rope is not None:  # DINOv3: rotate q/k of patch tokens before any backend sees them
            qkv = rope_qkv(qkv, shapes, rope, H)
        backend = resolve_backend(self.backend, x.device)
        if backend == "xformers" and torch.compiler.is_compiling():
            outs = []
            for chunk, (b, n) in zip(qkv.split([b * n for b, n in shapes]), shapes):
                q, k, v = chunk.view(b, n, 3, H, hd).unbind(2)  # each (b, n, H, hd)
                outs.append(xformers_attention(q, k, v).reshape(b * n, D))
            return self.proj(outs[0] if len(outs) == 1 else torch.cat(outs))
        if backend == "xformers":  # eager: one launch for the whole pack
            q, k, v = qkv.view(1, T, 3, H, hd).unbind(2)  # each (1, T, H, hd)
            mask = _block_diagonal_mask(tuple((int(b), int(n)) for b, n in shapes))
            out = xformers_ops().memory_efficient_attention(q, k, v, attn_bias=mask)
            return self.proj(out.reshape(T, D))
        outs = []
        for chunk, (b, n) in zip(qkv.split([b * n for b, n in shapes]), shapes):
            # unbind, then transpose (not one permute): the backward then stacks dq, dk, dv straight into qkv's
            # (b, n, 3, H, hd) layout, where the permute's backward needs a contiguous copy of all three
            q, k, v = (t.transpose(1, 2) for t in chunk.view(b, n, 3, H, hd).unbind(2))  # each (b, H, n, hd)
            if backend == "sdpa":
                o = F.scaled_dot_product_attention(q, k, v)
            else:
                o = math_attention(q, k, v)
            outs.append(o.transpose(1, 2).reshape(b * n, D))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.proj(out)


def attention_flops(num_tokens: int, dim: int) -> int:
    """Multiply-adds x2 of Q Kᵀ and A V for one sequence (used by the benches and planner)."""
    return 4 * num_tokens * num_tokens * dim


__all__ = ["Attention", "BACKENDS", "resolve_backend", "math_attention", "xformers_ops", "attention_flops"]
