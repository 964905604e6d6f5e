"""Self-supervised objectives (DINO, iBOT, KoLeo), teacher centering, schedules and optimizer groups."""

from .centering import CENTERING_MODES, EMACenter, TeacherCentering, all_reduce_sum, sinkhorn_knopp
from .losses import DINOLoss, IBOTPatchLoss, KoLeoLoss, koleo_loss
from .param_groups import apply_optim_schedules, build_param_groups, param_specs, vit_lr_decay_rate
from .schedules import (
    Piece,
    Schedule,
    SSLSchedules,
    build_ssl_schedules,
    cosine_schedule,
    piecewise,
    scaled_lr,
    warmup_then_constant,
)

__all__ = [
    "CENTERING_MODES", "DINOLoss", "EMACenter", "IBOTPatchLoss", "KoLeoLoss", "Piece", "SSLSchedules",
    "Schedule", "TeacherCentering", "all_reduce_sum", "apply_optim_schedules", "build_param_groups",
    "build_ssl_schedules", "cosine_schedule", "koleo_loss", "param_specs", "piecewise",
    "scaled_lr", "sinkhorn_knopp", "vit_lr_decay_rate", "warmup_then_constant",
]
