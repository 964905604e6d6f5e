"""The pretraining config's cross-field checks (``validate`` and the pieces distillation shares), kept apart from
the schema (``dinopipe/ssl/config.py``, which re-exports them): each raises ``ConfigError`` naming the key,
before any process group or file exists."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import check_choices, check_parallel_config

if TYPE_CHECKING:  # annotations only: the schema imports this module
    from .config import GramConfig, KnnProbeConfig, PretrainConfig


def validate(cfg: PretrainConfig) -> None:
    """Cross-field checks the type system cannot do; raise ConfigError naming the key."""
    from ..config import ConfigError

    check_choices(cfg)  # enum fields (teacher.centering, model.attn_backend, ...) of a config built in Python
    total = sum(p.fraction for p in cfg.phases)
    if not cfg.phases or abs(total - 1.0) > 1e-6:
        raise ConfigError(f"phases: fractions must sum to 1, got {total}")
    if not cfg.data.paths:
        raise ConfigError("data.paths: give at least one image folder, file list or shard path")
    check_parallel_config(cfg.parallel)
    ratio = list(cfg.ibot.mask_ratio_min_max)
    if len(ratio) != 2 or not 0 <= ratio[0] <= ratio[1] < 1:
        raise ConfigError(f"ibot.mask_ratio_min_max: need [min, max] with 0 <= min <= max < 1, got {ratio}")
    check_ranges(cfg)
    if getattr(cfg, "knn", None) is not None:
        validate_knn(cfg.knn)
    check_channels(cfg)
    validate_continue(cfg)
    validate_sizes(cfg)
    if getattr(cfg, "gram", None) is not None:
        validate_gram(cfg.gram)
    if getattr(cfg, "model", None) is not None:  # distillation: each student's model (distill_config.py)
        check_dinov3_keys(cfg.model, "model")
    for i, student in enumerate(getattr(cfg, "students", None) or []):
        check_dinov3_keys(student.model, f"students.{i}.model")


def _need(ok: bool, key: str, msg: str) -> None:
    from ..config import ConfigError

    if not ok:
        raise ConfigError(f"{key}: {msg}")


def check_ranges(cfg: PretrainConfig) -> None:
    """Values the loop would otherwise trip over mid-run (a modulo by zero, an empty schedule, a crop scale the
    augmentation rejects), checked before anything is written. Shared with distillation."""
    t = cfg.train
    for key in ("epochs", "epoch_length", "log_every", "checkpoint_every", "keep_last", "accumulate"):
        _need(getattr(t, key) >= 1, f"train.{key}", f"must be >= 1, got {getattr(t, key)}")
    _need(t.stop_after is None or t.stop_after >= 1, "train.stop_after", f"must be >= 1 or null, got {t.stop_after}")
    _need(t.max_skipped_in_a_row >= 0, "train.max_skipped_in_a_row", f"must be >= 0, got {t.max_skipped_in_a_row}")
    _need(0 < t.max_corrupt_fraction <= 1, "train.max_corrupt_fraction",
          f"must be in (0, 1], got {t.max_corrupt_fraction}")
    _need(cfg.data.num_workers >= 0, "data.num_workers", f"must be >= 0, got {cfg.data.num_workers}")
    for i, ph in enumerate(cfg.phases):
        key = f"phases.{i}"
        _need(ph.fraction > 0, f"{key}.fraction", f"must be > 0, got {ph.fraction}")
        _need(ph.batch_size_per_gpu >= 1, f"{key}.batch_size_per_gpu", f"must be >= 1, got {ph.batch_size_per_gpu}")
        for size in ("global_crops_size", "local_crops_size"):
            _need(getattr(ph, size) >= 1, f"{key}.{size}", f"must be >= 1 px, got {getattr(ph, size)}")
        _need(ph.lr_scale > 0, f"{key}.lr_scale", f"must be > 0, got {ph.lr_scale}")
        _need(0 <= ph.warmup_fraction < 1, f"{key}.warmup_fraction", f"must be in [0, 1), got {ph.warmup_fraction}")
        _need(ph.momentum_teacher is None or 0 <= ph.momentum_teacher <= 1, f"{key}.momentum_teacher",
              f"a momentum in [0, 1] or null, got {ph.momentum_teacher}")
    names = [ph.name for ph in cfg.phases]
    _need(len(set(names)) == len(names), "phases", f"names must be distinct (metrics log them), got {names}")
    c = cfg.crops
    _need(c.local_crops_number >= 0, "crops.local_crops_number", f"must be >= 0, got {c.local_crops_number}")
    for key in ("global_crops_scale", "local_crops_scale"):
        s = list(getattr(c, key))
        _need(len(s) == 2 and 0 < s[0] <= s[1] <= 1, f"crops.{key}", f"need [min, max] with 0 < min <= max <= 1, "
              f"got {s}")
    d = cfg.dino
    _need(d.koleo_topk >= 1, "dino.koleo_topk", f"must be >= 1, got {d.koleo_topk}")
    _need(d.koleo_group_size is None or d.koleo_group_size >= 2, "dino.koleo_group_size",
          f"a group needs >= 2 images (or null: the global batch), got {d.koleo_group_size}")
    _need(d.koleo_distributed or (d.koleo_topk == 1 and d.koleo_group_size is None), "dino.koleo_distributed",
          "koleo_topk / koleo_group_size apply to the distributed KoLeo only (as DINOv3); set it true")
    _need(0 <= cfg.ibot.mask_sample_probability <= 1, "ibot.mask_sample_probability",
          f"a probability in [0, 1], got {cfg.ibot.mask_sample_probability}")
    tc = cfg.teacher
    for key in ("teacher_temp", "warmup_teacher_temp", "student_temp"):
        _need(getattr(tc, key) > 0, f"teacher.{key}", f"a temperature must be > 0, got {getattr(tc, key)}")
    for key in ("momentum_teacher", "final_momentum_teacher", "center_momentum"):
        _need(0 <= getattr(tc, key) <= 1, f"teacher.{key}", f"a momentum in [0, 1], got {getattr(tc, key)}")
    o = cfg.optim
    _need(o.base_lr >= 0, "optim.base_lr", f"must be >= 0, got {o.base_lr}")  # 0: a run that must not move
    for key in ("min_lr", "warmup_epochs", "clip_grad", "freeze_last_layer_epochs"):
        _need(getattr(o, key) >= 0, f"optim.{key}", f"must be >= 0, got {getattr(o, key)}")
    for key in ("adamw_beta1", "adamw_beta2"):
        _need(0 <= getattr(o, key) < 1, f"optim.{key}", f"must be in [0, 1), got {getattr(o, key)}")


def check_channels(cfg) -> None:
    """data.channels, its statistics and every backbone's in_chans agree (null in_chans takes data.channels)."""
    from ..config import ConfigError

    d = cfg.data
    _need(1 <= d.channels <= 16, "data.channels", f"must be 1-16, got {d.channels}")
    for key in ("mean", "std"):
        v = getattr(d, key)
        if v is None and d.channels != 3:
            raise ConfigError(f"data.{key}: {d.channels}-channel images need their own per-channel statistics; "
                              f"print them with `dinopipe channel-stats {' '.join(d.paths) or 'PATH'} "
                              f"--channels {d.channels}` and paste the line into the config")
        _need(v is None or len(v) == d.channels, f"data.{key}", f"needs {d.channels} values, got {v}")
    _need(d.std is None or all(s > 0 for s in d.std), "data.std", f"must be > 0, got {d.std}")
    _need(d.reader != "rgb" or d.channels == 3, "data.reader", f"rgb reads 3 channels; use array for {d.channels}")
    models = [("model", cfg.model)] if getattr(cfg, "model", None) is not None else []
    models += [(f"students.{i}.model", s.model) for i, s in enumerate(getattr(cfg, "students", None) or [])]
    for where, m in models:
        if getattr(m, "in_chans", None) is None:
            m.in_chans = d.channels
        _need(m.in_chans == d.channels, f"{where}.in_chans", f"{m.in_chans} but data.channels is {d.channels}")
        if getattr(m, "expand_patch_embed", "mean") == "rgb_map":
            rgb = m.rgb_channels or []
            _need(len(rgb) == 3 and len(set(rgb)) == 3 and all(0 <= c < d.channels for c in rgb),
                  f"{where}.rgb_channels", f"rgb_map needs 3 distinct channel indices in [0, {d.channels}), got "
                  f"{m.rgb_channels}")


def data_reader(data) -> str:
    """'rgb' or 'array': how the loaders decode (DataConfig.reader, null = by channel count)."""
    return str(data.reader) if data.reader is not None else ("rgb" if data.channels == 3 else "array")


def validate_continue(cfg) -> None:
    """Head warm-up and loaded heads (continued pretraining) only where they mean something."""
    from ..config import phase_steps

    t, o = cfg.train, cfg.optim
    _need(t.head_warmup_steps >= 0, "train.head_warmup_steps", f"must be >= 0, got {t.head_warmup_steps}")
    _need(o.backbone_warmup_steps >= 0, "optim.backbone_warmup_steps", f"must be >= 0, got {o.backbone_warmup_steps}")
    _need(0.0 < o.backbone_lr_mult <= 1.0, "optim.backbone_lr_mult",
          f"must be in (0, 1] (the backbone's lr relative to the heads'; freeze it with train.head_warmup_steps), "
          f"got {o.backbone_lr_mult}")
    students = getattr(cfg, "students", None)
    if students is not None:  # distillation: its teacher is frozen throughout and its students start fresh
        _need(t.head_warmup_steps == 0, "train.head_warmup_steps", "pretraining only (continued pretraining from "
              "model.pretrained); distillation has no backbone to keep")
        _need(o.backbone_warmup_steps == 0, "optim.backbone_warmup_steps", "pretraining only")
        _need(o.backbone_lr_mult == 1.0, "optim.backbone_lr_mult", "pretraining only (a distilled student starts "
              "fresh: nothing to keep)")
        for i, s in enumerate(students):
            _need(s.model.pretrained_heads is None, f"students.{i}.model.pretrained_heads",
                  "pretraining only (distillation's heads come from teacher_model.path and student_heads)")
        return
    m = cfg.model
    if t.head_warmup_steps:
        _need(bool(m.pretrained), "train.head_warmup_steps", "a head warm-up keeps a released backbone frozen: set "
              "model.pretrained (a random backbone would give the heads nothing to learn from)")
        total = phase_steps(cfg)[-1][1]
        _need(t.head_warmup_steps < total, "train.head_warmup_steps",
              f"{t.head_warmup_steps} leaves no step for the backbone (the run has {total} steps)")
    _need(not m.pretrained_heads or bool(m.pretrained), "model.pretrained_heads",
          "heads are loaded to go with a pretrained backbone: set model.pretrained too")
    _need(m.pretrained_heads != "", "model.pretrained_heads", "give auto, a path or null")
    _need(o.backbone_lr_mult == 1.0 or bool(m.pretrained), "optim.backbone_lr_mult",
          "a slower backbone keeps what a release knows: set model.pretrained (from scratch use 1.0)")


def check_dinov3_keys(model, where: str) -> None:
    """RoPE / untied-norm keys exist only on DINOv3 backbones (registry names ``*_dinov3*``); a DINOv2 model
    given one would fail deep in its constructor, so say so here, naming the key."""
    from ..config import DINOV3_KEYS, ConfigError

    if model.pretrained or "_dinov3" in model.name:
        return
    for key in DINOV3_KEYS:
        if getattr(model, key) is not None:
            raise ConfigError(f"{where}.{key}: only DINOv3 backbones (vit_*_dinov3) have it; '{model.name}' is a "
                              "DINOv2 model (learned position embedding, no RoPE)")


def validate_sizes(cfg) -> None:
    from ..config import ConfigError

    for i, ph in enumerate(cfg.phases):
        if ph.sizes and abs(sum(s.probability for s in ph.sizes) - 1.0) > 1e-6:
            raise ConfigError(f"phases.{i}.sizes: probabilities must sum to 1, got "
                              f"{[s.probability for s in ph.sizes]}")
        if any(s.probability < 0 for s in ph.sizes):
            raise ConfigError(f"phases.{i}.sizes: probabilities must be >= 0")


def validate_knn(k: KnnProbeConfig) -> None:
    """Both sets or neither, and counts that make sense (the sets' contents are read by the train layer's check)."""
    _need((k.train is None) == (k.val is None), "knn.train / knn.val", "give both (gallery and queries) or neither, "
          f"got train={k.train} val={k.val}")
    for key in ("points", "max_queries", "k"):
        _need(getattr(k, key) >= 1, f"knn.{key}", f"must be >= 1, got {getattr(k, key)}")
    _need(k.img_size is None or k.img_size >= 1, "knn.img_size", f"must be >= 1 px or null, got {k.img_size}")


def validate_gram(g: GramConfig) -> None:
    from ..config import ConfigError

    for key in ("first_step", "refresh_every", "warmup_steps"):
        if getattr(g, key) < 0:
            raise ConfigError(f"gram.{key}: must be >= 0, got {getattr(g, key)}")
    if g.max_refreshes is not None and g.max_refreshes < 0:
        raise ConfigError(f"gram.max_refreshes: must be >= 0 or null, got {g.max_refreshes}")
    if str(g.tokens_used) != "all" and g.image_level:
        raise ConfigError(f"gram.tokens_used={g.tokens_used}: selected patches form one batch-level Gram matrix; "
                          "set gram.image_level=false (as DINOv3 requires)")


__all__ = ["validate", "check_ranges", "check_channels", "data_reader", "validate_continue", "check_dinov3_keys",
           "validate_sizes", "validate_knn", "validate_gram"]
