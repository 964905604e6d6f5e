"""Pretraining config checks that need the model registry (so they cannot live with the dataclasses in
``ssl/config.py``, which import nothing above them): run by ``dinopipe pretrain`` before anything is written."""

from __future__ import annotations

from pathlib import Path

from ..config import ConfigError
from ..hub import CheckpointError, check_backbone_file
from ..models import list_models, model_defaults
from .knn_probe import LabelError, check_sets
from ..ssl.config import PretrainConfig
from ..ssl.config_checks import validate


def check_backbone(cfg: PretrainConfig) -> None:
    """model.name is a registry variant, and every crop tiles into its patches (the collator would otherwise
    fail on the first batch, after the run directory was written)."""
    m = cfg.model
    if m.name not in list_models():
        raise ConfigError(f"model.name: unknown model '{m.name}' (choose from {', '.join(list_models())})")
    if m.pretrained:  # the file's architecture (patch size) is checked by check_pretrained
        return
    check_crops_tile(cfg, int({**model_defaults(m.name), **m.create_kwargs()}["patch_size"]), m.name)


def check_pretrained(cfg: PretrainConfig) -> None:
    """model.pretrained exists and is a file dinopipe reads (no unpickling, sound headers), and the crops tile
    into its patches: run on every rank before the process group starts, so a wrong path is one line and exit 2
    with nothing written (it used to surface after init, with config.yaml and the pool index written)."""
    m = cfg.model
    if not m.pretrained:
        return
    try:
        try:
            arch = check_backbone_file(m.pretrained, num_heads=m.num_heads)
        except CheckpointError:
            heads = None if m.num_heads else _named_heads(m)
            if heads is None:
                raise
            arch = check_backbone_file(m.pretrained, num_heads=heads)
            m.num_heads = heads  # the task builds the backbone from the file with it (and config.yaml says so)
    except (CheckpointError, OSError) as exc:
        raise ConfigError(f"model.pretrained: {exc}") from None
    if arch.get("patch_size"):
        check_crops_tile(cfg, int(arch["patch_size"]), f"the backbone in {m.pretrained}")


def _named_heads(m) -> "int | None":
    """The head count of the architecture ``model.name`` names (with its embed_dim override), for a pretrained
    file that does not record its own (a bare state dict of a non-released width, e.g. ``model.name=vit_test``),
    when the file's width is that architecture's; None otherwise (the file's own error stands)."""
    if m.name not in list_models():
        return None
    named = {**model_defaults(m.name), **m.create_kwargs()}
    heads = named.get("num_heads")
    if not heads:
        return None
    try:
        arch = check_backbone_file(m.pretrained, num_heads=heads)
    except (CheckpointError, OSError):
        return None
    return int(heads) if int(arch.get("embed_dim", -1)) == int(named["embed_dim"]) else None


def check_crops_tile(cfg: PretrainConfig, patch: int, model: str) -> None:
    """Every crop size of every phase is a multiple of the backbone's patch size."""
    gram = getattr(cfg, "gram", None) is not None and cfg.gram.enabled
    for i, ph in enumerate(cfg.phases):
        # a high-res adaptation phase draws its sizes from phases.N.sizes; a plain phase has one set
        sets = [(f"phases.{i}.sizes.{j}", s) for j, s in enumerate(ph.sizes)] if ph.sizes else [(f"phases.{i}", ph)]
        for where, s in sets:
            sizes = [("global_crops_size", s.global_crops_size)]
            if cfg.crops.local_crops_number:
                sizes.append(("local_crops_size", s.local_crops_size))
            if gram and s.gram_crops_size:
                sizes.append(("gram_crops_size", s.gram_crops_size))
            for key, size in sizes:
                if size % patch:
                    raise ConfigError(f"{where}.{key}: {size} px is not a multiple of {model}'s patch size {patch} "
                                      f"(e.g. {max(patch, size // patch * patch)})")


def check_pretrained_heads(cfg: PretrainConfig) -> None:
    """model.pretrained_heads: the saved heads exist and fit the configured ones on the pretrained backbone's
    width, checked here so a mismatch exits 2 before the process group starts (rank 0 alone reads the files
    when the task is built; an error there would leave the other ranks waiting)."""
    from .. import hub
    from ..ssl.adapt import heads_source, read_heads

    if heads_source(cfg.model) is None:
        return
    try:
        sds = hub.load_heads(heads_source(cfg.model)) if Path(heads_source(cfg.model)).exists() else {}
        # the width of the backbone the heads go on (an export records it: no weights are read)
        dim = int(hub.backbone_arch(cfg.model.pretrained, num_heads=cfg.model.num_heads)["embed_dim"]) if sds else 0
        read_heads(cfg, lambda _: sds, dim)  # the same checks the task runs, exit 2 on a mismatch
    except CheckpointError as exc:
        raise ConfigError(f"model.pretrained_heads: {exc}") from None


def validate_pretrain(cfg: PretrainConfig) -> None:
    validate(cfg)
    check_backbone(cfg)
    check_pretrained(cfg)
    check_pretrained_heads(cfg)
    try:  # the kNN sets are read before any work, like every other input path
        check_sets(cfg)
    except LabelError as exc:
        raise ConfigError(f"knn.train / knn.val: {exc}") from None


__all__ = ["check_backbone", "check_pretrained", "check_pretrained_heads", "check_crops_tile", "validate_pretrain"]
