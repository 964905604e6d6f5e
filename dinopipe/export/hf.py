"""Export a dinopipe backbone as a Hugging Face transformers DINOv2 or DINOv3 folder.

``export_hf(model, DIR)`` writes ``config.json``, ``model.safetensors`` and ``preprocessor_config.json`` so
that ``transformers.Dinov2Model.from_pretrained(DIR)`` (``Dinov2WithRegistersModel`` for register models, or
``AutoModel``) loads the backbone offline. transformers itself is not needed to export.

Weights use the key layout of the ``facebook/dinov2-*`` hub repositories, i.e. what transformers' own
``convert_dinov2_to_hf.py`` writes: ``qkv`` split into ``attention.attention.query/key/value``,
``attention.output.dense``, ``layer_scale1.lambda1``, ``mlp.fc1/fc2`` or, for SwiGLU, the packed
``mlp.weights_in`` / ``mlp.weights_out``. transformers 4.x reads it as is; 5.x renames it on load (its
checkpoint conversion mapping for Dinov2Model), so one folder serves both.

Parity: at the grid the model was built for (``img_size``) HF returns our features exactly (float32
rounding). At other sizes HF resamples position embeddings bicubically to an explicit size; for register
models that is (antialiased) what we do too, but models without registers use DINOv2's legacy rule
(``scale_factor = (h + 0.1) / M``), which maps coordinates slightly differently, so features at other
resolutions differ a little (measured in tests/test_export_hf.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from safetensors.torch import save_file
from torch import Tensor

from ..models.block import swiglu_hidden
from ..models.convert_hf import hf_dinov3_config, to_hf_dinov3
from ..utils.io import atomic_path
from ..utils.norm import IMAGENET_MEAN, IMAGENET_STD, input_norm
from .backbone import ARCH_METADATA_KEY, export_arch


def hf_config(arch: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json`` contents for ``Dinov2Config`` / ``Dinov2WithRegistersConfig`` from dinopipe arch kwargs."""
    dim, ratio = int(arch["embed_dim"]), float(arch.get("mlp_ratio", 4.0))
    swiglu = arch.get("ffn", "mlp") == "swiglu"
    if ratio != int(ratio):
        # transformers derives the FFN width from an integer mlp_ratio (its config type-checks it as int).
        raise ValueError(f"HF Dinov2 needs an integer mlp_ratio, this model has {ratio}; export it as "
                         f"--format timm or dinov2 instead")
    reg = int(arch.get("num_register_tokens", 0))
    cfg = {
        "architectures": ["Dinov2WithRegistersModel" if reg else "Dinov2Model"],
        "model_type": "dinov2_with_registers" if reg else "dinov2",
        "hidden_size": dim,
        "num_hidden_layers": int(arch["depth"]),
        "num_attention_heads": int(arch["num_heads"]),
        "mlp_ratio": int(ratio),
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "drop_path_rate": 0.0,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-6,
        "image_size": int(arch["img_size"]),
        "patch_size": int(arch["patch_size"]),
        "num_channels": int(arch.get("in_chans", 3)),
        "qkv_bias": bool(arch.get("qkv_bias", True)),
        "layerscale_value": 1.0,  # only the initial value; the trained scales are in the weights
        "use_swiglu_ffn": swiglu,
        "use_mask_token": True,
        "torch_dtype": "float32",
    }
    if reg:
        cfg["num_register_tokens"] = reg
    return cfg


def to_hf(sd: Mapping[str, Tensor], arch: Mapping[str, Any]) -> dict[str, Tensor]:
    """Canonical dinopipe state dict -> HF Dinov2 hub key layout (pure; no transformers import).

    HF always has biases on the attention output and FFN and always a layer scale: where our model has none,
    zeros / ones are written, which computes the same function.
    """
    dim = int(arch["embed_dim"])
    swiglu = arch.get("ffn", "mlp") == "swiglu"
    hf_width = 2 * swiglu_hidden(int(dim * float(arch.get("mlp_ratio", 4.0))))  # HF's hard-coded SwiGLU rule
    if swiglu and hf_width != sd["blocks.0.mlp.fc1.weight"].shape[0]:
        raise ValueError("SwiGLU width does not follow DINOv2's rule, which HF Dinov2 hard-codes")
    out = {
        "embeddings.cls_token": sd["cls_token"],
        "embeddings.mask_token": sd["mask_token"],
        "embeddings.position_embeddings": sd["pos_embed"],
        "embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        "embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        "layernorm.weight": sd["norm.weight"],
        "layernorm.bias": sd["norm.bias"],
    }
    if "register_tokens" in sd:
        out["embeddings.register_tokens"] = sd["register_tokens"]
    depth = int(arch["depth"])
    for i in range(depth):
        b, o = f"blocks.{i}.", f"encoder.layer.{i}."
        for n in ("norm1", "norm2"):
            out[o + n + ".weight"], out[o + n + ".bias"] = sd[b + n + ".weight"], sd[b + n + ".bias"]
        qkv_w = sd[b + "attn.qkv.weight"]  # (3D, D): rows are [q; k; v]
        qkv_b = sd.get(b + "attn.qkv.bias")
        for j, name in enumerate(("query", "key", "value")):
            out[o + f"attention.attention.{name}.weight"] = qkv_w[j * dim:(j + 1) * dim]
            if qkv_b is not None:
                out[o + f"attention.attention.{name}.bias"] = qkv_b[j * dim:(j + 1) * dim]
        proj_w = sd[b + "attn.proj.weight"]
        out[o + "attention.output.dense.weight"] = proj_w
        out[o + "attention.output.dense.bias"] = sd.get(b + "attn.proj.bias", proj_w.new_zeros(dim))
        for k in (1, 2):
            gamma = sd.get(f"{b}ls{k}.gamma")
            out[o + f"layer_scale{k}.lambda1"] = gamma if gamma is not None else proj_w.new_ones(dim)
        fc1, fc2 = sd[b + "mlp.fc1.weight"], sd[b + "mlp.fc2.weight"]
        names = ("weights_in", "weights_out") if swiglu else ("fc1", "fc2")  # SwiGLU fc1 = [w1; w2], as HF
        out[o + f"mlp.{names[0]}.weight"] = fc1
        out[o + f"mlp.{names[0]}.bias"] = sd.get(b + "mlp.fc1.bias", fc1.new_zeros(fc1.shape[0]))
        out[o + f"mlp.{names[1]}.weight"] = fc2
        out[o + f"mlp.{names[1]}.bias"] = sd.get(b + "mlp.fc2.bias", fc2.new_zeros(fc2.shape[0]))
    return out


def hf_preprocessor_config(img_size: int, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> dict[str, Any]:
    """What ``facebook/dinov2-*`` ship: resize the short side to 256/224 of the crop, centre crop, ImageNet norm."""
    return {
        "image_processor_type": "BitImageProcessor",
        "do_convert_rgb": len(mean) == 3,  # N-channel input is not to be made RGB
        "do_resize": True,
        "size": {"shortest_edge": int(round(img_size * 256 / 224))},
        "resample": 3,  # bicubic
        "do_center_crop": True,
        "crop_size": {"height": img_size, "width": img_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(mean),
        "image_std": list(std),
    }


def hf_dinov3_preprocessor_config(img_size: int, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> dict[str, Any]:
    """What ``facebook/dinov3-*`` ship: resize to a square (RoPE needs no fixed grid), ImageNet norm."""
    return {
        "image_processor_type": "DINOv3ViTImageProcessorFast",
        "do_resize": True,
        "size": {"height": img_size, "width": img_size},
        "resample": 2,  # bilinear
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(mean),
        "image_std": list(std),
    }


def export_hf(model, out_dir: str | Path) -> Path:
    """Folder that ``transformers.AutoModel.from_pretrained(DIR)`` loads (Dinov2Model / Dinov2WithRegistersModel,
    or DINOv3ViTModel for DINOv3 backbones, with its on-disk key names ``layer.N.*``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch = export_arch(model)
    if arch.get("family") == "dinov3":
        cfg = hf_dinov3_config(arch, int(model.blocks[0].mlp.fc2.in_features))
        sd = to_hf_dinov3(model.state_dict(), arch)
    else:
        cfg = hf_config(arch)
        sd = to_hf(model.state_dict(), arch)
    # HF refuses safetensors files without a 'format' entry in their metadata; dinopipe's arch beside it makes the
    # folder load back exactly (what config.json cannot say: norms, biases, interpolation, RoPE settings).
    with atomic_path(out / "model.safetensors") as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in sd.items()}, tmp,
                  metadata={"format": "pt", ARCH_METADATA_KEY: json.dumps(arch)})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    pre = hf_dinov3_preprocessor_config if arch.get("family") == "dinov3" else hf_preprocessor_config
    (out / "preprocessor_config.json").write_text(json.dumps(pre(cfg["image_size"], *input_norm(model)), indent=2))
    return out


__all__ = ["export_hf", "to_hf", "hf_config", "hf_preprocessor_config", "hf_dinov3_preprocessor_config"]
