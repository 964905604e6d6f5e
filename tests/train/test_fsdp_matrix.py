"""FSDP2 settings a user may pick, on 2 gloo ranks: reshard_after_forward x activation checkpointing x
param_dtype. Every combination trains, checkpoints, resumes to exactly where the uninterrupted run ends, and
exports a teacher equal (within the dtype's tolerance) to the one-process run of the same global batch.
reshard_after_forward=false used to crash at the first EMA update (the teacher's unsharded bf16 copies were
paired with the student's fp32 shards: "The size of tensor a (64) must match the size of tensor b (32)")."""

import itertools
import json
import subprocess
import sys

import pytest
import torch

import dinopipe
from tests.train.conftest import REPO, env
from dinopipe.ssl.ema import ema_update_

WORKER = str(REPO / "tests" / "train" / "_fsdp_matrix_worker.py")
COMBOS = [f"{raf},{ac},{dt}" for raf, ac, dt in itertools.product(("true", "false"), ("false", "true"), ("fp32", "bf16"))]
# One process vs 2 ranks after 4 steps. fp32: only the reduction order differs (measured 1.6e-8 on weights).
# bf16: one process autocasts (norms and softmax stay fp32) while FSDP2 casts parameters, so all of the
# block runs in bf16 (measured 1.7e-4 on weights, 0.34% on losses).
TOL = {"fp32": dict(weights=1e-6, loss=1e-5), "bf16": dict(weights=1e-3, loss=2e-2)}


def _worker(out, pool, combos, nproc):
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    r = subprocess.run([*launch, WORKER, str(out), str(pool), *combos], env=env(), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, f"worker exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, photo_pool):
    single = _worker(tmp_path_factory.mktemp("single"), photo_pool, ["-,-,fp32", "-,-,bf16"], 1)
    fsdp = _worker(tmp_path_factory.mktemp("fsdp"), photo_pool, COMBOS, 2)
    return single, fsdp


@pytest.mark.slow
@pytest.mark.dist
def test_every_fsdp2_combination_trains_resumes_exactly_and_matches_one_process(matrix):
    single, fsdp = matrix
    assert sorted(fsdp) == sorted(COMBOS)
    x = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    rows = []
    for combo, r in fsdp.items():
        dtype = combo.split(",")[2]
        ref = single[f"-,-,{dtype}"]
        assert r["codes"] == [0, 0], combo  # stopped after 2 steps with a checkpoint, then resumed to the end
        assert r["resumed_from"] == "step_00000004" and r["resumed_steps"] == r["steps"] == [0, 1, 2, 3], combo
        assert r["compute_dtype"] == ref["compute_dtype"] == dtype
        # resumed == uninterrupted, bit for bit (AC and resharding change memory, not math)
        assert r["resumed_losses"] == r["losses"] and r["resume_max_abs_diff"] == 0.0, combo
        assert r["losses"] == pytest.approx(ref["losses"], rel=TOL[dtype]["loss"]), combo
        a, b = dinopipe.load(r["export"]), dinopipe.load(ref["export"])
        diff = max(float((v - b.state_dict()[k]).abs().max()) for k, v in a.state_dict().items())
        assert diff <= TOL[dtype]["weights"], (combo, diff)
        with torch.no_grad():
            torch.testing.assert_close(a(x), b(x), atol=20 * TOL[dtype]["weights"], rtol=0)
        rows.append(f"{combo}: max |teacher - 1 process| = {diff:.2e}")
    print("\n".join(rows))
    # bf16 is in effect in one process too: its losses are not the fp32 ones
    assert single["-,-,bf16"]["losses"] != pytest.approx(single["-,-,fp32"]["losses"], rel=1e-5)


def test_ema_refuses_non_fp32_parameters():
    teacher, student = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    ema_update_(teacher, student, 0.5)  # fp32, unsharded in one process: fine
    with pytest.raises(RuntimeError, match=r"teacher parameter 'weight' is an unsharded tensor of torch.bfloat16"):
        ema_update_(teacher.to(torch.bfloat16), student, 0.5)
    with pytest.raises(ValueError, match="different parameters"):
        ema_update_(torch.nn.Linear(4, 4, bias=False), student, 0.5)
