"""The planner's share of DINOv3 training (``analytic.py`` calls these): the Gram teacher (a third, frozen
backbone copy: sharded fp32 state, a no-grad forward on the Gram crops, resampled targets and the (2B, N, N)
Gram matrices) and high-resolution adaptation phases, which draw one crop-size triple per batch: memory must
fit the largest triple, time follows the probability-weighted mix."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


def gram_on(cfg: Any) -> bool:
    g = getattr(cfg, "gram", None)
    return bool(g is not None and g.enabled)


def phase_variants(phase: Any) -> list[tuple[Any, float]]:
    """(a phase with one size triple, its probability) for each size a phase draws; itself for a plain one."""
    if not getattr(phase, "sizes", None):
        return [(phase, 1.0)]
    return [(dataclasses.replace(phase, global_crops_size=s.global_crops_size, local_crops_size=s.local_crops_size,
                                 gram_crops_size=s.gram_crops_size, sizes=[]), s.probability) for s in phase.sizes]


def largest_variant(phase: Any) -> Any:
    """The size triple with the most pixels (what the memory plan must fit)."""
    def pixels(p):
        return (p.global_crops_size ** 2, p.local_crops_size ** 2, (p.gram_crops_size or 0) ** 2)
    return max((v for v, _ in phase_variants(phase)), key=pixels)


def gram_size(phase: Any) -> int:
    return getattr(phase, "gram_crops_size", None) or phase.global_crops_size


def gram_state_bytes(cfg: Any, arch: Any, n_gpus: int, sharded_numel) -> int:
    """fp32 shards of the Gram teacher's backbone (no heads, no gradients, no optimizer state)."""
    if not gram_on(cfg):
        return 0
    return sum(sharded_numel(s, n_gpus) for s in arch.backbone_numels) * 4


def gram_step_memory(cfg: Any, arch: Any, phase: Any, b: int, c: int, tokens, nograd_block) -> dict[str, int]:
    """Bytes the Gram loss adds to a step at per-GPU batch b: what stays alive into the backward (fp32 targets on
    the student's grid, normalised student features, both Gram matrices and the loss's difference; none of it
    exists yet during the Gram teacher's forward) and the no-grad forward peak of the Gram teacher on its crops (its
    input images in the compute dtype and one block's working set, ``nograd_block(arch, tokens, c)``, as for the
    EMA teacher)."""
    if not gram_on(cfg):
        return {"gram_kept": 0, "gram_forward_peak": 0}
    n_s = (phase.global_crops_size // arch.patch_size) ** 2
    n_t = tokens(arch, gram_size(phase))
    kept = 2 * b * n_s * arch.dim * 4 * 2 + 3 * 2 * b * n_s * n_s * 4
    forward = nograd_block(arch, 2 * b * n_t, c) + 2 * b * 3 * gram_size(phase) ** 2 * c
    return {"gram_kept": kept, "gram_forward_peak": forward}


def gram_step_flops(cfg: Any, arch: Any, phase: Any, b: int, crop_forward_flops) -> float:
    """Gram teacher forward on 2b crops at its size, plus the two (N, N) Gram products per image and the
    student's Gram backward (2x its forward)."""
    if not gram_on(cfg):
        return 0.0
    n_s = (phase.global_crops_size // arch.patch_size) ** 2
    grams = 2 * b * 2 * n_s * n_s * arch.dim
    return crop_forward_flops(arch, gram_size(phase), None, 2 * b) + 2 * grams + 2 * grams / 2


def gram_active_flops(cfg: Any, flops: dict, start: int, end: int) -> dict:
    """Per-step FLOPs averaged over a phase's steps [start, end): the Gram teacher runs from gram.first_step."""
    if not gram_on(cfg) or not flops.get("gram") or end <= start:
        return flops
    frac = max(0, end - max(start, cfg.gram.first_step)) / (end - start)
    out = dict(flops, gram=flops["gram"] * frac)
    out["model"] = flops["model"] - flops["gram"] + out["gram"]
    out["hardware_ac"] = flops["hardware_ac"] - flops["gram"] + out["gram"]
    return out


def describe_gram(cfg: Any) -> Optional[str]:
    if not gram_on(cfg):
        return None
    g = cfg.gram
    every = f", refreshed every {g.refresh_every} steps" if g.refresh_every else ""
    most = f" (at most {g.max_refreshes} times)" if g.refresh_every and g.max_refreshes is not None else ""
    return f"Gram anchoring: frozen Gram teacher copied from the EMA teacher at step {g.first_step}{every}{most}"


__all__ = ["gram_active_flops", "gram_on", "phase_variants", "largest_variant", "gram_state_bytes", "gram_step_memory",
           "gram_step_flops", "describe_gram"]
