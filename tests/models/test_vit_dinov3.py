"""DINOv3 backbone: features equal transformers' DINOv3ViTModel and timm's Eva DINOv3 models (two independent
implementations) on random weights; registry sizes equal the released parameter counts; RoPE, storage tokens,
the masked key bias, untied norms, packed multi-crop and efficient stochastic depth behave as DINOv3's."""

from __future__ import annotations

import math

import pytest
import timm
import torch
from timm.layers import GluMlp, Mlp

from dinopipe.models import create_model, list_models, model_defaults
from dinopipe.models.convert_dinov3 import timm_dinov3_model_args, to_timm_dinov3
from dinopipe.models.convert_hf import hf_dinov3_config, to_hf_dinov3
from dinopipe.models.rope import RopeEmbedding, patch_coords, rope_periods, rope_qkv
from dinopipe.models.vit_dinov3 import swiglu_hidden_aligned

OUT_KEYS = {"x_norm_clstoken", "x_norm_regtokens", "x_norm_patchtokens", "x_prenorm", "masks"}
PARITY_TOL = 1e-4


def randomised(name: str, **kw):
    """A test model with every parameter random, LayerScale near 1 and a nonzero (masked) key bias, so every
    block, bias and token counts in the comparison."""
    torch.manual_seed(0)
    model = create_model(name, **kw).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            centre = 1.0 if n.endswith("gamma") or ("norm" in n and n.endswith("weight")) else 0.0
            p.copy_(centre + 0.1 * torch.randn_like(p))
    return model


def images(b, h, w, seed=0):
    return torch.randn(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


def all_tokens(out: dict) -> torch.Tensor:
    return torch.cat([out["x_norm_clstoken"][:, None], out["x_norm_regtokens"], out["x_norm_patchtokens"]], 1)


def hf_twin(model):
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    arch = model.arch_config()
    cfg = hf_dinov3_config(arch, model.blocks[0].mlp.fc2.in_features)
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf = DINOv3ViTModel(DINOv3ViTConfig(**cfg)).eval()
    # transformers >= 5 holds the layers under "model." in memory; the converter writes the on-disk names.
    sd = {("model." + k if k.startswith("layer.") else k): v for k, v in to_hf_dinov3(model.state_dict(), arch).items()}
    hf.load_state_dict(sd, strict=True)
    return hf


def timm_twin(model):
    arch = model.arch_config()
    name, args = timm_dinov3_model_args(arch, model.blocks[0].mlp.fc2.in_features)
    t = timm.create_model(name, **args).eval()
    t.load_state_dict(to_timm_dinov3(model.state_dict(), arch), strict=True)
    return t


@pytest.mark.parametrize("name", ["vit_test_dinov3", "vit_test_dinov3_swiglu"], ids=["mlp", "swiglu"])
def test_features_equal_transformers_and_timm(name):
    model = randomised(name)
    hf, tm = hf_twin(model), timm_twin(model)
    diffs = {}
    for h, w in [(224, 224), (160, 288)]:
        x = images(2, h, w)
        with torch.no_grad():
            ours = model.forward_features(x)
            ref_hf = hf(pixel_values=x)
            ref_timm = tm.forward_features(x)
            cls_timm = tm(x)  # global_pool='token': the CLS embedding
        diffs[f"hf {h}x{w}"] = (all_tokens(ours) - ref_hf.last_hidden_state).abs().max().item()
        diffs[f"timm {h}x{w}"] = (all_tokens(ours) - ref_timm).abs().max().item()
        torch.testing.assert_close(model(x), ref_hf.pooler_output, atol=PARITY_TOL, rtol=0)
        torch.testing.assert_close(model(x), cls_timm, atol=PARITY_TOL, rtol=0)
    print(name, {k: f"{v:.1e}" for k, v in diffs.items()})
    assert max(diffs.values()) <= PARITY_TOL, diffs
    # The comparison can fail: the same weights with another RoPE base give other features.
    other = create_model(name, rope_base=10.0).eval()
    other.load_state_dict(model.state_dict())
    x = images(2, 224, 224)
    with torch.no_grad():
        assert (other(x) - model(x)).abs().max() > 1e-2


# Official builders (facebookresearch/dinov3 hub/backbones.py) -> parameter counts of the released backbones:
# the paper's 21M / 29M / 86M / 0.3B / 0.84B / 6.7B, exactly (qkv bias incl. its masked key third, mask token,
# the 7B's local-crop class norm). timm leaves out those three, so it counts exactly that much less.
RELEASED = {
    "vit_s16_dinov3": (21_601_152, 1536),
    "vit_s16plus_dinov3": (28_697_472, 1536),
    "vit_b16_dinov3": (85_669_632, 3072),
    "vit_l16_dinov3": (303_154_176, 4096),
    "vit_l16plus_dinov3": (403_915_776, 4096),
    "vit_h16plus_dinov3": (840_633_600, 5120),
    "vit_7b16_dinov3": (6_716_043_264, 8192),
}
TIMM = {"vit_s16_dinov3": "vit_small_patch16_dinov3_qkvb", "vit_h16plus_dinov3": "vit_huge_plus_patch16_dinov3_qkvb",
        "vit_7b16_dinov3": "vit_7b_patch16_dinov3"}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_sizes_on_meta_device(name):
    with torch.device("meta"):
        model = create_model(name)
    count, hidden = RELEASED[name]
    assert sum(p.numel() for p in model.parameters()) == count
    assert model.blocks[0].mlp.fc2.in_features == hidden
    assert model.patch_size == 16 and model.num_register_tokens == 4
    assert model.blocks[0].norm1.eps == 1e-5
    if name in TIMM:
        with torch.device("meta"):
            ref = timm.create_model(TIMM[name], num_classes=0)
        d, depth = model.embed_dim, model.n_blocks
        masked_k = d * depth if model.blocks[0].attn.qkv.bias is not None else 0
        local_norm = 2 * d if model.local_cls_norm is not None else 0
        assert count == sum(p.numel() for p in ref.parameters()) + d + masked_k + local_norm


def test_swiglu_alignment():
    assert swiglu_hidden_aligned(int(4096 * 3), 64) == 8192  # 7B
    assert swiglu_hidden_aligned(int(384 * 6), 8) == 1536  # S+
    assert swiglu_hidden_aligned(300, 8) == 200 and swiglu_hidden_aligned(300, 64) == 256
    assert model_defaults("vit_7b16_dinov3")["ffn"] == "swiglu64"


def test_rope_tables_follow_dinov3():
    hd = 32
    # Periods base^(2i / (hd/2)) for i < hd/4: written out as DINOv3 defines them.
    want = torch.tensor([100.0 ** (2 * i / (hd // 2)) for i in range(hd // 4)])
    torch.testing.assert_close(rope_periods(hd, 100.0), want)
    c = patch_coords(2, 4)
    assert c.shape == (8, 2)
    torch.testing.assert_close(c[:4, 0], torch.full((4,), -0.5))  # row centres of 2 rows: -0.5, 0.5
    torch.testing.assert_close(c[:4, 1], torch.tensor([-0.75, -0.25, 0.25, 0.75]))  # per-axis normalisation
    rope = RopeEmbedding(hd, rescale=2.0, shift=0.1, jitter=1.5).eval()
    s1, _ = rope(3, 5)
    s2, _ = rope(3, 5)
    assert s1.shape == (15, hd) and torch.equal(s1, s2)  # eval: no augmentation
    rope.train()
    assert not torch.equal(rope(3, 5)[0], s1)  # training: coordinates augmented


def test_rope_rotates_patch_tokens_only():
    b, r, hw, heads, hd = 2, 5, 6, 2, 8
    qkv = torch.randn(b * (r + hw), 3 * heads * hd)
    sin, cos = RopeEmbedding(hd)(2, 3)
    out = rope_qkv(qkv, [(b, r + hw)], [(sin, cos)], heads).view(b, r + hw, 3, heads, hd)
    ref = qkv.view(b, r + hw, 3, heads, hd)
    torch.testing.assert_close(out[:, :r], ref[:, :r], rtol=0, atol=0)  # class + storage tokens untouched
    torch.testing.assert_close(out[:, :, 2], ref[:, :, 2], rtol=0, atol=0)  # values untouched
    assert not torch.allclose(out[:, r:, :2], ref[:, r:, :2])
    # A rotation: norms of q and k per head are preserved.
    torch.testing.assert_close(out[:, r:, :2].norm(dim=-1), ref[:, r:, :2].norm(dim=-1))


def test_masked_key_bias_has_no_effect_and_no_gradient():
    model = randomised("vit_test_dinov3")
    x = images(2, 32, 48)
    with torch.no_grad():
        before = model(x)
        for blk in model.blocks:
            d = model.embed_dim
            blk.attn.qkv.bias[d:2 * d] += 10.0
        torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    model.train()
    model(x).square().sum().backward()
    g = model.blocks[0].attn.qkv.bias.grad
    d = model.embed_dim
    assert g[d:2 * d].abs().max() == 0 and g[:d].abs().max() > 0


def test_rescale_augmentation_only_in_training():
    model = randomised("vit_test_dinov3")  # rope_rescale=2 as released
    x = images(2, 64, 64)
    with torch.no_grad():
        assert torch.equal(model(x), model(x))
        model.train()
        torch.manual_seed(1)
        a = model(x)
        torch.manual_seed(2)
        assert not torch.allclose(a, model(x))


@pytest.mark.parametrize("name", ["vit_test_dinov3", "vit_test_dinov3_swiglu"])
def test_output_contract_masks_and_intermediate_layers(name):
    model = randomised(name)
    assert type(model.blocks[0].mlp) is (GluMlp if "swiglu" in name else Mlp)
    x = images(2, 48, 80)  # 3 x 5 patches
    masks = torch.zeros(2, 15, dtype=torch.bool)
    masks[0, [1, 7]] = True
    with torch.no_grad():
        out = model.forward_features(x, masks=masks)
        assert set(out) == OUT_KEYS and out["masks"] is masks
        assert out["x_norm_regtokens"].shape == (2, 4, 64) and out["x_norm_patchtokens"].shape == (2, 15, 64)
        assert out["x_prenorm"].shape == (2, 1 + 4 + 15, 64)
        plain = model.forward_features(x)
        assert not torch.allclose(out["x_norm_clstoken"], plain["x_norm_clstoken"])
        layers = model.get_intermediate_layers(x, n=2, reshape=True, return_class_token=True)
        assert len(layers) == 2 and layers[-1][0].shape == (2, 64, 3, 5)
        torch.testing.assert_close(layers[-1][1], plain["x_norm_clstoken"])
        torch.testing.assert_close(layers[-1][0].flatten(2).transpose(1, 2), plain["x_norm_patchtokens"])


def test_packed_multicrop_equals_separate_forwards_with_rope_per_group():
    model = randomised("vit_test_dinov3")
    g, l = images(2, 64, 64, 1), images(3, 32, 48, 2)
    with torch.no_grad():
        packed = model.forward_features([g, l])
        for x, o in zip((g, l), packed):
            sep = model.forward_features(x)
            torch.testing.assert_close(o["x_prenorm"], sep["x_prenorm"], atol=1e-5, rtol=1e-5)


def test_efficient_drop_path_multicrop_trains():
    model = create_model("vit_test_dinov3", drop_path_rate=0.5).train()
    assert model.blocks[0].drop_path_rate == 0.5 and model.blocks[-1].drop_path_rate == 0.5  # uniform, as DINOv3
    outs = model.forward_features([images(4, 64, 64), images(4, 32, 32)], [torch.rand(4, 16) > 0.5, None])
    loss = sum(o["x_norm_patchtokens"].square().mean() + o["x_norm_clstoken"].square().mean() for o in outs)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() > 0


def test_untied_norms():
    model = randomised("vit_test_dinov3", untie_global_and_local_cls_norm=True, untie_cls_and_patch_norms=True)
    with torch.no_grad():
        model.local_cls_norm.weight.mul_(3.0)
        model.cls_norm.weight.mul_(2.0)
    g, l = images(2, 64, 64), images(2, 32, 32)
    with torch.no_grad():
        model.train()
        tr = model.forward_features([g, l])
        model.eval()
        ev = model.forward_features([g, l])
        r = 5
        torch.testing.assert_close(ev[1]["x_norm_clstoken"], model.cls_norm(ev[1]["x_prenorm"][:, :r])[:, 0])
        torch.testing.assert_close(ev[1]["x_norm_patchtokens"], model.norm(ev[1]["x_prenorm"][:, r:]))
        # training: local crops (the second group) use local_cls_norm for their class token
        torch.testing.assert_close(tr[1]["x_norm_clstoken"], model.local_cls_norm(tr[1]["x_prenorm"][:, :r])[:, 0])
        torch.testing.assert_close(tr[0]["x_norm_clstoken"], model.cls_norm(tr[0]["x_prenorm"][:, :r])[:, 0])


def test_registry_lists_dinov3_names():
    names = set(list_models())
    assert set(RELEASED) | {"vit_test_dinov3", "vit_test_dinov3_swiglu"} <= names
    for n in RELEASED:
        d = model_defaults(n)
        assert d["family"] == "dinov3" and d["patch_size"] == 16 and d["num_register_tokens"] == 4
        assert (d["embed_dim"] // d["num_heads"]) % 4 == 0 and math.isfinite(d["mlp_ratio"])


def test_rope_augmentation_drawn_per_block_and_group_in_training():
    """dinov3 ``models/vision_transformer.py:229-231`` calls ``rope_embed`` inside the block loop, one call per crop
    group: in training each block sees its own shift / jitter / rescale draw. Rebuilt here by hand from the same
    RNG stream (block-major, group-minor) and compared; in eval one table serves every block."""
    model = randomised("vit_test_dinov3", rope_shift=0.1, rope_jitter=1.3).train()
    g, l = images(2, 64, 64, 1), images(3, 32, 48, 2)
    calls = []
    orig = model.rope_embed.forward
    model.rope_embed.forward = lambda h, w, device=None: calls.append((h, w)) or orig(h, w, device)
    with torch.no_grad():
        torch.manual_seed(5)
        packed = model.forward_features([g, l])
        assert calls == [(4, 4), (2, 3)] * len(model.blocks)
        torch.manual_seed(5)
        prepared = [model.prepare_tokens_with_masks(x) for x in (g, l)]
        xs = [t for t, _ in prepared]
        tables = []
        for blk in model.blocks:
            ropes = [orig(h, w) for _, (h, w) in prepared]
            tables.append(ropes[0][0])
            xs = blk(xs, rope=ropes)
        assert not torch.equal(tables[0], tables[1])  # a new draw per block
        for o, x in zip(packed, xs):
            torch.testing.assert_close(o["x_prenorm"], x, atol=0, rtol=0)
        calls.clear()
        model.eval()
        model.forward_features([g, l])
        assert calls == [(4, 4), (2, 3)]  # eval: no augmentation, one table per group for all blocks


def test_bf16_rope_is_a_training_setting():
    """``rope_dtype=bf16`` (the official trainer's RoPE): tables in bf16, q/k rotated in bf16, the result cast back;
    exports rebuild the released models' fp32 RoPE (arch_config leaves it out)."""
    model = randomised("vit_test_dinov3", rope_dtype="bf16")
    sin, cos = model.rope_embed(3, 5)
    assert sin.dtype == cos.dtype == torch.bfloat16
    ref = randomised("vit_test_dinov3")
    x = images(2, 48, 80)
    with torch.no_grad():
        a, b = model(x), ref(x)
    assert a.dtype == torch.float32 and 0 < (a - b).abs().max() < 0.05 * b.abs().max()
    assert "rope_dtype" not in model.arch_config()
    with pytest.raises(ValueError, match="rope dtype"):
        create_model("vit_test_dinov3", rope_dtype="fp16")
