"""Pure checkpoint converters: foreign state dicts <-> dinopipe's canonical layout.

Canonical layout = the official DINOv2 layout with timm's FFN names (``mlp.fc1``/``mlp.fc2`` for both MLP
and SwiGLU). Sources are detected by their keys:

- official DINOv2 hub / training files: ``register_tokens``, ``mask_token``, SwiGLU ``mlp.w12``/``mlp.w3``,
  chunked ``blocks.CHUNK.N.*`` (FSDP block chunks), ``backbone.``/``teacher.``/``student.``/``module.``
  prefixes, training dicts wrapping the weights (``{"teacher": {...}}``, ``{"model": {...}}``);
- timm DINOv2 (``vit_*_dinov2``): no ``mask_token``; with registers ``reg_token`` and a class-free
  ``pos_embed`` whose class position was folded into ``cls_token``;
- dinopipe's own (canonical);
- DINOv3 (official, timm ``vit_*_patch16_dinov3``) in convert_dinov3.py, Hugging Face folders (Dinov2,
  Dinov2WithRegisters, DINOv3ViT) in convert_hf.py; ``convert_checkpoint`` dispatches to all of them.

Architecture is inferred from tensor shapes (``infer_arch``); the head count cannot be, so it is taken from the
released models (64-dim heads at the released widths 384 / 768 / 1024 / 1536) and otherwise must be given: the
reader refuses to guess. dinopipe's own exports record the whole architecture. Nothing here touches files or
devices.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

from .block import swiglu_hidden
from .convert_dinov3 import from_official_dinov3, from_timm_dinov3, infer_arch_dinov3, is_dinov3, is_timm_dinov3
from .convert_hf import arch_from_hf_dinov2_config, arch_from_hf_dinov3_config, detect_hf, from_hf_dinov2, from_hf_dinov3

# Head counts of the released DINOv2 widths (all 64-dim heads): the only widths whose head count is known.
RELEASED_DINOV2_HEADS = {384: 6, 768: 12, 1024: 16, 1536: 24}
_WRAPPER_KEYS = ("teacher", "model", "state_dict", "model_state_dict", "module", "student")
_PREFIXES = ("module.", "_orig_mod.", "teacher.", "student.", "model.", "backbone.", "encoder.")
_HEAD_PREFIXES = ("dino_head.", "ibot_head.", "head.", "dino_loss.", "ibot_patch_loss.")
_CHUNKED = re.compile(r"^blocks\.\d+\.(\d+)\.")


def unwrap_state_dict(obj: Any) -> dict[str, Tensor]:
    """Find the backbone tensors inside a checkpoint object (nested training dicts, prefixes)."""
    while isinstance(obj, Mapping) and not any(isinstance(v, Tensor) for v in obj.values()):
        inner = next((obj[k] for k in _WRAPPER_KEYS if isinstance(obj.get(k), Mapping)), None)
        if inner is None:
            raise ValueError(f"no state dict found in checkpoint (top-level keys: {sorted(obj)[:10]})")
        obj = inner
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected a state dict, got {type(obj).__name__}")
    sd = {k: v for k, v in obj.items() if isinstance(v, Tensor)}
    # Strip wrapper prefixes repeatedly (e.g. 'module.teacher.backbone.'); keep only backbone keys.
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if any(k.startswith(p) for k in sd):
                if p in ("teacher.", "student.", "backbone.") or all(k.startswith(p) for k in sd):
                    sd = {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}
                    changed = True
    return {k: v for k, v in sd.items() if not k.startswith(_HEAD_PREFIXES)}


def detect_format(sd: Mapping[str, Tensor]) -> str:
    """'hf_dinov2' | 'hf_dinov3' | 'timm_dinov3' | 'dinov3' | 'timm' | 'dinov2' | 'dinopipe' from the key
    names of an unwrapped state dict ('dinov3' covers the official release and dinopipe's DINOv3 layout)."""
    hf = detect_hf(sd)
    if hf:
        return hf
    if is_timm_dinov3(sd):
        return "timm_dinov3"
    if is_dinov3(sd):
        return "dinov3"
    if "reg_token" in sd or ("cls_token" in sd and "mask_token" not in sd):
        return "timm"
    if any(".mlp.w12." in k or _CHUNKED.match(k) for k in sd):
        return "dinov2"
    if "cls_token" in sd and "pos_embed" in sd:
        return "dinopipe"  # plain DINOv2 MLP files are identical to the canonical layout
    raise ValueError("unrecognised checkpoint: no cls_token/pos_embed keys (is this a ViT backbone?)")


def from_dinov2(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for k, v in sd.items():
        k = _CHUNKED.sub(r"blocks.\1.", k)  # blocks.CHUNK.N.* -> blocks.N.* (N is already global)
        k = k.replace(".mlp.w12.", ".mlp.fc1.").replace(".mlp.w3.", ".mlp.fc2.")
        out[k] = v
    return out


def from_timm(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out = {k: v for k, v in sd.items() if not k.startswith(("head.", "fc_norm."))}
    if "reg_token" in out:
        # timm keeps no class position for register models; a zero one with the folded cls token is exact,
        # because the class position is never interpolated.
        out["register_tokens"] = out.pop("reg_token")
        pe = out["pos_embed"]
        out["pos_embed"] = torch.cat([torch.zeros_like(pe[:, :1]), pe], dim=1)
    out.setdefault("mask_token", torch.zeros(1, out["cls_token"].shape[-1], dtype=out["cls_token"].dtype))
    return out


def _convert(sd: Mapping[str, Tensor], fmt: str, cat: Callable = torch.cat
             ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(canonical state dict, architecture hints the source's buffers give) for a detected format."""
    if fmt == "hf_dinov3":
        return from_hf_dinov3(sd, cat=cat), {}
    if fmt == "hf_dinov2":
        return from_hf_dinov2(sd, cat=cat), {}
    if fmt == "timm_dinov3":
        return from_timm_dinov3(sd, cat=cat), {}
    if fmt == "dinov3":
        return from_official_dinov3(sd, cat=cat)
    if fmt == "timm":
        return from_timm(sd), {}
    if fmt == "dinov2":
        return from_dinov2(sd), {}
    return dict(sd), {}


def convert_checkpoint(obj: Any, num_heads: Optional[int] = None,
                       hf_config: Optional[Mapping[str, Any]] = None, cat: Callable = torch.cat
                       ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Any supported checkpoint object -> (canonical state dict, ``build_vit`` kwargs inferred for it).

    ``hf_config`` (a Hugging Face ``config.json``) gives the exact architecture of HF weights. ``cat`` packs
    tensors (q/k/v, SwiGLU halves) along dim 0: ``torch.cat``, or ``dinopipe.utils.lazy_rows.lazy_cat`` so that
    nothing is copied until a slice is read (``dinopipe.load``: each rank reads only its shard).
    """
    sd = unwrap_state_dict(obj)
    fmt = detect_format(sd)
    sd, hints = _convert(sd, fmt, cat=cat)
    if hf_config and fmt == "hf_dinov3":
        return sd, arch_from_hf_dinov3_config(hf_config)
    if hf_config and fmt == "hf_dinov2":
        return sd, arch_from_hf_dinov2_config(hf_config, sd)
    if is_dinov3(sd):
        return sd, infer_arch_dinov3(sd, num_heads, hints)
    return sd, infer_arch(sd, num_heads=num_heads)


def to_canonical(obj: Any) -> dict[str, Tensor]:
    """Any supported checkpoint object -> canonical backbone state dict."""
    sd = unwrap_state_dict(obj)
    return _convert(sd, detect_format(sd))[0]


def to_dinov2(sd: Mapping[str, Tensor], ffn: str) -> dict[str, Tensor]:
    """Canonical -> the official DINOv2 hub layout (what ``torch.hub.load('facebookresearch/dinov2')`` loads)."""
    if ffn != "swiglu":
        return dict(sd)
    return {k.replace(".mlp.fc1.", ".mlp.w12.").replace(".mlp.fc2.", ".mlp.w3."): v for k, v in sd.items()}


def to_timm(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Canonical -> timm ``vit_*_dinov2`` layout (same conversion timm applies to DINOv2 files)."""
    out = {k: v for k, v in sd.items() if k != "mask_token"}
    if "register_tokens" in out:
        out["reg_token"] = out.pop("register_tokens")
        pe = out.pop("pos_embed")
        out["cls_token"] = out["cls_token"] + pe[:, :1]
        out["pos_embed"] = pe[:, 1:]
    return out


def infer_arch(sd: Mapping[str, Tensor], num_heads: Optional[int] = None) -> dict[str, Any]:
    """Constructor kwargs for ``build_vit`` from a canonical state dict's shapes."""
    if is_dinov3(sd):
        return infer_arch_dinov3(sd, num_heads=num_heads)
    w = sd["patch_embed.proj.weight"]  # (D, C, p, p)
    dim, in_chans, patch = w.shape[0], w.shape[1], w.shape[-1]
    depth = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k)))
    n_pos = sd["pos_embed"].shape[1] - 1
    grid = int(round(n_pos**0.5))
    if grid * grid != n_pos:
        raise ValueError(f"pos_embed has {n_pos} patch positions, not a square grid")
    fc1_out = sd["blocks.0.mlp.fc1.weight"].shape[0]
    fc2_in = sd["blocks.0.mlp.fc2.weight"].shape[1]
    if fc1_out == 2 * fc2_in:
        ffn = "swiglu"
        mlp_ratio = 4.0 if swiglu_hidden(int(dim * 4.0)) == fc2_in else fc2_in * 1.5 / dim
    else:
        ffn, mlp_ratio = "mlp", fc1_out / dim
    heads = num_heads or RELEASED_DINOV2_HEADS.get(dim)
    if heads is None:
        raise ValueError(f"the file does not record its attention head count and embed dim {dim} is no released "
                         f"DINOv2 width ({sorted(RELEASED_DINOV2_HEADS)}): pass num_heads (dinopipe.load(..., "
                         f"num_heads=N), --num-heads N, model.num_heads=N)")
    if dim % heads:
        raise ValueError(f"embed dim {dim} is not divisible by num_heads {heads}; pass num_heads explicitly")
    return dict(
        img_size=grid * patch,
        patch_size=patch,
        in_chans=in_chans,
        embed_dim=dim,
        depth=depth,
        num_heads=heads,
        mlp_ratio=mlp_ratio,
        ffn=ffn,
        num_register_tokens=sd["register_tokens"].shape[1] if "register_tokens" in sd else 0,
        init_values=1.0 if "blocks.0.ls1.gamma" in sd else None,  # value is overwritten by the weights
        qkv_bias="blocks.0.attn.qkv.bias" in sd,
        proj_bias="blocks.0.attn.proj.bias" in sd,
        ffn_bias="blocks.0.mlp.fc1.bias" in sd,
    )


def timm_model_args(arch: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(timm architecture name, model_args) that rebuild ``arch`` as a timm VisionTransformer."""
    reg = int(arch.get("num_register_tokens", 0))
    swiglu = arch.get("ffn", "mlp") == "swiglu"
    name = "vit_giant_patch14" if swiglu else "vit_small_patch14"
    name += "_reg4_dinov2" if reg else "_dinov2"
    dim = int(arch["embed_dim"])
    if swiglu:
        hidden2 = 2 * swiglu_hidden(int(dim * float(arch.get("mlp_ratio", 4.0))))
        mlp_ratio = (hidden2 + 0.5) / dim  # timm takes int(dim * ratio) as the packed fc1 width
    else:
        mlp_ratio = float(arch.get("mlp_ratio", 4.0))
    args = dict(
        img_size=int(arch["img_size"]),
        patch_size=int(arch["patch_size"]),
        in_chans=int(arch.get("in_chans", 3)),
        embed_dim=dim,
        depth=int(arch["depth"]),
        num_heads=int(arch["num_heads"]),
        mlp_ratio=mlp_ratio,
        init_values=arch.get("init_values") and 1e-5,
        qkv_bias=bool(arch.get("qkv_bias", True)),
        num_classes=0,
        dynamic_img_size=True,
    )
    if reg:
        args.update(reg_tokens=reg, no_embed_class=True)
    return name, args


__all__ = [
    "unwrap_state_dict", "detect_format", "from_dinov2", "from_timm", "to_canonical", "convert_checkpoint",
    "to_dinov2", "to_timm",
    "infer_arch", "timm_model_args",
]
