"""Mixed precision at any world size: parallel.param_dtype=bf16 applies in a single process too (autocast),
the compute dtype is reported, TF32 is on for CUDA's fp32 matmuls, and fp16 (no gradient scaler) is refused
as a config error before anything is written."""

import glob

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import dinopipe.models.attention as attention
from tests.train.conftest import REPO, TINY
from dinopipe.config import load_config
from dinopipe.data.transforms import MultiCropAugmentation, MultiCropCollator
from dinopipe.ssl.config import PretrainConfig
from dinopipe.ssl.task import SSLTask
from dinopipe.train.dist import DistInfo
from dinopipe.config import ParallelConfig
from dinopipe.train.parallel import configure_device_math
from dinopipe.train.run import parallelize_task


@pytest.fixture(scope="module")
def batch(photo_pool):
    aug = MultiCropAugmentation(global_size=56, local_size=28, n_local=2)
    imgs = [Image.open(p).convert("RGB") for p in sorted(glob.glob(f"{photo_pool}/*.jpg"))[:4]]
    return MultiCropCollator(14, mask_probability=0.5)([aug(im, seed=i) for i, im in enumerate(imgs)])


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_one_process_attention_runs_in_param_dtype(batch, dtype, monkeypatch):
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *a, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/quickstart.yaml",
                      [*TINY, "data.paths=[x]", f"parallel.param_dtype={dtype}"])
    task = SSLTask(cfg)
    parallelize_task(task, DistInfo(), cfg.parallel)  # one process, no process group
    loss, logs = task(batch, {"teacher_temp": 0.04, "momentum": 0.9})
    loss.backward()
    task.after_step({"momentum": 0.9})  # the EMA still works on the fp32 parameters
    want = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    assert seen and set(seen) == {(want, want, want)}  # teacher and student, global and local crops
    assert logs["compute_dtype"] == dtype
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in task.parameters())  # master weights stay fp32
    assert all(p.grad.dtype == torch.float32 for p in task.student.parameters() if p.grad is not None)


def test_tf32_on_for_cuda_only():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        configure_device_math(torch.device("cpu"))
        assert not torch.backends.cuda.matmul.allow_tf32
        configure_device_math(torch.device("cuda"))  # only sets flags: runs without a GPU
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("key,value,msg", [("param_dtype", "fp16", "gradient scaler"),
                                           ("param_dtype", "bf17", "expected one of"),
                                           ("reduce_dtype", "fp64", "expected one of")])
def test_bad_dtype_is_a_config_error_before_anything_is_written(tmp_path, capsys, key, value, msg, photo_pool):
    from dinopipe.train.pretrain import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["--config", str(REPO / "configs/pretrain/quickstart.yaml"), *TINY, f"data.paths=[{photo_pool}]",
              f"train.output_dir={out}", f"parallel.{key}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"parallel.{key}" in err and msg in err
    assert not out.exists()


def test_parallel_config_defaults_are_valid():
    from dinopipe.config import check_parallel_config

    check_parallel_config(ParallelConfig())
