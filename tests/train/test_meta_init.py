"""``train/meta_init.py`` in one process: a build recorded on ``meta`` and replayed (``to_empty`` + replay, no
sharding) gives exactly the tensors and the generator state of a real CPU build of the same seed; meta that the
build asks for itself draws nothing; what cannot be replayed is reported."""

import copy

import torch
from torch import nn

from dinopipe.models import create_model
from dinopipe.train.meta_init import InitRecorder


class Tiny(nn.Module):
    """A ViT, a BatchNorm CNN layer, an EMA-style deep copy, a weight loaded from a memory-mapped file, a shape
    check on explicit meta in between, and an in-place op on a view of a parameter."""

    def __init__(self, file=None) -> None:
        super().__init__()
        self.vit = create_model("vit_test")
        with torch.device("meta"):  # explicit meta (a shape check): draws nothing in a real build either
            nn.Linear(64, 64)
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
        self.loaded = nn.Linear(16, 16)
        if file is not None:
            self.loaded.load_state_dict(torch.load(file, mmap=True, weights_only=True))
        with torch.no_grad():
            self.loaded.weight[:, :4].mul_(2)  # a view of a parameter
        self.ema = copy.deepcopy(nn.ModuleList([self.vit, self.loaded]))
        self.extra = nn.Parameter(torch.randn(5, 7))  # a random factory op


def _real(file) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(3)
    sd = Tiny(file).state_dict()
    return sd, torch.get_rng_state()


def _replayed(file) -> tuple[dict, torch.Tensor, InitRecorder]:
    torch.manual_seed(3)
    rec = InitRecorder()
    with rec.recording():
        m = Tiny(file)
    rng_after_build = torch.get_rng_state()
    rec.bind(m)
    assert rec.unreplayable() is None
    m.to_empty(device="cpu")
    torch.manual_seed(99)  # replay restores its snapshots and ends where the build left the generator
    rec.materialize(m)
    assert torch.equal(torch.get_rng_state(), rng_after_build)
    return m.state_dict(), torch.get_rng_state(), rec


def test_replayed_build_equals_the_real_one(tmp_path):
    torch.manual_seed(0)
    file = tmp_path / "w.pt"
    torch.save(nn.Linear(16, 16).state_dict(), file)
    ref, rng = _real(file)
    got, got_rng, rec = _replayed(file)
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    assert torch.equal(got_rng, rng)
    assert rec.random_ops > 0
    largest = max(v.numel() * v.element_size() for v in ref.values())
    assert 0 < rec.peak_replay_bytes <= 2 * largest
    assert rec.peak_scratch_bytes <= largest


def test_what_cannot_be_replayed_is_reported():
    torch.manual_seed(0)
    rec = InitRecorder()
    with rec.recording():
        m = nn.Linear(4, 4)
        with torch.no_grad():
            m.weight.normal_(generator=torch.Generator().manual_seed(1))
    rec.bind(m)
    assert "explicit generator" in rec.unreplayable()

    rec = InitRecorder()
    with rec.recording():
        m = nn.Linear(4, 4)
        with torch.no_grad():
            m.weight.normal_(generator=torch.Generator().manual_seed(1))
            m.weight.zero_()  # a full overwrite: what came before no longer matters
    rec.bind(m)
    assert rec.unreplayable() is None
