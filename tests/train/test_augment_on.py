"""data.augment_on (issue 29): the GPU augmentation path wired into pretraining, its tensor code on the CPU
device here. Same (seed, epoch, sample) draws as the CPU path, so the first step sees the same images (within
decoder / resampling rounding) and the same masks: the losses agree closely."""

import pytest

from tests.train.conftest import losses, run_pretrain

pytestmark = pytest.mark.slow


def test_gpu_augmentation_path_trains_like_the_cpu_path(tmp_path, photo_pool):
    for on in ("cpu", "gpu"):
        run_pretrain(tmp_path / on, photo_pool, "train.epochs=1", f"data.augment_on={on}")
    cpu, gpu = losses(tmp_path / "cpu"), losses(tmp_path / "gpu")
    assert sorted(cpu) == sorted(gpu)
    assert abs(cpu[0] - gpu[0]) <= 1e-2 * abs(cpu[0]), (cpu[0], gpu[0])
