"""Transformer block with *efficient* stochastic depth over packed multi-crop tokens.

Stochastic depth (Huang et al. 2016) drops a residual branch per sample. Masked DropPath still computes
the branch for every sample and multiplies the dropped ones by zero. DINOv2 instead runs the branch only
on the kept subset of the batch and adds it back with ``index_add`` scaled by B/k, so a drop rate of 0.4
saves ~40% of the block's compute. Below a small rate the gather/scatter costs more than it saves, so we
fall back to masked DropPath there (DINOv2 uses 0.1 as that threshold).

A block works on a *list* of tensors, one per crop-size group, (B_i, N_i, D): norms, linear layers and
the MLP run once on all tokens concatenated; attention runs per group (see attention.py).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Type

import torch
from timm.layers import DropPath, GluMlp, LayerScale, Mlp
from torch import Tensor, nn

from .attention import Attention

# Below this rate the subset trick is not worth its gather/scatter (DINOv2's threshold).
EFFICIENT_DROP_PATH_MIN_RATE = 0.1

TensorList = list[Tensor]


def pack(xs: TensorList) -> tuple[Tensor, list[tuple[int, int]]]:
    """[(B_i, N_i, D)] -> (sum B_i*N_i, D) plus the group shapes. A single group is a free view."""
    shapes = [(x.shape[0], x.shape[1]) for x in xs]
    if len(xs) == 1:
        return xs[0].reshape(-1, xs[0].shape[-1]), shapes
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]), shapes


def unpack(t: Tensor, shapes: list[tuple[int, int]]) -> TensorList:
    if len(shapes) == 1:
        b, n = shapes[0]
        return [t.view(b, n, -1)]
    return [c.view(b, n, -1) for c, (b, n) in zip(t.split([b * n for b, n in shapes]), shapes)]


def subset_size(batch: int, rate: float) -> int:
    """Samples that keep the branch: k = max(1, int(B * (1 - rate)))."""
    return max(1, int(batch * (1.0 - rate)))


def drop_add_residual_subset(
    xs: TensorList, branch: Callable[[TensorList], TensorList], rate: float
) -> TensorList:
    """x + (B/k) * branch(x) on k random samples of each group; the other samples pass unchanged.

    The branch never sees the dropped samples, so their compute is skipped, not masked. Each group
    draws its own subset (crop sizes are independent batches).
    """
    keep = [torch.randperm(x.shape[0], device=x.device)[: subset_size(x.shape[0], rate)] for x in xs]
    # index_select, not x[idx]: its backward is an index_add, ~25x cheaper on CPU than advanced indexing's
    # index_put with accumulate (measured in bench/bench_vit.py's profile).
    residuals = branch([x.index_select(0, idx) for x, idx in zip(xs, keep)])
    out = []
    for x, idx, r in zip(xs, keep, residuals):
        # The scale multiplies the source rather than going in as index_add's alpha: under torch.compile with
        # dynamic batch sizes a symbolic alpha makes the decomposition guard on it (torch 2.11: "Guard failed on
        # the same frame it was created", seen in gpu-check's task on an H100).
        scale = x.shape[0] / idx.numel()
        y = torch.index_add(x.flatten(1), 0, idx, r.flatten(1).to(x.dtype) * scale)
        out.append(y.view_as(x))
    return out


def SwiGLU(in_features: int, hidden_features: int, out_features: Optional[int] = None,
           act_layer: Optional[Type[nn.Module]] = None, bias: bool = True, **_: object) -> nn.Module:
    """SwiGLU FFN with DINOv2's hidden-size rule, as timm's packed GluMlp: fc1 = [w1; w2], fc2 = w3.

    DINOv2 names these ``w12`` / ``w3``; the converters rename them. hidden = round_up(2/3 * h, 8).
    """
    return GluMlp(in_features, 2 * swiglu_hidden(hidden_features), out_features, act_layer=nn.SiLU,
                  bias=bias, gate_last=False)


def swiglu_hidden(hidden_features: int) -> int:
    return (int(hidden_features * 2 / 3) + 7) // 8 * 8


class Block(nn.Module):
    """Pre-norm block: x + ls1(attn(norm1(x))), then x + ls2(mlp(norm2(x))). Names match DINOv2."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        drop_path: float = 0.0,
        efficient_drop_path: bool = True,
        init_values: Optional[float] = None,
        attn_backend: str = "auto",
        attn_layer: Type[nn.Module] = Attention,
        mlp_layer: Type[nn.Module] = Mlp,
        act_layer: Type[nn.Module] = nn.GELU,
        norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
    ) -> None:
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn_layer(dim, num_heads, qkv_bias=qkv_bias, proj_bias=proj_bias, backend=attn_backend)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = mlp_layer(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, bias=ffn_bias)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path_rate = float(drop_path)
        self.efficient_drop_path = efficient_drop_path
        # Masked fallback (and the baseline the bench compares against).
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def _attn_branch(self, xs: TensorList, rope: Optional[list] = None) -> TensorList:
        t, shapes = pack(xs)
        out = self.attn(self.norm1(t), shapes) if rope is None else self.attn(self.norm1(t), shapes, rope=rope)
        return unpack(self.ls1(out), shapes)

    def _ffn_branch(self, xs: TensorList) -> TensorList:
        t, shapes = pack(xs)
        return unpack(self.ls2(self.mlp(self.norm2(t))), shapes)

    def forward(self, xs: TensorList | Tensor, rope: Optional[list] = None) -> TensorList | Tensor:
        """``rope``: one (sin, cos) per crop group for RoPE backbones (DINOv3); positions are per group, so
        the efficient stochastic depth's per-sample subsets need no change."""
        single = isinstance(xs, Tensor)
        if single:
            xs = [xs]
        rate = self.drop_path_rate if self.training else 0.0
        attn_branch = self._attn_branch if rope is None else functools.partial(self._attn_branch, rope=rope)
        for branch in (attn_branch, self._ffn_branch):
            if rate > EFFICIENT_DROP_PATH_MIN_RATE and self.efficient_drop_path:
                xs = drop_add_residual_subset(xs, branch, rate)
            elif rate > 0:
                xs = [x + self.drop_path(r) for x, r in zip(xs, branch(xs))]
            else:
                xs = [x + r for x, r in zip(xs, branch(xs))]
        return xs[0] if single else xs


__all__ = ["Block", "SwiGLU", "swiglu_hidden", "pack", "unpack", "drop_add_residual_subset", "subset_size",
           "EFFICIENT_DROP_PATH_MIN_RATE"]
