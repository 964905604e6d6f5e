"""Every rank materialises only its slice whatever the source (issue 31): an official DINOv3 ``.pth`` (SwiGLU
``w1``/``w2`` packed into ``fc1``, the masked key bias rewritten), a Hugging Face ``DINOv3ViTModel`` folder (q/k/v
packed into ``qkv``), a timm DINOv3 folder (``fc1_g``/``fc1_x``, ``q_bias``/``v_bias``) and a run's DCP
checkpoint folder. Two gloo ranks load each with ``dinopipe.load`` while the build is recorded on ``meta``
(``train/meta_init.py``), shard it with FSDP2 and replay it: each rank's shard equals that slice of the
one-process load, and no packed or DCP tensor is ever read whole: a rank reads at most its share of the rows
of each (the converters and the DCP reader hand out ``LazyRows``, ``utils/lazy_rows.py``)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.train.conftest import REPO, env

SOURCES = ("dinov3_pth", "hf", "timm", "dcp")
WORKER = str(REPO / "tests" / "train" / "_shard_sources_worker.py")


def write_sources(root: Path) -> dict[str, str]:
    """A random ``vit_test_dinov3_swiglu`` (periods record the head count) in each layout; {source: path}."""
    import torch.distributed.checkpoint as dcp

    from dinopipe import hub
    from dinopipe.models import create_model
    from dinopipe.train.checkpoint import ModelOptimState

    torch.manual_seed(0)
    model = create_model("vit_test_dinov3_swiglu").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    out = {"dinov3_pth": hub.export(model, "dinov3", root / "dinov3_vitx16.pth"),
           "hf": hub.export(model, "hf", root / "hf"), "timm": hub.export(model, "timm", root / "timm")}
    run = root / "run"
    ckpt = run / "checkpoints" / "step_00000002"
    ckpt.parent.mkdir(parents=True)
    dcp.save({"teacher": ModelOptimState(nn.ModuleDict({"backbone": model}))}, checkpoint_id=str(ckpt),
             no_dist=True)
    (run / "config.yaml").write_text("model:\n  name: vit_test_dinov3_swiglu\n")
    out["dcp"] = ckpt
    return {k: str(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("sources"))


@pytest.mark.slow
@pytest.mark.dist
def test_every_rank_reads_only_its_slice_of_every_source(tmp_path, sources):
    import dinopipe

    world = 2
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                        WORKER, str(tmp_path), *(f"{k}={v}" for k, v in sources.items())],
                       env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"worker exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    for name, path in sources.items():
        ref = dinopipe.load(path).state_dict()
        covered = {k: 0 for k in ref}
        for rank in range(world):
            got = torch.load(tmp_path / f"{name}.rank{rank}.pt", weights_only=True)
            assert got["unreplayable"] is None, (name, got["unreplayable"])
            assert got["full_reads"] == 0, f"{name}: rank {rank} read a packed / DCP tensor whole"
            assert got["lazy_tensors"] > 0, name  # the packed (or DCP) tensors were there to be sliced
            for rows, n in got["rows_read"].values():  # per lazy tensor: rows this rank read, of n
                assert rows <= -(-n // world), (name, rank, rows, n)
            assert sorted(got["shards"]) == sorted(ref), name
            for k, (local, offset) in got["shards"].items():
                index = tuple(slice(o, o + s) for o, s in zip(offset, local.shape))
                assert torch.equal(local, ref[k][index]), f"{name}: rank {rank}'s shard of {k} differs"
                covered[k] += local.numel()
        assert all(covered[k] == v.numel() for k, v in ref.items()), name  # the shards make up the whole
