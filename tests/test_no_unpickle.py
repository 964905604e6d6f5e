"""Nothing a user hands over is unpickled: crafted checkpoints whose pickles would create a marker file (a
stand-in for ``os.system``) go through every entry that reads a user-given path, and the marker never appears;
the error names the file and command-line entries exit 2. A genuine checkpoint still loads."""

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dinopipe
from dinopipe.app.cli import main as cli_main
from dinopipe.hub import CheckpointError, UnsafeCheckpointError
from dinopipe.models import create_model
from dinopipe.utils.safe_load import read_dcp_metadata, restricted_loads
from tests._dinov2_reference import official_keys
from tests.train.conftest import run_pretrain, stage_cmd

REPO = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def marker(tmp_path):
    m = tmp_path / "PWNED"
    yield m
    assert not m.exists(), "a crafted checkpoint ran code"


def _dcp_checkpoint(folder: Path) -> dict:
    """A genuine DCP checkpoint of a vit_test teacher, as the training code lays it out."""
    sd = create_model("vit_test").state_dict()
    dcp.save({"teacher": {"model": {"backbone": sd}}}, checkpoint_id=str(folder), no_dist=True)
    return sd


def _poison_metadata(folder: Path, marker: Path) -> None:
    """Rewrite ``folder/.metadata`` as the genuine metadata with a payload inside (our own file: trusted)."""
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.planner_data = {"x": Payload(marker)}
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)


@pytest.fixture
def evil_dcp(tmp_path, marker):
    folder = tmp_path / "ckpt"
    _dcp_checkpoint(folder)
    _poison_metadata(folder, marker)
    return folder


@pytest.fixture
def evil_pth(tmp_path, marker):
    path = tmp_path / "evil.pth"
    torch.save({"model": official_keys(64, 1, grid=2), "args": Payload(marker)}, path)
    return path


@pytest.fixture
def evil_run(tmp_path, marker):
    """A run directory (no export yet) whose checkpoints/latest names a poisoned DCP folder."""
    run = tmp_path / "run"
    _dcp_checkpoint(run / "checkpoints" / "step_00000002")
    _poison_metadata(run / "checkpoints" / "step_00000002", marker)
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    return run


def test_genuine_dcp_checkpoint_loads(tmp_path):
    sd = _dcp_checkpoint(tmp_path / "ok")
    # a bare DCP folder (no run config.yaml beside it) does not record the head count: the loader asks for it
    with pytest.raises(CheckpointError, match="num_heads"):
        dinopipe.load(tmp_path / "ok")
    model = dinopipe.load(tmp_path / "ok", num_heads=create_model("vit_test").blocks[0].attn.num_heads)
    assert torch.equal(model.state_dict()["cls_token"], sd["cls_token"])


@pytest.mark.parametrize("kind", ["dcp", "pth", "run"])
def test_dinopipe_load_refuses(kind, evil_dcp, evil_pth, evil_run):
    path = {"dcp": evil_dcp, "pth": evil_pth, "run": evil_run}[kind]
    with pytest.raises(UnsafeCheckpointError) as err:
        dinopipe.load(path)
    named = {"dcp": evil_dcp / ".metadata", "pth": evil_pth,
             "run": evil_run / "checkpoints" / "step_00000002" / ".metadata"}[kind]
    assert str(named) in str(err.value) and "refusing" in str(err.value)


@pytest.mark.parametrize("kind", ["dcp", "pth"])
def test_torch_hub_refuses(kind, evil_dcp, evil_pth):
    path = evil_dcp if kind == "dcp" else evil_pth
    with pytest.raises(UnsafeCheckpointError, match="refusing"):
        torch.hub.load(str(REPO), "dinopipe_vit_test", source="local", weights=str(path))


@pytest.mark.parametrize("kind", ["dcp", "pth", "run"])
def test_cli_export_refuses_with_exit_2(kind, evil_dcp, evil_pth, evil_run, tmp_path, capsys):
    path = {"dcp": evil_dcp, "pth": evil_pth, "run": evil_run}[kind]
    rc = cli_main(["export", "--model", str(path), "--format", "timm", "--out", str(tmp_path / "out")])
    assert rc == 2 and str(path) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["dcp", "pth"])
def test_curation_embed_model_refuses(kind, evil_dcp, evil_pth):
    from dinopipe.config import ConfigError

    from curation.embed.embedder import build_embedder

    path = {"dcp": evil_dcp, "pth": evil_pth}[kind]
    with pytest.raises(ConfigError, match="embed.model") as err:
        build_embedder(str(path), 28, device="cpu")
    assert str(path) in str(err.value)


@pytest.mark.parametrize("kind", ["dcp", "pth"])
def test_cli_eval_refuses_with_exit_2(kind, evil_dcp, evil_pth, tmp_path, capsys):
    from PIL import Image

    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (28, 28), (60 * i, 100, 30)).save(tmp_path / split / c / f"{i}.png")
    path = {"dcp": evil_dcp, "pth": evil_pth}[kind]
    rc = cli_main(["eval", "knn", "--model", str(path), "--train", str(tmp_path / "train"), "--val",
                   str(tmp_path / "val"), "--device", "cpu"])
    assert rc == 2 and str(path) in capsys.readouterr().err


def test_bytes_entry_payload_is_refused(tmp_path, marker):
    """A non-tensor entry of a .distcp file (DCP stores them with torch.save; its own reader would
    torch.load them with weights_only=False) is read with weights_only=True."""
    from dinopipe.utils import safe_dcp

    folder = tmp_path / "ckpt"
    dcp.save({"trainer": {"note": Payload(marker), "step": torch.tensor(3)}}, checkpoint_id=str(folder), no_dist=True)
    state = {"trainer": {"note": None, "step": torch.tensor(0)}}
    with pytest.raises(UnsafeCheckpointError, match="trainer.note"):
        safe_dcp.load(state, folder, no_dist=True)
    dcp.save({"trainer": {"note": "plain text", "step": torch.tensor(3)}}, checkpoint_id=str(tmp_path / "ok"),
             no_dist=True)
    safe_dcp.load(state, tmp_path / "ok", no_dist=True)  # plain values still load
    assert state["trainer"]["note"] == "plain text" and int(state["trainer"]["step"]) == 3


@pytest.mark.parametrize("target", ["posix.system", "builtins.eval", "builtins.getattr", "subprocess.Popen",
                                    "torch.load", "torch.serialization.load", "pathlib.Path.write_text"])
def test_restricted_unpickler_refuses_other_globals(target):
    module, name = target.rsplit(".", 1)
    data = b"\x80\x04c" + module.encode() + b"\n" + name.encode() + b"\n)R."  # GLOBAL, EMPTY_TUPLE, REDUCE
    with pytest.raises(UnsafeCheckpointError, match=f"refusing to unpickle '{module}.{name}'"):
        restricted_loads(data, "X.metadata")


def test_data_file_outside_the_folder_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    _dcp_checkpoint(folder)
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint folder"):
        dinopipe.load(folder)


def test_lying_tensor_size_is_refused_before_allocating(tmp_path):
    folder = tmp_path / "ckpt"
    _dcp_checkpoint(folder)
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.state_dict_metadata["teacher.model.backbone.cls_token"].size = torch.Size([1 << 20, 1 << 20])
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(CheckpointError, match="claims"):
        dinopipe.load(folder)


# -- the training entries, as processes (exit codes) ---------------------------------------------------------


@pytest.fixture(scope="module")
def photo_pool_small(tmp_path_factory):
    from tests._photos import write_pool

    root = tmp_path_factory.mktemp("pool")
    write_pool(str(root))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dcp", "pth"])
def test_pretrain_model_pretrained_refuses_with_exit_2(kind, evil_dcp, evil_pth, tmp_path, photo_pool_small):
    path = evil_dcp if kind == "dcp" else evil_pth
    r = run_pretrain(tmp_path / "out", photo_pool_small, f"model.pretrained={path}", check=False, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert str(path) in r.stderr and "refusing" in r.stderr


@pytest.mark.parametrize("kind", ["dcp", "pth", "run"])
def test_distill_teacher_refuses_with_exit_2(kind, evil_dcp, evil_pth, evil_run, tmp_path, photo_pool_small, capsys):
    """``dinopipe distill`` (in this process: the teacher is checked before any process group exists)."""
    from dinopipe.train.distill import main as distill_main

    path = {"dcp": evil_dcp, "pth": evil_pth, "run": evil_run}[kind]
    argv = stage_cmd("distill", tmp_path / "out", photo_pool_small, f"teacher_model.path={path}")[3:]
    with pytest.raises(SystemExit) as exit_:
        distill_main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and str(path) in err and "refusing" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_genuine_checkpoint_loads_and_a_poisoned_one_is_refused_on_resume(tmp_path, photo_pool_small, marker):
    """The training code's own checkpoint passes the restricted unpickler (the allow-list is what it really
    holds: tensors, bytes entries for optimizer hyper-parameters, storage metadata). Resuming reads
    RUN/checkpoints/latest: a poisoned .metadata, or a genuine one whose optimizer hyper-parameter (a bytes
    entry) carries a payload, is refused with exit 2."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    run = tmp_path / "run"
    args = ("train.epochs=1", "train.checkpoint_every=2")
    run_pretrain(run, photo_pool_small, *args, "train.stop_after=2")
    ckpt = run / "checkpoints" / "step_00000002"
    md = read_dcp_metadata(ckpt)
    assert {type(v).__name__ for v in md.state_dict_metadata.values()} == {"TensorStorageMetadata",
                                                                          "BytesStorageMetadata"}
    assert dinopipe.load(run, which="student").embed_dim == 64
    # A bytes entry with a payload: our own genuine checkpoint (trusted) re-saved with one value replaced.
    flat = _load_state_dict_from_keys(checkpoint_id=str(ckpt))
    flat["student"]["optim"]["param_groups"][0]["lr"] = Payload(marker)
    shutil.rmtree(ckpt)
    dcp.save(flat, checkpoint_id=str(ckpt), no_dist=True)
    r = run_pretrain(run, photo_pool_small, *args, check=False, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert str(ckpt) in r.stderr and "param_groups.0.lr" in r.stderr and "refusing" in r.stderr
    _poison_metadata(ckpt, marker)
    r = run_pretrain(run, photo_pool_small, *args, check=False, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert str(ckpt / ".metadata") in r.stderr and "refusing" in r.stderr
