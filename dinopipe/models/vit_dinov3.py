"""DINOv3 Vision Transformer (Siméoni et al. 2025, "DINOv3").

Differences from the DINOv2 layout (vit.py): no learned position embedding but axial RoPE on the patch
tokens' queries and keys (rope.py); 4 "storage" tokens (registers, Darcet et al. 2024) after the class
token; a qkv bias whose key third is masked to zero (a key bias only shifts every logit of a query by the
same amount, so it is dropped); SwiGLU widths aligned to 8 (64 for the 7B); LayerNorm eps 1e-5; uniform
stochastic depth; optionally separate norms for the class/storage tokens (``cls_norm``) and for local
crops' class tokens in training (``local_cls_norm``, the 7B and the satellite ViT-L).

Parameter names follow the official release where they exist (``storage_tokens``, ``ls1.gamma``,
``local_cls_norm``), with timm's ``mlp.fc1``/``mlp.fc2`` for the FFN as in the DINOv2 models, so both
families share Block, Attention, the packed multi-crop forward and the efficient stochastic depth.
``forward_features`` returns DINOv2's keys (storage tokens under ``x_norm_regtokens``).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Type

import torch
import torch.nn.functional as F
from timm.layers import GluMlp, Mlp, PatchEmbed, trunc_normal_
from torch import Tensor, nn

from .attention import BACKENDS, Attention
from .block import Block
from .rope import RopeEmbedding


class LinearKMaskedBias(nn.Linear):
    """qkv projection whose key bias is fixed at zero (forward and gradient), as DINOv3's ``mask_k_bias``.

    The full (3D,) bias is kept so the layout matches DINOv2's ``attn.qkv.bias``; its key third is never used.
    """

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return F.linear(x, self.weight)
        d = self.out_features // 3
        b = torch.cat([self.bias[:d], self.bias.new_zeros(d), self.bias[2 * d:]])
        return F.linear(x, self.weight, b)


class MaskedKBiasAttention(Attention):
    """Attention (all backends, RoPE) with the masked key bias."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, proj_bias: bool = True,
                 backend: str = "auto") -> None:
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, proj_bias=proj_bias, backend=backend)
        self.qkv = LinearKMaskedBias(dim, dim * 3, bias=qkv_bias)


def swiglu_hidden_aligned(hidden_features: int, align_to: int) -> int:
    """DINOv3's SwiGLU width: 2/3 of the MLP width rounded up to ``align_to`` (8; 64 for the 7B)."""
    d = int(hidden_features * 2 / 3)
    return d + (-d % align_to)


def SwiGLUAligned(in_features: int, hidden_features: int, out_features: Optional[int] = None,
                  act_layer: Optional[Type[nn.Module]] = None, bias: bool = True, align_to: int = 8,
                  **_: object) -> nn.Module:
    """SwiGLU FFN as timm's packed GluMlp: fc1 = [w1; w2] (silu(w1 x) * w2 x), fc2 = w3."""
    return GluMlp(in_features, 2 * swiglu_hidden_aligned(hidden_features, align_to), out_features,
                  act_layer=nn.SiLU, bias=bias, gate_last=False)


class DinoV3VisionTransformer(nn.Module):
    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        mask_k_bias: bool = True,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        drop_path_rate: float = 0.0,
        drop_path_uniform: bool = True,
        efficient_drop_path: bool = True,
        init_values: Optional[float] = 1e-5,
        num_register_tokens: int = 4,
        attn_backend: str = "auto",
        norm_eps: float = 1e-5,
        rope_base: float = 100.0,
        rope_shift: Optional[float] = None,
        rope_jitter: Optional[float] = None,
        rope_rescale: Optional[float] = 2.0,
        rope_dtype: str = "fp32",
        untie_cls_and_patch_norms: bool = False,
        untie_global_and_local_cls_norm: bool = False,
        mlp_layer: Type[nn.Module] = Mlp,
        act_layer: Type[nn.Module] = nn.GELU,
        block_layer: Type[nn.Module] = Block,
        attn_layer: Optional[Type[nn.Module]] = None,
    ) -> None:
        super().__init__()
        self.embed_dim = self.num_features = embed_dim
        self.patch_size = patch_size
        self.n_blocks = depth
        self.num_heads = num_heads
        self.num_register_tokens = num_register_tokens  # DINOv3's storage tokens
        norm_layer = functools.partial(nn.LayerNorm, eps=norm_eps)

        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                      embed_dim=embed_dim, strict_img_size=False)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.storage_tokens = nn.Parameter(torch.zeros(1, num_register_tokens, embed_dim)) if num_register_tokens else None
        self.mask_token = nn.Parameter(torch.zeros(1, embed_dim))  # replaces masked patches (iBOT)
        self.rope_embed = RopeEmbedding(embed_dim // num_heads, base=rope_base, shift=rope_shift,
                                        jitter=rope_jitter, rescale=rope_rescale, dtype=rope_dtype)
        if attn_layer is None:
            attn_layer = MaskedKBiasAttention if mask_k_bias else Attention
        dpr = ([drop_path_rate] * depth if drop_path_uniform
               else [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)])
        self.blocks = nn.ModuleList(
            block_layer(
                dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                proj_bias=proj_bias, ffn_bias=ffn_bias, drop_path=dpr[i], efficient_drop_path=efficient_drop_path,
                init_values=init_values, attn_backend=attn_backend, attn_layer=attn_layer,
                mlp_layer=mlp_layer, act_layer=act_layer, norm_layer=norm_layer,
            )
            for i in range(depth)
        )
        self.norm = norm_layer(embed_dim)  # patch tokens (and everything when the norms are tied)
        self.cls_norm = norm_layer(embed_dim) if untie_cls_and_patch_norms else None
        # Class/storage tokens of local crops in training only (the second crop group, as DINOv3 passes them).
        self.local_cls_norm = norm_layer(embed_dim) if untie_global_and_local_cls_norm else None
        self.head = nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.normal_(self.cls_token, std=0.02)
        if self.storage_tokens is not None:
            nn.init.normal_(self.storage_tokens, std=0.02)
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
    def prepare_tokens_with_masks(self, x: Tensor, masks: Optional[Tensor] = None) -> tuple[Tensor, tuple[int, int]]:
        """(B, C, H, W) -> ((B, 1 + R + h*w, D), (h, w)); masks (B, h*w) bool put ``mask_token`` on patches."""
        B, _, H, W = x.shape
        if H % self.patch_size or W % self.patch_size:
            raise ValueError(f"input {H}x{W} is not a multiple of the patch size {self.patch_size}")
        x = self.patch_embed(x)  # (B, N, D)
        if masks is not None:
            x = torch.where(masks.unsqueeze(-1), self.mask_token.to(x.dtype).unsqueeze(0), x)
        prefix = [self.cls_token.expand(B, -1, -1)]
        if self.storage_tokens is not None:
            prefix.append(self.storage_tokens.expand(B, -1, -1))
        x = torch.cat([p.to(x.dtype) for p in prefix] + [x], dim=1)
        return x, (H // self.patch_size, W // self.patch_size)

    def _norm(self, x: Tensor, local: bool = False) -> tuple[Tensor, Tensor]:
        """(normed class+storage tokens, normed patch tokens)."""
        r = self.num_register_tokens + 1
        if local and self.local_cls_norm is not None:
            return self.local_cls_norm(x[:, :r]), self.norm(x[:, r:])
        if self.cls_norm is not None:
            return self.cls_norm(x[:, :r]), self.norm(x[:, r:])
        x_norm = self.norm(x)
        return x_norm[:, :r], x_norm[:, r:]

    def _output(self, x: Tensor, masks: Optional[Tensor], local: bool) -> dict:
        cls_reg, patch = self._norm(x, local)
        return {
            "x_norm_clstoken": cls_reg[:, 0],
            "x_norm_regtokens": cls_reg[:, 1:],
            "x_norm_patchtokens": patch,
            "x_prenorm": x,
            "masks": masks,
        }

    # -- forwards -------------------------------------------------------------------------------
    def forward_features_list(
        self, x_list: Sequence[Tensor], masks_list: Optional[Sequence[Optional[Tensor]]] = None
    ) -> list[dict]:
        """Crops of different sizes in one call: linear layers see all tokens, attention and RoPE per group."""
        masks_list = list(masks_list) if masks_list is not None else [None] * len(x_list)
        if len(masks_list) != len(x_list):
            raise ValueError(f"{len(x_list)} crop groups but {len(masks_list)} masks")
        prepared = [self.prepare_tokens_with_masks(x, m) for x, m in zip(x_list, masks_list)]
        xs = [t for t, _ in prepared]
        grids = [hw for _, hw in prepared]
        ropes = self._ropes(grids, xs[0].device)
        for i, blk in enumerate(self.blocks):
            if i and self._redraw_rope():
                ropes = self._ropes(grids, xs[0].device)
            xs = blk(xs, rope=ropes)
        return [self._output(x, m, local=self.training and i == 1) for i, (x, m) in enumerate(zip(xs, masks_list))]

    def _redraw_rope(self) -> bool:
        """In training with a RoPE augmentation, every block gets its own draw, as the official
        ``forward_features_list`` calls ``rope_embed`` inside the block loop (dinov3 ``vision_transformer.py``);
        otherwise the tables are the same for every block and are computed once."""
        r = self.rope_embed
        return self.training and bool(r.shift or r.jitter or r.rescale)

    def _ropes(self, grids: Sequence[tuple[int, int]], device: torch.device) -> list:
        """One (sin, cos) table per crop group, drawn in group order (the official order)."""
        return [self.rope_embed(h, w, device=device) for h, w in grids]

    def forward_features(self, x: Tensor | Sequence[Tensor], masks=None):
        if isinstance(x, (list, tuple)):
            return self.forward_features_list(x, masks)
        return self.forward_features_list([x], [masks])[0]

    def forward(self, x: Tensor | Sequence[Tensor], masks=None, is_training: bool = False):
        """CLS embedding; with ``is_training`` the feature dict(s), as DINOv3's ``backbone(x, masks, is_training)``."""
        out = self.forward_features(x, masks)
        if is_training:
            return out
        if isinstance(out, list):
            return [self.head(o["x_norm_clstoken"]) for o in out]
        return self.head(out["x_norm_clstoken"])

    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1, reshape: bool = False,
                                return_class_token: bool = False, norm: bool = True) -> tuple:
        """Outputs of the last ``n`` blocks (or of the block indices in ``n``), like DINOv2/v3's method."""
        B = x.shape[0]
        take = set(range(self.n_blocks - n, self.n_blocks)) if isinstance(n, int) else set(n)
        bad = [i for i in take if not 0 <= i < self.n_blocks]
        if bad:
            raise ValueError(f"block indices {bad} out of range for a {self.n_blocks}-block model")
        t, (h, w) = self.prepare_tokens_with_masks(x)
        rope = self._ropes([(h, w)], t.device)
        outputs = []
        for i, blk in enumerate(self.blocks):
            if i and self._redraw_rope():
                rope = self._ropes([(h, w)], t.device)
            t = blk(t, rope=rope)
            if i in take:
                outputs.append(t)
        r = 1 + self.num_register_tokens
        if norm:
            outputs = [torch.cat(self._norm(o), dim=1) for o in outputs]
        class_tokens = [o[:, 0] for o in outputs]
        outputs = [o[:, r:] for o in outputs]
        if reshape:
            outputs = [o.reshape(B, h, w, -1).permute(0, 3, 1, 2).contiguous() for o in outputs]  # (B, D, h, w)
        if return_class_token:
            return tuple(zip(outputs, class_tokens))
        return tuple(outputs)

    def arch_config(self) -> dict:
        """Keyword arguments that rebuild this architecture (saved next to exported weights). The RoPE dtype is a
        training setting: exports run fp32 RoPE, as the released models do."""
        return {k: v for k, v in getattr(self, "_arch_kwargs", {}).items() if k != "rope_dtype"}


__all__ = ["DinoV3VisionTransformer", "LinearKMaskedBias", "MaskedKBiasAttention", "SwiGLUAligned",
           "swiglu_hidden_aligned"]
