"""Efficient stochastic depth (block.py): the residual branch runs on k = max(1, int(B(1-d))) kept samples
and is added back scaled by B/k; dropped samples pass untouched and contribute no gradient; below the 0.1
threshold (or with efficient_drop_path=False) masked DropPath is used; eval is deterministic."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dinopipe.models import Block, SwiGLU, create_model
from dinopipe.models.block import EFFICIENT_DROP_PATH_MIN_RATE, drop_add_residual_subset, subset_size

DIM, HEADS, N = 16, 2, 5


def make_block(rate: float = 0.5, efficient: bool = True, seed: int = 0) -> Block:
    torch.manual_seed(seed)
    return Block(DIM, HEADS, drop_path=rate, efficient_drop_path=efficient, init_values=1.0).train()


def tokens(b: int, n: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, n, DIM, generator=torch.Generator().manual_seed(seed))


def untouched_rows(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (out == x).flatten(1).all(dim=1)


def only_branch(block: Block, keep: str) -> Block:
    """A copy of ``block`` whose other branch is silenced through its LayerScale gamma."""
    blk = copy.deepcopy(block)
    with torch.no_grad():
        (blk.ls2 if keep == "attn" else blk.ls1).gamma.zero_()
    return blk


def branch_residual(block: Block, x: torch.Tensor) -> torch.Tensor:
    """Per-sample residual of the single live branch, computed deterministically in eval mode."""
    was_training = block.training
    block.eval()
    with torch.no_grad():
        r = block(x) - x
    block.train(was_training)
    return r


# ---------------------------------------------------------------------------------------------------------
# The subset helper, with a deterministic branch
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,rate", [(8, 0.5), (8, 0.75), (5, 0.5), (10, 0.3), (4, 0.99)])
def test_subset_helper_rows_are_x_or_x_plus_scaled_branch(B, rate):
    x = tokens(B)
    seen = []

    def branch(xs):
        seen.append([t.shape[0] for t in xs])
        return [2.0 * t + 1.0 for t in xs]

    torch.manual_seed(0)
    (out,) = drop_add_residual_subset([x], branch, rate)
    k = max(1, int(B * (1 - rate)))
    assert subset_size(B, rate) == k
    assert seen == [[k]]  # the branch only ever saw the kept samples
    kept = ~untouched_rows(out, x)
    assert int(kept.sum()) == k
    expected = x + (B / k) * (2.0 * x + 1.0)
    torch.testing.assert_close(out[kept], expected[kept])


def test_subset_helper_draws_per_group_and_per_call():
    xs = [tokens(8, 5, seed=0), tokens(6, 3, seed=1)]
    seen, kept_sets = [], []

    def branch(ts):
        seen.append([t.shape for t in ts])
        return [torch.ones_like(t) for t in ts]

    for seed in range(6):
        torch.manual_seed(seed)
        outs = drop_add_residual_subset(xs, branch, 0.5)
        kept = [tuple(torch.nonzero(~untouched_rows(o, x)).flatten().tolist()) for o, x in zip(outs, xs)]
        assert [len(k) for k in kept] == [4, 3]
        for o, x, k in zip(outs, xs, kept):
            scale = x.shape[0] / len(k)
            torch.testing.assert_close(o[list(k)], x[list(k)] + scale)
        kept_sets.append(kept[0])
    assert all(s == [torch.Size([4, 5, DIM]), torch.Size([3, 3, DIM])] for s in seen)
    assert len(set(kept_sets)) > 1, "the kept subset must be random, not always the same samples"


def test_subset_helper_gradient_comes_only_from_kept_samples():
    torch.manual_seed(0)
    lin = nn.Linear(DIM, DIM)
    x = tokens(8).requires_grad_(True)
    (out,) = drop_add_residual_subset([x], lambda ts: [lin(ts[0])], 0.5)
    dropped = untouched_rows(out.detach(), x.detach())
    assert int(dropped.sum()) == 4

    out[dropped].sum().backward()  # a loss that only sees dropped samples
    assert lin.weight.grad is None or torch.count_nonzero(lin.weight.grad) == 0
    assert lin.bias.grad is None or torch.count_nonzero(lin.bias.grad) == 0
    assert torch.all(x.grad[dropped] == 1) and torch.all(x.grad[~dropped] == 0)

    lin.zero_grad()
    x.grad = None
    (out,) = drop_add_residual_subset([x], lambda ts: [lin(ts[0])], 0.5)
    kept = ~untouched_rows(out.detach(), x.detach())
    out[kept].sum().backward()
    assert torch.count_nonzero(lin.weight.grad) > 0


# ---------------------------------------------------------------------------------------------------------
# Block in training mode
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("live", ["attn", "ffn"])
@pytest.mark.parametrize("B,rate", [(8, 0.5), (7, 0.4)])
def test_block_rows_are_x_or_x_plus_scaled_branch(live, B, rate):
    blk = only_branch(make_block(rate), live)
    x = tokens(B)
    residual = branch_residual(blk, x)
    assert residual.abs().min() > 0  # the live branch really changes every sample
    torch.manual_seed(1)
    out = blk(x)
    k = max(1, int(B * (1 - rate)))
    kept = ~untouched_rows(out, x)
    assert int(kept.sum()) == k
    torch.testing.assert_close(out[kept], (x + (B / k) * residual)[kept], atol=1e-5, rtol=1e-5)


def test_block_attention_and_ffn_draw_independently():
    blk = make_block(0.5)
    attn_only, ffn_only = only_branch(blk, "attn"), only_branch(blk, "ffn")
    B, s = 8, 2.0
    x = tokens(B)
    a = branch_residual(attn_only, x)
    y = x + s * a
    candidates = {
        "none": x,
        "attn": y,
        "ffn": x + s * branch_residual(ffn_only, x),
        "both": y + s * branch_residual(ffn_only, y),
    }
    patterns = set()
    for seed in range(5):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = blk(x)
        for i in range(B):
            match = [n for n, c in candidates.items() if torch.allclose(out[i], c[i], atol=1e-5, rtol=1e-5)]
            assert len(match) == 1, f"row {i} is none of x, x+attn, x+ffn, x+attn+ffn: {match}"
            patterns.add(match[0])
    assert {"attn", "ffn"} & patterns, "attention and FFN keep the same samples every time"


def test_block_gradient_comes_only_from_kept_samples():
    blk = make_block(0.5)
    x = tokens(8)
    torch.manual_seed(3)
    out = blk(x)
    dropped_in_both = untouched_rows(out.detach(), x)
    assert 0 < int(dropped_in_both.sum()) < 8
    out[dropped_in_both].pow(2).sum().backward()
    with_grad = [n for n, p in blk.named_parameters() if p.grad is not None and torch.count_nonzero(p.grad) > 0]
    assert with_grad == []

    blk.zero_grad()
    torch.manual_seed(3)
    out = blk(x)
    out[~dropped_in_both].pow(2).sum().backward()
    assert all(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in blk.parameters())


def record_branch_inputs(blk: Block) -> dict:
    """Group shapes the attention receives and token rows the FFN receives, per call."""
    seen = {"attn": [], "mlp": []}
    blk.attn.register_forward_pre_hook(lambda m, args: seen["attn"].append([tuple(s) for s in args[1]]))
    blk.mlp.register_forward_pre_hook(lambda m, args: seen["mlp"].append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize(
    "rate,efficient,train,kept",
    [
        (0.5, True, True, 4),  # subset: compute skipped for dropped samples
        (0.11, True, True, 7),  # just above the threshold
        (EFFICIENT_DROP_PATH_MIN_RATE, True, True, 8),  # at the threshold: masked DropPath, full batch
        (0.05, True, True, 8),
        (0.5, False, True, 8),  # efficient_drop_path=False: masked DropPath
        (0.5, True, False, 8),  # eval
    ],
)
def test_branches_see_only_the_kept_samples(rate, efficient, train, kept):
    blk = make_block(rate, efficient).train(train)
    seen = record_branch_inputs(blk)
    blk(tokens(8))
    assert seen == {"attn": [[(kept, N)]], "mlp": [kept * N]}


def test_packed_groups_each_keep_their_own_subset():
    blk = make_block(0.5)
    seen = record_branch_inputs(blk)
    outs = blk([tokens(8, 5), tokens(6, 3, seed=1)])
    assert [o.shape for o in outs] == [(8, 5, DIM), (6, 3, DIM)]
    assert seen == {"attn": [[(4, 5), (3, 3)]], "mlp": [4 * 5 + 3 * 3]}


@pytest.mark.parametrize("live", ["attn", "ffn"])
def test_masked_drop_path_rows_are_x_or_x_plus_rescaled_branch(live):
    rate = 0.5
    blk = only_branch(make_block(rate, efficient=False), live)
    x = tokens(16)
    residual = branch_residual(blk, x)
    torch.manual_seed(0)
    out = blk(x)
    kept = ~untouched_rows(out, x)
    assert 0 < int(kept.sum()) < 16
    torch.testing.assert_close(out[kept], (x + residual / (1 - rate))[kept], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Whole model
# ---------------------------------------------------------------------------------------------------------
def test_eval_with_drop_path_equals_model_without_it():
    torch.manual_seed(0)
    dropping = create_model("vit_test", drop_path_rate=0.5, drop_path_uniform=True, init_values=1.0)
    plain = create_model("vit_test", drop_path_rate=0.0, init_values=1.0)
    plain.load_state_dict(dropping.state_dict())
    x = torch.randn(4, 3, 28, 28)
    with torch.no_grad():
        ref = plain.eval().forward_features(x)["x_prenorm"]
        assert torch.equal(dropping.eval().forward_features(x)["x_prenorm"], ref)
        assert torch.equal(dropping.forward_features(x)["x_prenorm"], ref)  # deterministic
        assert torch.equal(plain.train().forward_features(x)["x_prenorm"], ref)  # rate 0 trains as eval
        assert not torch.allclose(dropping.train().forward_features(x)["x_prenorm"], ref)  # drop path is live


def test_drop_path_schedule_linear_and_uniform():
    linear = create_model("vit_test", depth=5, drop_path_rate=0.4)
    uniform = create_model("vit_test", depth=5, drop_path_rate=0.4, drop_path_uniform=True)
    assert [b.drop_path_rate for b in linear.blocks] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert [b.drop_path_rate for b in uniform.blocks] == pytest.approx([0.4] * 5)
    # The schedule decides who runs on a subset: the first linear block (rate 0) sees the whole batch.
    seen = [record_branch_inputs(b) for b in uniform.blocks] + [record_branch_inputs(linear.blocks[0])]
    x = torch.randn(10, 3, 28, 28)
    uniform.train().forward_features(x)
    linear.train().forward_features(x)
    assert [s["attn"] for s in seen] == [[[(6, 5)]]] * 5 + [[[(10, 5)]]]


# ---------------------------------------------------------------------------------------------------------
# SwiGLU FFN
# ---------------------------------------------------------------------------------------------------------
def test_swiglu_is_dinov2s_silu_gate_on_the_first_half():
    torch.manual_seed(0)
    ffn = SwiGLU(in_features=DIM, hidden_features=4 * DIM)
    hidden = (int(4 * DIM * 2 / 3) + 7) // 8 * 8
    assert ffn.fc1.weight.shape == (2 * hidden, DIM) and ffn.fc2.weight.shape == (DIM, hidden)
    x = torch.randn(3, DIM)
    # DINOv2 SwiGLUFFNFused: x1, x2 = w12(x).chunk(2); w3(silu(x1) * x2)
    x1, x2 = F.linear(x, ffn.fc1.weight, ffn.fc1.bias).chunk(2, dim=-1)
    ref = F.linear(F.silu(x1) * x2, ffn.fc2.weight, ffn.fc2.bias)
    torch.testing.assert_close(ffn(x), ref)
