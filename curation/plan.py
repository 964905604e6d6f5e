"""curate plan: memory per task and wall time of every curation step, on paper.

    curate plan --pool 1.2B --dim 1024 --index ivf_pq --pq-m 64 --nodes 20 --gpus-per-node 8 --gpu v100

A cost model, not a measurement: index sizes are exact (faiss code sizes); times come from per-device
rates, each either measured in this repository (where is said next to it) or marked ASSUMED -- replace
those with your own (--scan-rate etc.). Steps, as the sharded curation runs them: embed (array, 1 GPU
per task) -> hash dedup (W tasks by band value) -> index train (one sample) -> index add (W tasks, one
inverted-list file each) -> index merge (on disk) -> search (W tasks by query rows) -> verification (pairs
on pixels) -> grouping (pair arrays, one process) -> decontamination (eval rows on the pool index) ->
k-means levels (every level's rows and centroids sharded over the ranks) -> sampling (three sharded passes)
-> shard writing (W tasks). curate simulate and bench/bench_curation_scale.py check the growth of each
step (time ~ N, memory per task ~ N/W) on this machine.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from .index import HNSW_EF_SEARCH, HNSW_M, ivf_nlist, resolve_quantizer

GiB = 1024 ** 3

# name: (GPU memory GiB, fp16 IVF scan rate [dim-ops/s], GEMM rate [FLOP/s], ViT-L/14@224 img/s)
GPUS = {"v100": (32, 1.5e11, 2.5e13, 400), "a100": (80, 4e11, 1e14, 1200),
        "h100": (80, 8e11, 2.5e14, 2500)}
CPU_SCAN = 2.3e9  # dim-ops/s per core: faiss IVF SQfp16 scan, measured here (200k x 384, nprobe 16)
CPU_GEMM = 7e10  # FLOP/s per core: faiss flat search, measured here
KMEANS_ITERS = 20
# rows/s per task, measured by `curate simulate` here (bench/bench_curation_scale.py, N = 10M x 384, W = 1: one
# task with this machine's 2 cores, nothing else running; docs/curation-scale.md "Measured growth")
HASH_RATE = 7e4  # hash dedup: (t+1)^2 = 25 sorted keys per row (10M rows: 141 s)
GROUP_RATE = 1.5e7  # grouping: union-find over pair arrays, per row of the pool (10M rows, 0.02 pairs per row: 0.6 s)
HASH_SCAN_RATE = 2.5e7  # rows/s a hash task scans per band to find the rows it owns (20M hashes, 1/160 owned: 0.72 s)
SAMPLE_RATE = 4e6  # sampling: three passes over labels + hash keys (10M rows: 2.3 s)
VERIFY_RATE = 590.0  # pairs/s per core on pixels, JPEG decoding included: measured here (bench/bench_verify.py,
# 1,000 candidate pairs of 574 retina + micrograph tiles, k = 8, 1 thread, quiet machine: 588 pairs/s)
WRITE_RATE = 2e8  # bytes/s per task reading + writing image bytes into shards: ASSUMED
EDGES_PER_IMAGE = 0.2  # verified copy pairs per image: ASSUMED (web pools: ~10-20% copies)
IMAGE_BYTES = 1.1e5  # bytes per image in the shards: ASSUMED (LVD-like JPEGs)
KMEANS_SAMPLE = 64  # Lloyd's sample: points per centroid (the simulation's; curation.kmeans default 256)
KMEANS_PIECE = 256 * 2**20  # fp32 centroid bytes per piece (curation.kmeans_shards.PIECE_BYTES)
KMEANS_BLOCK = 16384  # rows per assignment block (curation.kmeans.BLOCK)
NET_RATE = 1e10  # bytes/s a rank sends / receives in a collective: ASSUMED (100 Gb/s InfiniBand)


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
         scan_rate: float | None = None, embed_rate: float | None = None, levels=None,
         resampling: int = 0, keep_fraction: float = 0.5) -> list[Step]:
    gpu_mem, gpu_scan, gpu_gemm, gpu_img = GPUS[gpu] if gpus_per_node else (0, 0, 0, 0)
    scan_rate = scan_rate or (gpu_scan if gpus_per_node else CPU_SCAN * cpus_per_task)
    gemm = gpu_gemm if gpus_per_node else CPU_GEMM * cpus_per_task
    n_gpus = nodes * gpus_per_node
    nlist = nlist or ivf_nlist(pool)  # the index's policy: max(4 sqrt(N), N / 1000) lists
    quantizer = resolve_quantizer("auto", nlist) if kind != "flat" else "flat"
    code = code_bytes(kind, dim, pq_m)
    index_gib = (pool * (code + (8 if kind != "flat" else 0)) + nlist * dim * 4) / GiB
    steps = []

    # embed: one task per GPU (or per CPU node), images decoded by the task's CPUs
    workers = n_gpus or nodes
    rate = embed_rate or (gpu_img if gpus_per_node else 2.0 * cpus_per_task)
    steps.append(Step("embed", workers, 8 + 0.05 * cpus_per_task, 4.0 if gpus_per_node else 0,
                      pool / (rate * workers) / 3600, f"{rate:g} img/s per task; writes {pool * dim * 2 / GiB:,.0f} GiB fp16"))

    # index: train k-means on 64 vectors per list once; W tasks assign + encode their rows into their own
    # inverted-list files; one merge into an OnDiskInvertedLists file (read and written once, sequentially)
    sample = min(pool, 64 * nlist)
    node_gemm = gemm * max(gpus_per_node, 1)
    # coarse k-means: flat (GPU, or a flat quantizer) sample x nlist per iteration; the CPU two-level k-means
    # of an HNSW quantizer sample x 2 sqrt(nlist)
    per_point = 2 * math.sqrt(nlist) if quantizer == "hnsw" and not gpus_per_node else nlist
    train_s = KMEANS_ITERS * 2.0 * sample * per_point * dim / node_gemm
    add_tasks = max(workers, 1)
    # one coarse assignment: flat, nlist inner products (GEMM); HNSW, ~2 efSearch log2(nlist) distance
    # evaluations (measured here on one quiet core, 384-d, efSearch 64: 230 / 267 / 294 us at 40k / 80k / 160k
    # lists, the model's 327 / 344 / 361 us; docs/curation-scale.md "IVF sizing")
    hnsw_evals = 2.0 * HNSW_EF_SEARCH * math.log2(max(nlist, 2))
    cpu_scan = CPU_SCAN * cpus_per_task

    def coarse_s(n_vectors: int, flop_rate: float) -> float:
        if quantizer == "hnsw":
            return n_vectors * hnsw_evals * dim / cpu_scan
        return n_vectors * 2.0 * nlist * dim / flop_rate

    add_s = (coarse_s(pool, gemm) + pool * dim * 2 / 2e9) / add_tasks  # assign + read fp16 at 2 GB/s
    qdesc = (f"HNSW{HNSW_M} coarse quantizer (efSearch {HNSW_EF_SEARCH})" if quantizer == "hnsw"
             else "flat coarse quantizer")
    steps.append(Step("index train", 1, sample * dim * 4 / GiB + 1, nlist * dim * 4 / GiB + 1 if gpus_per_node else 0,
                      train_s / 3600, f"nlist {nlist:,} (~{pool / nlist:,.0f} per list) on {sample:,} vectors; {qdesc}"))
    # a task holds its codes, the trained index's centroids and (HNSW) the graph's 2M level-0 links per list
    coarse_gib = (nlist * dim * 4 + (nlist * 2 * HNSW_M * 4 if quantizer == "hnsw" else 0)) / GiB
    steps.append(Step("index add", add_tasks, index_gib / add_tasks + coarse_gib + 0.5, 0, add_s / 3600,
                      f"{code} B/vector codes: index {index_gib:,.1f} GiB in {add_tasks} files"))
    steps.append(Step("index merge", 1, 1.0, 0, 2 * index_gib * GiB / 5e8 / 3600,
                      "faiss merge_ondisk: memory-mapped in and out (0.5 GB/s ASSUMED)"))
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
    coarse_rate = flops
    if quantizer == "hnsw" and not g_per_task:  # CPU search walks the graph (faiss-gpu: flat GEMM on the GPU)
        coarse, coarse_rate = hnsw_evals * dim, CPU_SCAN * cpus_per_task
    search_s = pool * (per_query / scan + coarse / coarse_rate) / tasks
    q_gib = chunk * (dim * 4 + (k + 1) * 12) / GiB
    fits = "" if index_gib + q_gib < node_mem_gib else f"; index exceeds {node_mem_gib:g} GiB of host memory"
    steps.append(Step("search (dedup)", tasks, index_gib + q_gib + 1, index_gib / g_per_task if g_per_task else 0,
                      search_s / 3600, where + fits))
    cpu_tasks = max(workers, 1)
    cores = cpu_tasks * cpus_per_task
    # hash dedup: task t owns band values % W == t; 25 keys x 16 B per owned row; every task streams all N
    # hashes once per band (t + 1 = 5) to find its own rows
    hash_s = pool / (HASH_RATE * cpu_tasks) + 5 * pool / HASH_SCAN_RATE
    steps.insert(1, Step("hash dedup", cpu_tasks, pool / cpu_tasks * 48 / GiB + 0.1, 0, hash_s / 3600,
                         "partitioned by band value; exact up to t bits; each task scans all N hashes 5x"))
    # verification: candidate pairs on pixels, partitioned by kept image, thumbnails decoded once per task
    pairs = pool * pairs_per_image
    steps.append(Step("verification", cpu_tasks, 2.0, 0, pairs / (VERIFY_RATE * cores) / 3600,
                      f"{pairs_per_image:g} candidate pairs per image; {VERIFY_RATE:g} pairs/s per core (bench_verify)"))
    edges = pool * EDGES_PER_IMAGE
    steps.append(Step("grouping", 1, pool * 8 * 2 / GiB + edges * 16 / GiB, 0, pool / GROUP_RATE / 3600,
                      f"one process: union-find (int64 per row) over {EDGES_PER_IMAGE:g} verified pairs per "
                      f"image (ASSUMED)"))
    # decontamination: eval rows queried on the pool index, range search (no k cap)
    eval_s = n_eval * (per_query / scan + coarse / flops) / tasks
    steps.append(Step("decontaminate", tasks, index_gib / max(g_per_task, 1) + 1, index_gib / g_per_task if g_per_task else 0,
                      eval_s / 3600, f"{n_eval:,} eval images on the pool index"))
    for li, kc in enumerate(levels or (), start=1):
        pts = pool if li == 1 else levels[li - 2]  # level l clusters level l-1's centroids
        kc = min(kc, pts)
        w = max(n_gpus, cpu_tasks)  # every level sharded over the same ranks (curation/dist_kmeans.py)
        lloyd_s = KMEANS_ITERS * 2.0 * min(pts, kc * KMEANS_SAMPLE) * kc * dim / (gemm * w)
        assign_s = (1 + resampling) * 2.0 * pts * kc * dim / (gemm * w)
        # collectives: every assignment pass receives all k x D fp32 centroids a piece at a time, every Lloyd
        # iteration also reduces k x D sums (8 B) to their owners
        comm_s = ((KMEANS_ITERS + 1 + resampling) * kc * dim * 4 + KMEANS_ITERS * kc * dim * 8) / NET_RATE if w > 1 else 0
        # per rank: its k/W fp32 centroids + one received piece (fp32) + one piece of sums (8 B a value), a block
        # of rows (fp32), and 40 B for each of its pts/W rows (labels + distances, Lloyd's labels, the sort of
        # the size counts); the GPU: the piece, the block and their B x piece distance tile
        piece = min(kc, KMEANS_PIECE // (4 * dim))
        cent = kc * dim * 4 / GiB / w
        mem = cent + piece * dim * 12 / GiB + KMEANS_BLOCK * dim * 4 / GiB + pts / w * 40 / GiB + 0.25
        gpu = (piece * dim * 4 + KMEANS_BLOCK * dim * 4 + KMEANS_BLOCK * piece * 4) / GiB if gpus_per_node else 0
        steps.append(Step(f"k-means level {li} ({kc:,})", w, mem, gpu, (lloyd_s + assign_s + comm_s) / 3600,
                          f"{KMEANS_ITERS} Lloyd iterations on {KMEANS_SAMPLE}/centroid, {1 + resampling} assignment "
                          f"passes; rows ({pts:,}) and centroids sharded over {w} ranks in "
                          f"{-(-kc // piece):,} pieces of {piece:,}; {comm_s / 3600:.2f} h of collectives at "
                          f"{NET_RATE / 1e9:g} GB/s per rank (ASSUMED)"))
    steps.append(Step("sampling", cpu_tasks, pool / cpu_tasks * 16 / GiB + 0.1, 0, pool / (SAMPLE_RATE * cpu_tasks) / 3600,
                      "3 sharded passes, merges O(k x 256)"))
    kept = pool * keep_fraction
    steps.append(Step("write shards", cpu_tasks, 1.0, 0, kept * IMAGE_BYTES / (WRITE_RATE * cpu_tasks) / 3600,
                      f"{kept:,.0f} images x {IMAGE_BYTES / 1e3:.0f} kB, rate ASSUMED"))
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
    p.add_argument("--nlist", type=int, default=None, help="default max(4 sqrt(pool), pool / 1000); HNSW quantizer from 40,000")
    p.add_argument("--eval", type=parse_count, default=1_000_000, help="eval images to decontaminate against")
    p.add_argument("--scan-rate", type=float, default=None, help="dim-ops/s per GPU (or per CPU task)")
    p.add_argument("--embed-rate", type=float, default=None, help="images/s per embedding task")
    p.add_argument("--levels", type=parse_count, nargs="*", default=[], help="hierarchical k-means levels, e.g. 10M 500k")
    p.add_argument("--resampling", type=int, default=0, help="resampling steps per k-means level")
    p.add_argument("--pairs-per-image", type=float, default=1.0, help="candidate pairs to verify per image")
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
                 a.k, a.nprobe, a.nlist, a.eval, pairs_per_image=a.pairs_per_image, scan_rate=a.scan_rate,
                 embed_rate=a.embed_rate, levels=a.levels, resampling=a.resampling)
    hw = f"{a.nodes} nodes x {a.gpus_per_node} {a.gpu.upper()}" if a.gpus_per_node else f"{a.nodes} CPU nodes"
    print(render(steps, f"{pool:,} x {a.dim}-d, {a.index}, {hw}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
