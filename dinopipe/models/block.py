"""Transformer block with *efficient* stochastic depth over packed multi-crop tokens.

Stochastic depth (Huang et al. 2016) drops a residual branch per sample. Masked DropPath still computes
the branch for every sample and multiplies the dropped ones by zero. DINOv2 instead runs the branch only
on the kept subset of the batch and adds it back with ``index_add`` scaled by B/k, so a drop rate of 0.4
saves ~40% of the block's compute. Below a small rate the gather/scatter costs more than it saves, so we
fall back to masked DropPath there (DINOv2 uses 0.1 as that threshold).

A block works on one *pack* of all crop-size groups' tokens, (sum B_i*N_i, D), with the groups' (B_i, N_i):
norms, linear layers and the MLP run once on all tokens; attention runs per group (see attention.py). The
backbones pack once before the first block and split once after the last, so no block concatenates
activations (a list of groups, or one tensor, is accepted too and packed on the way in).
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


def group_rows(shapes: list[tuple[int, int]], device: torch.device) -> list[Tensor]:
    """Per group, its (B_i, N_i) grid of row indices into the pack (groups in order)."""
    grids, off = [], 0
    for b, n in shapes:
        grids.append(torch.arange(off, off + b * n, device=device).view(b, n))
        off += b * n
    return grids


def drop_add_residual_packed(
    t: Tensor, shapes: list[tuple[int, int]], branch: Callable[[Tensor, list], Tensor | TensorList], rate: float,
    grids: Optional[list[Tensor]] = None,
) -> Tensor:
    """Efficient stochastic depth on a pack (sum B_i*N_i, D): x + (B_i/k_i) * branch(x) on k_i random samples of
    each group, the other samples unchanged; ``branch(sub_pack, sub_shapes)`` returns the kept rows' residual,
    packed or one tensor per group.

    The pack stays one tensor from block to block: the kept samples' rows are gathered by one ``index_select``
    and the residuals added back by one ``index_add`` per group, with no concatenation of activations (the rows'
    int64 indices are concatenated instead). Each group draws its own subset, in group order.
    """
    keep = [torch.randperm(b, device=t.device)[: subset_size(b, rate)] for b, _ in shapes]
    grids = grids if grids is not None else group_rows(shapes, t.device)
    rows = [g.index_select(0, idx).flatten() for g, idx in zip(grids, keep)]
    sub_shapes = [(idx.numel(), n) for idx, (_, n) in zip(keep, shapes)]
    # index_select, not x[idx]: its backward is an index_add, ~25x cheaper on CPU than advanced indexing's
    # index_put with accumulate (measured in bench/bench_vit.py's profile).
    res = branch(t.index_select(0, rows[0] if len(rows) == 1 else torch.cat(rows)), sub_shapes)
    if isinstance(res, Tensor):
        res = res.split([k * n for k, n in sub_shapes])
    out = None
    for r, rws, (b, _), idx in zip(res, rows, shapes, keep):
        # The scale multiplies the source rather than going in as index_add's alpha: under torch.compile with
        # dynamic batch sizes a symbolic alpha makes the decomposition guard on it (torch 2.11: "Guard failed on
        # the same frame it was created", seen in gpu-check's task on an H100).
        src = r.reshape(-1, t.shape[-1]).to(t.dtype) * (b / idx.numel())
        # the first group's add copies the pack, the others add into that copy (no further copy of it)
        out = torch.index_add(t, 0, rws, src) if out is None else out.index_add_(0, rws, src)
    return out


def drop_add_residual_subset(
    xs: TensorList, branch: Callable[[TensorList], TensorList], rate: float
) -> TensorList:
    """:func:`drop_add_residual_packed` on a list of groups (B_i, N_i, D), ``branch`` taking and returning lists."""
    t, shapes = pack(xs)
    out = drop_add_residual_packed(t, shapes, lambda u, sub: branch(unpack(u, sub)), rate)
    return unpack(out, shapes)


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

    def _attn_branch(self, t: Tensor, shapes: list, rope: Optional[list] = None,
                     per_group: bool = False) -> Tensor | TensorList:
        """Attention residual of a pack; ``per_group``: one tensor per group, each group's output projected on
        its own (one more GEMM launch) instead of concatenating the groups' attention outputs for one GEMM."""
        h = self.norm1(t)
        if per_group:
            return [self.ls1(o) for o in self.attn(h, shapes, rope=rope, per_group=True)]
        return self.ls1(self.attn(h, shapes) if rope is None else self.attn(h, shapes, rope=rope))

    def _ffn_branch(self, t: Tensor, shapes: list) -> Tensor:
        return self.ls2(self.mlp(self.norm2(t)))

    def forward(self, xs: TensorList | Tensor, rope: Optional[list] = None,
                shapes: Optional[list[tuple[int, int]]] = None) -> TensorList | Tensor:
        """Groups as a list of (B_i, N_i, D) (returns a list), one (B, N, D) tensor, or with ``shapes`` a pack
        (sum B_i*N_i, D) as :func:`pack` makes it (returns the pack: the backbones keep one pack through all
        blocks). ``rope``: one (sin, cos) per crop group for RoPE backbones (DINOv3); positions are per group, so
        the efficient stochastic depth's per-sample subsets need no change."""
        if shapes is not None:
            return self.forward_packed(xs, list(shapes), rope)
        single = isinstance(xs, Tensor)
        xs = [xs] if single else xs
        t, shp = pack(xs)
        out = unpack(self.forward_packed(t, shp, rope), shp)
        return out[0] if single else out

    def forward_packed(self, t: Tensor, shapes: list[tuple[int, int]], rope: Optional[list] = None) -> Tensor:
        rate = self.drop_path_rate if self.training else 0.0
        efficient = rate > EFFICIENT_DROP_PATH_MIN_RATE and self.efficient_drop_path
        attn = functools.partial(self._attn_branch, rope=rope, per_group=efficient and len(shapes) > 1)
        grids = group_rows(shapes, t.device) if efficient and len(shapes) > 1 else None
        for branch in (attn, self._ffn_branch):
            if efficient:
                t = drop_add_residual_packed(t, shapes, branch, rate, grids)
            elif rate > 0:  # masked DropPath: one mask per sample of each group
                r = branch(t, shapes)
                t = pack([x + self.drop_path(y) for x, y in zip(unpack(t, shapes), unpack(r, shapes))])[0]
            else:
                t = t + branch(t, shapes)
        return t


__all__ = ["Block", "SwiGLU", "swiglu_hidden", "pack", "unpack", "drop_add_residual_subset", "drop_add_residual_packed",
           "group_rows", "subset_size",
           "EFFICIENT_DROP_PATH_MIN_RATE"]
