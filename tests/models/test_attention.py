"""Attention over packed crops: every backend that runs on CPU agrees with the explicit ``math`` reference,
crops never attend to each other, and asking for xformers on CPU (or an unknown backend) fails clearly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dinopipe.models import BACKENDS, Attention, create_model
from dinopipe.models import attention as attention_mod
from dinopipe.models.attention import math_attention, resolve_backend

DIM, HEADS = 32, 4
SHAPES = [(3, 5), (2, 9), (1, 4)]  # (crops, tokens) per crop-size group
CPU = torch.device("cpu")


def make_attn(backend: str) -> Attention:
    torch.manual_seed(0)
    return Attention(DIM, HEADS, backend=backend)


def packed(shapes=SHAPES, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    rows = sum(b * n for b, n in shapes)
    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def per_sequence_reference(attn: Attention, x: torch.Tensor, shapes) -> torch.Tensor:
    """Textbook multi-head attention, one sequence at a time, in float64."""
    Wqkv, bqkv = attn.qkv.weight.double(), attn.qkv.bias.double()
    Wo, bo = attn.proj.weight.double(), attn.proj.bias.double()
    H, hd = attn.num_heads, attn.head_dim
    out, start = [], 0
    for b, n in shapes:
        for _ in range(b):
            seq = x[start : start + n].double()
            start += n
            q, k, v = (seq @ Wqkv.T + bqkv).split(DIM, dim=-1)
            heads = []
            for h in range(H):
                sl = slice(h * hd, (h + 1) * hd)
                a = torch.softmax(q[:, sl] @ k[:, sl].T / hd**0.5, dim=-1)
                heads.append(a @ v[:, sl])
            out.append(torch.cat(heads, dim=-1) @ Wo.T + bo)
    return torch.cat(out)


def test_math_backend_is_textbook_attention_per_sequence():
    attn = make_attn("math")
    x = packed()
    with torch.no_grad():
        got = attn(x, SHAPES)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), per_sequence_reference(attn, x, SHAPES), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_cpu_backends_agree_with_math_fp32(backend):
    ref_attn, attn = make_attn("math"), make_attn(backend)
    x = packed()
    with torch.no_grad():
        torch.testing.assert_close(attn(x, SHAPES), ref_attn(x, SHAPES), atol=1e-5, rtol=1e-5)
    # and the gradients too
    xa, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    attn(xa, SHAPES).pow(2).sum().backward()
    ref_attn(xr, SHAPES).pow(2).sum().backward()
    torch.testing.assert_close(xa.grad, xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attn.qkv.weight.grad, ref_attn.qkv.weight.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_crops_do_not_attend_across_groups_or_samples(backend):
    attn = make_attn(backend)
    x = packed()
    y = x.clone()
    y[15:33] += 5.0  # the second group (2 crops x 9 tokens) only
    with torch.no_grad():
        ox, oy = attn(x, SHAPES), attn(y, SHAPES)
    torch.testing.assert_close(oy[:15], ox[:15], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(oy[33:], ox[33:], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(oy[15:33], ox[15:33])
    # one group of 3 x 5 tokens equals three sequences of 5 run alone
    with torch.no_grad():
        alone = torch.cat([attn(x[i * 5 : (i + 1) * 5], [(1, 5)]) for i in range(3)])
    torch.testing.assert_close(ox[:15], alone, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_bf16_on_cpu_runs_and_is_close(backend):
    attn = make_attn(backend)
    x = packed()
    with torch.no_grad():
        ref = make_attn("math")(x, SHAPES)
        out = attn.to(torch.bfloat16)(x.bfloat16(), SHAPES)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=5e-2)


def test_sdpa_is_what_sdpa_and_auto_run(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    x = packed()
    for backend, expected in [("math", 0), ("sdpa", 3), ("auto", 3)]:
        calls.clear()
        with torch.no_grad():
            make_attn(backend)(x, SHAPES)
        assert len(calls) == expected, backend
    assert calls == [(3, HEADS, 5, DIM // HEADS), (2, HEADS, 9, DIM // HEADS), (1, HEADS, 4, DIM // HEADS)]


# ---------------------------------------------------------------------------------------------------------
# xformers, errors, switching
# ---------------------------------------------------------------------------------------------------------
def test_xformers_on_cpu_raises_a_clear_error():
    attn = make_attn("xformers")
    with pytest.raises(RuntimeError, match="xformers"):
        attn(packed(), SHAPES)
    model = create_model("vit_test", attn_backend="xformers")
    with pytest.raises(RuntimeError, match="xformers"):
        model(torch.randn(1, 3, 28, 28))


@pytest.mark.parametrize("installed", [False, True], ids=["missing", "installed"])
def test_xformers_on_cpu_error_whether_or_not_installed(monkeypatch, installed):
    monkeypatch.setattr(attention_mod, "xformers_ops", lambda: object() if installed else None)
    # On CPU the useful message is the device one: installing xformers would not help.
    with pytest.raises(RuntimeError, match="CUDA"):
        make_attn("xformers")(packed(), SHAPES)
    assert resolve_backend("auto", CPU) == "sdpa"  # auto never picks xformers on CPU


class _FakeBlockDiagonalMask:
    def __init__(self, seqlens):
        self.seqlens = list(seqlens)

    @classmethod
    def from_seqlens(cls, seqlens):
        return cls(seqlens)


def _fake_memory_efficient_attention(q, k, v, attn_bias):
    """xformers' contract: (1, T, H, hd) inputs, attention within each block of ``seqlens``."""
    assert q.shape[0] == 1 and q.dim() == 4
    outs, start = [], 0
    for n in attn_bias.seqlens:
        sl = slice(start, start + n)
        start += n
        o = math_attention(*(t[:, sl].transpose(1, 2) for t in (q, k, v)))  # (1, H, n, hd)
        outs.append(o.transpose(1, 2))
    assert start == q.shape[1]
    return torch.cat(outs, dim=1)


def test_xformers_path_packs_like_math(monkeypatch):
    """The xformers branch (CUDA-only in real life) run on CPU against a fake with xformers' contract."""
    fake = SimpleNamespace(
        fmha=SimpleNamespace(BlockDiagonalMask=_FakeBlockDiagonalMask),
        memory_efficient_attention=_fake_memory_efficient_attention,
    )
    monkeypatch.setattr(attention_mod, "xformers_ops", lambda: fake)
    monkeypatch.setattr(attention_mod, "resolve_backend", lambda backend, device: "xformers")
    attention_mod._block_diagonal_mask.cache_clear()
    try:
        x = packed()
        with torch.no_grad():
            torch.testing.assert_close(make_attn("xformers")(x, SHAPES), make_attn("math")(x, SHAPES),
                                       atol=1e-5, rtol=1e-5)
        mask = attention_mod._block_diagonal_mask(tuple(SHAPES))
        assert mask.seqlens == [5, 5, 5, 9, 9, 4]
    finally:
        attention_mod._block_diagonal_mask.cache_clear()


def test_unknown_backend_raises_value_error():
    with pytest.raises(ValueError, match="math"):
        Attention(DIM, HEADS, backend="flash3")
    with pytest.raises(ValueError, match="attn_backend"):
        create_model("vit_test", attn_backend="flash3")
    with pytest.raises(ValueError):
        resolve_backend("flash3", CPU)
    with pytest.raises(ValueError, match="divisible"):
        Attention(30, 4)
    assert set(BACKENDS) == {"auto", "sdpa", "xformers", "math"}


def test_set_attn_backend_switches_every_block():
    torch.manual_seed(0)
    model = create_model("vit_test", attn_backend="sdpa", init_values=1.0).eval()
    x = torch.randn(2, 3, 28, 56)
    with torch.no_grad():
        ref = model.forward_features(x)["x_prenorm"]
        model.set_attn_backend("math")
        assert [b.attn.backend for b in model.blocks] == ["math"] * 4
        torch.testing.assert_close(model.forward_features(x)["x_prenorm"], ref, atol=1e-5, rtol=1e-5)
        model.set_attn_backend("xformers")
        with pytest.raises(RuntimeError, match="xformers"):
            model.forward_features(x)
        with pytest.raises(ValueError):  # at the latest when the model runs
            model.set_attn_backend("flash3")
            model.forward_features(x)
