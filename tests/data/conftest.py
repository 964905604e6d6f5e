"""Fixtures for dinopipe.data tests: image files of every awkward kind a web pool contains."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._photos import bad_file_kinds


@pytest.fixture(scope="session")
def photo() -> np.ndarray:
    from tests._photos import real_photos

    return real_photos()["chelsea"]  # 300 x 451 RGB cat


@pytest.fixture(scope="session")
def bad_files(photo) -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, expected reason) for every unreadable kind."""
    return bad_file_kinds(photo)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny per-crop
    kernels on a shared 2-core box only contend with extra threads, and the input path runs one per worker."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
