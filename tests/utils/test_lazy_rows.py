"""``utils/lazy_rows.py``: packed checkpoint tensors (official DINOv3 SwiGLU halves, Hugging Face q/k/v, timm
``fc1_g``/``fc1_x``) and a DCP folder's tensors are read only where sliced, so reading a source's architecture
before the process group (``check_backbone_file``) reads no weights, and a slice reads only its rows."""

import pytest
import torch
from torch import nn

from dinopipe import hub
from dinopipe.utils import lazy_rows, safe_dcp
from dinopipe.utils.lazy_rows import LazyRows, lazy_cat
from tests.train.test_shard_sources import write_sources


def test_lazy_cat_is_torch_cat_read_by_rows():
    a, b = torch.randn(4, 3), torch.randn(2, 3)
    ref, lazy = torch.cat([a, b]), lazy_cat([a, b])
    assert isinstance(lazy, LazyRows) and lazy.shape == ref.shape and lazy.dtype == ref.dtype
    for rows in (slice(0, 3), slice(3, 6), slice(1, 5), slice(6, 6)):
        got = lazy[rows]
        assert type(got) is torch.Tensor and torch.equal(got, ref[rows])
    assert torch.equal(lazy[2:5, 1:], ref[2:5, 1:]) and torch.equal(lazy * 2, ref * 2)
    real = nn.Linear(3, 6, bias=False)
    real.load_state_dict({"weight": lazy})  # one process: read whole at the copy
    assert torch.equal(real.weight, ref)
    with torch.device("meta"):
        meta = nn.Linear(3, 6, bias=False)
    with pytest.warns(UserWarning, match="meta"):
        meta.load_state_dict({"weight": lazy})  # nothing to read for a meta module


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("sources"))


@pytest.fixture
def counted(monkeypatch):
    """Rows read from any LazyRows, and whole reads."""
    seen = {"rows": 0, "full": 0}
    rows, full = LazyRows.rows, LazyRows.full

    def counted_rows(self, a, b):
        seen["rows"] += max(0, b - a)
        return rows(self, a, b)

    def counted_full(self):
        seen["full"] += 1
        return full(self)

    monkeypatch.setattr(LazyRows, "rows", counted_rows)
    monkeypatch.setattr(LazyRows, "full", counted_full)
    monkeypatch.setattr(safe_dcp, "LAZY_MIN_BYTES", 1)
    return seen


@pytest.mark.parametrize("name", ["dinov3_pth", "hf", "timm", "dcp"])
def test_reading_a_sources_architecture_reads_no_packed_weights(sources, counted, name):
    arch = hub.check_backbone_file(sources[name])
    assert arch["embed_dim"] == 64 and arch["num_heads"] == 2 and arch["ffn"].startswith("swiglu")
    assert counted == {"rows": 0, "full": 0}
    sd, _, _, _ = hub._read_backbone(hub.Path(sources[name]), None, None)
    packed = [k for k, v in sd.items() if isinstance(v, LazyRows)]
    assert "blocks.0.mlp.fc1.weight" in packed, packed  # SwiGLU halves packed (DCP: every tensor) lazily
    if name in ("hf", "dcp"):
        assert "blocks.0.attn.qkv.weight" in packed
    ref = hub.load(sources["dinov3_pth"]).state_dict()  # every source holds the same weights
    counted.update(rows=0, full=0)  # (a one-process load reads each packed tensor whole, one at a time)
    w = sd["blocks.0.mlp.fc1.weight"]
    n = w.shape[0]
    assert torch.equal(w[n // 4:n // 2], ref["blocks.0.mlp.fc1.weight"][n // 4:n // 2])
    assert counted == {"rows": n // 4, "full": 0}  # a slice reads its rows only


def test_dcp_tensors_read_lazily_equal_the_eager_read(sources):
    keys = {"teacher.model.backbone.blocks.1.attn.qkv.weight", "teacher.model.backbone.cls_token"}
    eager = safe_dcp.read_tensors(sources["dcp"], keys)
    lazy = safe_dcp.lazy_tensors(sources["dcp"], keys, min_bytes=1)
    assert all(isinstance(v, lazy_rows.LazyRows) for v in lazy.values())
    for k, v in eager.items():
        assert torch.equal(lazy[k][1:v.shape[0]], v[1:]) and torch.equal(lazy[k] + 0, v)
