"""Suite-wide settings. Runs before any test module imports torch."""

import os

import pytest

# See dinopipe/__init__.py: spinning OpenMP threads collapse CPU throughput when processes share cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture
def dynamo_reset():
    """Dynamo's caches and counters cleared around a test that counts graphs and graph breaks."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
