"""dinopipe.utils.io: a file trusted by its presence is whole or absent, never torn."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dinopipe.utils.io import atomic_open, atomic_path, atomic_write, atomic_write_json


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "manifest.json"
    atomic_write_json(path, {"kept": 1})
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_open(path) as f:
            f.write('{"kept": 2, "torn')
            raise RuntimeError("killed mid-write")
    assert json.loads(path.read_text()) == {"kept": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_writers_that_append_an_extension_land_on_the_real_name(tmp_path):
    path = tmp_path / "dedup.npz"
    with atomic_path(path, suffix=".npz") as tmp:  # np.savez appends .npz to a name without it
        np.savez(tmp[: -len(".npz")], status=np.arange(3))
    with np.load(path) as z:
        np.testing.assert_array_equal(z["status"], np.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dedup.npz"]


def test_text_and_bytes_round_trip_and_read_modes_are_refused(tmp_path):
    assert atomic_write(tmp_path / "latest", "step_00000010\n").read_text() == "step_00000010\n"
    assert atomic_write(tmp_path / "b.bin", b"\x00\x01").read_bytes() == b"\x00\x01"
    with pytest.raises(ValueError, match="mode"):
        with atomic_open(tmp_path / "latest", "a"):
            pass
