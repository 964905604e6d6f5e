"""The object-store rows of the fault table (tests/faults/rows_store.py), each run for real: moto's S3 server behind
the fault proxy (tests/storage/_s3.py), the fault armed at the row's point, the operation run under the commands'
exit-code wrapper (``run_command``), then: the exit code, the time bound, what is kept, and the rerun (faults
disarmed) against the undisturbed result."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import time
import warnings
from types import SimpleNamespace

import pytest

from tests.faults.rows_store import BUDGET_S, ROWS
from tests.faults.table import Row

BUCKET = "faults"
STORMS = {"503 storm < budget": ("slowdown", 3), "503 storm > budget": ("slowdown", None),
          "500 storm > budget": ("internal", None), "500 once": ("internal", 1),
          "connection reset": ("reset", 2), "reset storm > budget": ("reset", None), "cut body": ("drop", 1),
          "truncated body": ("short", 1), "403": ("forbidden", None), "bad key": ("badkey", None),
          "expired token": ("expired", None)}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from tests.storage.conftest import s3_server

    with s3_server(BUCKET, DINOPIPE_STORAGE_RETRY_S=str(BUDGET_S),
                   DINOPIPE_SCRATCH=str(tmp_path_factory.mktemp("scratch"))) as server:
        yield server


def _slug(row: Row) -> str:
    """The row's id as an object-key component (no characters a URL would escape)."""
    return re.sub(r"[^A-Za-z0-9_-]", "", row.id().replace("<", "lt").replace(">", "gt"))


def _arm(store, fault: str, key: str, method: str = "GET") -> None:
    from tests.storage._s3 import FOREVER

    action, times = STORMS[fault]
    store.arm(action, key, FOREVER if times is None else times, method)


def _disarm(store, row: Row) -> None:
    """Disarm; a row whose fault is a proxy fault must have hit the code under test (no vacuous pass)."""
    fired = store.disarm()
    if row.fault in STORMS:
        assert fired.get(STORMS[row.fault][0]), f"{row.id()}: the fault never fired"


def _run(op) -> tuple[int, float, str, object]:
    """(exit code through the commands' wrapper, seconds, stderr, the op's result)."""
    from dinopipe.utils.exits import run_command

    from dinopipe.utils.safe_load import CheckpointError

    out: dict = {}

    def body() -> int:
        try:
            out["r"] = op()
        except CheckpointError as exc:  # as `dinopipe pretrain` (builders.stage_main): a checkpoint it cannot use
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0

    err = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "single process" notes: not the command's one line
        code = run_command("faults", body)
    return code, time.monotonic() - t0, err.getvalue(), out.get("r")


def _ls(store, prefix: str) -> dict:
    """{key: ETag} under ``prefix``, straight from moto (the proxy's faults do not touch it)."""
    fs = store.client()
    fs.invalidate_cache()
    return {k: v.get("ETag") for k, v in fs.find(f"{BUCKET}/{prefix}", detail=True).items()}


def _check(row: Row, code: int, secs: float, err: str) -> None:
    from tests.storage.conftest import PLANTED_SECRET

    assert code == row.code, f"{row.id()}: exit {code}, want {row.code}\n{err[-3000:]}"
    assert secs <= row.bound_s, f"{row.id()}: took {secs:.1f} s > {row.bound_s} s"
    assert PLANTED_SECRET not in err
    if row.code in (2, 75):
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    if row.code == 75:
        assert "rerun the same command" in err


# ------------------------------------------------------------------------------------------------ checkpoints
def _states(seed: int):
    import torch

    from dinopipe.train.checkpoint import ModelOptimState, ValueState

    torch.manual_seed(seed)
    return {"trainer": ValueState(step=seed), "model": ModelOptimState(torch.nn.Linear(4, 3))}


def _weights(states):
    return {k: v.clone() for k, v in states["model"].model.state_dict().items()}


@pytest.fixture(scope="module")
def ckpt(store, tmp_path_factory):
    """A bucket run folder with a complete checkpoint at step 4 (and its tensors)."""
    from dinopipe.train.checkpoint import CheckpointManager

    url = f"s3://{BUCKET}/ck/base"
    states = _states(4)
    CheckpointManager(tmp_path_factory.mktemp("ck"), location=url).save(4, states)
    return url, _weights(states)


def _manager(url, tmp_path, keep_last=2):
    from dinopipe.train.checkpoint import CheckpointManager

    return CheckpointManager(tmp_path, keep_last=keep_last, location=url)


def _latest(store, row, ckpt, tmp_path):
    url, _ = ckpt
    if row.fault == "absent (404)":
        url = f"s3://{BUCKET}/ck/never-saved"
    elif row.fault == "no such bucket":
        url = "s3://no-such-bucket-here/ck"
    else:
        _arm(store, row.fault, "ck/base/latest")
    before = _ls(store, "ck/base")
    code, secs, err, found = _run(lambda: _manager(url, tmp_path).resume_point())
    _disarm(store, row)
    _check(row, code, secs, err)
    assert _ls(store, "ck/base") == before  # nothing written or deleted, whatever the end
    if row.fault == "absent (404)":
        assert found is None
        return
    if code == 0:
        assert str(found).endswith("step_00000004")
    if row.fault != "no such bucket":  # the rerun finds the checkpoint
        assert str(_manager(url, tmp_path).resume_point()).endswith("step_00000004")


def _save(store, row, ckpt, tmp_path):
    prefix = f"ck/save-{_slug(row)}"
    url = f"s3://{BUCKET}/{prefix}"
    mgr = _manager(url, tmp_path)
    if row.fault == "an older run's later checkpoints":  # a forgotten run's steps 6 and 8 in the same folder
        for step in (6, 8, 2, 4):
            mgr.save(step, _states(step))
        names = {k.rsplit("/", 2)[-2] for k in _ls(store, prefix) if "/step_" in k}
        assert names == {"step_00000004", "step_00000006", "step_00000008"}  # never the newest nor the one saved
        return
    mgr.save(2, _states(2))
    before = _ls(store, prefix)
    _arm(store, row.fault, f"{prefix}/step_00000004", method="PUT")
    code, secs, err, _ = _run(lambda: mgr.save(4, _states(4)))
    _disarm(store, row)
    _check(row, code, secs, err)
    if code != 0:
        after = _ls(store, prefix)
        assert {k: v for k, v in after.items() if "step_00000004" not in k} == before  # latest, step 2 untouched
        assert str(mgr.resume_point()).endswith("step_00000002")
        mgr.save(4, _states(4))  # the rerun
    assert str(mgr.resume_point()).endswith("step_00000004")
    loaded = _states(0)
    assert mgr.load(loaded) == 4
    want = _weights(_states(4))
    assert all((loaded["model"].model.state_dict()[k] == v).all() for k, v in want.items())


def _load(store, row, ckpt, tmp_path):
    url, want = ckpt
    if row.fault == "deleted mid-run":
        prefix = "ck/deleted"
        url = f"s3://{BUCKET}/{prefix}"
        _manager(url, tmp_path).save(4, _states(4))
        data = [k for k in _ls(store, prefix) if k.endswith(".distcp")]
        saved = {k: store.client().cat_file(k) for k in data}
        store.client().rm(data)
    else:
        _arm(store, row.fault, "ck/base/step_00000004/__")
    before = _ls(store, "ck")
    loaded = _states(0)
    code, secs, err, _ = _run(lambda: _manager(url, tmp_path).load(loaded))
    _disarm(store, row)
    _check(row, code, secs, err)
    assert _ls(store, "ck") == before
    if row.fault == "deleted mid-run":
        assert ".distcp" in err
        for k, v in saved.items():  # restored: the rerun loads it
            store.client().pipe_file(k, v)
    if code != 0:
        loaded = _states(0)
        _manager(url, tmp_path).load(loaded)
    got = _weights(loaded)
    assert all((got[k] == v).all() for k, v in want.items())


# ----------------------------------------------------------------------------------------------- training pool
@pytest.fixture(scope="module")
def pool(store, tmp_path_factory):
    """Real photos as shards in the bucket; the undisturbed pool index's locations and every sample's bytes."""
    from dinopipe.data.pool_index import open_pool
    from tests.storage.conftest import make_shards

    local = tmp_path_factory.mktemp("shards")
    paths = make_shards(str(local), per_shard=6)
    client = store.client()
    for p in paths:
        client.put_file(p, f"{BUCKET}/shards/{os.path.basename(p)}")
    url = f"s3://{BUCKET}/shards"
    ref = open_pool([url], cache_dir=str(tmp_path_factory.mktemp("idx")))
    locs = [tuple(ref[i][:3]) for i in range(len(ref))]
    return url, locs, [ref.read(ref[i]) for i in range(len(ref))], str(local)


def _walk(store, row, pool, tmp_path):
    from dinopipe.data.pool_index import open_pool

    url, want, _, _ = pool
    if row.fault == "no such bucket":
        url = "s3://no-such-bucket-here/shards"
    elif row.point == "pool listing":
        _arm(store, row.fault, "prefix=shards")
    else:
        _arm(store, row.fault, "shards/shard-000002.tar")
    cache = tmp_path / "idx"
    code, secs, err, got = _run(lambda: open_pool([url], cache_dir=str(cache)))
    _disarm(store, row)
    _check(row, code, secs, err)
    if code != 0:
        assert not cache.exists() or not any(cache.rglob("*.idx*")) and not any(cache.rglob("*.npy")), \
            sorted(cache.rglob("*"))  # no index of a walk that did not finish
        if row.fault == "no such bucket":
            return
        got = open_pool([url], cache_dir=str(cache))  # the rerun
    assert [tuple(got[i][:3]) for i in range(len(got))] == want
    assert all(got[i].offset >= 0 for i in range(len(got)))  # no '#damaged' placeholder persisted


def _reads(store, row, pool, tmp_path):
    from dinopipe.data.pool_index import open_pool
    from dinopipe.utils import storage

    url, _, want, local = pool
    if row.point.endswith("(s3fs)"):
        os.environ["DINOPIPE_S3_READER"] = "s3fs"
    try:
        if row.fault in ("deleted mid-run", "replaced mid-run"):
            url = f"s3://{BUCKET}/mid-{row.fault.split()[0]}"
            for fn in sorted(os.listdir(local)):
                store.client().put_file(os.path.join(local, fn), f"{url[5:]}/{fn}")
        idx = open_pool([url], cache_dir=str(tmp_path / "idx"))
        victim = "shard-000001.tar"
        if row.fault == "deleted mid-run":
            store.client().rm(f"{BUCKET}/mid-deleted/{victim}")
        elif row.fault == "replaced mid-run":
            store.client().pipe_file(f"{BUCKET}/mid-replaced/{victim}", open(os.path.join(local, victim), "rb").read()
                                     + b"\0" * 1024)
        else:
            _arm(store, row.fault, f"shards/{victim}")

        def read_all():
            out = []
            for i in range(len(idx)):
                try:
                    out.append(idx.read(idx[i]))
                except storage.Unreadable as e:  # what the training loader counts as corrupt, by reason
                    out.append(e.reason)
            return out

        code, secs, err, got = _run(read_all)
        _disarm(store, row)
        _check(row, code, secs, err)
        if code != 0:
            got = read_all()  # the rerun
        in_victim = [idx[i].path.endswith(victim) for i in range(len(idx))]
        if row.fault in ("deleted mid-run", "replaced mid-run"):
            reason = "missing" if row.fault.startswith("deleted") else "changed"
            assert [g for g, v in zip(got, in_victim) if v] == [reason] * sum(in_victim)
            assert [g for g, v in zip(got, in_victim) if not v] == [w for w, v in zip(want, in_victim) if not v]
        else:
            assert got == want  # every sample's bytes: none called corrupt
    finally:
        os.environ.pop("DINOPIPE_S3_READER", None)


# --------------------------------------------------------------------------------------------------- curation
@pytest.fixture(scope="module")
def images(store):
    """A folder of images in the bucket (a curation input): {name: bytes}."""
    from dinopipe.data.samples import encode
    from tests._photos import real_photos

    out = {}
    for name, arr in sorted(real_photos().items())[:6]:
        out[f"{name}.jpg"] = encode(arr, quality=85)
        store.client().pipe_file(f"{BUCKET}/imgs/{name}.jpg", out[f"{name}.jpg"])
    return f"s3://{BUCKET}/imgs", out


def _curation(store, row, images, tmp_path):
    from dinopipe.data.tar_sources import RemoteSource

    url, files = images
    if row.point == "curation listing":
        _arm(store, row.fault, "prefix=imgs")
        code, secs, err, got = _run(lambda: [r.id for r in RemoteSource(url).ref_seq(0, 1)])
        _disarm(store, row)
        _check(row, code, secs, err)
        if code != 0:
            got = [r.id for r in RemoteSource(url).ref_seq(0, 1)]
        assert got == [f"imgs/{n}" for n in sorted(files)]
        return
    source = RemoteSource(url)
    refs = list(source.ref_seq(0, 1))
    victim = sorted(files)[1]
    if row.fault == "deleted mid-run":
        store.client().rm(f"{BUCKET}/imgs/{victim}")
    else:
        _arm(store, row.fault, f"imgs/{victim}")
    try:
        code, secs, err, got = _run(lambda: [source.read(r) for r in refs])
        _disarm(store, row)
        _check(row, code, secs, err)
        if code != 0:
            got = [source.read(r) for r in refs]
        want = [files[n] for n in sorted(files)]
        if row.fault == "deleted mid-run":
            k = sorted(files).index(victim)
            assert got[k] is None and got[:k] + got[k + 1:] == want[:k] + want[k + 1:]
        else:
            assert got == want
    finally:
        store.client().pipe_file(f"{BUCKET}/imgs/{victim}", files[victim])


def _local_output(root, files: dict) -> str:
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    return str(root)


OUTPUT = {"manifest.json": b'{"kept": 3}', "shards/shard-000000.tar": b"t" * 3000, "decisions.tsv": b"a\tkept\n"}


def _publish(store, row, _, tmp_path):
    from curation.core.remote_output import MARKER, publish

    prefix = f"pub/{_slug(row)}"
    url = f"s3://{BUCKET}/{prefix}"
    local = _local_output(tmp_path / "out", OUTPUT)
    earlier = _local_output(tmp_path / "earlier", {"manifest.json": b"{}", "shards/shard-000009.tar": b"old"})
    publish(earlier, url)  # an earlier publish of another output to the same prefix
    if row.fault != "an earlier publish's stale objects":
        _arm(store, row.fault, f"{prefix}/shards/shard-000000.tar", method="PUT")
    code, secs, err, _ = _run(lambda: publish(local, url))
    _disarm(store, row)
    _check(row, code, secs, err)
    if code != 0:
        assert f"{BUCKET}/{prefix}/{MARKER}" not in _ls(store, prefix)  # never a marker on a half-published prefix
        assert all(os.path.exists(os.path.join(local, rel)) for rel in OUTPUT)  # the local output stays
        publish(local, url)  # the rerun
    got = {k[len(f"{BUCKET}/{prefix}/"):] for k in _ls(store, prefix)}
    assert got == {*OUTPUT, MARKER}  # the earlier publish's stale objects are gone
    for rel, data in OUTPUT.items():
        assert store.client().cat_file(f"{BUCKET}/{prefix}/{rel}") == data


def _pull(store, row, _, tmp_path):
    import shutil

    from curation.core.remote_output import MARKER, localize, publish, scratch_for

    prefix = f"pull/{_slug(row)}"
    url = f"s3://{BUCKET}/{prefix}"
    publish(_local_output(tmp_path / "out", OUTPUT), url)
    if row.fault == "no marker (half published)":
        store.client().rm(f"{BUCKET}/{prefix}/{MARKER}")
    else:
        _arm(store, row.fault, f"{prefix}/shards/shard-000000.tar")
    local = scratch_for(url)
    shutil.rmtree(local, ignore_errors=True)
    cfg = SimpleNamespace(output=SimpleNamespace(dir=url))
    code, secs, err, _ = _run(lambda: localize(cfg))
    _disarm(store, row)
    _check(row, code, secs, err)
    if row.fault == "no marker (half published)":
        assert os.path.isdir(local) and not os.listdir(local)  # nothing of a half-published prefix is used
        return
    if code != 0:
        assert not os.path.exists(local)  # no half-pulled folder left to be trusted
        localize(SimpleNamespace(output=SimpleNamespace(dir=url)))  # the rerun
    for rel, data in OUTPUT.items():
        with open(os.path.join(local, rel), "rb") as f:
            assert f.read() == data


# ------------------------------------------------------------------------------------- `dinopipe pretrain`
def _train():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("train_conftest", Path(__file__).parents[1] / "train" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SAME = ("train.epochs=2", "train.checkpoint_every=4", "data.num_workers=0")


@pytest.fixture(scope="module")
def pretrained(store, pool, tmp_path_factory):
    """An undisturbed run from the bucket (losses, checkpoints in the bucket) and a run SIGKILLed at step 6."""
    import subprocess

    train, url = _train(), pool[0]
    root = tmp_path_factory.mktemp("runs")
    ref_ckpt, run_ckpt = f"s3://{BUCKET}/e2e/ref", f"s3://{BUCKET}/e2e/run"
    train.run_pretrain(root / "ref", url, *SAME, f"train.checkpoint_dir={ref_ckpt}")
    env = dict(train.env(), DINOPIPE_DEBUG_HOOKS="signal=step:6:KILL")
    r = subprocess.run(train.pretrain_cmd(root / "run", url, *SAME, f"train.checkpoint_dir={run_ckpt}"), env=env,
                       capture_output=True, text=True, timeout=600, start_new_session=True)
    assert r.returncode == -9, r.stderr[-3000:]
    return train, url, root, ref_ckpt, run_ckpt


def _pretrain(train, run_dir, url, ckpt, *more):
    t0 = time.monotonic()
    r = train.run_pretrain(run_dir, url, *SAME, f"train.checkpoint_dir={ckpt}", *more, check=False)
    return r.returncode, time.monotonic() - t0, r.stderr


def _last_lines(err: str) -> str:
    """The command's own last line (a pretrain's log lines come first)."""
    return err.strip().splitlines()[-1] if err.strip() else ""


def _resume(store, row, pretrained, tmp_path):
    train, url, root, ref_ckpt, run_ckpt = pretrained
    want = train.losses(root / "ref")
    if row.fault.startswith("SIGKILL"):
        run, ckpt, prefix = root / "run", run_ckpt, "e2e/run"
        metrics = (run / "metrics.jsonl").read_text()
        before = _ls(store, prefix)
        _arm(store, "503 storm > budget", f"{prefix}/latest")
        code, secs, err = _pretrain(train, run, url, ckpt)
        _disarm(store, SimpleNamespace(fault="503 storm > budget", id=row.id))
        assert _ls(store, prefix) == before and (run / "metrics.jsonl").read_text() == metrics
        assert f"{ckpt}/latest" in err and "rerun the same command" in _last_lines(err)
    else:
        run, ckpt, prefix = root / "ref", ref_ckpt, "e2e/ref"
        saved = store.client().cat_file(f"{BUCKET}/{prefix}/latest")
        store.client().rm(f"{BUCKET}/{prefix}/latest")
        before = _ls(store, prefix)
        code, secs, err = _pretrain(train, run, url, ckpt)
        assert _ls(store, prefix) == before
        assert "step 4" in _last_lines(err) and "none" in _last_lines(err), err[-2000:]
        store.client().pipe_file(f"{BUCKET}/{prefix}/latest", saved)
    assert code == row.code, err[-3000:]
    assert secs <= row.bound_s and "Traceback" not in err
    code, _, err = _pretrain(train, run, url, ckpt)  # the rerun
    assert code == 0, err[-3000:]
    got = train.losses(run)
    assert sorted(got) == sorted(want) and all(got[s] == want[s] for s in want)


def _bad_data(store, row, _, tmp_path):
    train = _train()
    pool = tmp_path / "garbage"
    pool.mkdir()
    for k in range(12):
        (pool / f"img{k:02d}.jpg").write_bytes(b"not a jpeg " * (k + 1))
    t0 = time.monotonic()
    r = train.run_pretrain(tmp_path / "run", pool, *SAME, "train.max_skipped_in_a_row=3", check=False)
    secs = time.monotonic() - t0
    assert r.returncode == row.code and secs <= row.bound_s, r.stderr[-3000:]
    line = _last_lines(r.stderr)
    assert "3 steps in a row were skipped" in line and "img" in line and "garbage" in line, line
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------- URL loads
@pytest.fixture(scope="module")
def exported(store, tmp_path_factory):
    """A vit_test backbone exported (dinopipe's export folder) and a pretraining-like run folder with a DCP
    checkpoint, both in the bucket; the backbone's weights."""
    import torch

    from dinopipe.export.backbone import save_backbone
    from dinopipe.models.registry import create_model
    from dinopipe.train.checkpoint import CheckpointManager, ModelOptimState, ValueState

    torch.manual_seed(0)
    model = create_model("vit_test").eval()
    out = tmp_path_factory.mktemp("export")
    save_backbone(model, out / "exp")
    client = store.client()
    for f in sorted((out / "exp").rglob("*")):
        if f.is_file():
            client.put_file(str(f), f"{BUCKET}/exp/{f.relative_to(out / 'exp')}")
    run = out / "run"
    holder = torch.nn.Module()
    holder.backbone = model  # as a pretraining teacher: teacher.model.backbone.*
    CheckpointManager(run).save(3, {"trainer": ValueState(step=3), "teacher": ModelOptimState(holder)})
    for f in sorted(run.rglob("*")):
        if f.is_file():
            client.put_file(str(f), f"{BUCKET}/run/{f.relative_to(run)}")
    return {k: v.clone() for k, v in model.state_dict().items()}


def _url_load(store, row, weights, tmp_path):
    from dinopipe.export.remote import cache_root

    os.environ["DINOPIPE_CACHE"] = str(tmp_path / "cache")
    try:
        if "export --model" in row.point:
            from dinopipe.app.cli import main

            out = tmp_path / "out"
            _arm(store, row.fault, "exp/model.safetensors")
            err = io.StringIO()
            t0 = time.monotonic()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = main(["export", "--model", f"s3://{BUCKET}/exp", "--format", "timm", "--out", str(out)])
            _disarm(store, row)
            _check(row, code, time.monotonic() - t0, _last_lines(err.getvalue()) + "\n")
            assert not out.exists() and not any(cache_root().glob("*"))  # no --out, nothing half-fetched
            with contextlib.redirect_stdout(io.StringIO()):
                assert main(["export", "--model", f"s3://{BUCKET}/exp", "--format", "timm", "--out", str(out)]) == 0
            return
        import dinopipe

        dcp = "DCP" in row.point
        url = f"s3://{BUCKET}/run" if dcp else f"s3://{BUCKET}/exp"
        _arm(store, row.fault, "run/checkpoints/step_00000003/__" if dcp else "exp/model.safetensors")
        from dinopipe.models.registry import model_defaults

        heads = model_defaults("vit_test")["num_heads"] if dcp else None  # a bare DCP folder records no config
        code, secs, err, model = _run(lambda: dinopipe.load(url, num_heads=heads))
        _disarm(store, row)
        _check(row, code, secs, err)
        if code != 0:
            assert not any(cache_root().glob("*"))  # nothing half-fetched left to be read
            model = dinopipe.load(url, num_heads=heads)  # the rerun
        got = model.state_dict()
        assert all((got[k] == v).all() for k, v in weights.items() if k in got) and len(got) > 0
    finally:
        os.environ.pop("DINOPIPE_CACHE", None)


POINTS = {"dinopipe.load of an export": (_url_load, "exported"),
          "dinopipe.load of a run folder (DCP)": (_url_load, "exported"),
          "dinopipe export --model": (_url_load, "exported"),
          "resume": (_resume, "pretrained"), "training steps": (_bad_data, None),
          "latest": (_latest, "ckpt"), "checkpoint save": (_save, "ckpt"), "checkpoint load": (_load, "ckpt"),
          "pool walk": (_walk, "pool"), "pool listing": (_walk, "pool"), "sample reads": (_reads, "pool"),
          "sample reads (s3fs)": (_reads, "pool"), "curation listing": (_curation, "images"),
          "curation reads": (_curation, "images"), "publish": (_publish, None), "pull": (_pull, None)}


@pytest.mark.parametrize("row", [pytest.param(r, marks=[pytest.mark.slow] if r.slow else []) for r in ROWS],
                         ids=Row.id)
def test_store_fault_row(row, store, request, tmp_path):
    run, fixture = POINTS[row.point]
    run(store, row, request.getfixturevalue(fixture) if fixture else None, tmp_path)
