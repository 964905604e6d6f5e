"""Bytes one rank sends and receives through FSDP2's collectives per training step, on paper, and their ratio to
the same step with every collective in fp32 (issue 29: "weights broadcast and gradients reduced in 16-bit").

Per step and rank (each all-gather's output and each reduce-scatter's input is a whole unit, whatever W):
- all-gather, ``param_dtype``: the student's parameters in forward, again in backward when
  ``reshard_after_forward`` (every unit, roots and heads included, measured by the trace), and the EMA teacher's
  in its forward; the Gram teacher's backbone too while Gram anchoring runs;
- reduce-scatter: the student's gradients once, the backbone's in ``reduce_dtype`` and the heads' in
  ``head_reduce_dtype`` (DINOv2: the backbone in 16 bits, the heads in fp32).
``dinopipe plan --trace`` counts the same bytes on the real step and prints the same ratio.
"""

from __future__ import annotations

import math
from typing import Any

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def sharded_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements one rank holds of a parameter FSDP2 shards on dim 0 (padded to a multiple of n)."""
    if n <= 1 or not shape:
        return math.prod(shape)
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


def comm_bytes(backbone_params: int, head_params: int, param_dtype: str, reduce_dtype: str,
               head_reduce_dtype: str, reshard_after_forward: bool = True, gram: bool = False) -> dict[str, Any]:
    """{"all_gather", "reduce_scatter", "total", "fp32_total", "ratio"} per step and rank (bytes)."""
    student = backbone_params + head_params
    gathers = student * (2 if reshard_after_forward else 1) + student + (backbone_params if gram else 0)

    def total(cp: int, cb: int, ch: int) -> tuple[int, int]:
        return gathers * cp, backbone_params * cb + head_params * ch

    ag, rs = total(DTYPE_BYTES[param_dtype], DTYPE_BYTES[reduce_dtype], DTYPE_BYTES[head_reduce_dtype])
    ag32, rs32 = total(4, 4, 4)
    return {"all_gather": ag, "reduce_scatter": rs, "total": ag + rs, "fp32_total": ag32 + rs32,
            "ratio": (ag + rs) / (ag32 + rs32)}


def plan_comm(cfg: Any, arch: Any, heads: list, n_gpus: int) -> dict[str, Any]:
    """``comm_bytes`` of a pretraining config at ``n_gpus`` ranks, from the planner's shapes: each parameter as
    FSDP2 pads it (dim 0 to a multiple of W; ``pos_embed``'s dim 0 of 1 becomes W rows in every collective)."""
    from ..config import reduce_dtypes

    def padded(shapes) -> int:
        return sum(sharded_numel(tuple(s), n_gpus) * n_gpus for s in shapes)

    p = cfg.parallel
    backbone_reduce, head_reduce = reduce_dtypes(p)
    gram = getattr(cfg, "gram", None) is not None and bool(cfg.gram.enabled)
    return comm_bytes(padded(arch.backbone_numels), padded([s for h in heads for s in h.shapes]), p.param_dtype,
                      backbone_reduce, head_reduce, p.reshard_after_forward, gram)


__all__ = ["comm_bytes", "plan_comm"]
