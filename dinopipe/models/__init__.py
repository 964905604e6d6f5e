"""Single-device model code: DINOv2 and DINOv3 (RoPE) ViT backbones, attention backends, blocks, DINO head,
registry, converters."""

from .attention import BACKENDS, Attention
from .block import Block, SwiGLU
from .head import DINOHead
from .registry import build_vit, create_model, list_models, model_defaults, random_init_like
from .timm_backbone import TimmBackbone, is_timm_name, timm_name_error
from .vit import DinoVisionTransformer, interpolate_pos_embed
from .vit_dinov3 import DinoV3VisionTransformer

__all__ = [
    "Attention", "BACKENDS", "Block", "SwiGLU", "DINOHead", "DinoVisionTransformer", "DinoV3VisionTransformer",
    "interpolate_pos_embed",
    "build_vit", "create_model", "random_init_like", "list_models", "model_defaults", "TimmBackbone", "is_timm_name",
    "timm_name_error",
]
