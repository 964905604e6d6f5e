"""DINO head: MLP -> bottleneck -> L2-normalise -> weight-normalised prototypes, checked against the
DINOv2 head (``weight_norm`` Linear) written out here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from dinopipe.models import DINOHead

IN, OUT, HIDDEN, BOTTLENECK = 24, 40, 32, 16


def make_head(**kw) -> DINOHead:
    torch.manual_seed(0)
    kw = dict(dict(out_dim=OUT, hidden_dim=HIDDEN, bottleneck_dim=BOTTLENECK), **kw)
    return DINOHead(IN, **kw)


def features(b: int = 6) -> torch.Tensor:
    return torch.randn(b, IN, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("nlayers", [1, 2, 3])
@pytest.mark.parametrize("use_bn", [False, True])
def test_output_shapes(nlayers, use_bn):
    head = make_head(nlayers=nlayers, use_bn=use_bn)
    linears = [m for m in head.mlp.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == nlayers
    assert linears[0].in_features == IN and linears[-1].out_features == BOTTLENECK
    assert any(isinstance(m, nn.BatchNorm1d) for m in head.mlp.modules()) == (use_bn and nlayers > 1)
    x = features()
    assert head(x).shape == (6, OUT)
    assert head(x, no_last_layer=True).shape == (6, BOTTLENECK)
    assert head(torch.randn(6, BOTTLENECK), only_last_layer=True).shape == (6, OUT)


def test_no_last_layer_returns_unit_bottleneck_vectors():
    head = make_head()
    z = head(features(), no_last_layer=True)
    torch.testing.assert_close(z.norm(dim=-1), torch.ones(6))
    torch.testing.assert_close(z, F.normalize(head.mlp(features()), dim=-1))
    # the logits are z against the unit prototypes
    torch.testing.assert_close(head(features()), z @ F.normalize(head.last_layer.weight, dim=1).T)


def test_normalised_last_layer_ignores_prototype_scale():
    head = make_head(norm_last_layer=True)
    x = features()
    with torch.no_grad():
        before = head(x)
        head.last_layer.weight.mul_(torch.rand(OUT, 1) * 10 + 0.1)  # rescale every prototype row
        after = head(x)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-5)
    assert before.abs().max() <= 1 + 1e-6  # logits are cosine similarities
    # nothing learnable sets the prototype norms: an SGD step keeps the logits cosines
    opt = torch.optim.SGD(head.parameters(), lr=100.0)
    head(x).pow(2).sum().mul(-1).backward()
    opt.step()
    with torch.no_grad():
        assert head(x).abs().max() <= 1 + 1e-6


def test_unnormalised_last_layer_has_a_learnable_prototype_gain():
    head = make_head(norm_last_layer=False)
    x = features()
    with torch.no_grad():
        before = head(x)
    gains = [p for n, p in head.named_parameters() if "last_layer" in n and p.shape == (OUT, 1)]
    assert len(gains) == 1, "norm_last_layer=False must keep a learnable per-prototype gain (weight_g)"
    gain = gains[0]
    head(x).sum().backward()
    assert gain.grad is not None and torch.count_nonzero(gain.grad) > 0
    with torch.no_grad():
        gain[3] = 5.0
        after = head(x)
    torch.testing.assert_close(after[:, 3], 5.0 * before[:, 3])
    torch.testing.assert_close(after[:, :3], before[:, :3])


@pytest.mark.parametrize("norm_last_layer", [True, False])
def test_matches_dinov2_weight_norm_head(norm_last_layer):
    head = make_head(norm_last_layer=norm_last_layer, nlayers=3)
    ref_mlp = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                            nn.Linear(HIDDEN, BOTTLENECK))
    ref_mlp.load_state_dict(head.mlp.state_dict())
    ref_last = weight_norm(nn.Linear(BOTTLENECK, OUT, bias=False))
    with torch.no_grad():
        ref_last.parametrizations.weight.original1.copy_(head.last_layer.weight)  # weight_v
        g = torch.ones(OUT, 1) if norm_last_layer else torch.rand(OUT, 1) + 0.5
        ref_last.parametrizations.weight.original0.copy_(g)  # weight_g
        if not norm_last_layer:
            [p for n, p in head.named_parameters() if "last_layer" in n and p.shape == (OUT, 1)][0].copy_(g)
        x = features()
        ref = ref_last(F.normalize(ref_mlp(x), dim=-1, p=2, eps=1e-12))
        torch.testing.assert_close(head(x), ref, atol=1e-6, rtol=1e-5)


def test_mlp_bias_flag():
    head = make_head(mlp_bias=False)
    assert all(m.bias is None for m in head.mlp.modules() if isinstance(m, nn.Linear))
    assert head.last_layer.bias is None
