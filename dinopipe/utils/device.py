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


def host_tensor(values: list[float], device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Python numbers as a tensor on ``device`` without waiting for it: on CUDA through pinned memory with an
    asynchronous copy (``torch.tensor(values, device=cuda)`` copies from pageable memory and blocks the host
    until the GPU has caught up, one host sync per call; the pinned block is not reused before the copy ends)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


__all__ = ["pick_device", "host_tensor"]
