"""The teacher's exponential moving average over the student (DINO, Caron et al. 2021 §3.1), on whatever
each rank holds: full parameters in one process, FSDP2's local fp32 shards when sharded.

Pure torch: a module sharded by ``fully_shard`` is recognised by the methods FSDP2 gives it (``unshard`` /
``reshard``), so this layer (``dinopipe.ssl``) needs nothing from ``torch.distributed`` or ``dinopipe.train``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..utils.torch_compat import norm_base


def _is_fsdp(module: nn.Module) -> bool:
    """An FSDP2-sharded module (``fully_shard`` swaps its class for one with ``unshard`` / ``reshard``)."""
    return callable(getattr(module, "unshard", None)) and callable(getattr(module, "reshard", None))


def reshard_(module: nn.Module) -> None:
    """Free the unsharded copies FSDP2 still holds for ``module`` (after a no-grad forward nothing else
    would). A no-op for modules that are not sharded or already resharded."""
    for m in module.modules():
        if _is_fsdp(m):
            m.reshard()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (a DTensor's local part, or the tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _is_sharded(module: nn.Module) -> bool:
    return any(_is_fsdp(m) for m in module.modules())


def _ema_pairs(target: nn.Module, source: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Local shards of (target, source) parameters, checked: fp32, sharded when the module is, same shapes.
    An unsharded bf16 copy left by a forward (reshard_after_forward=False, or a root on torch < 2.8) would
    otherwise pair a full tensor with a shard, or quietly mix bf16 into the fp32 teacher."""
    t_named, s_named = list(target.named_parameters()), list(source.named_parameters())
    if [n for n, _ in t_named] != [n for n, _ in s_named]:
        raise ValueError("ema_update_: teacher and student have different parameters; build the teacher as a "
                         "deep copy of the student and parallelize both the same way")
    sharded = (_is_sharded(target), _is_sharded(source))
    ts, ss = [], []
    for (name, t), (_, s) in zip(t_named, s_named):
        for role, p, fsdp in (("teacher", t, sharded[0]), ("student", s, sharded[1])):
            if p.dtype != torch.float32 or (fsdp and not hasattr(p, "to_local")):
                kind = "a sharded DTensor" if hasattr(p, "to_local") else "an unsharded tensor"
                raise RuntimeError(
                    f"ema_update_: {role} parameter '{name}' is {kind} of {p.dtype}; the EMA works only on "
                    f"FSDP2's sharded fp32 parameters (call reshard_() on the module after its no-grad forward; "
                    f"frozen models must be parallelized with frozen=True)")
        lt, ls = local_tensor(t), local_tensor(s)
        if lt.shape != ls.shape:
            raise RuntimeError(f"ema_update_: '{name}' is sharded differently in teacher {tuple(lt.shape)} and "
                               f"student {tuple(ls.shape)}; parallelize both with the same mesh")
        ts.append(lt)
        ss.append(ls)
    return ts, ss


@torch.no_grad()
def ema_update_(target: nn.Module, source: nn.Module, momentum: float) -> None:
    """target = m * target + (1 - m) * source on the local shards (both modules are sharded identically by
    parallelize(), so shard i of one pairs with shard i of the other): two multi-tensor ops over every shard
    (one kernel per chunk of tensors, not one per parameter), DINOv2's own arithmetic. A single
    ``_foreach_lerp_`` would save one launch per step but rounds differently: the teacher then leaves the
    official step's run-to-run noise (tests/ssl/test_official_step.py)."""
    t, s = _ema_pairs(target, source)
    if t:
        torch._foreach_mul_(t, momentum)
        torch._foreach_add_(t, s, alpha=1.0 - momentum)
    _ema_norm_stats_(target, source, momentum)


def _ema_norm_stats_(target: nn.Module, source: nn.Module, momentum: float) -> None:
    """BatchNorm running statistics (a timm CNN student) follow the same EMA (timm's ModelEmaV3 default; the
    counter is copied): the EMA model never runs forward in train mode, so without this its running mean and
    variance would stay at their init and the exported CNN would normalise with 0 / 1. ViTs have no such
    buffers, so this is a no-op for them. FSDP2 does not shard buffers: they are full tensors on every rank."""
    t_mods = dict(target.named_modules())
    for name, src in source.named_modules():
        if not isinstance(src, norm_base()) or not src.track_running_stats:
            continue
        dst = t_mods[name]
        for key in ("running_mean", "running_var"):
            a, b = getattr(dst, key), getattr(src, key)
            if a is not None and b is not None:
                a.lerp_(b.to(a.dtype), 1.0 - momentum)
        if dst.num_batches_tracked is not None and src.num_batches_tracked is not None:
            dst.num_batches_tracked.copy_(src.num_batches_tracked)


__all__ = ["ema_update_", "local_tensor", "reshard_"]
