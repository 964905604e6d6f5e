"""Teacher centering: Sinkhorn-Knopp's normalisation properties and agreement with a hand-written reference,
the EMA centre's update, and both giving the single-process answer when the batch is split over simulated
ranks (uneven splits included) through ``all_reduce_fn`` — without torch.distributed being initialised."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dinopipe.ssl.centering import EMACenter, TeacherCentering, all_reduce_sum, sinkhorn_knopp


def reference_sinkhorn(logits: np.ndarray, temp: float, n_iter: int) -> np.ndarray:
    """DINOv2's sinkhorn_knopp_teacher for one process, written out in float64 numpy."""
    q = np.exp(logits / temp).T  # (K, B)
    k, b = q.shape
    q = q / q.sum()
    for _ in range(n_iter):
        q = q / q.sum(axis=1, keepdims=True) / k
        q = q / q.sum(axis=0, keepdims=True) / b
    return (q * b).T


class FakeGroup:
    """Sum-all-reduce between threads standing in for ranks."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list = [None] * world
        # A rank that never reaches the barrier breaks it (BrokenBarrierError in the others) instead of hanging;
        # every thread then ends, so run() joins them all and never asserts on half-finished results.
        self.barrier = threading.Barrier(world, timeout=120)

    def reducer(self, rank: int):
        def all_reduce(t: torch.Tensor) -> None:  # in place, returns None, like torch.distributed.all_reduce
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.slots)
            self.barrier.wait()
            t.copy_(total)

        return all_reduce

    def run(self, fn):
        results: list = [None] * self.world
        errors: list = []

        def target(rank):
            try:
                results[rank] = fn(rank, self.reducer(rank))
            except Exception as exc:  # pragma: no cover - surfaced below
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert all(r is not None for r in results), results
        return results


def logits(b: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, k, generator=torch.Generator().manual_seed(seed))


def test_sinkhorn_rows_are_distributions_and_columns_balance():
    x = logits(16, 8) * 0.1  # logits / T of unit scale: 3 iterations get close to balanced
    temp = 0.07
    q = sinkhorn_knopp(x, temp, n_iterations=3)
    assert not torch.distributed.is_initialized()
    b, k = q.shape
    # Exactly: each sample's assignment sums to 1.
    torch.testing.assert_close(q.sum(dim=1), torch.ones(b), atol=1e-5, rtol=0)
    # Approximately: each prototype receives B/K of the mass; much closer than the plain softmax.
    softmax_dev = (torch.softmax(x / temp, dim=1).sum(dim=0) - b / k).abs().max()
    sk_dev = (q.sum(dim=0) - b / k).abs().max()
    assert sk_dev < 0.2 * softmax_dev
    # Each iteration improves the balance.
    devs = [(sinkhorn_knopp(x, temp, n).sum(dim=0) - b / k).abs().max() for n in (1, 2, 3)]
    assert devs[0] > devs[1] > devs[2]
    # Converged, both marginals hold.
    q50 = sinkhorn_knopp(x, temp, n_iterations=50)
    torch.testing.assert_close(q50.sum(dim=0), torch.full((k,), b / k), atol=1e-3, rtol=0)
    torch.testing.assert_close(q50.sum(dim=1), torch.ones(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_iter", [1, 3])
def test_sinkhorn_matches_reference(n_iter):
    x = logits(6, 5, seed=1) * 0.3
    got = sinkhorn_knopp(x, 0.05, n_iterations=n_iter).double().numpy()
    want = reference_sinkhorn(x.double().numpy(), 0.05, n_iter)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_sinkhorn_split_over_ranks_equals_single_process():
    x = logits(8, 6, seed=2) * 0.5
    full = sinkhorn_knopp(x, 0.06)
    parts = [x[:3], x[3:]]  # uneven: 3 + 5 rows, as masked-patch counts differ per rank
    out = FakeGroup(2).run(lambda r, fn: sinkhorn_knopp(parts[r], 0.06, all_reduce_fn=fn))
    torch.testing.assert_close(torch.cat(out), full, atol=1e-6, rtol=1e-5)


def test_sinkhorn_with_an_empty_rank():
    x = logits(5, 4, seed=3)
    full = sinkhorn_knopp(x, 0.1)
    parts = [x, x[:0]]
    out = FakeGroup(2).run(lambda r, fn: sinkhorn_knopp(parts[r], 0.1, all_reduce_fn=fn))
    assert out[1].shape == (0, 4)
    torch.testing.assert_close(out[0], full)
    assert sinkhorn_knopp(x[:0], 0.1).shape == (0, 4)


def test_ema_center_update_and_order():
    c = TeacherCentering(3, mode="centering", center_momentum=0.9)
    x1 = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    p1 = c(x1, teacher_temp=0.5)
    # Targets use the centre from *before* this batch (zeros at first).
    torch.testing.assert_close(p1, torch.softmax(x1 / 0.5, dim=-1))
    torch.testing.assert_close(c.ema.center, 0.1 * torch.tensor([[2.0, 2.0, 2.0]]))
    x2 = torch.tensor([[0.0, 4.0, -1.0]])
    p2 = c(x2, teacher_temp=0.5)
    torch.testing.assert_close(p2, torch.softmax((x2 - torch.tensor([[0.2, 0.2, 0.2]])) / 0.5, dim=-1))
    torch.testing.assert_close(c.ema.center, 0.9 * torch.tensor([[0.2, 0.2, 0.2]]) + 0.1 * x2)
    # update=False leaves it alone; the centre is saved in the state dict.
    before = c.ema.center.clone()
    c(x1, 0.5, update=False)
    torch.testing.assert_close(c.ema.center, before)
    assert "ema.center" in c.state_dict()


def test_ema_center_split_over_ranks_equals_single_process():
    x = logits(7, 5, seed=4)
    single = EMACenter(5, momentum=0.9)
    single.update(x)
    parts = [x[:2], x[2:]]

    def rank_fn(r, fn):
        m = EMACenter(5, momentum=0.9)
        m.update(parts[r], all_reduce_fn=fn)
        return m.center

    for center in FakeGroup(2).run(rank_fn):
        torch.testing.assert_close(center, single.center)
    # A naive per-rank mean averaged over ranks would differ with uneven batches.
    naive = 0.1 * (parts[0].mean(0) + parts[1].mean(0)) / 2
    assert not torch.allclose(single.center[0], naive)


def test_ema_center_ignores_empty_batch_and_sk_mode_skips_centre():
    m = EMACenter(4)
    m.center.fill_(1.0)
    m.update(torch.zeros(0, 4))
    torch.testing.assert_close(m.center, torch.ones(1, 4))
    sk = TeacherCentering(4, mode="sinkhorn_knopp")
    q = sk(logits(3, 4), 0.1)
    torch.testing.assert_close(q.sum(1), torch.ones(3))
    torch.testing.assert_close(sk.ema.center, torch.zeros(1, 4))


def test_all_reduce_contract_and_bad_mode():
    t = torch.ones(2)
    assert all_reduce_sum(t, None) is t
    assert torch.equal(all_reduce_sum(t, lambda x: x * 2), torch.full((2,), 2.0))  # returning reducer
    assert all_reduce_sum(t, lambda x: (x.mul_(3), None)[1]) is t  # in-place reducer returning None
    with pytest.raises(ValueError, match="centering mode"):
        TeacherCentering(4, mode="softmax")
