"""Pure converters for Hugging Face transformers folders: ``DINOv3ViTModel``, ``Dinov2Model``,
``Dinov2WithRegistersModel`` (``model.safetensors`` + ``config.json``).

Keys are read as they are *on disk*: transformers >= 5 renames some of them in memory (DINOv2's
``attention.attention.query`` -> ``attention.q_proj``, DINOv3's ``layer.N`` -> ``model.layer.N``) but reads
and writes the old names in files. The in-memory names are accepted too, so a ``model.state_dict()``
saved with torch.save loads as well. The architecture comes from ``config.json`` (head count included).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from .vit_dinov3 import swiglu_hidden_aligned

_DINOV3_LAYER = re.compile(r"^(?:model\.)?layer\.(\d+)\.(.+)$")
_DINOV2_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")

# Per-layer renames: HF suffix -> dinopipe suffix (after the q/k/v and FFN packing below).
_COMMON = {
    "norm1.weight": "norm1.weight", "norm1.bias": "norm1.bias",
    "norm2.weight": "norm2.weight", "norm2.bias": "norm2.bias",
    "layer_scale1.lambda1": "ls1.gamma", "layer_scale2.lambda1": "ls2.gamma",
}


def detect_hf(sd: Mapping[str, Tensor]) -> str | None:
    """'hf_dinov3' | 'hf_dinov2' | None."""
    if not any(k.startswith("embeddings.") for k in sd):
        return None
    if any(_DINOV3_LAYER.match(k) for k in sd):
        return "hf_dinov3"
    if any(_DINOV2_LAYER.match(k) for k in sd):
        return "hf_dinov2"
    return None


def _split_layers(sd: Mapping[str, Tensor], pattern: re.Pattern) -> dict[int, dict[str, Tensor]]:
    layers: dict[int, dict[str, Tensor]] = {}
    for k, v in sd.items():
        m = pattern.match(k)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = v
    return layers


def _pack_qkv(p: Mapping[str, Tensor], names: tuple[str, str, str], mask_k: bool, cat: Callable = torch.cat
              ) -> dict[str, Tensor]:
    q, k, v = (p[f"{n}.weight"] for n in names)
    out = {"attn.qkv.weight": cat([q, k, v])}
    biases = [p.get(f"{n}.bias") for n in names]
    if any(b is not None for b in biases):
        zeros = torch.zeros(q.shape[0], dtype=q.dtype)
        if mask_k:
            biases[1] = None  # a key bias cannot change softmax over keys: dropping it is exact
        out["attn.qkv.bias"] = cat([b if b is not None else zeros for b in biases])
    return out


def _copy(p: Mapping[str, Tensor], src: str, dst: str, out: dict[str, Tensor]) -> None:
    for s in ("weight", "bias"):
        if f"{src}.{s}" in p:
            out[f"{dst}.{s}"] = p[f"{src}.{s}"]


def from_hf_dinov3(sd: Mapping[str, Tensor], cat: Callable = torch.cat) -> dict[str, Tensor]:
    """DINOv3ViTModel (disk ``layer.N.*`` or memory ``model.layer.N.*``) -> dinopipe DINOv3 layout."""
    out = {
        "cls_token": sd["embeddings.cls_token"],
        "mask_token": sd["embeddings.mask_token"].reshape(1, -1),
        "patch_embed.proj.weight": sd["embeddings.patch_embeddings.weight"],
        "norm.weight": sd["norm.weight"],
        "norm.bias": sd["norm.bias"],
    }
    if "embeddings.patch_embeddings.bias" in sd:
        out["patch_embed.proj.bias"] = sd["embeddings.patch_embeddings.bias"]
    if sd.get("embeddings.register_tokens") is not None and sd["embeddings.register_tokens"].shape[1]:
        out["storage_tokens"] = sd["embeddings.register_tokens"]
    for i, p in sorted(_split_layers(sd, _DINOV3_LAYER).items()):
        b = f"blocks.{i}."
        blk = _pack_qkv(p, ("attention.q_proj", "attention.k_proj", "attention.v_proj"), mask_k=True, cat=cat)
        _copy(p, "attention.o_proj", "attn.proj", blk)
        if "mlp.gate_proj.weight" in p:
            for s in ("weight", "bias"):
                if f"mlp.gate_proj.{s}" in p:
                    blk[f"mlp.fc1.{s}"] = cat([p[f"mlp.gate_proj.{s}"], p[f"mlp.up_proj.{s}"]])
        else:
            _copy(p, "mlp.up_proj", "mlp.fc1", blk)
        _copy(p, "mlp.down_proj", "mlp.fc2", blk)
        blk.update({dst: p[src] for src, dst in _COMMON.items() if src in p})
        out.update({b + k: v for k, v in blk.items()})
    return out


def to_hf_dinov3(sd: Mapping[str, Tensor], arch: Mapping[str, Any]) -> dict[str, Tensor]:
    """dinopipe DINOv3 -> DINOv3ViTModel keys as on disk (what ``from_pretrained`` reads)."""
    if "cls_norm.weight" in sd:
        raise ValueError("transformers' DINOv3ViTModel has one final norm; this model unties the class-token norm")
    dim = int(arch["embed_dim"])
    swiglu = str(arch.get("ffn", "mlp")).startswith("swiglu")
    cls = sd["cls_token"]
    out = {
        "embeddings.cls_token": cls,
        "embeddings.mask_token": sd["mask_token"].reshape(1, 1, -1),
        "embeddings.register_tokens": sd.get("storage_tokens", cls.new_zeros(1, 0, dim)),
        "embeddings.patch_embeddings.weight": sd["patch_embed.proj.weight"],
        "embeddings.patch_embeddings.bias": sd["patch_embed.proj.bias"],
        "norm.weight": sd["norm.weight"],
        "norm.bias": sd["norm.bias"],
    }
    for i in range(int(arch["depth"])):
        b, o = f"blocks.{i}.", f"layer.{i}."
        q, k, v = sd[b + "attn.qkv.weight"].chunk(3)
        out.update({o + "attention.q_proj.weight": q, o + "attention.k_proj.weight": k,
                    o + "attention.v_proj.weight": v})
        if b + "attn.qkv.bias" in sd:
            qb, _, vb = sd[b + "attn.qkv.bias"].chunk(3)
            out[o + "attention.q_proj.bias"], out[o + "attention.v_proj.bias"] = qb, vb
        out[o + "attention.o_proj.weight"] = sd[b + "attn.proj.weight"]
        out[o + "attention.o_proj.bias"] = sd.get(b + "attn.proj.bias", cls.new_zeros(dim))
        for n in (1, 2):
            out[o + f"norm{n}.weight"], out[o + f"norm{n}.bias"] = sd[b + f"norm{n}.weight"], sd[b + f"norm{n}.bias"]
            out[o + f"layer_scale{n}.lambda1"] = sd.get(f"{b}ls{n}.gamma", cls.new_ones(dim))
        fc1w, fc1b = sd[b + "mlp.fc1.weight"], sd.get(b + "mlp.fc1.bias")
        if swiglu:
            names = ("gate_proj", "up_proj")
            for n, w in zip(names, fc1w.chunk(2)):
                out[o + f"mlp.{n}.weight"] = w
            for n, bias in zip(names, (fc1b.chunk(2) if fc1b is not None else ())):
                out[o + f"mlp.{n}.bias"] = bias
        else:
            out[o + "mlp.up_proj.weight"] = fc1w
            if fc1b is not None:
                out[o + "mlp.up_proj.bias"] = fc1b
        out[o + "mlp.down_proj.weight"] = sd[b + "mlp.fc2.weight"]
        if b + "mlp.fc2.bias" in sd:
            out[o + "mlp.down_proj.bias"] = sd[b + "mlp.fc2.bias"]
    return out


def hf_dinov3_config(arch: Mapping[str, Any], ffn_hidden: int) -> dict[str, Any]:
    """``config.json`` for ``DINOv3ViTConfig`` from dinopipe arch kwargs."""
    qkv_bias = bool(arch.get("qkv_bias", True))
    swiglu = str(arch.get("ffn", "mlp")).startswith("swiglu")
    return {
        "architectures": ["DINOv3ViTModel"],
        "model_type": "dinov3_vit",
        "hidden_size": int(arch["embed_dim"]),
        "intermediate_size": int(ffn_hidden),
        "num_hidden_layers": int(arch["depth"]),
        "num_attention_heads": int(arch["num_heads"]),
        "hidden_act": "silu" if swiglu else "gelu",  # the gated MLP applies hidden_act to its gate
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "layer_norm_eps": float(arch.get("norm_eps", 1e-5)),
        "rope_theta": float(arch.get("rope_base", 100.0)),
        "image_size": int(arch.get("img_size", 224)),
        "patch_size": int(arch["patch_size"]),
        "num_channels": int(arch.get("in_chans", 3)),
        "query_bias": qkv_bias,
        "key_bias": False,
        "value_bias": qkv_bias,
        "proj_bias": True,
        "mlp_bias": bool(arch.get("ffn_bias", True)),
        "layerscale_value": 1.0,
        "drop_path_rate": 0.0,
        "use_gated_mlp": swiglu,
        "num_register_tokens": int(arch.get("num_register_tokens", 4)),
        "pos_embed_shift": arch.get("rope_shift"),
        "pos_embed_jitter": arch.get("rope_jitter"),
        "pos_embed_rescale": arch.get("rope_rescale", 2.0),
        "torch_dtype": "float32",
    }


# Config fields that do not change what the backbone computes at inference (bookkeeping, training-only
# settings, output selection); every other field is either honoured below or refused, naming it.
_HF_NEUTRAL = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "initializer_range",
    "drop_path_rate", "hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "layerscale_value",
    "use_mask_token", "out_features", "out_indices", "stage_names", "apply_layernorm", "reshape_hidden_states",
    "pos_embed_shift", "pos_embed_jitter", "pos_embed_rescale", "id2label", "label2id", "_name_or_path",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_return_dict", "name_or_path",
    "_attn_implementation_autoset", "tie_word_embeddings", "chunk_size_feed_forward", "problem_type",
}
_HF_DINOV3_READ = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
                   "layer_norm_eps", "rope_theta", "image_size", "patch_size", "num_channels", "query_bias",
                   "key_bias", "value_bias", "proj_bias", "mlp_bias", "use_gated_mlp", "num_register_tokens"}
_HF_DINOV2_READ = {"hidden_size", "num_hidden_layers", "num_attention_heads", "mlp_ratio", "hidden_act",
                   "layer_norm_eps", "image_size", "patch_size", "num_channels", "qkv_bias", "use_swiglu_ffn",
                   "num_register_tokens"}


def _refuse_unknown(cfg: Mapping[str, Any], read: set[str]) -> None:
    """A field the reader does not know might change the features: an error naming it, not a silent default."""
    unknown = sorted(k for k in cfg if k not in read and k not in _HF_NEUTRAL and not k.startswith("_"))
    if unknown:
        raise ValueError(f"config.json: field(s) {unknown} are not understood by dinopipe's reader; it will not "
                         f"guess what they change (remove them if they do not affect the backbone)")


def arch_from_hf_dinov3_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    _refuse_unknown(cfg, _HF_DINOV3_READ)
    dim, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    gated = bool(cfg.get("use_gated_mlp", False))
    if gated:
        ratio = inter * 1.5 / dim
        align = next((a for a in (8, 32, 64, 128) if swiglu_hidden_aligned(int(dim * ratio), a) == inter), None)
        if align is None:
            raise ValueError(f"config.json: intermediate_size {inter} follows no DINOv3 SwiGLU alignment for {dim}")
        ffn = "swiglu" if align == 8 else f"swiglu{align}"
    else:
        ratio, ffn = inter / dim, "mlp"
    if cfg.get("hidden_act", "gelu") not in ("gelu", "silu") or (cfg.get("hidden_act", "gelu") == "silu") != gated:
        raise ValueError(f"config.json: hidden_act '{cfg.get('hidden_act')}' with use_gated_mlp={gated} is not a DINOv3 FFN")
    patch = cfg.get("patch_size", 16)
    size = cfg.get("image_size", 224)
    return dict(
        family="dinov3",
        img_size=int(size[0] if isinstance(size, (list, tuple)) else size),
        patch_size=int(patch[0] if isinstance(patch, (list, tuple)) else patch),
        in_chans=int(cfg.get("num_channels", 3)),
        embed_dim=dim,
        depth=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]),
        mlp_ratio=ratio,
        ffn=ffn,
        num_register_tokens=int(cfg.get("num_register_tokens", 0)),
        init_values=1.0,
        # A key bias adds one constant per query to all its logits (softmax ignores it): with or without one,
        # the reader drops it exactly, and a query- or value-only bias is the packed bias with zeros.
        qkv_bias=bool(cfg.get("query_bias", True) or cfg.get("value_bias", True) or cfg.get("key_bias", False)),
        mask_k_bias=True,
        proj_bias=bool(cfg.get("proj_bias", True)),
        ffn_bias=bool(cfg.get("mlp_bias", True)),
        norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
        rope_base=float(cfg.get("rope_theta", 100.0)),
        rope_shift=cfg.get("pos_embed_shift"),
        rope_jitter=cfg.get("pos_embed_jitter"),
        rope_rescale=cfg.get("pos_embed_rescale"),
    )


def from_hf_dinov2(sd: Mapping[str, Tensor], cat: Callable = torch.cat) -> dict[str, Tensor]:
    """Dinov2Model / Dinov2WithRegistersModel (disk or transformers >= 5 memory names) -> canonical DINOv2."""
    out = {
        "cls_token": sd["embeddings.cls_token"],
        "mask_token": sd["embeddings.mask_token"].reshape(1, -1),
        "pos_embed": sd["embeddings.position_embeddings"],
        "patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": sd["layernorm.weight"],
        "norm.bias": sd["layernorm.bias"],
    }
    if "embeddings.register_tokens" in sd:
        out["register_tokens"] = sd["embeddings.register_tokens"]
    for i, p in sorted(_split_layers(sd, _DINOV2_LAYER).items()):
        disk = "attention.attention.query.weight" in p
        qkv = (("attention.attention.query", "attention.attention.key", "attention.attention.value") if disk
               else ("attention.q_proj", "attention.k_proj", "attention.v_proj"))
        blk = _pack_qkv(p, qkv, mask_k=False, cat=cat)
        _copy(p, "attention.output.dense" if disk else "attention.o_proj", "attn.proj", blk)
        if "mlp.weights_in.weight" in p:  # SwiGLU on disk: weights_in = [w1; w2] already packed
            _copy(p, "mlp.weights_in", "mlp.fc1", blk)
            _copy(p, "mlp.weights_out", "mlp.fc2", blk)
        elif "mlp.gate_proj.weight" in p:
            for s in ("weight", "bias"):
                if f"mlp.gate_proj.{s}" in p:
                    blk[f"mlp.fc1.{s}"] = cat([p[f"mlp.gate_proj.{s}"], p[f"mlp.up_proj.{s}"]])
            _copy(p, "mlp.down_proj", "mlp.fc2", blk)
        else:
            _copy(p, "mlp.fc1", "mlp.fc1", blk)
            _copy(p, "mlp.fc2", "mlp.fc2", blk)
        blk.update({dst: p[src] for src, dst in _COMMON.items() if src in p})
        out.update({f"blocks.{i}.{k}": v for k, v in blk.items()})
    return out


def arch_from_hf_dinov2_config(cfg: Mapping[str, Any], sd: Mapping[str, Tensor]) -> dict[str, Any]:
    _refuse_unknown(cfg, _HF_DINOV2_READ)
    swiglu = bool(cfg.get("use_swiglu_ffn", False))
    act = cfg.get("hidden_act", "gelu")
    if not swiglu and act != "gelu":  # HF's SwiGLU FFN applies SiLU whatever hidden_act says
        raise ValueError(f"config.json: hidden_act '{act}' is not supported (dinopipe's DINOv2 MLP is exact GELU, "
                         f"as every DINOv2 release)")
    eps = float(cfg.get("layer_norm_eps", 1e-6))
    if eps != 1e-6:
        raise ValueError(f"config.json: layer_norm_eps {eps} is not supported (dinopipe's DINOv2 uses 1e-6, as "
                         f"every DINOv2 release)")
    ratio = float(cfg.get("mlp_ratio", 4))
    if not swiglu and "blocks.0.mlp.fc1.weight" in sd and sd["blocks.0.mlp.fc1.weight"].shape[0] != int(
            int(cfg["hidden_size"]) * ratio):
        raise ValueError(f"config.json: mlp_ratio {ratio} does not match the weights' FFN width "
                         f"{sd['blocks.0.mlp.fc1.weight'].shape[0]}")
    reg = int(cfg.get("num_register_tokens", 0)) if cfg.get("model_type") == "dinov2_with_registers" else 0
    n_pos = sd["pos_embed"].shape[1] - 1
    patch = int(cfg.get("patch_size", 14))
    return dict(
        img_size=int(round(n_pos**0.5)) * patch,
        patch_size=patch,
        in_chans=int(cfg.get("num_channels", 3)),
        embed_dim=int(cfg["hidden_size"]),
        depth=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]),
        mlp_ratio=ratio,
        ffn="swiglu" if swiglu else "mlp",
        num_register_tokens=reg,
        init_values=1.0,
        qkv_bias=bool(cfg.get("qkv_bias", True)),
    )  # HF Dinov2 always has the output-projection and FFN biases (and a layer scale): the defaults


__all__ = ["detect_hf", "from_hf_dinov3", "to_hf_dinov3", "hf_dinov3_config", "arch_from_hf_dinov3_config",
           "from_hf_dinov2", "arch_from_hf_dinov2_config"]
