"""DINOv3's distributed KoLeo (``dino.koleo_distributed``) on 2 gloo ranks equals one process holding the whole
batch: the loss averaged over ranks and each rank's feature gradients (averaged over ranks, as the gradient
all-reduce does) match the single-process loss and gradient, for one group (the global batch) and for groups of
half the global batch. Features: scikit-learn's digits (real 8x8 images, 64 values each)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from dinopipe.ssl.losses import koleo_loss, koleo_loss_distributed
from dinopipe.utils.proc import exit_now

B_LOCAL, WORLD = 6, 2


def digits(n: int) -> torch.Tensor:
    from sklearn.datasets import load_digits

    return torch.from_numpy(load_digits().data[:n]).float()


def reference(x: torch.Tensor, group_size):
    """One process, the whole batch: KoLeo per group, averaged (groups are equal in size)."""
    x = x.clone().requires_grad_(True)
    size = group_size or x.shape[0]
    loss = sum(koleo_loss(g) for g in x.split(size)) / (x.shape[0] // size)
    loss.backward()
    return loss.item(), x.grad


GROUPS = {"global": None, "half": B_LOCAL}


def _rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from dinopipe.train.dist import all_gather_fn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    result = {}
    for name, group_size in GROUPS.items():
        x = digits(B_LOCAL * WORLD)[rank * B_LOCAL:(rank + 1) * B_LOCAL].clone().requires_grad_(True)
        loss = koleo_loss_distributed(x, all_gather_fn(), rank, group_size)
        loss.backward()
        result.update({f"{name}/loss": loss.detach(), f"{name}/grad": x.grad})
    torch.save(result, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)  # gloo's teardown at interpreter exit can abort a finished rank (SIGABRT: the test failed in CI)


def test_two_gloo_ranks_equal_one_process_with_the_whole_batch(tmp_path):
    """One group (the global batch) and groups of half of it (each rank's own batch here)."""
    import torch.multiprocessing as mp

    from tests.train.conftest import free_port

    out = str(tmp_path / "r")
    sys.path.insert(0, os.getcwd())
    mp.start_processes(_rank_main, args=(free_port(), out), nprocs=WORLD, start_method="spawn")
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(WORLD)]
    for name, group_size in GROUPS.items():
        loss, grad = reference(digits(B_LOCAL * WORLD), group_size)
        assert sum(float(r[f"{name}/loss"]) for r in ranks) / WORLD == pytest.approx(loss, rel=1e-6), name
        torch.testing.assert_close(torch.cat([r[f"{name}/grad"] for r in ranks]) / WORLD, grad, rtol=1e-5, atol=1e-7)


def test_one_process_equals_koleo_and_checks_the_group():
    x = digits(8)
    torch.testing.assert_close(koleo_loss_distributed(x), koleo_loss(x))
    with pytest.raises(ValueError, match="koleo_group_size"):  # a group smaller than a rank's batch (as DINOv3)
        koleo_loss_distributed(x, group_size=4)
    with pytest.raises(ValueError, match="koleo_group_size"):
        koleo_loss_distributed(x, group_size=16)
    two = koleo_loss_distributed(x, topk=2)  # the mean over the two nearest others
    assert float(two) < float(koleo_loss(x)) + 1e-6


def test_the_task_term_switches_to_the_distributed_form():
    """``dino.koleo_distributed`` in one process (no gather): the same per-crop KoLeo sum as DINOv2's."""
    from dinopipe.ssl.base import koleo_per_global_crop

    x = digits(8)
    torch.testing.assert_close(koleo_per_global_crop(x, distributed=True), koleo_per_global_crop(x))
