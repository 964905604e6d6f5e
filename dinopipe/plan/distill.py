"""``dinopipe plan`` of a distillation config: every student (a registry ViT or any ``timm:NAME``) and the frozen
teacher built on the meta device (no memory, no weights), with their parameter counts, the model state per GPU
under FSDP2 full sharding and the forward FLOPs of one global crop (``torch.utils.flop_counter`` on meta
tensors, so a timm CNN is counted as exactly as a ViT).

Model state per student: fp32 parameters, fp32 gradients, AdamW ``exp_avg`` + ``exp_avg_sq`` and the EMA copy
(params only), each sharded over the GPUs (dim 0, padded, as FSDP2); the teacher: fp32 parameters only. Trained
modules are the backbone plus, in feature mode, the two projections to the teacher's width, in ssl mode new
heads shaped like the teacher's (read from the heads file's header, no tensor loaded). Activations are not
modelled for distillation (the pretraining planner's activation model is a ViT's); measure them with a short
run at the configured batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..config import ConfigError
from ..models import build_vit, create_model, is_timm_name, list_models
from ..ssl.base import build_head, head_config
from ..ssl.distill import create_student
from ..ssl.distill_config import DistillConfig, resolve_mode
from .analytic import GiB, sharded_numel


def _numel(module: nn.Module, gpus: int) -> tuple[int, int]:
    """(all parameters, this GPU's shard of them)."""
    shapes = [tuple(p.shape) for p in module.parameters()]
    return sum(p.numel() for p in module.parameters()), sum(sharded_numel(s, gpus) for s in shapes)


def _forward_flops(model: nn.Module, channels: int, size: int) -> int:
    with FlopCounterMode(display=False) as fc:
        model.forward_features(torch.empty(1, channels, size, size, device="meta"))
    return int(fc.get_total_flops())


def _teacher(cfg: DistillConfig) -> nn.Module:
    """The teacher on meta: a registry name, or the architecture its file records (metadata, or a memory-mapped
    read of a bare weights file; nothing is loaded)."""
    from .. import hub

    path = str(cfg.teacher_model.path)
    try:
        if path in list_models() and not Path(path).exists():
            with torch.device("meta"):
                return create_model(path)
        arch = hub.backbone_arch(path, num_heads=cfg.teacher_model.num_heads)
    except (hub.CheckpointError, OSError) as exc:
        raise ConfigError(f"teacher_model.path: {exc} (to plan before the teacher exists, name its registry "
                          f"variant, e.g. teacher_model.path=vit_g14)") from None
    with torch.device("meta"):
        return build_vit(**arch)


def _teacher_heads(cfg: DistillConfig) -> dict[str, dict]:
    """The teacher run's DINO / iBOT head shapes as meta tensors, from the heads file's header ({} if none)."""
    from safetensors import safe_open

    from ..hub import _heads_file  # where a run / export keeps heads.safetensors

    path = Path(str(cfg.teacher_model.path))
    f = _heads_file(path) if path.is_dir() else None
    if f is None:  # a bare backbone, or a DCP checkpoint folder (its heads are read; they are small next to it)
        from ..hub import load_heads

        return load_heads(path) if path.is_dir() else {}
    heads: dict[str, dict] = {}
    with safe_open(str(f), framework="pt") as sf:
        for key in sf.keys():
            name, _, rest = key.partition(".")
            heads.setdefault(name, {})[rest] = torch.empty(sf.get_slice(key).get_shape(), device="meta")
    return heads


def plan_distill(cfg: DistillConfig, gpus: int, gpu_mem_gb: float) -> dict:
    """Per-student parameters, state bytes per GPU and forward FLOPs at the first phase's global crop size."""
    if gpus < 1 or gpu_mem_gb <= 0:
        raise ValueError("need gpus >= 1 and gpu_mem_gb > 0")
    teacher = _teacher(cfg)
    t_dim = int(teacher.embed_dim)
    heads = _teacher_heads(cfg)
    mode = resolve_mode(cfg, has_heads="dino_head" in heads)
    size = int(cfg.phases[0].global_crops_size)
    channels = int(cfg.data.channels)
    t_all, t_local = _numel(teacher, gpus)
    students = []
    for s in cfg.students:
        with torch.device("meta"):
            bb = create_student(s.model)
            if mode == "ssl":
                extra = nn.ModuleDict({n: build_head(bb.embed_dim, head_config(sd)) for n, sd in heads.items()})
            else:
                extra = nn.ModuleDict({"proj_cls": nn.Linear(bb.embed_dim, t_dim),
                                       "proj_patch": nn.Linear(bb.embed_dim, t_dim)})
        b_all, b_local = _numel(bb, gpus)
        e_all, e_local = _numel(extra, gpus)
        local = (b_local + e_local) * 4  # fp32
        state = {"params": local, "grads": local, "optimizer": 2 * local, "ema": local}
        state["total"] = sum(state.values())
        students.append({"name": s.name, "model": str(s.model.name), "kind": "timm" if is_timm_name(s.model.name)
                         else "vit", "backbone_params": b_all, "trained_extra_params": e_all,
                         "embed_dim": int(bb.embed_dim), "state": state,
                         "forward_flops_per_global_crop": _forward_flops(bb, channels, size)})
    total = sum(s["state"]["total"] for s in students) + t_local * 4
    return {"mode": mode, "gpus": gpus, "gpu_mem_gb": gpu_mem_gb, "global_crops_size": size, "channels": channels,
            "teacher": {"path": str(cfg.teacher_model.path), "params": t_all, "embed_dim": t_dim,
                        "state": t_local * 4, "forward_flops_per_global_crop": _forward_flops(teacher, channels, size)},
            "students": students, "state_total": total}


def format_distill_report(r: dict) -> str:
    gb = lambda b: f"{b / GiB:.3f}"  # noqa: E731
    t = r["teacher"]
    lines = [f"dinopipe plan (distill, mode {r['mode']}): {len(r['students'])} student(s) on {r['gpus']} GPU(s) x "
             f"{r['gpu_mem_gb']:g} GiB{', FSDP2 full sharding' if r['gpus'] > 1 else ''}",
             f"teacher {t['path']}: {t['params'] / 1e6:.1f}M params, width {t['embed_dim']}, frozen fp32 "
             f"{gb(t['state'])} GiB/GPU, {t['forward_flops_per_global_crop'] / 1e9:.2f} GFLOP per "
             f"{r['global_crops_size']} px crop", "",
             f"  {'student':12s} {'model':22s} {'backbone':>9s} {'+ trained':>9s} {'GFLOP/crop':>10s} "
             f"{'params':>7s} {'grads':>7s} {'AdamW':>7s} {'EMA':>7s} {'state GiB/GPU':>13s}"]
    for s in r["students"]:
        st = s["state"]
        lines.append(f"  {s['name']:12s} {s['model']:22s} {s['backbone_params'] / 1e6:8.1f}M "
                     f"{s['trained_extra_params'] / 1e6:8.2f}M {s['forward_flops_per_global_crop'] / 1e9:10.2f} "
                     f"{gb(st['params']):>7s} {gb(st['grads']):>7s} {gb(st['optimizer']):>7s} {gb(st['ema']):>7s} "
                     f"{gb(st['total']):>13s}")
    lines += ["", f"model state per GPU, all students + teacher: {gb(r['state_total'])} GiB "
              "(activations are not modelled for distillation: measure a short run at the configured batch)"]
    return "\n".join(lines)


def is_distill_config(path: Optional[str]) -> bool:
    """A YAML with a ``students`` or ``teacher_model`` section is a distillation config."""
    if not path:
        return False
    from omegaconf import OmegaConf

    try:
        raw = OmegaConf.load(path)
    except Exception:  # unreadable: load_config reports it with the pretraining schema's message
        return False
    return hasattr(raw, "keys") and any(k in raw for k in ("students", "teacher_model"))


__all__ = ["plan_distill", "format_distill_report", "is_distill_config"]
