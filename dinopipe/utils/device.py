"""Where a stage that runs in one process (embedding, eval, the GPU check) puts its model.

Distributed training picks its device in ``dinopipe.train.dist`` (one per local rank); everything
else asks here, so "auto" means the same thing everywhere and a GPU asked for on a machine without
one is a config mistake named by its key, not a CUDA traceback later.
"""

from __future__ import annotations

import torch

from ..config import ConfigError


def pick_device(spec: str | torch.device = "auto", key: str = "device") -> torch.device:
    """``auto`` -> CUDA when torch sees a GPU, else CPU; ``cpu`` | ``cuda`` | ``cuda:N`` as given.
    Asking for CUDA without a visible GPU raises :class:`ConfigError` naming ``key``."""
    if isinstance(spec, torch.device):
        return spec
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{key}: '{spec}' but torch sees no CUDA device; use auto or cpu")
    try:
        return torch.device(spec)
    except RuntimeError as exc:
        raise ConfigError(f"{key}: '{spec}' is not a device (auto | cpu | cuda | cuda:N)") from exc


__all__ = ["pick_device"]
