"""Tiny pretraining runs on real photos, launched as real processes (plain python or torchrun)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent

# vit_test at 56 px, 2 local crops of 28 px, small heads: a step takes well under a second on 2 cores.
TINY = [
    "model.name=vit_test", "model.img_size=56", "model.drop_path_rate=0.0", "model.attn_backend=sdpa",
    "dino.head.n_prototypes=128", "dino.head.hidden_dim=64", "dino.head.bottleneck_dim=32",
    "ibot.head.n_prototypes=128", "ibot.head.hidden_dim=64", "ibot.head.bottleneck_dim=32",
    "crops.local_crops_number=2", "optim.base_lr=0.02", "optim.warmup_epochs=1", "optim.freeze_last_layer_epochs=0",
    "teacher.warmup_teacher_temp_epochs=1", "train.epoch_length=4", "train.log_every=1", "train.progress=false",
    "data.num_workers=0", "parallel.param_dtype=fp32",
    "phases=[{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: 4}]",
]


@pytest.fixture(scope="session")
def photo_pool(tmp_path_factory):
    from tests._photos import write_pool

    root = tmp_path_factory.mktemp("pool")
    write_pool(str(root))
    return root


def env():
    e = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


# The same tiny settings for distillation; students are even smaller vit_test variants. mode=auto (the
# default; the quickstart config pins feature mode): a teacher with heads gives ssl mode, a bare one feature.
TINY_DISTILL = [o for o in TINY if not o.startswith(("model.", "dino.head", "ibot.head"))] + ["mode=auto"] + [
    "students=[{name: s1, model: {name: vit_test, embed_dim: 32, num_heads: 1, depth: 2, img_size: 56}},"
    " {name: s2, model: {name: vit_test, embed_dim: 48, num_heads: 2, depth: 2, img_size: 56}}]",
]


def stage_cmd(stage, run_dir, pool, *overrides, nproc=1):
    base = TINY if stage == "pretrain" else TINY_DISTILL
    args = ["--config", str(REPO / f"configs/{stage}/quickstart.yaml"), *base, f"data.paths=[{pool}]",
            f"train.output_dir={run_dir}", *overrides]
    if nproc == 1:
        return [sys.executable, "-m", f"dinopipe.train.{stage}", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", f"dinopipe.train.{stage}", *args]


def pretrain_cmd(run_dir, pool, *overrides, nproc=1):
    return stage_cmd("pretrain", run_dir, pool, *overrides, nproc=nproc)


def run_stage(stage, run_dir, pool, *overrides, nproc=1, check=True, timeout=600):
    r = subprocess.run(stage_cmd(stage, run_dir, pool, *overrides, nproc=nproc), env=env(), capture_output=True,
                       text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{stage} exited {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-5000:]}")
    return r


def run_pretrain(run_dir, pool, *overrides, **kw):
    return run_stage("pretrain", run_dir, pool, *overrides, **kw)


def run_distill(run_dir, pool, *overrides, **kw):
    return run_stage("distill", run_dir, pool, *overrides, **kw)


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run_dir, key="loss"):
    return {r["step"]: r[key] for r in metrics(run_dir)}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(cmd, nproc, extra_env=None, timeout=600):
    """Start ``nproc`` ranks of ``cmd`` the way srun does: one process per rank, each leading its own process
    group (so a signal to "the job step" can reach each rank and its data workers), rendezvous through
    MASTER_ADDR/MASTER_PORT. Returns [(returncode, stdout, stderr)] per rank."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        e = dict(env(), **(extra_env or {}))
        if nproc > 1:
            e.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    return results
