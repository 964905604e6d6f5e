"""Where dinopipe's training step spends its GPU time: torch.profiler over 3 steps after 5 warm-up steps of the
step `make gpu-bench` times (bench/gpu_bench.py's build and step), ViT-S/14 b=64 and ViT-L/14 b=32 compiled, then
ViT-L/14 eager; prints the kernels by self CUDA time and writes one table per case into OUT (docs/gpu.md's
profile table came from this script on an H200). On a machine without CUDA: vit_test, CPU times.

    python3 bench/gpu_profile_step.py OUT
"""
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import gpu_bench as gb  # noqa: E402
from dinopipe.gpu_check_train import _one_rank_group, _task_config  # noqa: E402
from dinopipe.plan.trace import synthetic_batch  # noqa: E402
from dinopipe.train.parallel import configure_device_math  # noqa: E402

cpu = not torch.cuda.is_available()
dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
configure_device_math(dev)
info, _ = _one_rank_group(dev)
out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("gpu-profile")
out.mkdir(parents=True, exist_ok=True)
cases = [("vit_s14", 64, True), ("vit_l14", 32, True), ("vit_l14", 32, False)] if not cpu else [("vit_test", 4, False)]
for model, b, comp in cases:
    t0 = time.time()
    dcfg = _task_config(cpu, compile_=comp, model=model, batch=b)
    task, opt, values = gb.build_dinopipe(dcfg, info)
    batch = gb._on_device(synthetic_batch(dcfg, dcfg.phases[0], task.data_patch_size), dev)

    def step(task=task, opt=opt, batch=batch, dcfg=dcfg, values=values):
        gb.dinopipe_step(task, opt, batch, values, dcfg.optim.clip_grad)
    for _ in range(5 if not cpu else 1):
        step()
    gb._sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not cpu else [])
    with profile(activities=acts) as prof:
        t1 = time.perf_counter()
        for _ in range(3):
            step()
        gb._sync(dev)
        wall = (time.perf_counter() - t1) / 3
    key = "self_cpu_time_total" if cpu else "self_cuda_time_total"
    tab = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
    evs = prof.key_averages()
    gpu_total = sum(e.self_device_time_total for e in evs) / 3 / 1e6 if not cpu else 0
    name = f"{model}_b{b}_{'compile' if comp else 'eager'}"
    (out / f"{name}.txt").write_text(tab)
    print(f"== {name}: wall {wall*1e3:.1f} ms/step, GPU kernel time {gpu_total*1e3:.1f} ms/step, "
          f"build+warmup {time.time()-t0:.0f}s", flush=True)
    print("\n".join(tab.splitlines()[:28]), flush=True)
    del task, opt, batch
    gb._cleanup(dev)
