"""The store rule's small pieces on their own: a missing client extra, the one line of an error re-raised from a
DataLoader worker, pruning by step number, and the bounds that end a training that only skips."""

from __future__ import annotations

import pytest

from dinopipe.utils import storage


def test_a_missing_extra_is_exit_2_printing_the_pip_command(monkeypatch, capsys):
    import fsspec

    from dinopipe.utils.exits import run_command

    def no_client(proto):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "get_filesystem_class", no_client)
    monkeypatch.setattr(storage, "_fs_cache", {})
    assert run_command("dinopipe pretrain", lambda: storage.filesystem("s3://bucket/shards") and 0) == 2
    err = capsys.readouterr().err
    assert "pip install 'dinopipe[s3]'" in err and "s3://bucket/shards" in err and "Traceback" not in err


def test_a_store_error_from_a_dataloader_worker_is_still_one_line():
    from torch._utils import ExceptionWrapper

    try:
        raise storage.StoreUnavailable("s3://b/shard-000001.tar: still failing after 9 attempts in 300 s (throttled)")
    except storage.StoreUnavailable:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(storage.StoreUnavailable) as e:
        wrapped.reraise()
    assert str(e.value) == "s3://b/shard-000001.tar: still failing after 9 attempts in 300 s (throttled)"


def test_checkpoints_are_pruned_by_step_number_never_the_newest():
    from dinopipe.train.checkpoint import _stale

    names = ["step_9", "step_10", "step_00000011", "step_2", "latest", "notes"]
    assert _stale(names, keep="step_2", keep_last=2) == ["step_9"]  # 10 and 11 are the newest two; 2 was just saved
    assert _stale(["step_5"], keep="step_5", keep_last=1) == []


def _report(skip=False, corrupt=0):
    from dinopipe.train.step_data import DataReport

    return DataReport(skip=skip, corrupt={"not_an_image": corrupt} if corrupt else {})


def test_training_that_only_skips_ends_naming_the_shards():
    from dinopipe.train.step_data import DataGuard, TooMuchBadData

    guard = DataGuard(max_in_a_row=3, max_fraction=1.0)
    batch = [{"corrupt_where": ["s3://b/shard-000007.tar"], "n_images": 0}]
    guard.update(0, _report(skip=True, corrupt=4), batch, 4)
    guard.update(1, _report(), [], 4)  # a good step resets the count
    guard.update(2, _report(skip=True, corrupt=4), batch, 4)
    guard.update(3, _report(skip=True, corrupt=4), batch, 4)
    with pytest.raises(TooMuchBadData, match="3 steps in a row.*shard-000007.tar"):
        guard.update(4, _report(skip=True, corrupt=4), batch, 4)


def test_a_corrupt_fraction_above_the_bound_ends_training_once_enough_images_were_read():
    from dinopipe.train.step_data import DataGuard, TooMuchBadData

    guard = DataGuard(max_in_a_row=0, max_fraction=0.25, min_images=64)
    for step in range(7):  # 3 of 8 unreadable (37 %), but only 56 images read: not yet judged
        guard.update(step, _report(corrupt=3), [{"corrupt_where": ["/data/bad.tar"]}], 8)
    with pytest.raises(TooMuchBadData, match=r"24 of 64 images were unreadable.*bad.tar"):
        guard.update(7, _report(corrupt=3), [], 8)
