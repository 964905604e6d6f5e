"""The lr record's decision on resume (dinopipe/train/lr_record.py): keep the run's lr when only the world size
changed, apply (and say) an explicit change of the config's lr."""

import logging

from dinopipe.train.lr_record import LrBasis, resume_batches


def basis(batches, base_lr):
    return LrBasis(list(batches), lambda b: {}, lambda b: [base_lr * (x / 1024) ** 0.5 for x in b])


def test_another_world_size_keeps_the_recorded_batch(caplog):
    caplog.set_level(logging.INFO, logger="dinopipe.train.lr_record")
    now = basis([4], 0.004)
    assert resume_batches(now, [8], now.peaks([8])) == [8]
    assert len(caplog.records) == 1 and "keeping the run's peak lr" in caplog.text
    caplog.clear()
    assert resume_batches(now, [4], now.peaks([4])) == [4] and not caplog.records  # nothing changed: silent


def test_an_explicit_lr_change_applies_and_says_what_changed(caplog):
    caplog.set_level(logging.INFO, logger="dinopipe.train.lr_record")
    old, new = basis([8], 0.004), basis([4], 0.008)
    assert resume_batches(new, [8], old.peaks([8])) == [8]  # the new base lr, on the run's recorded batch
    assert len(caplog.records) == 1
    assert "lr override: the config changes the peak lr from [0.0003536] to [0.0007071]" in caplog.text


def test_a_changed_number_of_phases_falls_back_to_this_run(caplog):
    now = basis([4, 4], 0.004)
    assert resume_batches(now, [8], [0.1]) == [4, 4]
    assert "the checkpoint records the lr of 1 phases" in caplog.text
