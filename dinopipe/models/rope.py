"""Axial rotary position embedding of DINOv3 (Siméoni et al. 2025, "DINOv3"; RoPE from Su et al. 2021).

Each head's dimensions are split in four quarters: the first half of the head rotates with the patch row
coordinate, the second half with the column coordinate (``rotate_half`` layout, as released). Coordinates
are patch centres normalised *per axis* to [-1, 1] ("separate"), so a 14 x 20 grid spans the same range
on both axes as a 14 x 14 one; periods grow geometrically from 1 to ``base`` over a quarter head.
The embedding is a pure function of the grid size (no weights, no buffers): nothing to checkpoint,
nothing to materialise after a meta-device build.

Training-only augmentations (DINOv3 §3): ``shift`` adds a uniform offset in [-s, s] per axis, ``jitter``
scales each axis by a log-uniform factor in [1/J, J], ``rescale`` scales both axes by one log-uniform
factor in [1/R, R] (the released models were trained with R = 2). The backbone asks for a new draw per crop-size
group *and per block*, as the official ``forward_features_list`` calls ``rope_embed`` inside its block loop
(dinov3 ``models/vision_transformer.py:229-231``); in eval mode the tables are the same for every block.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

# (sin, cos), each (h * w, head_dim) float32, for one crop-size group.
RopeSinCos = tuple[Tensor, Tensor]
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rope_periods(head_dim: int, base: float, device: Optional[torch.device] = None) -> Tensor:
    """(head_dim // 4,) periods base^(4i / head_dim): what the official file stores as ``rope_embed.periods``."""
    if head_dim % 4:
        raise ValueError(f"axial RoPE needs a head dim divisible by 4, got {head_dim}")
    return base ** (torch.arange(head_dim // 4, dtype=torch.float32, device=device) * (4.0 / head_dim))


def base_from_periods(periods: Tensor) -> float:
    """Invert ``rope_periods``: periods[1] = base^(4 / head_dim) with head_dim = 4 * len(periods)."""
    n = periods.numel()
    if n < 2:
        raise ValueError("cannot infer the RoPE base from fewer than 2 periods")
    return float(periods[1].double() ** n)


def patch_coords(h: int, w: int, device: Optional[torch.device] = None) -> Tensor:
    """(h * w, 2) patch-centre (row, col) coordinates in [-1, 1], normalised per axis, row-major."""
    ch = (torch.arange(h, dtype=torch.float32, device=device) + 0.5) / h
    cw = (torch.arange(w, dtype=torch.float32, device=device) + 0.5) / w
    grid = torch.stack(torch.meshgrid(ch, cw, indexing="ij"), dim=-1).reshape(h * w, 2)
    return 2.0 * grid - 1.0


class RopeEmbedding(nn.Module):
    """(sin, cos) tables for a patch grid; augments coordinates in training mode only."""

    def __init__(self, head_dim: int, base: float = 100.0, shift: Optional[float] = None,
                 jitter: Optional[float] = None, rescale: Optional[float] = None, dtype: str = "fp32") -> None:
        super().__init__()
        rope_periods(head_dim, base)  # validates head_dim
        if str(dtype) not in _DTYPES:
            raise ValueError(f"rope dtype must be one of {sorted(_DTYPES)}, got '{dtype}'")
        self.head_dim, self.base = head_dim, float(base)
        self.shift, self.jitter, self.rescale = shift, jitter, rescale
        self.dtype = _DTYPES[str(dtype)]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}, shift={self.shift}, jitter={self.jitter}, rescale={self.rescale}"

    def _augment(self, coords: Tensor) -> Tensor:
        dd = dict(device=coords.device, dtype=coords.dtype)
        if self.shift:
            coords = coords + torch.empty(1, 2, **dd).uniform_(-self.shift, self.shift)
        if self.jitter:
            lj = math.log(self.jitter)
            coords = coords * torch.empty(1, 2, **dd).uniform_(-lj, lj).exp()
        if self.rescale:
            lr = math.log(self.rescale)
            coords = coords * torch.empty(1, 1, **dd).uniform_(-lr, lr).exp()
        return coords

    def forward(self, h: int, w: int, device: Optional[torch.device] = None) -> RopeSinCos:
        if self.dtype != torch.float32:  # the official trainer's bf16 RoPE: every op in that dtype, its op order
            dd = dict(device=device, dtype=self.dtype)
            ch, cw = torch.arange(0.5, h, **dd) / h, torch.arange(0.5, w, **dd) / w
            coords = 2.0 * torch.stack(torch.meshgrid(ch, cw, indexing="ij"), dim=-1).flatten(0, 1) - 1.0
            n = self.head_dim // 4
            periods = self.base ** (2 * torch.arange(n, **dd) / (self.head_dim // 2))
        else:
            coords = patch_coords(h, w, device)
            periods = rope_periods(self.head_dim, self.base, coords.device)
        if self.training:
            coords = self._augment(coords)
        angles = (2 * math.pi) * coords[:, :, None] / periods  # (hw, 2, hd/4): rows then cols
        angles = angles.flatten(1).tile(2)  # (hw, hd): same angles on both halves for rotate_half
        return angles.sin(), angles.cos()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_qkv(qkv: Tensor, shapes: Sequence[tuple[int, int]], ropes: Sequence[Optional[RopeSinCos]],
             num_heads: int) -> Tensor:
    """Rotate q and k of the *patch* tokens (the last h*w of each sequence) in a packed qkv.

    qkv: (T, 3D) for crop groups ``shapes`` [(b, n)]; ropes: one (sin, cos) per group (None: no RoPE).
    The class and storage tokens in front stay unrotated (they have no position). q and k (all tokens, as the
    official ``apply_rope``) go through the tables' dtype (float32 as the released models; bf16 as the official
    trainer) and are cast back to the activations' dtype.
    """
    if len(ropes) != len(shapes):
        raise ValueError(f"{len(shapes)} crop groups but {len(ropes)} RoPE tables")
    out = []
    for chunk, (b, n), rope in zip(qkv.split([b * n for b, n in shapes]), shapes, ropes):
        if rope is None:
            out.append(chunk)
            continue
        sin, cos = rope  # (hw, hd)
        hw = sin.shape[0]
        c = chunk.view(b, n, 3, num_heads, -1)
        qk_all = c[:, :, :2].to(sin.dtype)
        qk = qk_all[:, n - hw:]  # (b, hw, 2, H, hd)
        sin, cos = sin[:, None, None], cos[:, None, None]  # (hw, 1, 1, hd)
        qk = qk * cos + rotate_half(qk) * sin
        qk = torch.cat([qk_all[:, : n - hw], qk], dim=1).to(chunk.dtype)
        out.append(torch.cat([qk, c[:, :, 2:]], dim=2).reshape(b * n, -1))
    return out[0] if len(out) == 1 else torch.cat(out)


__all__ = ["RopeEmbedding", "RopeSinCos", "rope_periods", "base_from_periods", "patch_coords", "rotate_half",
           "rope_qkv"]
