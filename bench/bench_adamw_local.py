"""Host time of the AdamW step on FSDP2's DTensors: torch's AdamW vs the trainer's ShardLocalAdamW (ssl/adamw.py),
alternated in one run (issue 29, deliverable 3: fewer launches and less host work per step).

The student of the real ``SSLTask`` (a ViT-S/14's 12 blocks with DINO + iBOT heads: the recipe's parameter tensors
and DINOv2's layer-wise lr groups) sharded by ``parallelize_task`` on a 1-rank gloo FSDP2 mesh, with its widths cut
(``--dim``, heads' hidden / prototypes) so that the update's arithmetic is small next to the per-op host work that
a GPU step pays while its kernels run asynchronously: the count of tensors, groups and ops is the recipe's. Each
round times ``--reps`` optimizer steps of each side (same gradients), alternating; prints the median ms per step
and the ratio, for the foreach kernel (CPU's) and the fused one (CUDA's; torch has it on CPU too).

    python bench/bench_adamw_local.py [--rounds 5 --reps 20 --dim 48 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def build(dim: int):
    from dinopipe.config import load_config
    from dinopipe.ssl.config import PretrainConfig
    from dinopipe.ssl.task import SSLTask
    from dinopipe.train.dist import DistInfo
    from dinopipe.train.run import parallelize_task

    over = ["model.name=vit_s14", f"model.embed_dim={dim}", "model.num_heads=3", "model.img_size=56",
            "dino.head.n_prototypes=256", "dino.head.hidden_dim=64", "dino.head.bottleneck_dim=32",
            "ibot.head.n_prototypes=256", "ibot.head.hidden_dim=64", "ibot.head.bottleneck_dim=32",
            "ibot.separate_head=true", "data.paths=[x]", "parallel.param_dtype=fp32"]
    cfg = load_config(PretrainConfig, None, over)
    torch.manual_seed(0)
    task = SSLTask(cfg)
    info = DistInfo(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    parallelize_task(task, info, cfg.parallel)
    return task


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dim", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from dinopipe.ssl.adamw import ShardLocalAdamW
    from dinopipe.ssl.param_groups import build_param_groups

    task = build(args.dim)
    params = [p for p in task.student.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    for p in params:  # FSDP2's sharded gradients: DTensors like the parameters
        p.grad = p.detach().clone()
        p.grad.to_local().copy_(torch.randn(p.to_local().shape, generator=g))
    out: dict = {"torch": torch.__version__, "tensors": len(params), "dim": args.dim, "cases": {}}
    for impl in ("foreach", "fused"):
        opts = {name: cls(build_param_groups(task.student), lr=1e-4, **{impl: True})
                for name, cls in (("stock", torch.optim.AdamW), ("local", ShardLocalAdamW))}
        out["groups"] = len(opts["stock"].param_groups)
        times: dict = {k: [] for k in opts}
        for _ in range(args.rounds):
            for name, opt in opts.items():
                opt.step()  # warm (state created on the first)
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    opt.step()
                times[name].append((time.perf_counter() - t0) / args.reps * 1e3)
        ratios = [s / loc for s, loc in zip(times["stock"], times["local"])]
        case = {k: statistics.median(v) for k, v in times.items()}
        case["stock_over_local"] = statistics.median(ratios)
        out["cases"][impl] = case
        print(f"AdamW {impl:7s} on {len(params)} DTensors in {out['groups']} groups: stock {case['stock']:.2f} ms, "
              f"ShardLocalAdamW {case['local']:.2f} ms per step -> {case['stock_over_local']:.2f}x less host time",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
