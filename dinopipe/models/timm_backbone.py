"""Any timm model as a distillation student (``timm:convnext_tiny``, ``timm:resnet50``, ...), behind the
interface dinopipe's ViTs have: ``forward_features`` returning DINOv2's keys, ``forward_features_list`` for the
crop list, ``forward`` giving the global embedding, ``arch_config`` so exports rebuild it.

The global feature (``x_norm_clstoken``) is timm's own pooled pre-logits feature (``forward_head(...,
pre_logits=True)``: global average pool, plus ConvNeXt's head norm); the dense features
(``x_norm_patchtokens``) are the last feature map flattened row-major, one token per ``patch_size`` (the
network's total stride, e.g. 32) pixels, with its (h, w) in ``patch_grid``. There are no register tokens and
no mask token (CNN students see unmasked crops; DINOv3 distils into ConvNeXt the same way).

Random init only (``pretrained=False``): nothing is downloaded. Model code: no torch.distributed, no .cuda().
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

PREFIX = "timm:"


def is_timm_name(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def timm_name_error(name: str) -> Optional[str]:
    """None if ``timm:NAME`` names a timm architecture, else a message saying what to do."""
    import timm

    arch = name[len(PREFIX):]
    if not arch:
        return f"'{name}' names no timm model (write e.g. timm:convnext_tiny or timm:resnet50)"
    if not timm.is_model(arch):
        near = timm.list_models(f"*{arch.split('_')[0]}*")[:8]
        return (f"timm has no model '{arch}'" + (f" (similar: {', '.join(near)})" if near else "")
                + "; python -c \"import timm; print(timm.list_models('convnext*'))\" lists the names")
    return None


class TimmBackbone(nn.Module):
    """A timm model (``self.model``, timm's own parameter names below it) as a dinopipe backbone."""

    num_register_tokens = 0
    input_multiple = 1
    """Any input size works (a ViT needs multiples of its patch size); evals use the size they are given."""

    def __init__(self, model: str, img_size: int = 224, in_chans: int = 3, drop_path_rate: float = 0.0,
                 model_args: Optional[dict] = None) -> None:
        super().__init__()
        import timm

        self.model_name, self.img_size, self.in_chans = model, int(img_size), int(in_chans)
        self.model_args = dict(model_args or {})
        kwargs: dict[str, Any] = dict(self.model_args, pretrained=False, num_classes=0, in_chans=in_chans)
        if drop_path_rate:
            kwargs["drop_path_rate"] = drop_path_rate
        self.model = timm.create_model(model, **kwargs)
        self.embed_dim = int(self.model.num_features)
        info = getattr(self.model, "feature_info", None) or [{"reduction": 32, "module": ""}]
        self.patch_size = int(info[-1]["reduction"])
        """Pixels per output token (the total stride): what a ViT's patch size is to its patch tokens."""
        self._units = [m["module"] for m in info if m.get("module")]
        self._drop_path_rate = float(drop_path_rate)

    def arch_config(self) -> dict[str, Any]:
        """What ``build_vit(**arch)`` (family ``timm``) needs to rebuild this model."""
        return {"family": "timm", "model": self.model_name, "img_size": self.img_size, "in_chans": self.in_chans,
                "embed_dim": self.embed_dim, "patch_size": self.patch_size, "num_register_tokens": 0,
                "model_args": dict(self.model_args), "drop_path_rate": self._drop_path_rate}

    def shard_units(self) -> list[nn.Module]:
        """The stages (timm's ``feature_info`` modules that hold parameters): FSDP2, activation checkpointing
        and compile treat each as a ViT block; the stem and head stay with the root."""
        mods = [self.model.get_submodule(n) for n in self._units]
        return [m for m in mods if any(True for _ in m.parameters())]

    def forward_features(self, x: Tensor, masks: Optional[Tensor] = None) -> dict[str, Any]:
        if masks is not None:
            raise ValueError("a timm student has no mask token: it sees unmasked crops (feature distillation)")
        fmap = self.model.forward_features(x)  # (B, C, h, w)
        pooled = self.model.forward_head(fmap, pre_logits=True)  # (B, C)
        B, C, h, w = fmap.shape
        return {
            "x_norm_clstoken": pooled,
            "x_norm_regtokens": pooled.new_zeros(B, 0, C),
            "x_norm_patchtokens": fmap.flatten(2).transpose(1, 2),  # (B, h*w, C)
            "x_prenorm": None,
            "masks": None,
            "patch_grid": (h, w),  # no int(): traced, that would pin the graph to one size
        }

    def forward_features_list(self, xs: list[Tensor], masks_list: Optional[list] = None) -> list[dict[str, Any]]:
        return [self.forward_features(x) for x in xs]

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_features(x)["x_norm_clstoken"]

    @torch.no_grad()
    def timm_state_dict(self) -> dict[str, Tensor]:
        """timm's own keys (``self.model``'s), as ``timm.create_model(NAME)`` loads them."""
        return dict(self.model.state_dict())


def create_timm_backbone(name: str, img_size: int = 224, in_chans: int = 3, drop_path_rate: float = 0.0,
                         **ignored: Any) -> TimmBackbone:
    """``timm:NAME`` -> a randomly initialised :class:`TimmBackbone` (ViT-only overrides are ignored)."""
    err = timm_name_error(name)
    if err:
        raise ValueError(err)
    model = TimmBackbone(name[len(PREFIX):], img_size=img_size, in_chans=in_chans, drop_path_rate=drop_path_rate)
    model.variant = name
    return model


def from_timm_keys(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """A state dict with timm's keys (a timm folder) or dinopipe's (``model.`` prefix) -> dinopipe's."""
    if sd and all(k.startswith("model.") for k in sd):
        return sd
    return {f"model.{k}": v for k, v in sd.items()}


__all__ = ["TimmBackbone", "create_timm_backbone", "is_timm_name", "timm_name_error", "from_timm_keys", "PREFIX"]
