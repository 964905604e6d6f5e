"""Nothing in a file a user hands over runs without an explicit opt-in (issue 31).

A ``.pt2`` (``torch.export``) is loaded by ``torch.export.load``, which falls back to
``torch.load(weights_only=False)`` when its weights-only load fails: the crafted archive below, a genuine export
whose sample inputs are a pickle that opens a marker file, writes the marker when torch loads it. dinopipe reads a
``.pt2``'s metadata as a zip member without loading it, and runs one only with ``trust_code``; a TorchScript copy
model (``dedup.model``) needs ``dedup.trust_code=true``. The restricted unpickler of DCP metadata caps what
``bytes(n)`` / ``bytearray(n)`` may build.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile

import pytest
import torch

from dinopipe.export.onnx import graph_metadata, program_runner
from dinopipe.utils.safe_load import CheckpointError, UnsafeCheckpointError, UntrustedCodeError, restricted_loads

META = {"in_chans": "3", "mean": "[0.5, 0.5, 0.5]", "std": "[0.2, 0.2, 0.2]"}


class _Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


class _OpensMarker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pt2(tmp_path, payload_marker=None, meta=None):
    """A genuine .pt2 with dinopipe.json, or with its sample inputs replaced by a pickle that opens a marker."""
    good = tmp_path / "good.pt2"
    ep = torch.export.export(_Double(), (torch.ones(2),))
    torch.export.save(ep, str(good), extra_files={"dinopipe.json": json.dumps(meta or META)})
    if payload_marker is None:
        return good
    buf = io.BytesIO()
    torch.save({"x": _OpensMarker(str(payload_marker))}, buf)
    evil = tmp_path / "evil.pt2"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(evil, "w") as zout:
        for info in zin.infolist():
            data = buf.getvalue() if info.filename.endswith("sample_inputs/model.pt") else zin.read(info.filename)
            zout.writestr(info, data)
    return evil


def test_crafted_pt2_metadata_is_read_and_running_it_is_refused(tmp_path):
    marker = tmp_path / "MARKER"
    evil = _pt2(tmp_path, payload_marker=marker)
    assert graph_metadata(evil) == {"in_chans": 3, "mean": [0.5] * 3, "std": [0.2] * 3}
    with pytest.raises(UntrustedCodeError, match="trust_code") as err:
        program_runner(evil)
    assert str(evil) in str(err.value)
    assert not marker.exists()  # nothing of the archive was loaded


def test_pt2_runs_with_the_opt_in(tmp_path):
    run = program_runner(_pt2(tmp_path), trust_code=True)
    assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0))


def test_pt2_metadata_that_is_too_large_or_not_json_is_refused(tmp_path):
    big = _pt2(tmp_path, meta={"in_chans": "3", "pad": "x" * (2 << 20)})
    with pytest.raises(CheckpointError, match="bytes"):
        graph_metadata(big)
    (tmp_path / "junk.pt2").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="junk.pt2"):
        graph_metadata(tmp_path / "junk.pt2")


def test_restricted_unpickler_caps_bytes():
    class Big:
        def __reduce__(self):
            return (bytes, (10**12,))

    with pytest.raises(UnsafeCheckpointError, match="bytes"):
        restricted_loads(pickle.dumps(Big()), "x/.metadata")
    assert restricted_loads(pickle.dumps(bytearray(b"ab")), "x/.metadata") == bytearray(b"ab")


class _Net(torch.nn.Module):
    def forward(self, x):
        return x.mean((2, 3))


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
def test_torchscript_copy_model_needs_dedup_trust_code(tmp_path):
    from dinopipe.config import ConfigError

    from curation.config import CurationConfig, validate
    from curation.embed.copymodel import build_copy_embedder

    path = tmp_path / "copy.torchscript.pt"
    torch.jit.save(torch.jit.script(_Net()), str(path))
    cfg = CurationConfig()
    cfg.input.paths, cfg.output.dir = [str(tmp_path)], str(tmp_path / "o")
    cfg.dedup.model = str(path)
    with pytest.raises(ConfigError, match="dedup.trust_code") as err:
        validate(cfg)
    assert str(path) in str(err.value)
    with pytest.raises(ConfigError, match="dedup.trust_code=true"):
        build_copy_embedder(str(path), 32, device="cpu")
    cfg.dedup.trust_code = True
    validate(cfg)
    emb = build_copy_embedder(str(path), 32, device="cpu", trust_code=True)
    assert emb is not None
    assert not os.path.exists(tmp_path / "o")
