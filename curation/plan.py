"""``curate plan``: memory per task and wall time per step of a sharded curation, on paper.

    curate plan --pool 142M --dim 1024 --index ivf_pq --pq-m 64 --nodes 20 --gpus-per-node 8 --gpu v100

A cost model, not a measurement: the index sizes are exact (faiss code sizes), the times come from
per-device rates (dimension-operations per second for IVF scans, FLOP/s for the coarse quantizer
and k-means, images/s for the embedder). The CPU rates were measured on this repository's 2-core CI
machine (ENVIRONMENT.md, bench/bench_sharded.py); the GPU rates are assumptions stated in
``GPUS`` — replace them with your own measurements (``--scan-rate`` etc.).

Steps, as slurm/submit_curation.sh chains them: embed (array, 1 GPU per task) -> index (one job on
one node: train IVF on 64 vectors per list, add every vector, write the index) -> search (array:
each task holds the index, memory-mapped or on its node's GPUs, and its query chunk) -> finish
(merge pairs, group, decontaminate, write; one CPU process).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

GiB = 1024 ** 3

# name: (GPU memory GiB, fp16 IVF scan rate [dim-ops/s], GEMM rate [FLOP/s], ViT-L/14@224 img/s)
GPUS = {"v100": (32, 1.5e11, 2.5e13, 400), "a100": (80, 4e11, 1e14, 1200),
        "h100": (80, 8e11, 2.5e14, 2500)}
CPU_SCAN = 2.3e9  # dim-ops/s per core: faiss IVF SQfp16 scan, measured here (200k x 384, nprobe 16)
CPU_GEMM = 7e10  # FLOP/s per core: faiss flat search, measured here
KMEANS_ITERS = 20


def parse_count(s: str) -> int:
    s = str(s).strip().upper().replace("_", "")
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(s[-1:], 1)
    return int(float(s[:-1] if mult != 1 else s) * mult)


def code_bytes(kind: str, dim: int, pq_m: int) -> int:
    return {"flat": 4 * dim, "ivf": 2 * dim, "ivf_sq8": dim}.get(kind, pq_m or dim // 16)


@dataclass
class Step:
    name: str
    tasks: int
    host_gib: float
    gpu_gib: float
    hours: float
    note: str = ""


def plan(pool: int, dim: int, kind: str = "ivf_pq", pq_m: int = 64, nodes: int = 20, gpus_per_node: int = 8,
         gpu: str = "v100", cpus_per_task: int = 8, node_mem_gib: float = 480, k: int = 64, nprobe: int = 16,
         nlist: int | None = None, n_eval: int = 1_000_000, chunk: int = 65536, pairs_per_image: float = 1.0,
         scan_rate: float | None = None, embed_rate: float | None = None) -> list[Step]:
    gpu_mem, gpu_scan, gpu_gemm, gpu_img = GPUS[gpu] if gpus_per_node else (0, 0, 0, 0)
    scan_rate = scan_rate or (gpu_scan if gpus_per_node else CPU_SCAN * cpus_per_task)
    gemm = gpu_gemm if gpus_per_node else CPU_GEMM * cpus_per_task
    n_gpus = nodes * gpus_per_node
    nlist = nlist or max(1, int(4 * math.sqrt(pool)))
    code = code_bytes(kind, dim, pq_m)
    index_gib = (pool * (code + (8 if kind != "flat" else 0)) + nlist * dim * 4) / GiB
    steps = []

    # embed: one task per GPU (or per CPU node), images decoded by the task's CPUs
    workers = n_gpus or nodes
    rate = embed_rate or (gpu_img if gpus_per_node else 2.0 * cpus_per_task)
    steps.append(Step("embed", workers, 8 + 0.05 * cpus_per_task, 4.0 if gpus_per_node else 0,
                      pool / (rate * workers) / 3600, f"{rate:g} img/s per task; writes {pool * dim * 2 / GiB:,.0f} GiB fp16"))

    # index: train k-means on 64 vectors per list, then assign + encode every vector; one node
    sample = min(pool, 64 * nlist)
    node_gemm = gemm * max(gpus_per_node, 1)
    train_s = KMEANS_ITERS * 2.0 * sample * nlist * dim / node_gemm
    add_s = 2.0 * pool * nlist * dim / node_gemm + pool * dim * 2 / 2e9  # assign + read the fp16 at 2 GB/s
    host = index_gib + sample * dim * 4 / GiB + 2
    # faiss-gpu k-means streams the host-side sample through the GPU: centroids + ~1 GiB scratch there
    steps.append(Step("index", 1, host, nlist * dim * 4 / GiB + 1 if gpus_per_node else 0,
                      (train_s + add_s) / 3600, f"nlist {nlist:,}, {code} B/vector codes: index {index_gib:,.1f} GiB"))

    # search: each query visits nprobe lists of ~pool/nlist codes; flat: every vector
    # dim-ops per query: one per stored dimension (flat, SQ) or one table lookup per PQ byte
    per_vector = code if kind == "ivf_pq" else dim
    per_query = per_vector * (pool if kind == "flat" else nprobe * pool / nlist)
    if kind == "ivf_pq":
        per_query += 256 * dim  # the query's lookup tables (inner product: once per query)
    coarse = 0 if kind == "flat" else 2.0 * nlist * dim
    gpus_needed = math.ceil(index_gib / (gpu_mem * 0.8)) if gpus_per_node else 0
    if gpus_per_node and gpus_needed <= 1:
        tasks, g_per_task, where = n_gpus, 1, "one task per GPU, index in GPU memory"
    elif gpus_per_node and gpus_needed <= gpus_per_node:
        tasks, g_per_task, where = nodes, gpus_per_node, f"one task per node, index sharded over {gpus_per_node} GPUs"
    else:
        tasks, g_per_task, where = nodes, 0, "index does not fit the GPUs: CPU search, index memory-mapped"
    scan = scan_rate * max(g_per_task, 1) if g_per_task else CPU_SCAN * cpus_per_task * (gpus_per_node or 1)
    flops = (gpu_gemm * g_per_task) if g_per_task else CPU_GEMM * cpus_per_task
    search_s = pool * (per_query / scan + coarse / flops) / tasks
    q_gib = chunk * (dim * 4 + (k + 1) * 12) / GiB
    fits = "" if index_gib + q_gib < node_mem_gib else f"; index exceeds {node_mem_gib:g} GiB of host memory"
    steps.append(Step("search (dedup)", tasks, index_gib + q_gib + 1, index_gib / g_per_task if g_per_task else 0,
                      search_s / 3600, where + fits))
    # decontamination: pool chunks against a flat eval index (small: on the GPUs when there are any)
    eval_gib = n_eval * dim * 4 / GiB
    eval_rate = gpu_gemm * n_gpus if gpus_per_node else CPU_GEMM * cpus_per_task * tasks
    steps.append(Step("search (eval)", tasks, eval_gib + q_gib + 1, eval_gib if gpus_per_node else 0,
                      2.0 * pool * n_eval * dim / eval_rate / 3600, f"{n_eval:,} eval images, flat"))
    # finish: union-find over the pool and the pairs, one process
    fin_gib = pool * (8 * 4 + 64) / GiB + pool * pairs_per_image * 24 / GiB
    steps.append(Step("finish", 1, fin_gib, 0, (pool * 2e-6 + pool * pairs_per_image * 1e-6) / 3600,
                      "merge pairs, group, decontaminate, write decisions (ids ~64 B each)"))
    return steps


def render(steps: list[Step], title: str) -> str:
    lines = [f"### {title}", "", "| step | tasks | host GiB / task | GPU GiB / task | wall h | note |",
             "|---|---:|---:|---:|---:|---|"]
    for s in steps:
        lines.append(f"| {s.name} | {s.tasks} | {s.host_gib:,.1f} | {s.gpu_gib:,.1f} | {s.hours:.2f} | {s.note} |")
    lines.append(f"| **total** | | | | **{sum(s.hours for s in steps):.1f}** | steps run one after another |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="curate plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", default="142M", help="embeddings in the pool, e.g. 142M, 1.2B")
    p.add_argument("--dim", type=int, default=1024, help="embedding dimension (ViT-L: 1024)")
    p.add_argument("--index", default="ivf_pq", choices=("flat", "ivf", "ivf_sq8", "ivf_pq"))
    p.add_argument("--pq-m", type=int, default=64, help="ivf_pq: bytes per vector")
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--gpus-per-node", type=int, default=8, help="0: CPU nodes")
    p.add_argument("--gpu", default="v100", choices=sorted(GPUS))
    p.add_argument("--cpus-per-task", type=int, default=8)
    p.add_argument("--node-mem", type=float, default=480, help="host GiB per node")
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--nprobe", type=int, default=16)
    p.add_argument("--nlist", type=int, default=None, help="default 4 sqrt(pool)")
    p.add_argument("--eval", type=parse_count, default=1_000_000, help="eval images to decontaminate against")
    p.add_argument("--scan-rate", type=float, default=None, help="dim-ops/s per GPU (or per CPU task)")
    p.add_argument("--embed-rate", type=float, default=None, help="images/s per embedding task")
    a = p.parse_args(argv)
    try:
        pool = parse_count(a.pool)
    except ValueError:
        print(f"curate plan: error: --pool {a.pool!r} is not a count like 142M or 1.2B", file=sys.stderr)
        return 2
    if a.index == "ivf_pq" and a.dim % a.pq_m:
        print(f"curate plan: error: --pq-m {a.pq_m} must divide --dim {a.dim}", file=sys.stderr)
        return 2
    steps = plan(pool, a.dim, a.index, a.pq_m, a.nodes, a.gpus_per_node, a.gpu, a.cpus_per_task, a.node_mem,
                 a.k, a.nprobe, a.nlist, a.eval, scan_rate=a.scan_rate, embed_rate=a.embed_rate)
    hw = f"{a.nodes} nodes x {a.gpus_per_node} {a.gpu.upper()}" if a.gpus_per_node else f"{a.nodes} CPU nodes"
    print(render(steps, f"{pool:,} x {a.dim}-d, {a.index}, {hw}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
