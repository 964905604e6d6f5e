"""The iBOT mask-token weight rule, used by the collator (data) and the iBOT loss (ssl): one home."""

from __future__ import annotations

from torch import Tensor


def mask_token_weights(masks: Tensor) -> Tensor:
    """(n, N) bool masks -> (M,) weights, 1 / (masked patches in that image), in ``masks[masks]`` order
    (DINOv2's ``collate_data_and_cast``: every masked image weighs the same in the iBOT loss)."""
    per_image = 1.0 / masks.sum(dim=-1).clamp(min=1).float()  # (n,)
    return per_image.unsqueeze(-1).expand_as(masks)[masks]


__all__ = ["mask_token_weights"]
