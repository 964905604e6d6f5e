"""DINOv2-compatible Vision Transformer (Oquab et al. 2023, "DINOv2: Learning Robust Visual Features
without Supervision"; registers from Darcet et al. 2024, "Vision Transformers Need Registers").

Parameter names and ``forward_features`` outputs match the official implementation, so released weights
load through a pure key converter. Beyond it: crops of several sizes run in one packed call
(``forward_features_list``), stochastic depth skips the compute of dropped samples, and the attention
backend is chosen at run time (SDPA everywhere, xformers on CUDA).
"""

from __future__ import annotations

from typing import Optional, Sequence, Type

import torch
import torch.nn.functional as F
from timm.layers import Mlp, PatchEmbed, resample_abs_pos_embed, trunc_normal_
from torch import Tensor, nn

from .attention import BACKENDS, Attention
from .block import Block


def interpolate_pos_embed(
    pos_embed: Tensor, grid_hw: tuple[int, int], antialias: bool, offset: float
) -> Tensor:
    """Resample (1, 1 + M*M, D) position embeddings to a (h, w) patch grid, as the DINOv2 hub does.

    ``offset == 0`` (models with registers): bicubic to an explicit size, antialiased. Otherwise the legacy
    path of the first DINOv2 release: bicubic with ``scale_factor = (h + offset) / M`` (the +0.1 avoided a
    floating-point size off by one), which maps coordinates slightly differently from the size path —
    pretrained weights were tuned with it, so we reproduce it exactly.
    """
    n = pos_embed.shape[1] - 1
    m = int(round(n**0.5))
    if m * m != n:
        raise ValueError(f"position embedding has {n} patch positions, not a square grid")
    h, w = grid_hw
    if (h, w) == (m, m):
        return pos_embed
    if offset == 0:
        return resample_abs_pos_embed(pos_embed, (h, w), (m, m), num_prefix_tokens=1,
                                      interpolation="bicubic", antialias=antialias, verbose=False)
    dtype = pos_embed.dtype
    pe = pos_embed.float()
    cls_pe, patch_pe = pe[:, :1], pe[:, 1:]
    dim = pe.shape[-1]
    patch_pe = F.interpolate(
        patch_pe.reshape(1, m, m, dim).permute(0, 3, 1, 2),  # (1, D, M, M)
        scale_factor=((h + offset) / m, (w + offset) / m),
        mode="bicubic",
        antialias=antialias,
    )
    if tuple(patch_pe.shape[-2:]) != (h, w):
        raise RuntimeError(f"pos-embed interpolation gave {tuple(patch_pe.shape[-2:])}, wanted {(h, w)}")
    patch_pe = patch_pe.permute(0, 2, 3, 1).reshape(1, h * w, dim)
    return torch.cat([cls_pe, patch_pe], dim=1).to(dtype)


class DinoVisionTransformer(nn.Module):
    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 14,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        drop_path_rate: float = 0.0,
        drop_path_uniform: bool = False,
        efficient_drop_path: bool = True,
        init_values: Optional[float] = 1e-5,
        num_register_tokens: int = 0,
        attn_backend: str = "auto",
        mlp_layer: Type[nn.Module] = Mlp,
        act_layer: Type[nn.Module] = nn.GELU,
        block_layer: Type[nn.Module] = Block,
        attn_layer: Type[nn.Module] = Attention,
        interpolate_antialias: Optional[bool] = None,
        interpolate_offset: Optional[float] = None,
    ) -> None:
        super().__init__()
        self.embed_dim = self.num_features = embed_dim
        self.patch_size = patch_size
        self.n_blocks = depth
        self.num_heads = num_heads
        self.num_register_tokens = num_register_tokens
        # Official hub behaviour: register models interpolate antialiased with no offset, the others legacy.
        self.interpolate_antialias = bool(num_register_tokens) if interpolate_antialias is None else interpolate_antialias
        self.interpolate_offset = (0.0 if num_register_tokens else 0.1) if interpolate_offset is None else interpolate_offset

        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                      embed_dim=embed_dim, strict_img_size=False)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.register_tokens = (
            nn.Parameter(torch.zeros(1, num_register_tokens, embed_dim)) if num_register_tokens else None
        )
        self.mask_token = nn.Parameter(torch.zeros(1, embed_dim))  # replaces masked patches (iBOT)

        if drop_path_uniform:
            dpr = [drop_path_rate] * depth
        else:
            # Plain floats (not torch.linspace) so the model can be built on the meta device.
            dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.ModuleList(
            block_layer(
                dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                proj_bias=proj_bias, ffn_bias=ffn_bias, drop_path=dpr[i], efficient_drop_path=efficient_drop_path,
                init_values=init_values, attn_backend=attn_backend, attn_layer=attn_layer,
                mlp_layer=mlp_layer, act_layer=act_layer, norm_layer=_layer_norm,
            )
            for i in range(depth)
        )
        self.norm = _layer_norm(embed_dim)
        self.head = nn.Identity()
        self.init_weights()

    # -- init -----------------------------------------------------------------------------------
    def init_weights(self) -> None:
        trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        if self.register_tokens is not None:
            nn.init.normal_(self.register_tokens, std=1e-6)
        nn.init.zeros_(self.mask_token)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def set_attn_backend(self, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"attn_backend must be one of {BACKENDS}, got '{backend}'")
        for blk in self.blocks:
            blk.attn.backend = backend

    # -- tokens ---------------------------------------------------------------------------------
    def interpolate_pos_encoding(self, h: int, w: int) -> Tensor:
        grid = (h // self.patch_size, w // self.patch_size)
        return interpolate_pos_embed(self.pos_embed, grid, self.interpolate_antialias, self.interpolate_offset)

    def prepare_tokens_with_masks(self, x: Tensor, masks: Optional[Tensor] = None) -> Tensor:
        """(B, C, H, W) -> (B, 1 + R + N, D); masks (B, N) bool put ``mask_token`` on masked patches."""
        B, _, H, W = x.shape
        if H % self.patch_size or W % self.patch_size:
            raise ValueError(f"input {H}x{W} is not a multiple of the patch size {self.patch_size}")
        x = self.patch_embed(x)  # (B, N, D)
        if masks is not None:
            x = torch.where(masks.unsqueeze(-1), self.mask_token.to(x.dtype).unsqueeze(0), x)
        x = torch.cat([self.cls_token.expand(B, -1, -1).to(x.dtype), x], dim=1)
        x = x + self.interpolate_pos_encoding(H, W).to(x.dtype)
        if self.register_tokens is not None:
            x = torch.cat([x[:, :1], self.register_tokens.expand(B, -1, -1).to(x.dtype), x[:, 1:]], dim=1)
        return x

    def _output(self, x: Tensor, masks: Optional[Tensor]) -> dict:
        x_norm = self.norm(x)
        r = self.num_register_tokens
        return {
            "x_norm_clstoken": x_norm[:, 0],
            "x_norm_regtokens": x_norm[:, 1 : r + 1],
            "x_norm_patchtokens": x_norm[:, r + 1 :],
            "x_prenorm": x,
            "masks": masks,
        }

    # -- forwards -------------------------------------------------------------------------------
    def forward_features_list(
        self, x_list: Sequence[Tensor], masks_list: Optional[Sequence[Optional[Tensor]]] = None
    ) -> list[dict]:
        """Crops of different sizes in one call: linear layers see all tokens, attention runs per group."""
        masks_list = list(masks_list) if masks_list is not None else [None] * len(x_list)
        if len(masks_list) != len(x_list):
            raise ValueError(f"{len(x_list)} crop groups but {len(masks_list)} masks")
        xs = [self.prepare_tokens_with_masks(x, m) for x, m in zip(x_list, masks_list)]
        for blk in self.blocks:
            xs = blk(xs)
        return [self._output(x, m) for x, m in zip(xs, masks_list)]

    def forward_features(self, x: Tensor | Sequence[Tensor], masks=None):
        if isinstance(x, (list, tuple)):
            return self.forward_features_list(x, masks)
        return self.forward_features_list([x], [masks])[0]

    def forward(self, x: Tensor | Sequence[Tensor], masks=None, is_training: bool = False):
        """CLS embedding; with ``is_training`` the feature dict(s), as DINOv2's ``backbone(x, masks, is_training)``."""
        out = self.forward_features(x, masks)
        if is_training:
            return out
        if isinstance(out, list):
            return [self.head(o["x_norm_clstoken"]) for o in out]
        return self.head(out["x_norm_clstoken"])

    def get_intermediate_layers(
        self,
        x: Tensor,
        n: int | Sequence[int] = 1,
        reshape: bool = False,
        return_class_token: bool = False,
        norm: bool = True,
    ) -> tuple:
        """Outputs of the last ``n`` blocks (or of the block indices in ``n``), like DINOv2's method."""
        B, _, H, W = x.shape
        take = set(range(self.n_blocks - n, self.n_blocks)) if isinstance(n, int) else set(n)
        bad = [i for i in take if not 0 <= i < self.n_blocks]
        if bad:
            raise ValueError(f"block indices {bad} out of range for a {self.n_blocks}-block model")
        x = self.prepare_tokens_with_masks(x)
        outputs = []
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i in take:
                outputs.append(x)
        if norm:
            outputs = [self.norm(o) for o in outputs]
        class_tokens = [o[:, 0] for o in outputs]
        outputs = [o[:, 1 + self.num_register_tokens :] for o in outputs]
        if reshape:
            h, w = H // self.patch_size, W // self.patch_size
            outputs = [o.reshape(B, h, w, -1).permute(0, 3, 1, 2).contiguous() for o in outputs]  # (B, D, h, w)
        if return_class_token:
            return tuple(zip(outputs, class_tokens))
        return tuple(outputs)

    def arch_config(self) -> dict:
        """Keyword arguments that rebuild this architecture (saved next to exported weights)."""
        return dict(getattr(self, "_arch_kwargs", {}))


def _layer_norm(dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=1e-6)


__all__ = ["DinoVisionTransformer", "interpolate_pos_embed"]
