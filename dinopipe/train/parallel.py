"""One ``parallelize()`` for every model the trainer holds (student, teacher, heads): activation
checkpointing, then per-block ``torch.compile``, then FSDP2 ``fully_shard`` per block and at the root
(torchtitan's order). Model code stays single-device; this is the only place that shards it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .dist import DistInfo

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ParallelConfig:
    param_dtype: str = "bf16"
    """FSDP2 compute dtype of parameters (bf16 / fp32)."""
    reduce_dtype: str = "fp32"
    """dtype of gradient reduce-scatter."""
    activation_checkpointing: bool = False
    compile: bool = False
    """Per-block torch.compile (useful on CUDA; slow to compile on CPU)."""
    reshard_after_forward: bool = True


def _blocks(module: nn.Module) -> list[nn.Module]:
    blocks = getattr(module, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def apply_activation_checkpointing(block: nn.Module) -> None:
    """Recompute the block in backward instead of storing its activations. Parameter names are unchanged
    (no wrapper module), so checkpoints and exports do not care whether AC was on."""
    if getattr(block, "_dinopipe_ac", False):
        return
    inner = block.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward
    block._dinopipe_ac = True


def parallelize(modules: Iterable[nn.Module], info: DistInfo, cfg: Optional[ParallelConfig] = None) -> None:
    """Apply AC / compile / FSDP2 in place to each module (a backbone with ``.blocks`` or a head)."""
    cfg = cfg or ParallelConfig()
    modules = list(modules)
    for m in modules:
        for blk in _blocks(m):
            if cfg.activation_checkpointing:
                apply_activation_checkpointing(blk)
            if cfg.compile:
                blk.compile(dynamic=True)
    if not info.distributed:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype])
    for m in modules:
        for blk in _blocks(m):
            fully_shard(blk, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (a DTensor's local part, or the tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def ema_update_(target: nn.Module, source: nn.Module, momentum: float) -> None:
    """target = m * target + (1 - m) * source, parameter by parameter on the local shards (both modules are
    sharded identically by parallelize(), so shard i of one pairs with shard i of the other)."""
    t = [local_tensor(p) for p in target.parameters()]
    s = [local_tensor(p).to(t[0].dtype) for p in source.parameters()]
    torch._foreach_mul_(t, momentum)
    torch._foreach_add_(t, s, alpha=1.0 - momentum)


__all__ = ["ema_update_", "ParallelConfig", "parallelize", "apply_activation_checkpointing", "local_tensor", "DTYPES"]
