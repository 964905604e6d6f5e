"""DinoVisionTransformer behaviour: every registry variant trains, DINOv2's output contract (keys, registers,
masks, intermediate layers), position-embedding interpolation equal to the official hub code, and packed
multi-crop forwards equal to separate ones. Tiny models and 28/56 px images keep this under a few seconds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from timm.layers import GluMlp, Mlp

from dinopipe.models import create_model, interpolate_pos_embed, list_models, model_defaults
from dinopipe.models.block import swiglu_hidden

TINY = dict(embed_dim=32, depth=2, num_heads=2)
OUT_KEYS = {"x_norm_clstoken", "x_norm_regtokens", "x_norm_patchtokens", "x_prenorm", "masks"}
TENSOR_KEYS = ("x_norm_clstoken", "x_norm_regtokens", "x_norm_patchtokens", "x_prenorm")


def tiny(name: str = "vit_test", **kw):
    torch.manual_seed(0)
    # LayerScale at its 1e-5 default makes every block a near-identity, which would hide numerical bugs in
    # attention / packing behind tolerances; gamma = 1 makes the blocks count.
    kw.setdefault("init_values", 1.0)
    return create_model(name, **kw)


def images(b: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


def random_projection_loss(*tensors: torch.Tensor) -> torch.Tensor:
    # A plain .sum() of a LayerNorm output has zero gradient w.r.t. its input; random weights do not.
    g = torch.Generator().manual_seed(1)
    return sum((t * torch.randn(t.shape, generator=g)).sum() for t in tensors)


# ---------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------
DINOV2_SIZES = {"s": (384, 12, 6, Mlp), "b": (768, 12, 12, Mlp), "l": (1024, 24, 16, Mlp), "g": (1536, 40, 24, GluMlp)}


def test_registry_holds_dinov2_variants_with_their_dims():
    names = set(list_models())
    assert {"vit_test", "vit_test_reg4"} <= names
    for size, (dim, depth, heads, _) in DINOV2_SIZES.items():
        for patch in (14, 16):
            for suffix, regs in (("", 0), ("_reg4", 4)):
                d = model_defaults(f"vit_{size}{patch}{suffix}")
                assert (d["embed_dim"], d["depth"], d["num_heads"]) == (dim, depth, heads)
                assert d["embed_dim"] // d["num_heads"] == 64
                assert d["patch_size"] == patch and d["num_register_tokens"] == regs
                assert d["ffn"] == ("swiglu" if size == "g" else "mlp")


@pytest.mark.parametrize("with_masks", [False, True], ids=["nomask", "mask"])
# DINOv3 variants (RoPE, other FFN widths) have their own version of this test in test_vit_dinov3.py.
@pytest.mark.parametrize("name", [n for n in list_models() if model_defaults(n).get("family") != "dinov3"])
def test_every_variant_forward_backward_at_tiny_size(name, with_masks):
    defaults = model_defaults(name)
    p, R = defaults["patch_size"], defaults["num_register_tokens"]
    model = tiny(name, **TINY, img_size=2 * p).train()
    assert model.patch_embed.proj.kernel_size == (p, p)
    mlp = model.blocks[0].mlp
    if defaults["ffn"] == "swiglu":
        # hidden = round_up(int(2/3 * 128), 8) = 88; fc1 packs [w1; w2]
        assert isinstance(mlp, GluMlp) and (mlp.fc1.out_features, mlp.fc2.in_features) == (176, 88)
    else:
        assert type(mlp) is Mlp and mlp.fc1.out_features == 4 * 32

    B, h, w = 2, 2, 3  # non-square and off the 2x2 pos-embed grid: interpolation is in the graph too
    masks = None
    if with_masks:
        masks = torch.zeros(B, h * w, dtype=torch.bool)
        masks[0, [0, 4]] = True
        masks[1, 2] = True
    out = model.forward_features(images(B, h * p, w * p), masks=masks)
    assert set(out) == OUT_KEYS
    assert out["x_norm_clstoken"].shape == (B, 32)
    assert out["x_norm_regtokens"].shape == (B, R, 32)
    assert out["x_norm_patchtokens"].shape == (B, h * w, 32)
    assert out["x_prenorm"].shape == (B, 1 + R + h * w, 32)

    random_projection_loss(out["x_norm_clstoken"], out["x_norm_regtokens"], out["x_norm_patchtokens"]).backward()
    no_grad = [n for n, prm in model.named_parameters() if prm.grad is None or not prm.grad.abs().sum() > 0]
    assert no_grad == ([] if with_masks else ["mask_token"])


def test_giant_uses_dinov2_swiglu_hidden_size():
    # DINOv2's SwiGLUFFNFused: hidden = round_up(int(2/3 * 4 * 1536), 8) = 4096, fused w12 is 2 * 4096 wide.
    assert swiglu_hidden(4 * 1536) == 4096
    assert swiglu_hidden(4 * 384) == 1024
    assert swiglu_hidden(4 * 32) == 88  # int(85.33) = 85, rounded up to a multiple of 8
    g = create_model("vit_g14", depth=1)  # real width, one block: cheap to build, never run
    mlp = g.blocks[0].mlp
    assert isinstance(mlp, GluMlp)
    assert (mlp.fc1.in_features, mlp.fc1.out_features) == (1536, 8192)
    assert (mlp.fc2.in_features, mlp.fc2.out_features) == (4096, 1536)
    assert g.blocks[0].attn.num_heads == 24 and g.blocks[0].attn.head_dim == 64


def test_create_model_errors_and_overrides():
    with pytest.raises(KeyError, match="vit_test.*vit_test_reg4|vit_s14"):
        create_model("vit_nonexistent")
    with pytest.raises(ValueError, match="ffn"):
        create_model("vit_test", ffn="moe")
    m = create_model("vit_s14", embed_dim=48, depth=3, num_heads=3, img_size=56)
    assert (m.embed_dim, len(m.blocks), m.blocks[0].attn.num_heads, m.pos_embed.shape[1]) == (48, 3, 3, 1 + 16)
    assert isinstance(create_model("vit_test", init_values=None).blocks[0].ls1, torch.nn.Identity)
    assert create_model("vit_test", img_size=None).pos_embed.shape[1] == 1 + 16 * 16  # None = keep default


# ---------------------------------------------------------------------------------------------------------
# Output contract
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["vit_test", "vit_test_reg4"])
def test_forward_features_keys_shapes_and_forward(name):
    model = tiny(name).eval()
    R, D = model.num_register_tokens, model.embed_dim
    x = images(3, 28, 56)
    with torch.no_grad():
        out = model.forward_features(x)
        assert set(out) == OUT_KEYS and out["masks"] is None
        assert out["x_norm_clstoken"].shape == (3, D)
        assert out["x_norm_regtokens"].shape == (3, R, D)
        assert out["x_norm_patchtokens"].shape == (3, 8, D)
        assert out["x_prenorm"].shape == (3, 1 + R + 8, D)
        normed = model.norm(out["x_prenorm"])
        torch.testing.assert_close(out["x_norm_clstoken"], normed[:, 0], atol=0, rtol=0)
        torch.testing.assert_close(out["x_norm_regtokens"], normed[:, 1 : 1 + R], atol=0, rtol=0)
        torch.testing.assert_close(out["x_norm_patchtokens"], normed[:, 1 + R :], atol=0, rtol=0)
        assert torch.equal(model(x), out["x_norm_clstoken"])
        assert set(model(x, is_training=True)) == OUT_KEYS


def test_register_tokens_sit_after_cls_without_position_embedding():
    model = tiny("vit_test_reg4")
    with torch.no_grad():
        model.register_tokens.normal_()
        x = images(2, 28, 56)
        tokens = model.prepare_tokens_with_masks(x)  # (B, 1 + 4 + 8, D)
        pos = model.interpolate_pos_encoding(28, 56)
        patches = model.patch_embed(x)
        assert tokens.shape == (2, 13, 64)
        torch.testing.assert_close(tokens[:, 0], (model.cls_token + pos[:, :1])[:, 0].expand(2, -1))
        torch.testing.assert_close(tokens[:, 1:5], model.register_tokens.expand(2, -1, -1), atol=0, rtol=0)
        torch.testing.assert_close(tokens[:, 5:], patches + pos[:, 1:])


def test_masked_patches_take_the_mask_token():
    model = tiny().eval()
    with torch.no_grad():
        model.mask_token.fill_(3.0)  # distinctive, far from any patch embedding
    x = images(2, 28, 56)  # 2 x 4 patch grid
    masks = torch.zeros(2, 8, dtype=torch.bool)
    masks[0, [1, 6]] = True  # sample 0: (row 0, col 1) and (row 1, col 2)
    masks[1, 3] = True
    with torch.no_grad():
        out = model.forward_features(x, masks=masks)
        assert out["masks"] is masks

        # Same as feeding mask_token itself as the patch embedding of the masked patches.
        def put_mask_token(module, inputs, emb):
            return torch.where(masks.unsqueeze(-1), model.mask_token.view(1, 1, -1), emb)

        handle = model.patch_embed.register_forward_hook(put_mask_token)
        ref = model.forward_features(x)
        handle.remove()
        for key in TENSOR_KEYS:
            torch.testing.assert_close(out[key], ref[key], atol=1e-6, rtol=1e-6)

        tokens = model.prepare_tokens_with_masks(x, masks)
        pos = model.interpolate_pos_encoding(28, 56)
        torch.testing.assert_close(tokens[0, 1 + 1], 3.0 + pos[0, 1 + 1])
        torch.testing.assert_close(tokens[0, 1 + 0], model.patch_embed(x)[0, 0] + pos[0, 1])

        # Pixels under a masked patch no longer matter; pixels of an unmasked patch do.
        x_masked_edit = x.clone()
        x_masked_edit[0, :, 0:14, 14:28] = 100.0
        assert torch.equal(model.forward_features(x_masked_edit, masks=masks)["x_prenorm"], out["x_prenorm"])
        x_visible_edit = x.clone()
        x_visible_edit[0, :, 0:14, 0:14] = 100.0
        edited = model.forward_features(x_visible_edit, masks=masks)["x_prenorm"]
        assert not torch.allclose(edited[0], out["x_prenorm"][0])

        # No patch masked == no masks; masking changes the output.
        none_masked = model.forward_features(x, masks=torch.zeros(2, 8, dtype=torch.bool))
        plain = model.forward_features(x)
        assert torch.equal(none_masked["x_prenorm"], plain["x_prenorm"])
        assert not torch.allclose(out["x_prenorm"], plain["x_prenorm"])


def test_non_multiple_of_patch_input_raises():
    model = tiny()
    with pytest.raises(ValueError, match="patch"):
        model.forward_features(images(1, 30, 28))
    with pytest.raises(ValueError, match="patch"):
        model.forward_features_list([images(1, 28, 28), images(1, 28, 29)])
    with pytest.raises(ValueError):
        model.forward_features_list([images(1, 28, 28), images(1, 28, 28)], [None])


@pytest.mark.parametrize("name", ["vit_test", "vit_test_reg4"])
def test_get_intermediate_layers(name):
    model = tiny(name).eval()
    R, D = model.num_register_tokens, model.embed_dim
    x = images(2, 28, 56)
    blocks_out = []
    hooks = [
        blk.register_forward_hook(lambda m, i, o: blocks_out.append(o[0] if isinstance(o, list) else o))
        for blk in model.blocks
    ]
    with torch.no_grad():
        feats = model.forward_features(x)
    for hk in hooks:
        hk.remove()
    assert len(blocks_out) == 4
    normed = [model.norm(o) for o in blocks_out]

    with torch.no_grad():
        last2 = model.get_intermediate_layers(x, n=2)
        assert isinstance(last2, tuple) and len(last2) == 2
        for got, i in zip(last2, (2, 3)):
            assert got.shape == (2, 8, D)
            torch.testing.assert_close(got, normed[i][:, 1 + R :])
        torch.testing.assert_close(last2[-1], feats["x_norm_patchtokens"])

        picked = model.get_intermediate_layers(x, n=[0, 2])
        torch.testing.assert_close(picked[0], normed[0][:, 1 + R :])
        torch.testing.assert_close(picked[1], normed[2][:, 1 + R :])

        raw = model.get_intermediate_layers(x, n=1, norm=False)
        torch.testing.assert_close(raw[0], feats["x_prenorm"][:, 1 + R :])

        with_cls = model.get_intermediate_layers(x, n=[1, 3], return_class_token=True)
        assert len(with_cls) == 2 and all(len(pair) == 2 for pair in with_cls)
        torch.testing.assert_close(with_cls[0][1], normed[1][:, 0])
        torch.testing.assert_close(with_cls[1][0], feats["x_norm_patchtokens"])
        torch.testing.assert_close(with_cls[1][1], feats["x_norm_clstoken"])

        maps = model.get_intermediate_layers(x, n=1, reshape=True)
        assert maps[0].shape == (2, D, 2, 4)  # (B, D, h, w) for a 28 x 56 input
        for r in range(2):
            for c in range(4):  # row-major patch order
                torch.testing.assert_close(maps[0][:, :, r, c], last2[-1][:, r * 4 + c])
        maps_cls = model.get_intermediate_layers(x, n=1, reshape=True, return_class_token=True)
        torch.testing.assert_close(maps_cls[0][0], maps[0])
        torch.testing.assert_close(maps_cls[0][1], feats["x_norm_clstoken"])

    with pytest.raises(ValueError):
        model.get_intermediate_layers(x, n=[4])
    with pytest.raises(ValueError):
        model.get_intermediate_layers(x, n=5)


# ---------------------------------------------------------------------------------------------------------
# Position-embedding interpolation: the official DINOv2 hub code, written out here as the reference.
# ---------------------------------------------------------------------------------------------------------
def dinov2_hub_interpolation(pos_embed: torch.Tensor, h: int, w: int, with_registers: bool) -> torch.Tensor:
    """DinoVisionTransformer.interpolate_pos_encoding of the DINOv2 hub (h, w in patches)."""
    pe = pos_embed.float()
    n, dim = pe.shape[1] - 1, pe.shape[-1]
    M = int(math.sqrt(n))
    if (h, w) == (M, M):
        return pos_embed
    grid = pe[:, 1:].reshape(1, M, M, dim).permute(0, 3, 1, 2)
    if with_registers:  # interpolate_offset = 0, interpolate_antialias = True
        grid = F.interpolate(grid, size=(h, w), mode="bicubic", antialias=True)
    else:  # interpolate_offset = 0.1, interpolate_antialias = False
        grid = F.interpolate(grid, scale_factor=((h + 0.1) / M, (w + 0.1) / M), mode="bicubic", antialias=False)
    assert tuple(grid.shape[-2:]) == (h, w)
    grid = grid.permute(0, 2, 3, 1).reshape(1, h * w, dim)
    return torch.cat([pe[:, :1], grid], dim=1).to(pos_embed.dtype)


GRIDS = [(2, 4), (4, 2), (5, 3), (10, 10), (37, 37), (16, 20), (8, 32)]


@pytest.mark.parametrize("M", [16, 37])
@pytest.mark.parametrize("hw", GRIDS, ids=lambda hw: f"{hw[0]}x{hw[1]}")
def test_interpolate_pos_embed_matches_dinov2_hub(M, hw):
    pos = torch.randn(1, 1 + M * M, 8, generator=torch.Generator().manual_seed(M))
    legacy = interpolate_pos_embed(pos, hw, antialias=False, offset=0.1)
    registers = interpolate_pos_embed(pos, hw, antialias=True, offset=0.0)
    ref_legacy = dinov2_hub_interpolation(pos, *hw, with_registers=False)
    ref_registers = dinov2_hub_interpolation(pos, *hw, with_registers=True)
    assert legacy.shape == registers.shape == (1, 1 + hw[0] * hw[1], 8)
    torch.testing.assert_close(legacy, ref_legacy, atol=1e-6, rtol=0)
    torch.testing.assert_close(registers, ref_registers, atol=1e-6, rtol=0)
    assert torch.equal(legacy[:, 0], pos[:, 0]) and torch.equal(registers[:, 0], pos[:, 0])
    if hw != (M, M):  # the two hub paths really differ, so the comparisons above tell them apart
        assert (legacy - registers).abs().max() > 1e-3


def test_interpolate_pos_embed_identity_and_bad_grid():
    pos = torch.randn(1, 1 + 16 * 16, 8)
    assert torch.equal(interpolate_pos_embed(pos, (16, 16), antialias=False, offset=0.1), pos)
    with pytest.raises(ValueError):
        interpolate_pos_embed(torch.randn(1, 1 + 15, 8), (4, 4), antialias=False, offset=0.1)


@pytest.mark.parametrize("name,with_registers", [("vit_test", False), ("vit_test_reg4", True)])
def test_model_pos_encoding_follows_the_hub_path_of_its_kind(name, with_registers):
    model = tiny(name, img_size=518)  # the hub models' 37 x 37 grid
    other = tiny("vit_test_reg4" if not with_registers else "vit_test", img_size=518)
    with torch.no_grad():
        other.pos_embed.copy_(model.pos_embed)
        for H, W in [(28, 56), (224, 224), (98, 420)]:
            got = model.interpolate_pos_encoding(H, W)
            ref = dinov2_hub_interpolation(model.pos_embed, H // 14, W // 14, with_registers)
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
            assert (got - other.interpolate_pos_encoding(H, W)).abs().max() > 1e-4
        assert torch.equal(model.interpolate_pos_encoding(518, 518), model.pos_embed)
        # ... and that is what the forward adds to the patch embeddings.
        x = images(1, 28, 56)
        tokens = model.prepare_tokens_with_masks(x)
        R = model.num_register_tokens
        ref = dinov2_hub_interpolation(model.pos_embed, 2, 4, with_registers)
        torch.testing.assert_close(tokens[:, 1 + R :], model.patch_embed(x) + ref[:, 1:], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# Packed multi-crop
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("name", ["vit_test", "vit_test_reg4"])
def test_packed_multicrop_equals_separate_forwards(name, backend):
    model = tiny(name, attn_backend=backend).eval()
    with torch.no_grad():
        model.mask_token.normal_()
    global_crops, local_crops = images(4, 56, 56, seed=0), images(6, 28, 28, seed=1)
    masks = torch.rand(4, 16, generator=torch.Generator().manual_seed(2)) < 0.4
    assert masks.any()
    with torch.no_grad():
        packed = model.forward_features_list([global_crops, local_crops], [masks, None])
        also_packed = model.forward_features([global_crops, local_crops], [masks, None])
        separate = [model.forward_features(global_crops, masks), model.forward_features(local_crops)]
    assert len(packed) == 2
    assert packed[0]["masks"] is masks and packed[1]["masks"] is None
    for p, a, s in zip(packed, also_packed, separate):
        for key in TENSOR_KEYS:
            assert p[key].shape == s[key].shape
            torch.testing.assert_close(p[key], s[key], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a[key], p[key], atol=0, rtol=0)
