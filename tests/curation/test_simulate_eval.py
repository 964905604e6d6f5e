"""`curate simulate`'s eval set sits where a real one does (issue 40): its rows are other images of the pool's
domain, not points of the pool's own clusters, so at the default decontamination threshold only the planted
near-copies of pool rows are within reach -- not most of the pool, as when eval rows were drawn from the pool's
clusters (64% of the default pool decontaminated)."""

from __future__ import annotations

import numpy as np

from curation.simulate import generate as gen

DIM, CLUSTERS, THRESHOLD = 384, 200, 0.45  # the default D and decontaminate.threshold


def _near_eval(pool: np.ndarray, ev: np.ndarray) -> float:
    """Fraction of pool rows whose nearest eval row is above the threshold."""
    return float(np.mean((pool @ ev.T).max(axis=1) > THRESHOLD))


def test_fresh_eval_rows_stay_away_from_the_pool_and_planted_copies_stay_near():
    cent, w = gen.centres(CLUSTERS, DIM, seed=0)
    pool = gen.gen_block(0, 20_000, cent, w, DIM, 0, 0.01, 0.01, 3)[0].astype(np.float32)
    fresh = gen._normalise(gen.eval_fresh(2_000, cent, w, DIM, np.random.default_rng([0, 2])))
    assert _near_eval(pool, fresh) < 0.005  # next to none of the pool within reach of an unplanted eval row
    # the same domain: an eval row is closer to some pool row than a random direction is
    rand = gen._normalise(np.random.default_rng(1).standard_normal((2_000, DIM)).astype(np.float32))
    assert (pool @ fresh.T).max(axis=0).mean() > (pool @ rand.T).max(axis=0).mean() + 0.05
    # what the generator did before: eval rows of the pool's own clusters reach most of the pool
    rng = np.random.default_rng(2)
    same = gen._normalise(cent[rng.choice(CLUSTERS, size=2_000, p=w)] + rng.standard_normal(
        (2_000, DIM)).astype(np.float32) * np.float32(np.sqrt(gen.SPREAD / DIM)))
    assert _near_eval(pool, same) > 0.3
    # a planted near-copy of a pool row is found at that threshold
    rows = np.arange(0, 20_000, 100)
    copies = gen._normalise(pool[rows] + rng.standard_normal((len(rows), DIM)).astype(np.float32)
                            * np.float32(np.sqrt(gen.COPY_NOISE / DIM)))
    assert (np.sum(copies * pool[rows], axis=1) > 0.9).all()


def test_fresh_eval_rows_are_a_function_of_the_seed():
    cent, w = gen.centres(50, 32, seed=3)
    a = gen.eval_fresh(500, cent, w, 32, np.random.default_rng([3, 2]))
    b = gen.eval_fresh(500, cent, w, 32, np.random.default_rng([3, 2]))
    np.testing.assert_array_equal(a, b)
