"""`curate simulate`'s eval set sits where a real one does (issue 40): its fresh rows are other images of the pool's
domain, not points of the pool's own clusters, and a pool cluster's rows are not within the decontamination
threshold of each other, so at the default threshold only the planted near-copies of pool rows (and a thin tail)
are within reach -- not most of the pool, as with the former generator (64% of the default pool decontaminated)."""

from __future__ import annotations

import numpy as np

from curation.simulate import generate as gen

DIM, CLUSTERS, THRESHOLD = 384, 200, 0.45  # the default D and decontaminate.threshold


def _reached(pool: np.ndarray, ev: np.ndarray) -> float:
    """Fraction of pool rows whose nearest eval row is above the threshold."""
    return float(np.mean((pool @ ev.T).max(axis=1) > THRESHOLD))


def _pool(cent, w) -> np.ndarray:
    return gen.gen_block(0, 20_000, cent, w, DIM, 0, 0.01, 0.01, 3)[0].astype(np.float32)


def _near_copies(pool, rows, rng):
    return gen._normalise(pool[rows] + rng.standard_normal((len(rows), DIM)).astype(np.float32)
                          * np.float32(np.sqrt(gen.COPY_NOISE / DIM)))


def test_fresh_eval_rows_stay_away_from_the_pool_and_planted_copies_take_little_else():
    cent, w = gen.centres(CLUSTERS, DIM, seed=0)
    pool = _pool(cent, w)
    fresh = gen._normalise(gen.eval_fresh(2_000, cent, w, DIM, np.random.default_rng([0, 2])))
    assert _reached(pool, fresh) < 0.002  # next to none of the pool within reach of an unplanted eval row
    # the same domain: an eval row is closer to some pool row than a random direction is
    rand = gen._normalise(np.random.default_rng(1).standard_normal((2_000, DIM)).astype(np.float32))
    assert (pool @ fresh.T).max(axis=0).mean() > (pool @ rand.T).max(axis=0).mean() + 0.04
    # planted near-copies of 1% of the pool rows: found, and they reach little beyond their own rows
    rows = np.arange(0, 20_000, 100)
    copies = _near_copies(pool, rows, np.random.default_rng(2))
    assert (np.sum(copies * pool[rows], axis=1) > 0.9).all()
    assert _reached(pool, copies) < 0.015


def test_the_former_generator_reached_most_of_the_pool(monkeypatch):
    """What the test above guards against: rows of one cluster at cosine ~0.4 (SPREAD 1.5) and eval rows drawn
    from the pool's clusters put a third of the pool within the threshold, and each planted near-copy took ~20%
    of its cluster with it."""
    monkeypatch.setattr(gen, "SPREAD", 1.5)
    cent, w = gen.centres(CLUSTERS, DIM, seed=0)
    pool, rng = _pool(cent, w), np.random.default_rng(2)
    same = gen._normalise(cent[rng.choice(CLUSTERS, size=2_000, p=w)] + rng.standard_normal(
        (2_000, DIM)).astype(np.float32) * np.float32(np.sqrt(gen.SPREAD / DIM)))
    assert _reached(pool, same) > 0.3
    assert _reached(pool, _near_copies(pool, np.arange(0, 20_000, 10), rng)) > 0.15


def test_fresh_eval_rows_are_a_function_of_the_seed():
    cent, w = gen.centres(50, 32, seed=3)
    a = gen.eval_fresh(500, cent, w, 32, np.random.default_rng([3, 2]))
    b = gen.eval_fresh(500, cent, w, 32, np.random.default_rng([3, 2]))
    np.testing.assert_array_equal(a, b)
