"""The checkpoint manager in one process: keep-last-k, an atomic ``latest`` naming only complete saves, a torn
save ignored on resume, and states restored exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dinopipe.train.checkpoint import CheckpointManager, ModelOptimState, ValueState

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as meant


def _states(seed: int):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # optimizer state exists (exp_avg...), so it is saved too
    return {"model": ModelOptimState(model, opt), "trainer": ValueState(step=seed, lr=0.5 * seed)}, model, opt


def _names(ckpt):
    return sorted(p.name for p in ckpt.dir.glob("step_*"))


def test_keep_last_k_and_latest_names_the_newest(tmp_path):
    ckpt = CheckpointManager(tmp_path, keep_last=2)
    assert ckpt.latest() is None and ckpt.latest_step() is None
    for step in (1, 2, 3, 4, 5):
        states, _, _ = _states(step)
        ckpt.save(step, states)
    assert _names(ckpt) == ["step_00000004", "step_00000005"]
    assert (ckpt.dir / "latest").read_text() == "step_00000005\n"
    assert not list(ckpt.dir.glob("latest.tmp*"))  # the pointer was replaced, not left half-written
    assert ckpt.latest_step() == 5


def test_load_restores_every_state_exactly(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    states, model, opt = _states(7)
    ckpt.save(7, states)
    fresh, model2, opt2 = _states(8)  # different weights, optimizer moments and values
    assert ckpt.load(fresh) == 7
    torch.testing.assert_close(model2.weight, model.weight, rtol=0, atol=0)
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(opt2.state[q]["exp_avg"], opt.state[p]["exp_avg"], rtol=0, atol=0)
    values = fresh["trainer"].values
    assert values == {"step": 7, "lr": 3.5} and type(values["step"]) is int


def test_a_torn_save_is_ignored_on_resume(tmp_path):
    ckpt = CheckpointManager(tmp_path, keep_last=3)
    states, model, _ = _states(2)
    ckpt.save(2, states)
    # A run killed while writing step 4: its folder has shards but no completion marker (.metadata), and
    # `latest` still names step 2.
    torn = ckpt.dir / "step_00000004"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")
    fresh, model2, _ = _states(9)
    assert ckpt.load(fresh) == 2
    torch.testing.assert_close(model2.weight, model.weight, rtol=0, atol=0)
    # A pointer to a folder without its marker (e.g. a copy that lost it) is not trusted either.
    (ckpt.dir / "latest").write_text("step_00000004\n")
    assert ckpt.latest() is None and ckpt.load(_states(3)[0]) is None
    # Saving that step again replaces the torn folder with a complete one.
    states4, _, _ = _states(4)
    ckpt.save(4, states4)
    assert (torn / ".metadata").is_file() and not (torn / "__0_0.distcp").read_bytes() == b"partial"
    assert ckpt.latest_step() == 4
