"""One ``parallelize()`` for every model the trainer holds (student, teacher, heads): activation
checkpointing, then per-block ``torch.compile``, then FSDP2 ``fully_shard`` per block and at the root
(torchtitan's order), or, in a single process, autocast to the same compute dtype. Model code stays
single-device; this is the only place that shards it or picks its compute dtype.

Frozen models (the EMA teacher, a distillation teacher, the students' EMAs) never run backward, so FSDP2
never gets the post-backward hook that reshards a module kept unsharded after forward: they are always
sharded with ``reshard_after_forward=True`` and callers reshard them explicitly after a no-grad forward
(``reshard_``), because torch < 2.8 keeps every root module unsharded after forward regardless. The EMA then
only ever sees FSDP2's sharded fp32 parameters, and ``ema_update_`` refuses anything else.
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
COMPUTE_DTYPES = ("fp32", "bf16")  # fp16 would need a gradient scaler (refused by check_config)


@dataclass
class ParallelConfig:
    param_dtype: str = "bf16"
    """Compute dtype of parameters and activations (bf16 / fp32), at any world size: FSDP2's mixed-precision
    policy with several processes, autocast in one. fp16 is refused (it would need a gradient scaler)."""
    reduce_dtype: str = "fp32"
    """dtype of gradient reduce-scatter (fp32 / bf16)."""
    activation_checkpointing: bool = False
    compile: bool = False
    """Per-block torch.compile(fullgraph=True) (useful on CUDA; slow to compile on CPU)."""
    reshard_after_forward: bool = True
    """Student only: free the gathered parameters after forward (re-gather in backward). Frozen models
    (teachers, EMAs) always reshard."""


def check_config(cfg: ParallelConfig) -> None:
    """Config errors (exit 2, naming the key) for choices the type system cannot check."""
    from ..config import ConfigError

    if cfg.param_dtype == "fp16":
        raise ConfigError("parallel.param_dtype: fp16 is not supported: it needs a gradient scaler, which the "
                          "training loop does not have (gradients underflow/overflow). Use bf16 (same speed on "
                          "A100/H100, fp32's exponent range) or fp32.")
    if cfg.param_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"parallel.param_dtype: expected one of {list(COMPUTE_DTYPES)}, got '{cfg.param_dtype}'")
    if cfg.reduce_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"parallel.reduce_dtype: expected one of {list(COMPUTE_DTYPES)}, got '{cfg.reduce_dtype}'")


def configure_device_math(device: torch.device) -> None:
    """TF32 tensor cores for the fp32 matmuls and convolutions that remain (fp32 runs, the losses, the
    optimizer): ~8x the fp32 rate on A100/H100 at a 10-bit mantissa, PyTorch's recommended training setting."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


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


def compile_block(block: nn.Module, backend: str = "inductor") -> None:
    """Compile the block's forward (after AC, so the checkpoint is inside the graph) with fullgraph=True: a
    graph break is an error, not a silent slowdown. Only ``forward`` is compiled, not ``__call__``, so FSDP2's
    all-gather hooks added later run eagerly around it (torchtitan compiles blocks before sharding too).
    dynamic=True: sizes are symbolic from the first call, so a resolution switch or a ragged last batch reuses
    the graph instead of recompiling."""
    if getattr(block, "_dinopipe_compiled", False):
        return
    block.forward = torch.compile(block.forward, backend=backend, dynamic=True, fullgraph=True)
    block._dinopipe_compiled = True


# Methods the task calls on a backbone or head; all run under autocast in a single process.
_AUTOCAST_METHODS = ("forward", "forward_features_list")


def apply_autocast(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Single process: run the module's forward methods under ``torch.autocast`` (torchtitan does the same
    when FSDP is off). Parameters stay fp32, so the optimizer, the EMA and checkpoints are those of an fp32
    run; matmuls and attention run in ``dtype``."""
    if getattr(module, "_dinopipe_autocast", None) is not None:
        return
    for name in _AUTOCAST_METHODS:
        fn = getattr(module, name, None)
        if fn is None:
            continue
        setattr(module, name, functools.wraps(fn)(torch.autocast(device_type, dtype=dtype)(fn)))
    module._dinopipe_autocast = dtype


def parallelize(modules: Iterable[nn.Module], info: DistInfo, cfg: Optional[ParallelConfig] = None,
                frozen: bool = False, compile_backend: str = "inductor") -> str:
    """Apply AC / compile / FSDP2 (or autocast) in place to each module (a backbone with ``.blocks`` or a
    head). ``frozen``: modules that only run no-grad forwards (no AC; always resharded after forward).
    Returns the compute dtype in effect ('bf16' / 'fp32'), also logged."""
    cfg = cfg or ParallelConfig()
    check_config(cfg)
    configure_device_math(info.device)
    modules = list(modules)
    for m in modules:
        for blk in _blocks(m):
            if cfg.activation_checkpointing and not frozen:
                apply_activation_checkpointing(blk)
            if cfg.compile:
                compile_block(blk, compile_backend)
    compute = DTYPES[cfg.param_dtype]
    if not info.distributed:
        if compute != torch.float32:
            for m in modules:
                apply_autocast(m, info.device.type, compute)
        log.info("compute dtype %s (%s, one process)", cfg.param_dtype,
                 "autocast" if compute != torch.float32 else "no mixed precision")
        return cfg.param_dtype
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=DTYPES[cfg.reduce_dtype])
    reshard = True if frozen else cfg.reshard_after_forward
    for m in modules:
        for blk in _blocks(m):
            fully_shard(blk, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    log.info("compute dtype %s (FSDP2 mixed precision over %d ranks, reduce %s, %s)", cfg.param_dtype,
             info.world_size, cfg.reduce_dtype, "frozen" if frozen else f"reshard_after_forward={reshard}")
    return cfg.param_dtype


def reshard_(module: nn.Module) -> None:
    """Free the unsharded copies FSDP2 still holds for ``module`` (after a no-grad forward nothing else
    would). A no-op for modules that are not sharded or already resharded."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (a DTensor's local part, or the tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


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
    """target = m * target + (1 - m) * source, parameter by parameter on the local shards (both modules are
    sharded identically by parallelize(), so shard i of one pairs with shard i of the other)."""
    t, s = _ema_pairs(target, source)
    if not t:
        return
    torch._foreach_mul_(t, momentum)
    torch._foreach_add_(t, s, alpha=1.0 - momentum)


__all__ = ["ema_update_", "ParallelConfig", "parallelize", "apply_activation_checkpointing", "apply_autocast",
           "check_config", "compile_block", "configure_device_math", "reshard_", "local_tensor", "DTYPES"]
