"""RGB weights into N input channels: expanding a backbone's patch embedding for multi-channel continued
pretraining (multispectral bands, microscopy stains; the question of dinov3 #156 and dinov2 PR #131).

Two initialisations of the new (D, N, p, p) kernel from the released (D, 3, p, p) one, W_R, W_G, W_B:

* ``mean``: every channel gets the mean RGB kernel (W_R + W_G + W_B) / 3, times 3 / N. A grey image put in
  all N channels then gives exactly the embedding its RGB rendering (grey in R, G, B) gave, and with N = 1
  the kernel is W_R + W_G + W_B, the released model on a grey image.
* ``rgb_map``: the channels named as red, green and blue get W_R, W_G, W_B, the others the mean kernel; all
  times 3 / N so the total response to channels of similar size stays that of the released model.

The bias is kept. Pure tensor code on a single device (models layer); the choice is the config key
``model.expand_patch_embed`` (docs/multichannel.md has the measurement behind the default).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

EXPAND_MODES = ("mean", "rgb_map")


def expand_kernel(weight: Tensor, in_chans: int, mode: str = "mean",
                  rgb_channels: Optional[Sequence[int]] = None) -> Tensor:
    """(D, 3, p, p) RGB kernel -> (D, in_chans, p, p) as ``mode`` says (module docstring)."""
    if weight.ndim != 4 or weight.shape[1] != 3:
        raise ValueError(f"expected an RGB patch kernel (D, 3, p, p), got {tuple(weight.shape)}")
    if mode not in EXPAND_MODES:
        raise ValueError(f"expand mode must be one of {EXPAND_MODES}, got '{mode}'")
    if not 1 <= in_chans <= 16:
        raise ValueError(f"in_chans must be 1-16, got {in_chans}")
    mean = weight.mean(dim=1, keepdim=True)  # (D, 1, p, p)
    out = mean.repeat(1, in_chans, 1, 1)
    if mode == "rgb_map":
        rgb = list(rgb_channels or [])
        if len(rgb) != 3 or len(set(rgb)) != 3 or not all(0 <= c < in_chans for c in rgb):
            raise ValueError(f"rgb_map needs 3 distinct channel indices in [0, {in_chans}), got {rgb_channels}")
        for src, dst in enumerate(rgb):
            out[:, dst] = weight[:, src]
    return out * (3.0 / in_chans)


@torch.no_grad()
def expand_patch_embed(model: nn.Module, in_chans: int, mode: str = "mean",
                       rgb_channels: Optional[Sequence[int]] = None) -> nn.Module:
    """Give an RGB backbone ``in_chans`` input channels in place (its patch embedding's conv replaced, its
    ``arch_config`` updated so exports record the new count); returns the model."""
    proj = model.patch_embed.proj
    if proj.in_channels == in_chans:
        return model
    if proj.in_channels != 3:
        raise ValueError(f"can only expand an RGB (3-channel) patch embedding, this one has {proj.in_channels} "
                         f"channels and {in_chans} were asked for")
    new = nn.Conv2d(in_chans, proj.out_channels, kernel_size=proj.kernel_size, stride=proj.stride,
                    padding=proj.padding, bias=proj.bias is not None, device=proj.weight.device,
                    dtype=proj.weight.dtype)
    new.weight.copy_(expand_kernel(proj.weight, in_chans, mode, rgb_channels))
    if proj.bias is not None:
        new.bias.copy_(proj.bias)
    new.weight.requires_grad_(proj.weight.requires_grad)
    model.patch_embed.proj = new
    if hasattr(model, "_arch_kwargs"):
        model._arch_kwargs["in_chans"] = in_chans
    return model


def in_chans_of(model: nn.Module) -> int:
    return int(model.patch_embed.proj.in_channels)


__all__ = ["EXPAND_MODES", "expand_kernel", "expand_patch_embed", "in_chans_of"]
