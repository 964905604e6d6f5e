"""Pure converters for DINOv3 checkpoints: official release <-> dinopipe <-> timm ``vit_*_patch16_dinov3``.

dinopipe's DINOv3 layout (vit_dinov3.py) is the official one except for the FFN, which uses timm's names as
the DINOv2 models do: official ``mlp.w1``/``mlp.w2``/``mlp.w3`` (SwiGLU) become ``mlp.fc1`` = [w1; w2] and
``mlp.fc2`` = w3; ``rope_embed.periods`` (a buffer that is a function of the head dim and base) and
``attn.qkv.bias_mask`` (the masked key bias) are not stored but read back as architecture: the periods give
the head dim (4 x their count) and the RoPE base, the mask tells ``mask_k_bias``.

timm (``timm/models/eva.py``) names the storage tokens ``reg_token``, LayerScale ``gamma_1/2``, splits the
qkv bias into ``q_bias``/``v_bias`` (no key bias) and SwiGLU's first layer into ``fc1_g`` (gate) and ``fc1_x``.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

from .rope import base_from_periods, rope_periods
from .vit_dinov3 import swiglu_hidden_aligned

# Head counts of the released widths (the 7B's heads are 128-dim, the others 64-dim).
RELEASED_HEADS = {384: 6, 768: 12, 1024: 16, 1280: 20, 4096: 32}
_BLOCK = re.compile(r"blocks\.(\d+)\.")


def is_dinov3(sd: Mapping[str, Tensor]) -> bool:
    """Official or dinopipe DINOv3 layout: storage tokens / RoPE periods, or a class token without pos_embed."""
    if "reg_token" in sd or any(".gamma_1" in k for k in sd):
        return False
    return ("storage_tokens" in sd or "rope_embed.periods" in sd
            or ("cls_token" in sd and "pos_embed" not in sd))


def is_timm_dinov3(sd: Mapping[str, Tensor]) -> bool:
    return "cls_token" in sd and "pos_embed" not in sd and ("reg_token" in sd or any(".gamma_1" in k for k in sd))


def _mask_token(sd: Mapping[str, Tensor]) -> Tensor:
    cls = sd["cls_token"]
    return torch.zeros(1, cls.shape[-1], dtype=cls.dtype)


def from_official_dinov3(sd: Mapping[str, Tensor], cat: Callable = torch.cat
                         ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Official DINOv3 backbone -> (dinopipe state dict, architecture hints read off the buffers). ``cat``
    packs tensors along dim 0 (``dinopipe.utils.lazy_rows.lazy_cat``: rows read only when asked for)."""
    out, hints = {}, {}
    for k, v in sd.items():
        if k == "rope_embed.periods":
            hints["head_dim"], hints["rope_base"] = 4 * v.numel(), round(base_from_periods(v), 6)
            continue
        if k.endswith("attn.qkv.bias_mask"):
            hints["mask_k_bias"] = True
            continue
        m = re.match(r"(blocks\.\d+\.mlp\.)w([123])\.(weight|bias)$", k)
        if m:
            if m.group(2) == "3":
                out[f"{m.group(1)}fc2.{m.group(3)}"] = v
            elif m.group(2) == "1":  # w1 (gated by SiLU) first, then w2: timm GluMlp's packed fc1
                out[f"{m.group(1)}fc1.{m.group(3)}"] = cat([v, sd[f"{m.group(1)}w2.{m.group(3)}"]])
            continue
        out[k] = v
    for k, v in list(out.items()):
        # The masked key bias never reaches the logits (and official init leaves it NaN-masked): store zeros.
        if k.endswith("attn.qkv.bias") and hints.get("mask_k_bias"):
            d = v.shape[0] // 3
            out[k] = cat([v[:d], torch.zeros_like(v[d:2 * d]), v[2 * d:]])
    out.setdefault("mask_token", _mask_token(out))
    if out["mask_token"].dim() == 3:
        out["mask_token"] = out["mask_token"].reshape(1, -1)
    return out, hints


def to_official_dinov3(sd: Mapping[str, Tensor], arch: Mapping[str, Any]) -> dict[str, Tensor]:
    """dinopipe DINOv3 -> the layout ``dinov3.hub.backbones.dinov3_*(weights=PATH)`` loads with strict=True."""
    swiglu = str(arch.get("ffn", "mlp")).startswith("swiglu")
    out = {}
    for k, v in sd.items():
        m = re.match(r"(blocks\.\d+\.mlp\.)fc([12])\.(weight|bias)$", k)
        if m and swiglu:
            if m.group(2) == "1":
                w1, w2 = v.chunk(2)
                out[f"{m.group(1)}w1.{m.group(3)}"], out[f"{m.group(1)}w2.{m.group(3)}"] = w1, w2
            else:
                out[f"{m.group(1)}w3.{m.group(3)}"] = v
            continue
        out[k] = v
        if k.endswith("attn.qkv.bias") and arch.get("mask_k_bias", True):
            mask = torch.ones_like(v)
            d = v.shape[0] // 3
            mask[d:2 * d] = 0
            out[k[: -len("bias")] + "bias_mask"] = mask
    head_dim = int(arch["embed_dim"]) // int(arch["num_heads"])
    out["rope_embed.periods"] = rope_periods(head_dim, float(arch.get("rope_base", 100.0)))
    return out


def from_timm_dinov3(sd: Mapping[str, Tensor], cat: Callable = torch.cat) -> dict[str, Tensor]:
    out = {}
    for k, v in sd.items():
        if k.startswith(("head.", "fc_norm.", "rope.")):
            continue
        if k == "reg_token":
            out["storage_tokens"] = v
            continue
        if k.endswith(("attn.q_bias", "attn.v_bias")):
            continue
        m = re.match(r"(blocks\.\d+\.mlp\.)fc1_([gx])\.(weight|bias)$", k)
        if m:
            if m.group(2) == "g":
                out[f"{m.group(1)}fc1.{m.group(3)}"] = cat([v, sd[f"{m.group(1)}fc1_x.{m.group(3)}"]])
            continue
        out[k.replace(".gamma_1", ".ls1.gamma").replace(".gamma_2", ".ls2.gamma")] = v
    for k, q in sd.items():
        if k.endswith("attn.q_bias"):
            out[k.replace("q_bias", "qkv.bias")] = cat([q, torch.zeros_like(q), sd[k.replace("q_bias", "v_bias")]])
    out["mask_token"] = _mask_token(out)
    return out


def to_timm_dinov3(sd: Mapping[str, Tensor], arch: Mapping[str, Any]) -> dict[str, Tensor]:
    """dinopipe DINOv3 -> timm Eva ``vit_*_patch16_dinov3[_qkvb]``. The key bias is dropped: with a fixed
    query, it adds one constant to all of that query's logits, which softmax ignores."""
    if "cls_norm.weight" in sd:
        raise ValueError("timm's DINOv3 models have one final norm; this model unties the class-token norm")
    swiglu = str(arch.get("ffn", "mlp")).startswith("swiglu")
    out = {}
    for k, v in sd.items():
        if k in ("mask_token",) or k.startswith("local_cls_norm."):  # pretraining-only parameters
            continue
        if k == "storage_tokens":
            out["reg_token"] = v
            continue
        if k.endswith("attn.qkv.bias"):
            q, _, vb = v.chunk(3)
            out[k.replace("qkv.bias", "q_bias")], out[k.replace("qkv.bias", "v_bias")] = q, vb
            continue
        m = re.match(r"(blocks\.\d+\.mlp\.)fc1\.(weight|bias)$", k)
        if m and swiglu:
            g, x = v.chunk(2)
            out[f"{m.group(1)}fc1_g.{m.group(2)}"], out[f"{m.group(1)}fc1_x.{m.group(2)}"] = g, x
            continue
        out[k.replace(".ls1.gamma", ".gamma_1").replace(".ls2.gamma", ".gamma_2")] = v
    return out


def timm_dinov3_model_args(arch: Mapping[str, Any], ffn_hidden: int) -> tuple[str, dict[str, Any]]:
    """(timm architecture name, model_args) that rebuild ``arch`` as timm's Eva DINOv3 model."""
    if float(arch.get("norm_eps", 1e-5)) != 1e-5:
        raise ValueError("timm's DINOv3 models fix LayerNorm eps at 1e-5")
    swiglu = str(arch.get("ffn", "mlp")).startswith("swiglu")
    qkvb = bool(arch.get("qkv_bias", True))
    name = ("vit_small_plus_patch16_dinov3" if swiglu else "vit_small_patch16_dinov3") + ("_qkvb" if qkvb else "")
    dim = int(arch["embed_dim"])
    args = dict(
        img_size=int(arch.get("img_size", 224)),
        patch_size=int(arch["patch_size"]),
        in_chans=int(arch.get("in_chans", 3)),
        embed_dim=dim,
        depth=int(arch["depth"]),
        num_heads=int(arch["num_heads"]),
        # timm takes int(dim * ratio) as the hidden width (per SwiGLU branch), already aligned here.
        mlp_ratio=(ffn_hidden + 0.5) / dim,
        init_values=1e-5 if arch.get("init_values") else None,
        num_reg_tokens=int(arch.get("num_register_tokens", 4)),
        rope_temperature=float(arch.get("rope_base", 100.0)),
        num_classes=0,
        global_pool="token",
    )
    return name, args


def infer_arch_dinov3(sd: Mapping[str, Tensor], num_heads: Optional[int] = None,
                      hints: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """``build_vit`` kwargs of a dinopipe-layout DINOv3 state dict (shapes + hints from the buffers)."""
    hints = dict(hints or {})
    w = sd["patch_embed.proj.weight"]  # (D, C, p, p)
    dim, in_chans, patch = w.shape[0], w.shape[1], w.shape[-1]
    depth = 1 + max(int(m.group(1)) for k in sd if (m := _BLOCK.match(k)))
    fc1_out, hidden = sd["blocks.0.mlp.fc1.weight"].shape[0], sd["blocks.0.mlp.fc2.weight"].shape[1]
    if fc1_out == 2 * hidden:
        ratio = hidden * 1.5 / dim
        align = next((a for a in (8, 32, 64, 128) if swiglu_hidden_aligned(int(dim * ratio), a) == hidden), None)
        if align is None:
            raise ValueError(f"SwiGLU width {hidden} for dim {dim} follows no DINOv3 alignment rule")
        ffn = "swiglu" if align == 8 else f"swiglu{align}"
    else:
        ffn, ratio = "mlp", fc1_out / dim
    if num_heads is None:
        num_heads = dim // hints["head_dim"] if "head_dim" in hints else RELEASED_HEADS.get(dim)
    if num_heads is None:
        raise ValueError(f"the file does not record its attention head count (no rope_embed.periods) and embed dim "
                         f"{dim} is no released DINOv3 width ({sorted(RELEASED_HEADS)}): pass num_heads")
    if dim % num_heads or (dim // num_heads) % 4:
        raise ValueError(f"embed dim {dim} with {num_heads} heads: RoPE needs a head dim divisible by 4; "
                         f"pass num_heads explicitly")
    has_qkv_bias = "blocks.0.attn.qkv.bias" in sd
    return dict(
        family="dinov3",
        img_size=224,
        patch_size=patch,
        in_chans=in_chans,
        embed_dim=dim,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=ratio,
        ffn=ffn,
        num_register_tokens=sd["storage_tokens"].shape[1] if "storage_tokens" in sd else 0,
        init_values=1.0 if "blocks.0.ls1.gamma" in sd else None,  # value is overwritten by the weights
        qkv_bias=has_qkv_bias,
        mask_k_bias=bool(hints.get("mask_k_bias", has_qkv_bias)),
        proj_bias="blocks.0.attn.proj.bias" in sd,
        ffn_bias="blocks.0.mlp.fc1.bias" in sd,
        rope_base=float(hints.get("rope_base", 100.0)),
        untie_cls_and_patch_norms="cls_norm.weight" in sd,
        untie_global_and_local_cls_norm="local_cls_norm.weight" in sd,
    )


__all__ = ["is_dinov3", "is_timm_dinov3", "from_official_dinov3", "to_official_dinov3", "from_timm_dinov3",
           "to_timm_dinov3", "timm_dinov3_model_args", "infer_arch_dinov3", "RELEASED_HEADS"]
