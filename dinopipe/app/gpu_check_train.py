"""The training and curation parts of ``dinopipe gpu-check`` (see gpu_check.py): the SSL task on a 1-rank
FSDP2 mesh with measurements, the real CLI preempted by SIGTERM to its process group, and curation's faiss
paths. Each ``check_*(device, small, out_dir) -> dict`` returns its measurements and ``ok``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from ..utils.run_layout import TrainLayout


class Skip(Exception):
    """A check that does not apply here (no GPU, package not installed); recorded with its reason."""


REPO = Path(__file__).resolve().parents[2]  # the repository (this file: dinopipe/app/)


def _need(*modules: str) -> None:
    for m in modules:
        try:
            __import__(m)
        except ImportError:
            raise Skip(f"{m} is not installed (carry its wheel in: README, 'GPU acceptance check')") from None


# -- SSLTask on a 1-rank mesh --------------------------------------------------------------------------------


def _one_rank_group(dev: torch.device) -> tuple:
    """A world of 1 (NCCL on CUDA, gloo on CPU) without torchrun: FSDP2 and DCP as on a cluster.
    Returns (DistInfo, whether this call created the group)."""
    from ..train.dist import DistInfo

    created = not dist.is_initialized()
    if created:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=dev if dev.type == "cuda" else None)
    return DistInfo(rank=0, world_size=1, device=dev, backend=dist.get_backend()), created


@contextlib.contextmanager
def _record_collectives(seen: list):
    """Wrap the collectives FSDP2, DCP and the losses call, recording the device of every tensor they get."""
    names = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_gather",
             "_reduce_scatter_base", "_all_gather_base")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def wrap(name, fn):
        def inner(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else [a]):
                    if torch.is_tensor(t):
                        seen.append((name, t.device.type))
            return fn(*args, **kwargs)
        return inner

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _batch(cfg, b: int, seed: int = 0) -> dict:
    from ..data.transforms import MultiCropAugmentation, MultiCropCollator

    ph = cfg.phases[0]
    aug = MultiCropAugmentation(global_size=ph.global_crops_size, local_size=ph.local_crops_size,
                                n_local=cfg.crops.local_crops_number)
    rng = np.random.default_rng(seed)
    imgs = [rng.integers(0, 255, (ph.global_crops_size + 32, ph.global_crops_size + 32, 3), dtype=np.uint8)
            for _ in range(b)]
    return MultiCropCollator(14, tuple(cfg.ibot.mask_ratio_min_max), cfg.ibot.mask_sample_probability)(
        [aug(im, seed=i) for i, im in enumerate(imgs)])


def bf16_gemm_tflops(dev: torch.device, n: int = 8192, iters: int = 20) -> float:
    """The GPU's achievable bf16 matmul rate, measured now (the MFU denominator)."""
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(dev)
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def _task_config(small: bool, compile_: bool, model: str = "vit_s14", batch: int = 64):
    """The recipe's defaults at W = 1 for ``model`` at ``batch`` per GPU, bf16 (small: vit_test, tiny heads)
    (also ``bench/gpu_bench.py``'s dinopipe side)."""
    from ..config import load_config
    from ..ssl.config import PretrainConfig

    if small:
        over = ["model.name=vit_test", "model.img_size=56", "dino.head.n_prototypes=128", "dino.head.hidden_dim=64",
                "dino.head.bottleneck_dim=32", "ibot.head.n_prototypes=128", "ibot.head.hidden_dim=64",
                "ibot.head.bottleneck_dim=32", "crops.local_crops_number=2",
                "phases=[{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: 4}]"]
    else:
        over = [f"model.name={model}", "model.img_size=224", "crops.local_crops_number=8",
                "phases=[{name: base, fraction: 1.0, global_crops_size: 224, local_crops_size: 98, "
                f"batch_size_per_gpu: {batch}}}]"]
    return load_config(PretrainConfig, None, over + ["data.paths=[unused]", "parallel.param_dtype=bf16",
                                                      f"parallel.compile={str(compile_).lower()}"])


def _build(cfg, info, seed: int):
    from ..ssl.param_groups import build_param_groups
    from ..ssl.task import SSLTask
    from ..train.run import parallelize_task

    torch.manual_seed(seed)
    task = SSLTask(cfg).to(info.device)
    parallelize_task(task, info, cfg.parallel)
    task.build_optimizer(build_param_groups)
    opt = task.optimizers["student"]  # the trainer's AdamW (fused on CUDA, foreach on CPU: ssl/base.py)
    for g in opt.param_groups:
        g["lr"] = 1e-4
    return task, opt


def _local_states(task, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ..ssl.ema import local_tensor

    msd, osd = get_state_dict(task.student, opt)
    tsd = {f"teacher.{k}": v for k, v in task.teacher.state_dict().items()}
    flat = {**{f"student.{k}": v for k, v in msd.items()}, **tsd}
    for p, st in osd["state"].items():
        for k, v in st.items():
            flat[f"optim.{p}.{k}"] = v
    return {k: local_tensor(v).detach().cpu().clone() for k, v in flat.items() if torch.is_tensor(v)}


def check_task(dev: torch.device, small: bool, out_dir: Path) -> dict:
    _need("omegaconf")
    info, created = _one_rank_group(dev)
    try:
        return _task(dev, small, out_dir, info)
    finally:
        if created:
            dist.destroy_process_group()


def _task(dev: torch.device, small: bool, out_dir: Path, info) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from .. import plan as planner
    from ..ssl.ema import local_tensor
    from ..train.run import checkpoint_states

    cfg = _task_config(small, compile_=not small)  # compile on CPU would dominate the smoke's budget
    task, opt = _build(cfg, info, seed=0)
    b = cfg.phases[0].batch_size_per_gpu
    batch = _batch(cfg, b)
    values = {"teacher_temp": 0.07, "momentum": 0.99}
    n_steps = 3 if small else 20
    res: dict = {"model": cfg.model.name, "batch_per_gpu": b, "steps": n_steps, "compute_dtype": task.compute_dtype}
    seen: list = []
    sync_counts, step_times = [], []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with _record_collectives(seen):
        for step in range(n_steps):
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if dev.type == "cuda" and step == n_steps - 1:
                    torch.cuda.set_sync_debug_mode("warn")  # each host sync warns: count them on one step
                opt.zero_grad(set_to_none=True)
                loss, logs = task(batch, values)
                if step == 0:
                    teacher = list(task.teacher.parameters())
                    # the fp32 masters, not a bf16 copy left behind: FSDP2's sharded DTensors, or at one rank the
                    # plain parameters train/mirror.py swaps back after a no-grad forward
                    res["teacher_fp32_after_forward"] = all(
                        (isinstance(p, DTensor) or info.world_size == 1) and p.dtype == torch.float32
                        for p in teacher)
                loss.backward()
                opt.step()
                before = local_tensor(teacher[0]).clone()
                task.after_step(values)
                if step == 0:
                    res["ema_moved_teacher"] = not torch.equal(before, local_tensor(teacher[0]))
                if dev.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
                    torch.cuda.synchronize(dev)
            if dev.type == "cuda" and step == n_steps - 1:
                sync_counts.append(sum("synchroniz" in str(w.message) for w in caught))
            step_times.append(time.perf_counter() - t0)
    res["n_collectives"] = len(seen)  # FSDP2 issues none at world size 1; the loss all-reduces are skipped too
    res["collective_devices"] = sorted({d for _, d in seen})
    res["collectives_on_device"] = all(d == dev.type for _, d in seen)
    res["host_syncs_in_task_step"] = sync_counts[-1] if sync_counts else None
    steady = step_times[len(step_times) // 2:]
    res["step_s"] = float(np.median(steady))
    res["images_per_s"] = b / res["step_s"]
    res["loss"] = loss.detach().item()
    arch, heads = planner.describe(cfg)
    flops = planner.step_flops(cfg, arch, heads, cfg.phases[0], b)["model"]
    res["model_tflop_per_step"] = flops / 1e12
    if dev.type == "cuda":
        gemm = bf16_gemm_tflops(dev)
        mem_gb = torch.cuda.get_device_properties(dev).total_memory / 2**30
        predicted = planner.plan(cfg, 1, mem_gb)["phases"][0]["memory"]["fused_noac"]["total"]
        res.update(gemm_bf16_tflops=gemm, achieved_tflops=flops / res["step_s"] / 1e12,
                   mfu_vs_measured_gemm=flops / res["step_s"] / 1e12 / gemm,
                   peak_memory_gb=torch.cuda.max_memory_allocated(dev) / 2**30, plan_predicted_gb=predicted / 2**30)
    # DCP save, then load into a fresh task built from another seed: every tensor identical
    ckpt = out_dir / "task_dcp"
    states = checkpoint_states(task, opt)
    dcp.save(states, checkpoint_id=str(ckpt))
    task2, opt2 = _build(cfg, info, seed=1)
    task2(batch, values)[0].backward()  # materialise optimizer state to load into
    opt2.step()
    dcp.load(checkpoint_states(task2, opt2), checkpoint_id=str(ckpt))
    a, b2 = _local_states(task, opt), _local_states(task2, opt2)
    res["dcp_roundtrip_identical"] = a.keys() == b2.keys() and all(torch.equal(a[k], b2[k]) for k in a)
    res["ok"] = bool(res["teacher_fp32_after_forward"] and res["ema_moved_teacher"]
                     and res["collectives_on_device"] and res["dcp_roundtrip_identical"] and np.isfinite(res["loss"])
                     and res["compute_dtype"] == "bf16")
    return res


# -- the real CLI, preempted ---------------------------------------------------------------------------------


def _write_photos(folder: Path, n: int = 24) -> None:
    from PIL import Image
    from skimage import data as skd

    folder.mkdir(parents=True, exist_ok=True)
    names = ["astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina", "cat"]
    for i in range(n):
        img = getattr(skd, names[i % len(names)])()
        img = np.asarray(img)[:, ::-1] if i >= len(names) else np.asarray(img)  # flips: distinct files
        Image.fromarray(np.ascontiguousarray(img)).convert("RGB").save(folder / f"img_{i:03d}.jpg", quality=90)


def check_cli(dev: torch.device, small: bool, out_dir: Path) -> dict:
    if dev.type != "cuda":
        raise Skip("CUDA only (on CPU the preemption tests in tests/train cover it)")
    _need("omegaconf", "webdataset", "skimage")
    pool, run = out_dir / "photos", out_dir / "cli_run"
    _write_photos(pool)
    cmd = [sys.executable, "-m", "dinopipe.train.pretrain", "--config", str(REPO / "configs/pretrain/quickstart.yaml"),
           f"data.paths=[{pool}]", f"train.output_dir={run}", "model.name=vit_s14", "model.img_size=224",
           "data.num_workers=2", "parallel.compile=true", "parallel.param_dtype=bf16", "train.epochs=1",
           "train.epoch_length=12", "train.log_every=1", "train.checkpoint_every=100", "train.progress=false",
           "phases=[{name: low, fraction: 0.5, global_crops_size: 112, local_crops_size: 56, batch_size_per_gpu: 8},"
           " {name: high, fraction: 0.5, global_crops_size: 224, local_crops_size: 98, batch_size_per_gpu: 4}]"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + sys.path))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    metrics, deadline = TrainLayout(run).metrics, time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # wait until 3 steps are logged, then preempt
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)  # the whole group: ranks and data workers, as Slurm does
    out1, _ = proc.communicate(timeout=300)
    latest = TrainLayout(run).latest
    res = {"preempted_exit": proc.returncode, "checkpoint": latest.read_text().strip() if latest.is_file() else None}
    r2 = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    res.update(rerun_exit=r2.returncode, export=TrainLayout(run).export("teacher").is_dir())
    res["ok"] = res["preempted_exit"] == 124 and res["checkpoint"] is not None and r2.returncode == 0 and res["export"]
    if not res["ok"]:
        res["log_tail"] = (out1[-2000:], r2.stdout[-1000:], r2.stderr[-2000:])
    return res


# -- curation ------------------------------------------------------------------------------------------------


def _recall(idx: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(idx, truth)]))


def check_curation(dev: torch.device, small: bool, out_dir: Path) -> dict:
    _need("faiss")
    from curation.knn.index import build_index, iter_knn, num_gpus
    from curation.kmeans.hierarchical import kmeans

    from ..models import create_model

    res: dict = {"faiss_gpus": num_gpus()}
    name, px, n_img = ("vit_test", 56, 16) if small else ("vit_s14", 224, 256)
    model = create_model(name, img_size=px).to(dev).eval()
    x = torch.randn(n_img, 3, px, px, device=dev)
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
        model(x[:4])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for i in range(0, n_img, 64):
            emb = model(x[i:i + 64])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    res["embed_images_per_s"] = n_img / (time.perf_counter() - t0)
    res["embed_dtype"] = str(emb.dtype)
    n, d, k = (2000, 64, 10) if small else (200_000, 384, 10)
    g = torch.Generator().manual_seed(0)
    # clustered, like real embeddings (uniform random vectors are the worst case for an inverted file)
    centers = torch.randn(n // 100, d, generator=g)
    data = centers[torch.randint(0, len(centers), (n,), generator=g)] + 0.5 * torch.randn(n, d, generator=g)
    data = torch.nn.functional.normalize(data, dim=1)
    q = data[:500]
    truth = (q.to(dev) @ data.to(dev).T).topk(k, dim=1).indices.cpu().numpy()  # torch brute force
    for kind in ("flat", "ivf"):
        # batch_size < n: several add() calls, which a GPU-sharded flat index (IndexShards) must accept
        index = build_index(data.numpy(), kind=kind, nprobe=64, batch_size=n // 4)
        _, _, idx = next(iter_knn(index, q.numpy(), k, batch_size=len(q)))
        res[f"{kind}_recall@{k}"] = _recall(idx, truth)
        res[f"{kind}_on_gpu"] = bool(getattr(index, "on_gpu", False))
    if res["faiss_gpus"]:
        try:
            next(iter_knn(build_index(data.numpy(), kind="flat"), q.numpy()[:4], 2049))
            res["k_over_2048"] = "not refused"
        except Exception as exc:  # faiss-gpu cannot: the message must say what to do
            res["k_over_2048"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    t0 = time.perf_counter()
    cent = kmeans(data.numpy(), 32 if small else 1000, niter=10)
    res.update(kmeans_seconds=time.perf_counter() - t0, kmeans_shape=list(cent.shape))
    refused = not res.get("k_over_2048", "").startswith("not refused") and "2048" in res.get("k_over_2048", "2048")
    res["ok"] = res["flat_recall@10"] >= 0.99 and res["ivf_recall@10"] >= 0.5 and refused and \
        cent.shape[0] == (32 if small else 1000)
    return res


__all__ = ["check_task", "check_cli", "check_curation", "bf16_gemm_tflops"]


# -- the traced dry run against the real step on the GPU -------------------------------------------------------


def check_trace(dev: torch.device, small: bool, out_dir: Path) -> dict:
    """``dinopipe plan --trace`` at W = 1 (fake tensors, fake process group, on the CPU) vs the same two steps
    really run on this GPU under a 1-rank NCCL FSDP2 mesh: traced peak vs ``torch.cuda.max_memory_allocated``.
    The trace cannot see the caching allocator, NCCL buffers or the CUDA kernels' own workspaces (see
    ``dinopipe/plan/trace.py``), so it should sit a little below the real figure."""
    if dev.type != "cuda":
        raise Skip("compares a trace with torch.cuda.max_memory_allocated: needs a GPU")
    from functools import partial

    from ..plan.trace import _step, synthetic_batch, trace
    from ..ssl.param_groups import build_param_groups
    from ..ssl.task import SSLTask
    from ..train.builders import build_schedules
    from ..train.run import build_sharded_task

    cfg = _task_config(small=False, compile_=False)
    cfg.parallel.activation_checkpointing = True
    traced = trace(cfg, world_size=1, steps=2, comm_debug=False)
    info, created = _one_rank_group(dev)
    try:
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        task = build_sharded_task(SSLTask, cfg, info, cfg.parallel)

        opt = task.build_optimizer(partial(build_param_groups, lr_decay_rate=1.0, patch_embed_lr_mult=0.2))
        batch = synthetic_batch(cfg, cfg.phases[0], task.data_patch_size)
        sched = build_schedules(cfg, 1)
        for s in range(2):
            _step(task, opt, batch, {k: float(v[s]) for k, v in sched.items()}, cfg.optim.clip_grad)
        torch.cuda.synchronize(dev)
        real = torch.cuda.max_memory_allocated(dev) - base
        reserved = torch.cuda.max_memory_reserved(dev)
    finally:
        if created:
            dist.destroy_process_group()
    ratio = traced.peak_bytes / real
    return {"ok": 0.8 <= ratio <= 1.1, "config": f"{cfg.model.name} b={cfg.phases[0].batch_size_per_gpu} bf16 AC",
            "traced_peak_gib": traced.peak_bytes / 2**30, "cuda_max_allocated_gib": real / 2**30,
            "cuda_max_reserved_gib": reserved / 2**30, "trace_over_cuda": ratio,
            "planner_counted_gib": traced.planner["counted"] / 2**30, "trace_seconds": traced.seconds}
