"""One ``parallelize()`` for every model the trainer holds (student, teacher, heads): activation
checkpointing, then per-block ``torch.compile``, then FSDP2 ``fully_shard`` per block and at the root
(torchtitan's order), or, in a single process, autocast to the same compute dtype; at one rank of a process
group, FSDP2's numerics without FSDP2 (train/mirror.py). Model code stays
single-device; this is the only place that shards it or picks its compute dtype.

Frozen models (the EMA teacher, a distillation teacher, the students' EMAs) never run backward, so FSDP2
never gets the post-backward hook that reshards a module kept unsharded after forward: they are always
sharded with ``reshard_after_forward=True`` and callers reshard them explicitly after a no-grad forward
(``reshard_``), because torch < 2.8 keeps every root module unsharded after forward regardless. The EMA then
only ever sees FSDP2's sharded fp32 parameters, and ``ema_update_`` refuses anything else.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Iterable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ParallelConfig, check_parallel_config, reduce_dtypes
from ..utils import torch_compat as compat
from .dist import DistInfo

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def configure_device_math(device: torch.device) -> None:
    """TF32 tensor cores for the fp32 matmuls and convolutions that remain (fp32 runs, the losses, the
    optimizer): ~8x the fp32 rate on A100/H100 at a 10-bit mantissa, PyTorch's recommended training setting."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The wrap units of a backbone: a ViT's blocks, a timm CNN's stages (``shard_units``), none for a head."""
    if callable(getattr(module, "shard_units", None)):
        return list(module.shard_units())
    blocks = getattr(module, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def _batchnorms(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, compat.batchnorm_base()) and m.track_running_stats]


@contextlib.contextmanager
def _running_stats_frozen(bns: list[nn.Module]):
    """The recomputation of a checkpointed block must not update BatchNorm running statistics a second time:
    momentum 0 keeps running_mean / running_var as they are (the same kernel runs, so the recompute saves the
    same tensors as the forward did and the checkpoint's checks hold), and the step counter is put back."""
    saved = [(bn.momentum, bn.num_batches_tracked.clone()) for bn in bns]
    for bn in bns:
        bn.momentum = 0.0
    try:
        yield
    finally:
        for bn, (momentum, count) in zip(bns, saved):
            bn.momentum = momentum
            bn.num_batches_tracked.copy_(count)


def apply_activation_checkpointing(block: nn.Module) -> None:
    """Recompute the block in backward instead of storing its activations. Parameter names are unchanged
    (no wrapper module), so checkpoints and exports do not care whether AC was on. A block with BatchNorm
    (a timm CNN student's stage) keeps its running statistics frozen while it is recomputed, so they are
    updated once per forward, as without AC."""
    if getattr(block, "_dinopipe_ac", False):
        return
    inner = block.forward
    # found at run time: a later conversion (SyncBatchNorm) replaces the layers
    freeze = {"context_fn": lambda: (contextlib.nullcontext(), _running_stats_frozen(_batchnorms(block)))}

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        # Compiled, the recompute is part of the backward graph and buffer mutations are applied once, after
        # the forward graph (and a context_fn there must be a dispatch mode): nothing to freeze.
        kw = {} if torch.compiler.is_compiling() or not _batchnorms(block) else freeze
        return checkpoint(inner, *args, use_reentrant=False, **kw, **kwargs)

    block.forward = forward
    block._dinopipe_ac = True


SYNC_BN_DEVICES = ("cuda", "hpu", "xpu")
"""Where torch's SyncBatchNorm has kernels (torch 2.14.1 refuses CPU tensors: "expected input tensor to be on
GPU or XPU or privateuseone")."""


def sync_batchnorm_(modules: list[nn.Module], info: DistInfo) -> int:
    """Several ranks on a device with SyncBatchNorm kernels: every BatchNorm of the trained modules becomes a
    SyncBatchNorm over the default process group (same parameters and buffers, same state-dict keys, so
    checkpoints, the EMA and exports are unchanged). Returns how many were converted (0 on CPU or one rank,
    where each rank's BatchNorm normalises its own images)."""
    if not info.distributed or info.device.type not in SYNC_BN_DEVICES:
        return 0
    n = 0
    for m in modules:
        bns = [b for b in m.modules() if isinstance(b, compat.batchnorm_base())
               and not isinstance(b, nn.SyncBatchNorm)]
        if not bns:
            continue
        if isinstance(m, compat.batchnorm_base()):
            raise TypeError("sync_batchnorm_ converts the BatchNorm layers inside a module, not a bare BatchNorm")
        nn.SyncBatchNorm.convert_sync_batchnorm(m)  # children replaced in place; m itself is not a BatchNorm
        n += len(bns)
    if n:
        log.info("%d BatchNorm layers -> SyncBatchNorm over %d ranks", n, info.world_size)
    return n


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


ONE_RANK_MIRROR = True
"""At one rank of a process group, run FSDP2's mixed precision without FSDP2 (train/mirror.py). False: FSDP2 at
one rank too (the reference tests/train/test_one_rank_mirror.py compares against)."""

_MESHES: dict = {}


def device_mesh(info: DistInfo):
    """The 1-D FSDP mesh over all ranks, made once per process group (the traced dry run makes it outside its
    fake-tensor mode: building a mesh reads tensor values, which fake tensors do not have)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (info.device.type, info.world_size, id(compat.default_process_group()))
    if key not in _MESHES:
        _MESHES.clear()
        _MESHES[key] = init_device_mesh(info.device.type, (info.world_size,))
    return _MESHES[key]


def parallelize(modules: Iterable[nn.Module], info: DistInfo, cfg: Optional[ParallelConfig] = None,
                frozen: bool = False, compile_backend: str = "inductor") -> str:
    """Apply AC / compile / FSDP2 (or autocast) in place to each module (a backbone with ``.blocks`` or a
    head). ``frozen``: modules that only run no-grad forwards (no AC; always resharded after forward).
    Returns the compute dtype in effect ('bf16' / 'fp32'), also logged."""
    cfg = cfg or ParallelConfig()
    check_parallel_config(cfg)
    configure_device_math(info.device)
    modules = list(modules)
    if not frozen and cfg.sync_batchnorm:
        sync_batchnorm_(modules, info)
    for m in modules:
        blocks = _blocks(m)
        for blk in blocks:
            if cfg.activation_checkpointing and not frozen:
                apply_activation_checkpointing(blk)
            if cfg.compile:
                compile_block(blk, compile_backend)
        if cfg.compile and not blocks:  # a head: one unit, compiled whole (its FSDP2 hooks stay eager around it)
            compile_block(m, compile_backend)
    compute = DTYPES[cfg.param_dtype]
    if not info.distributed:
        if compute != torch.float32:
            for m in modules:
                apply_autocast(m, info.device.type, compute)
        log.info("compute dtype %s (%s, one process, %s modules)", cfg.param_dtype,
                 "autocast" if compute != torch.float32 else "no mixed precision", "frozen" if frozen else "trained")
        return cfg.param_dtype
    if info.world_size == 1 and compute != torch.float32 and ONE_RANK_MIRROR:
        # One rank: nothing to shard or gather; FSDP2 would still cast and copy every parameter per unshard.
        from .mirror import apply_mirror

        for m in modules:
            apply_mirror(m, compute, _AUTOCAST_METHODS)
        log.info("compute dtype %s (one rank: fp32 masters, %s copy cast per forward, no FSDP2), %s modules",
                 cfg.param_dtype, cfg.param_dtype, "frozen" if frozen else "trained")
        return cfg.param_dtype
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = device_mesh(info)
    backbone_reduce, head_reduce = reduce_dtypes(cfg)
    # One rank: the shard is the whole parameter, so resharding after forward frees nothing and costs a second
    # unshard in backward (a cast and a copy per parameter); the official recipe's SHARD_GRAD_OP keeps them too.
    reshard = True if frozen else (cfg.reshard_after_forward and info.world_size > 1)
    for m in modules:
        blocks = _blocks(m)
        # Per part, as DINOv2's config: a backbone's gradients (the bulk of the bytes) in ``reduce_dtype``, a
        # head's (no wrap units) in ``head_reduce_dtype``. The sharded gradients stay fp32 either way.
        reduce = DTYPES[backbone_reduce if blocks else head_reduce]
        # Only the root casts its inputs: a block's activations are already in the compute dtype, and its other
        # float inputs keep theirs (DINOv3's RoPE tables in ``model.rope_dtype``, which a cast would override).
        mp_block = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce, cast_forward_inputs=False)
        for blk in blocks:
            fully_shard(blk, mesh=mesh, mp_policy=mp_block, reshard_after_forward=reshard)
        fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce),
                    reshard_after_forward=reshard)
    log.info("compute dtype %s (FSDP2 mixed precision over %d ranks, reduce backbones %s / heads %s, %s)",
             cfg.param_dtype, info.world_size, backbone_reduce, head_reduce,
             "frozen" if frozen else f"reshard_after_forward={reshard}")
    return cfg.param_dtype


__all__ = ["parallelize", "sync_batchnorm_", "apply_activation_checkpointing", "apply_autocast", "compile_block",
           "configure_device_math", "DTYPES"]
