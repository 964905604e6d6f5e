"""torch.hub entry points. Works offline with ``source="local"``; nothing is ever downloaded.

    model = torch.hub.load("/path/to/dinopipe", "dinopipe_vits14", source="local", weights="run/export/teacher")

    model = torch.hub.load("/path/to/dinopipe", "dinopipe_vitl16_dinov3", source="local",
                           weights="dinov3_vitl16_pretrain_lvd1689m-8aa4cbdd.pth")

``weights`` is anything ``dinopipe.load`` accepts (export folder, run dir, DCP checkpoint, official DINOv2 or
DINOv3 .pth, timm file, Hugging Face folder); without it the model is randomly initialised. The weights must
match the entry's architecture. The weights go through the same readers as ``dinopipe.load``: nothing in them is
unpickled, and a file that would need code to run to be read is refused (``UnsafeCheckpointError``, naming it).
"""

dependencies = ["torch", "timm", "safetensors"]


def _entry(variant: str, weights=None, **kwargs):
    from dinopipe.hub import load
    from dinopipe.models import create_model, model_defaults

    if weights is None:
        return create_model(variant, **kwargs).eval()
    model = load(weights, **kwargs)
    want = {**model_defaults(variant), **{k: v for k, v in kwargs.items() if k in ("embed_dim", "depth")}}
    got = dict(embed_dim=model.embed_dim, depth=model.n_blocks, patch_size=model.patch_size,
               num_register_tokens=model.num_register_tokens,
               family=model.arch_config().get("family", "dinov2"))
    if any(want.get(k, "dinov2") != v for k, v in got.items()):
        raise ValueError(f"weights '{weights}' hold a model with {got}, not a {variant}; use the matching entry point")
    return model


def _make(variant: str):
    def entry(weights=None, **kwargs):
        return _entry(variant, weights, **kwargs)

    # vit_s14_reg4 -> dinopipe_vits14_reg; vit_l16_dinov3 -> dinopipe_vitl16_dinov3 (DINOv3's hub names)
    entry.__name__ = "dinopipe_" + variant.replace("vit_", "vit").replace("_reg4", "_reg")
    entry.__doc__ = f"dinopipe {variant} backbone (weights=PATH to load trained weights)."
    return entry


dinopipe_vits14 = _make("vit_s14")
dinopipe_vitb14 = _make("vit_b14")
dinopipe_vitl14 = _make("vit_l14")
dinopipe_vitg14 = _make("vit_g14")
dinopipe_vits14_reg = _make("vit_s14_reg4")
dinopipe_vitb14_reg = _make("vit_b14_reg4")
dinopipe_vitl14_reg = _make("vit_l14_reg4")
dinopipe_vitg14_reg = _make("vit_g14_reg4")
dinopipe_vits16 = _make("vit_s16")
dinopipe_vitb16 = _make("vit_b16")
dinopipe_vitl16 = _make("vit_l16")
dinopipe_vit_test = _make("vit_test")
dinopipe_vit_test_reg = _make("vit_test_reg4")

# DINOv3 (RoPE, 4 storage tokens); official .pth files, timm and Hugging Face DINOv3 weights all load.
dinopipe_vits16_dinov3 = _make("vit_s16_dinov3")
dinopipe_vits16plus_dinov3 = _make("vit_s16plus_dinov3")
dinopipe_vitb16_dinov3 = _make("vit_b16_dinov3")
dinopipe_vitl16_dinov3 = _make("vit_l16_dinov3")
dinopipe_vitl16plus_dinov3 = _make("vit_l16plus_dinov3")
dinopipe_vith16plus_dinov3 = _make("vit_h16plus_dinov3")
dinopipe_vit7b16_dinov3 = _make("vit_7b16_dinov3")
dinopipe_vit_test_dinov3 = _make("vit_test_dinov3")
