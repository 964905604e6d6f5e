"""DINO projection head (Caron et al. 2021): MLP -> bottleneck -> L2-normalise -> prototypes.

The prototype layer, ``last_layer``: DINO/DINOv2 wrap it in ``nn.utils.weight_norm`` with the gain
initialised to 1; DINO v1 froze the gain (``"weight_norm_fixed"``), DINOv2 trains it (``"weight_norm"``, the
default: dinov2 ``layers/dino_head.py:27-28``), DINOv3 uses a plain linear layer (``"linear"``: dinov3
``layers/dino_head.py:32``; its state dict carries a ``plain_last_layer`` marker so a saved head rebuilds as
itself). Weight norm is computed explicitly — normalised rows times an optional gain — so the parameters are
plain tensors that shard cleanly with FSDP2 and load without parametrization hooks. A DINOv2 head's
``weight_v`` / ``weight_g`` map to ``last_layer.weight`` / ``last_layer_gain``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import Tensor, nn


LAST_LAYERS = ("weight_norm", "weight_norm_fixed", "linear")


class DINOHead(nn.Module):
    def __init__(
        self,
        in_dim: int,
        out_dim: int = 65536,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        nlayers: int = 3,
        use_bn: bool = False,
        mlp_bias: bool = True,
        norm_last_layer: bool = False,
        last_layer: str | None = None,
    ) -> None:
        super().__init__()
        nlayers = max(nlayers, 1)
        dims = [in_dim] + [hidden_dim] * (nlayers - 1) + [bottleneck_dim]
        layers: list[nn.Module] = []
        for i in range(nlayers):
            layers.append(nn.Linear(dims[i], dims[i + 1], bias=mlp_bias))
            if i < nlayers - 1:
                if use_bn:
                    layers.append(nn.BatchNorm1d(dims[i + 1]))
                layers.append(nn.GELU())
        self.mlp = nn.Sequential(*layers)
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)
        kind = last_layer or ("weight_norm_fixed" if norm_last_layer else "weight_norm")
        if kind not in LAST_LAYERS:
            raise ValueError(f"last_layer must be one of {LAST_LAYERS}, got '{kind}'")
        self.last_layer_kind = kind
        # Learnable per-prototype gain only with DINOv2's trainable weight norm.
        self.last_layer_gain = nn.Parameter(torch.ones(out_dim, 1)) if kind == "weight_norm" else None
        if kind == "linear":
            self.register_buffer("plain_last_layer", torch.ones(()))
        self.init_weights()

    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def prototypes(self) -> Tensor:
        if self.last_layer_kind == "linear":
            return self.last_layer.weight
        w = F.normalize(self.last_layer.weight, dim=1)  # (K, bottleneck)
        return w if self.last_layer_gain is None else w * self.last_layer_gain

    def forward(self, x: Tensor, no_last_layer: bool = False, only_last_layer: bool = False) -> Tensor:
        if not only_last_layer:
            x = self.mlp(x)
            eps = 1e-6 if x.dtype == torch.float16 else 1e-12
            x = F.normalize(x, dim=-1, p=2, eps=eps)  # (B, bottleneck)
        if no_last_layer:
            return x
        return F.linear(x, self.prototypes().to(x.dtype))  # (B, K)


__all__ = ["DINOHead", "LAST_LAYERS"]
