"""DINO projection head (Caron et al. 2021): MLP -> bottleneck -> L2-normalise -> prototypes.

DINO/DINOv2 wrap the prototype layer in ``nn.utils.weight_norm`` with the gain initialised to 1; DINO v1
froze the gain (``norm_last_layer=True``, our default), DINOv2 leaves it trainable (``norm_last_layer=False``
here). Weight norm is computed explicitly — normalised rows times an optional gain — so the parameters are
plain tensors that shard cleanly with FSDP2 and load without parametrization hooks. A DINOv2 head's
``weight_v`` / ``weight_g`` map to ``last_layer.weight`` / ``last_layer_gain``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import Tensor, nn


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
        norm_last_layer: bool = True,
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
        # Learnable per-prototype gain only when the last layer is not kept normalised.
        self.last_layer_gain = None if norm_last_layer else nn.Parameter(torch.ones(out_dim, 1))
        self.init_weights()

    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def prototypes(self) -> Tensor:
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


__all__ = ["DINOHead"]
