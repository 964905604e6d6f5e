"""curate plan: memory per task and wall time of every curation step, on paper, with the chain's task counts.

    curate plan --pool 1.2B --dim 1024 --index ivf_pq --pq-m 64 --nodes 20 --gpus-per-node 8 --gpu v100 \
        --search-tasks 20 --kmeans-tasks 160

Task counts are the chain's, not the model's: chain_tasks calls curation.config.task_plan -- the function
curate run calls -- with the rows each step sees (--tasks is tasks.count; without it: 1 up to one block of
rows, else min(--cores, 8)). Hash dedup, index add, verification, decontamination, the k-means tree, sampling,
shard writing and the decisions parts run as those W local processes of curate run (or of the Slurm chain's
finishing job) on one machine of --cores cores; index train, index merge and grouping in one process. The
Slurm chain (slurm/submit_curation.sh) gives three steps arrays of their own: embedding (-n: --embed-tasks),
the copy and eval searches (-s: --search-tasks) and the k-means tree (-k: --kmeans-tasks).

Times are op counts or rows over rates, each printed with its mark: measured (source) -- from curation/plan_rates.json,
which bench/tools/rates_from_bench.py derives from the JSON of bench/bench_curation_scale.py and bench/bench_verify.py,
or a cited measurement -- or ASSUMED (--rates FILE: another rates file). Index sizes are exact (faiss code
sizes). Steps: embed, hash dedup, index train / add / merge, search, verification, grouping, decontamination,
k-means levels, sampling, shard writing, decisions.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from dinopipe.config import InputError

from curation.config import TasksConfig, task_plan
from curation.knn.index import FLAT_MAX_DEFAULT, HNSW_EF_SEARCH, HNSW_M, ivf_nlist, resolve_kind, resolve_quantizer
from curation.plan_rates import Rate, load_rates

GiB = 1024 ** 3

# name: (GPU memory GiB, fp16 IVF scan rate [dim-ops/s], GEMM rate [FLOP/s], ViT-L/14@224 img/s): ASSUMED
GPUS = {"v100": (32, 1.5e11, 2.5e13, 400), "a100": (80, 4e11, 1e14, 1200),
        "h100": (80, 8e11, 2.5e14, 2500)}
KMEANS_ITERS = 20
EDGES_PER_IMAGE = 0.2  # verified copy pairs per image: ASSUMED (web pools: ~10-20% copies)
HASH_DUP_FRACTION = 0.01  # hash near-duplicates per image: ASSUMED (the simulation plants 1%)
IMAGE_BYTES = 1.1e5  # bytes per image in the shards: ASSUMED (LVD-like JPEGs)
LLOYD_ITERS = 50  # Lloyd iterations per k-means (rebalance.kmeans_niter; the tolerance may stop it earlier)
LLOYD_POINTS = 256  # Lloyd runs on at most this many rows per centroid (curation.kmeans.dist.work_rows)
KMEANS_PIECE = 256 * 2**20  # fp32 centroid bytes per piece (curation.kmeans.shards.PIECE_BYTES)
KMEANS_BLOCK = 16384  # rows per assignment block (curation.kmeans.hierarchical.BLOCK)
READ_RATE = 2e9  # bytes/s a task reads embeddings at: ASSUMED
EVAL_NPROBE = 16  # the eval index's nprobe (an IVF above FLAT_MAX_DEFAULT eval rows, curation.knn.shards)


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
    rate: str = ""  # the rate the time came from, with its mark (measured (<source>) / ASSUMED)


def chain_tasks(pool: int, tasks: int | None = None, cores: int | None = None, kind: str = "auto",
                use_gpu: bool = False, hash_dup: float = HASH_DUP_FRACTION, copy_dup: float = EDGES_PER_IMAGE,
                decontaminated: int = 0, keep_fraction: float = 0.5, eval_rows: int = 1, verify: bool = True,
                hierarchical: bool = True, search_tasks: int = 0, kmeans_tasks: int = 0,
                launcher: str = "local") -> dict[str, int]:
    """Tasks of every step after embedding as the chain runs them on ``pool`` rows: each sharded step asks
    curation.config.task_plan (what curation.pipeline asks) for the rows it sees -- the hash dedup all rows,
    the index / copy search / verification the hash survivors, decontamination the rows not hash duplicates,
    k-means and sampling the rows left after dedup and decontamination, writing the kept rows. 0: the step
    does not run (flat or GPU index: no merge, one add; no eval rows; no hierarchical rebalancing). The Slurm
    chain's arrays: ``search_tasks`` (copy + eval search), ``kmeans_tasks`` (ranks of `curate kmeans`).
    ``launcher`` (tasks.launcher): inline runs the k-means tree as one rank (curation.kmeans.tree)."""
    cfg = TasksConfig(count=tasks, launcher=launcher)

    def w(n: int) -> int:
        return task_plan(cfg, n, cores)["tasks"]

    n_surv = pool - int(pool * hash_dup)
    n_rows = max(n_surv - int(pool * copy_dup) - decontaminated, 0)
    n_kept = int(n_rows * keep_fraction) if hierarchical else n_rows
    ondisk = resolve_kind(kind, n_surv) != "flat"  # KnnJob.build: an IVF (GPUs too) by W add tasks; flat: one
    knn = w(n_surv)
    tree = task_plan(cfg, n_rows, cores)
    tree_w = tree["tasks"] if tree["launcher"] in ("local", "srun") else 1
    return {"hash dedup": w(pool), "index train": 1, "index add": knn if ondisk else 1,
            "index merge": 1 if ondisk else 0, "search (dedup)": search_tasks or knn,
            "verification": knn if verify else 0, "grouping": 1,
            "decontaminate": (search_tasks or w(n_surv)) if eval_rows else 0,
            "k-means": (kmeans_tasks or tree_w) if hierarchical else 0,
            "sampling": w(n_rows) if hierarchical else 0, "write shards": w(n_kept), "decisions": w(n_kept)}


def _fmt(r: Rate, value: float | None = None, unit: str | None = None) -> str:
    return f"{value if value is not None else r.value:.3g} {unit or r.unit}, {r.mark()}"


def plan(pool: int, dim: int, kind: str = "ivf_pq", pq_m: int = 64, nodes: int = 20, gpus_per_node: int = 8,
         gpu: str = "v100", cpus_per_task: int = 8, node_mem_gib: float = 480, k: int = 64, nprobe: int = 16,
         nlist: int | None = None, n_eval: int = 1_000_000, chunk: int = 65536, pairs_per_image: float = 1.0,
         scan_rate: float | None = None, embed_rate: float | None = None, levels=None,
         resampling: int = 10, keep_fraction: float = 0.5, sample_size: int = 10, tasks: int | None = None,
         cores: int | None = None, search_tasks: int = 0, kmeans_tasks: int = 0, embed_tasks: int | None = None,
         rates: dict[str, Rate] | None = None, finish_tasks: int = 0, eval_views: int = 98) -> list[Step]:
    """The steps of the chain on ``pool`` rows: tasks (:func:`chain_tasks`), host / GPU GiB per task, hours.
    ``cores``: CPU cores of the machine running the W local tasks (default ``cpus_per_task``: the finishing
    job's); ``rates``: curation.plan_rates.load_rates() unless given. ``finish_tasks``: the finishing job as
    ``finish_tasks`` Slurm tasks (submit_curation.sh --finish-tasks: ``tasks.launcher=srun tasks.count=N``), each
    with ``cpus_per_task`` cores of its own and its share of the allocation's GPUs, instead of W processes
    sharing one machine's ``cores``."""
    R = rates or load_rates()
    cores = cores or cpus_per_task
    srun = bool(finish_tasks)
    if srun:
        tasks = finish_tasks
    gpu_mem, gpu_scan, gpu_gemm, gpu_img = GPUS[gpu] if gpus_per_node else (0, 0, 0, 0)
    gpu_rate = Rate(gpu_gemm, "FLOP/s per GPU")  # the GPU table: ASSUMED
    n_gpus = nodes * gpus_per_node
    nlist = nlist or ivf_nlist(pool)  # the index's policy: max(4 sqrt(N), N / 4000) lists
    quantizer = resolve_quantizer("auto", nlist) if kind != "flat" else "flat"
    code = code_bytes(kind, dim, pq_m)
    index_gib = (pool * (code + (8 if kind != "flat" else 0)) + nlist * dim * 4) / GiB
    tw = chain_tasks(pool, tasks, cores, kind, gpus_per_node > 0, keep_fraction=keep_fraction, eval_rows=n_eval,
                     verify=pairs_per_image > 0, hierarchical=bool(levels), search_tasks=search_tasks,
                     kmeans_tasks=kmeans_tasks, launcher="srun" if srun else "local")
    W = tw["hash dedup"]
    cpu_scan, cpu_gemm = R["cpu_scan"].value, R["cpu_gemm"].value
    steps = []

    def par(w: int) -> int:  # local tasks at once on the machine's cores (a task: one core at least); srun: all
        return w if srun else max(1, min(w, cores))

    # embed: the embedding array (-n), one GPU per task (or a CPU node), images decoded by the task's CPUs
    workers = embed_tasks or n_gpus or nodes
    rate = embed_rate or (gpu_img if gpus_per_node else 2.0 * cpus_per_task)
    steps.append(Step("embed", workers, 8 + 0.05 * cpus_per_task, 4.0 if gpus_per_node else 0,
                      pool / (rate * workers) / 3600, f"writes {pool * dim * 2 / GiB:,.0f} GiB fp16",
                      f"{rate:g} img/s per task, " + ("given" if embed_rate else "ASSUMED")))
    # hash dedup: W tasks by band value, each at the measured rows/s of one task
    r = R["hash_dedup"]
    steps.append(Step("hash dedup", W, pool / W * 48 / GiB + 0.1, 0, pool / (r.value * par(W)) / 3600,
                      "partitioned by band value; exact up to t bits", _fmt(r)))

    # index: trained once on 64 vectors per list; W tasks add into their own inverted-list files, merged on disk
    # (CPU IVF); a GPU or flat index is added in one process (curation.knn.shards.KnnJob.build)
    sample = min(pool, 64 * nlist)
    node_gemm, train_rate = (gpu_gemm * gpus_per_node, gpu_rate) if gpus_per_node else (cpu_gemm * cores, R["cpu_gemm"])
    # coarse k-means: flat (GPU, or a flat quantizer) sample x nlist per iteration; the CPU two-level k-means
    # of an HNSW quantizer sample x 2 sqrt(nlist)
    per_point = 2 * math.sqrt(nlist) if quantizer == "hnsw" and not gpus_per_node else nlist
    train_s = KMEANS_ITERS * 2.0 * sample * per_point * dim / node_gemm
    # one coarse assignment: flat, nlist inner products (GEMM); HNSW, ~2 efSearch log2(nlist) distance
    # evaluations (docs/curation-scale.md "IVF sizing")
    hnsw_evals = 2.0 * HNSW_EF_SEARCH * math.log2(max(nlist, 2))

    def coarse_s(n_vectors: int, flop_rate: float, scan: float) -> float:
        if quantizer == "hnsw" and not gpus_per_node:
            return n_vectors * hnsw_evals * dim / scan
        return n_vectors * 2.0 * nlist * dim / flop_rate

    qdesc = (f"HNSW{HNSW_M} coarse quantizer (efSearch {HNSW_EF_SEARCH})" if quantizer == "hnsw"
             else "flat coarse quantizer")
    if kind != "flat":
        steps.append(Step("index train", 1, sample * dim * 4 / GiB + 1,
                          nlist * dim * 4 / GiB + 1 if gpus_per_node else 0, train_s / 3600,
                          f"nlist {nlist:,} (~{pool / nlist:,.0f} per list) on {sample:,} vectors; {qdesc}",
                          _fmt(train_rate)))
    add_w = tw["index add"]
    if srun and add_w > 1:  # the add tasks' coarse assignment spread over the allocation's tasks (their cores)
        add_s = (coarse_s(pool, cpu_gemm * cpus_per_task * add_w, cpu_scan * cpus_per_task * add_w)
                 + pool * dim * 2 / (READ_RATE * add_w))
    else:
        add_s = coarse_s(pool, node_gemm, cpu_scan * cores) + pool * dim * 2 / (READ_RATE * par(add_w))
    coarse_gib = (nlist * dim * 4 + (nlist * 2 * HNSW_M * 4 if quantizer == "hnsw" else 0)) / GiB
    steps.append(Step("index add", add_w, index_gib / add_w + coarse_gib + 0.5, 0, add_s / 3600,
                      f"{code} B/vector codes: index {index_gib:,.1f} GiB in {add_w} file(s)"
                      + ("" if tw["index merge"] else "; one process (flat build)"), _fmt(train_rate)))
    if tw["index merge"]:
        r = R["merge"]
        steps.append(Step("index merge", 1, 1.0, 0, 2 * index_gib * GiB / r.value / 3600,
                          "faiss merge_ondisk: memory-mapped in and out", _fmt(r)))

    # search: S tasks (the Slurm array) or the W local tasks; each query visits nprobe lists of ~pool/nlist
    # codes (flat: every vector); dim-ops per query: one per stored dimension (flat, SQ) or one PQ byte lookup
    per_vector = code if kind == "ivf_pq" else dim
    per_query = per_vector * (pool if kind == "flat" else nprobe * pool / nlist)
    if kind == "ivf_pq":
        per_query += 256 * dim  # the query's lookup tables (inner product: once per query)
    coarse = 0 if kind == "flat" else 2.0 * nlist * dim
    s_w = tw["search (dedup)"]
    array = bool(search_tasks) or srun  # Slurm tasks of their own: the search array or the srun finishing job
    cpus = cpus_per_task if array else cores / s_w  # a local task's share of the machine
    gpus = (n_gpus if array else gpus_per_node) / s_w  # a task's share of the GPUs (< 1: tasks share one)
    g_whole = max(1, int(gpus)) if gpus_per_node else 0
    copies = max(1.0, 1 / gpus) if gpus_per_node else 1  # tasks sharing a GPU each load the index on it
    if gpus_per_node and index_gib * copies <= 0.8 * gpu_mem * g_whole:
        where = (f"{g_whole} GPU(s) per task, index in GPU memory" if gpus >= 1 else
                 f"{1 / gpus:.0f} tasks per GPU, each its own copy of the index")
        scan, flops, rate_s = (scan_rate or gpu_scan) * min(gpus, g_whole), gpu_gemm * min(gpus, g_whole), \
            Rate(gpu_scan, "dim-ops/s per GPU")
        gpu_gib = index_gib / g_whole
    else:
        where = ("index does not fit the GPUs: " if gpus_per_node else "") + "CPU search, index memory-mapped"
        scan, flops, rate_s, gpu_gib = (scan_rate or cpu_scan) * cpus, cpu_gemm * cpus, R["cpu_scan"], 0
        if quantizer == "hnsw":  # CPU search walks the graph (faiss-gpu: flat GEMM on the GPU)
            coarse, flops = hnsw_evals * dim, cpu_scan * cpus
    search_s = pool * (per_query / scan + coarse / flops) / s_w
    q_gib = chunk * (dim * 4 + (k + 1) * 12) / GiB
    fits = "" if index_gib + q_gib < node_mem_gib else f"; index exceeds {node_mem_gib:g} GiB of host memory"
    steps.append(Step("search (dedup)", s_w, index_gib + q_gib + 1, gpu_gib, search_s / 3600,
                      ("Slurm array; " if search_tasks else "srun tasks; " if srun else "") + where + fits,
                      _fmt(rate_s, scan_rate) if scan_rate else _fmt(rate_s)))
    # verification: candidate pairs on pixels, W tasks by kept image, one core each, thumbnails decoded once
    if tw["verification"]:
        pairs, r = pool * pairs_per_image, R["verification"]
        steps.append(Step("verification", tw["verification"], 2.0, 0,
                          pairs / (r.value * par(tw["verification"])) / 3600,
                          f"{pairs_per_image:g} candidate pairs per image, one core per task", _fmt(r)))
    edges, r = pool * EDGES_PER_IMAGE, R["grouping"]
    steps.append(Step("grouping", 1, pool * 8 * 2 / GiB + edges * 16 / GiB, 0, pool / r.value / 3600,
                      f"one process: star grouping over {EDGES_PER_IMAGE:g} verified pairs per image (ASSUMED)",
                      _fmt(r)))
    # decontamination: pool rows queried on the eval index (CPU: flat up to 50k eval rows, else an IVF), the
    # search array's tasks or the W local tasks
    if tw["decontaminate"]:
        d_w = tw["decontaminate"]
        d_cpus = cpus_per_task if array else cores / d_w
        rows = n_eval * max(1, eval_views)  # the eval index holds every view (curation.decontaminate.views)
        if rows <= FLAT_MAX_DEFAULT:
            per, how = 2.0 * rows * dim / (cpu_gemm * d_cpus), "flat eval index"
        else:
            nl = ivf_nlist(rows)
            per = 2.0 * nl * dim / (cpu_gemm * d_cpus) + EVAL_NPROBE * rows / nl * dim / (cpu_scan * d_cpus)
            how = f"IVF eval index ({nl:,} lists, nprobe {EVAL_NPROBE})"
        steps.append(Step("decontaminate", d_w, 1.0 + q_gib, 0, pool * per / d_w / 3600,
                          f"{n_eval:,} eval images x {eval_views} views; pool rows queried on the {how}, on CPU"
                          + ("; Slurm array" if search_tasks else "; srun tasks" if srun else ""), _fmt(R["cpu_gemm"])))
    for li, kc in enumerate(levels or (), start=1):
        pts = pool if li == 1 else levels[li - 2]  # level l clusters level l-1's centroids
        kc = min(kc, pts)
        w = tw["k-means"]  # every level sharded over the same ranks (curation/kmeans/dist.py)
        local = not kmeans_tasks and not srun
        g_rank = (gpus_per_node / w if local else n_gpus / w) if gpus_per_node else 0
        gemm = gpu_gemm * min(g_rank, 1) if g_rank else cpu_gemm * (cores / w if local else cpus_per_task)
        # the chain's level (curation.kmeans.dist.run): Lloyd on <= 256 rows per centroid, an assignment of every
        # row; each resampling step (rebalance.n_resampling_steps, when sample_size > 1) Lloyd again on the
        # k x sample_size rows kept and another assignment of every row
        steps_r = resampling if sample_size > 1 else 0
        lloyd_rows = min(pts, kc * LLOYD_POINTS) + steps_r * min(pts, kc * sample_size, kc * LLOYD_POINTS)
        lloyd_s = LLOYD_ITERS * 2.0 * lloyd_rows * kc * dim / (gemm * w)
        assign_s = (1 + steps_r) * 2.0 * pts * kc * dim / (gemm * w)
        # collectives: every Lloyd iteration and assignment pass receives all k x D fp32 centroids a piece at a
        # time, every Lloyd iteration also reduces k x D sums (8 B) to their owners
        net = R["network"]
        comm_s = (1 + steps_r) * ((LLOYD_ITERS + 1) * kc * dim * 4 + LLOYD_ITERS * kc * dim * 8) / net.value \
            if w > 1 and not local else 0
        # per rank: its k/W fp32 centroids + one received piece (fp32) + one piece of sums (8 B a value), a block
        # of rows (fp32), and 40 B for each of its pts/W rows (labels + distances, Lloyd's labels, the sort of
        # the size counts); the GPU: the piece, the block and their B x piece distance tile
        piece = min(kc, KMEANS_PIECE // (4 * dim))
        cent = kc * dim * 4 / GiB / w
        mem = cent + piece * dim * 12 / GiB + KMEANS_BLOCK * dim * 4 / GiB + pts / w * 40 / GiB + 0.25
        gpu_k = (piece * dim * 4 + KMEANS_BLOCK * dim * 4 + KMEANS_BLOCK * piece * 4) / GiB if gpus_per_node else 0
        steps.append(Step(f"k-means level {li} ({kc:,})", w, mem, gpu_k, (lloyd_s + assign_s + comm_s) / 3600,
                          f"{1 + steps_r} k-means of <= {LLOYD_ITERS} Lloyd iterations, {1 + steps_r} assignment "
                          f"passes; rows ({pts:,}) and centroids over {w} ranks "
                          + ("(local processes, gloo)" if local else "(srun tasks of the finishing job)" if
                             not kmeans_tasks else "(Slurm, `curate kmeans`)")
                          + f" in {-(-kc // piece):,} pieces of {piece:,}; {comm_s / 3600:.2f} h of collectives",
                          _fmt(gpu_rate if g_rank else R["cpu_gemm"]) + (f"; network {_fmt(net)}" if comm_s else "")))
    if tw["sampling"]:
        r, w = R["sampling"], tw["sampling"]
        steps.append(Step("sampling", w, pool / w * 16 / GiB + 0.1, 0, pool / (r.value * par(w)) / 3600,
                          "3 sharded passes, merges O(k x 256)", _fmt(r)))
    kept = pool * keep_fraction
    r, w = R["write_shards"], tw["write shards"]
    steps.append(Step("write shards", w, 1.0, 0, kept * IMAGE_BYTES / (r.value * par(w)) / 3600,
                      f"{kept:,.0f} images x {IMAGE_BYTES / 1e3:.0f} kB", _fmt(r)))
    r, w = R["decisions"], tw["decisions"]
    steps.append(Step("decisions", w, 0.1, 0, pool / (r.value * par(w)) / 3600,
                      "decisions parts by input ids, every input row", _fmt(r)))
    return steps


def render(steps: list[Step], title: str) -> str:
    lines = [f"### {title}", "", "| step | tasks | host GiB / task | GPU GiB / task | wall h | rate | note |",
             "|---|---:|---:|---:|---:|---|---|"]
    for s in steps:
        lines.append(f"| {s.name} | {s.tasks} | {s.host_gib:,.1f} | {s.gpu_gib:,.1f} | {s.hours:.2f} | {s.rate} "
                     f"| {s.note} |")
    lines.append(f"| **total** | | | | **{sum(s.hours for s in steps):.1f}** | | steps run one after another |")
    return "\n".join(lines)


def render_sources(rates: dict[str, Rate]) -> str:
    """The rates' sources below the table: each measurement once (bench, date, machine, command) with the rates
    taken from it; then the ASSUMED ones."""
    from curation.plan_rates import USED

    groups: dict[str, list[str]] = {}
    for name, r in sorted(rates.items()):
        if r.measured:
            note = "" if name in USED else " (reference: this step's time is the cost model's)"
            groups.setdefault(r.where(), []).append(f"{name} {r.value:.3g} {r.unit}{note}")
    out = ["", "Rates measured:"] + [f"* {where}: " + ", ".join(names) for where, names in groups.items()]
    out.append("* ASSUMED: " + ", ".join(f"{name} {r.value:.3g} {r.unit}" for name, r in sorted(rates.items())
                                         if not r.measured) + "; the GPU table (GPUS), embedding img/s, "
               f"{HASH_DUP_FRACTION:g} hash duplicates and {EDGES_PER_IMAGE:g} verified copies per image.")
    return "\n".join(out)


def _level(text: str):
    return "auto" if text == "auto" else parse_count(text)


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
    p.add_argument("--cpus-per-task", type=int, default=8, help="CPUs of an array task and of the finishing job")
    p.add_argument("--tasks", type=int, default=None,
                   help="W = tasks.count of the sharded steps (default: the chain's, 1 up to 65,536 rows, else "
                        "min(--cores, 8))")
    p.add_argument("--cores", type=int, default=None,
                   help="CPU cores where curate run / the finishing job runs its W tasks (default --cpus-per-task)")
    p.add_argument("--search-tasks", type=int, default=0, help="Slurm search array tasks (submit_curation.sh -s); "
                                                               "0: the W local tasks search")
    p.add_argument("--kmeans-tasks", type=int, default=0, help="curate kmeans ranks (submit_curation.sh -k); "
                                                               "0: the W local tasks")
    p.add_argument("--embed-tasks", type=int, default=None, help="embedding array tasks (default: one per GPU)")
    p.add_argument("--finish-tasks", type=int, default=0,
                   help="the finishing job as N Slurm tasks (submit_curation.sh --finish-tasks: tasks.launcher=srun "
                        "tasks.count=N), each --cpus-per-task cores; 0: W local tasks on one machine")
    p.add_argument("--node-mem", type=float, default=480, help="host GiB per node")
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--nprobe", type=int, default=16)
    p.add_argument("--nlist", type=int, default=None, help="default max(4 sqrt(pool), pool / 4000); HNSW quantizer from 40,000")
    p.add_argument("--eval", type=parse_count, default=1_000_000, help="eval images to decontaminate against")
    p.add_argument("--eval-views", type=int, default=98, help="rows per eval image in the eval index (98: "
                   "decontaminate.views, the default; 1: views off)")
    p.add_argument("--scan-rate", type=float, default=None, help="dim-ops/s per GPU (or per CPU task)")
    p.add_argument("--embed-rate", type=float, default=None, help="images/s per embedding task")
    p.add_argument("--levels", type=_level, nargs="*", default=[],
                   help="hierarchical k-means levels, e.g. 10M 500k, or auto (rebalance.levels: auto for this pool)")
    p.add_argument("--resampling", type=int, default=10,
                   help="resampling steps per k-means level (rebalance.n_resampling_steps)")
    p.add_argument("--sample-size", type=int, default=10, help="rows per cluster resampled (rebalance.sample_size)")
    p.add_argument("--pairs-per-image", type=float, default=1.0,
                   help="candidate pairs to verify per image (0: dedup.verify=false)")
    p.add_argument("--rates", default=None, help="rates file (default curation/plan_rates.json; bench/tools/rates_from_bench.py)")
    a = p.parse_args(argv)
    try:
        pool = parse_count(a.pool)
    except ValueError:
        print(f"curate plan: error: --pool {a.pool!r} is not a count like 142M or 1.2B", file=sys.stderr)
        return 2
    for name in ("dim", "pq_m", "nodes", "cpus_per_task", "k", "nprobe"):  # counts of which 0 means nothing to plan
        if getattr(a, name) < 1:
            print(f"curate plan: error: --{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}",
                  file=sys.stderr)
            return 2
    if a.index == "ivf_pq" and a.dim % a.pq_m:
        print(f"curate plan: error: --pq-m {a.pq_m} must divide --dim {a.dim}", file=sys.stderr)
        return 2
    if a.finish_tasks < 0:
        print(f"curate plan: error: --finish-tasks must be >= 0, got {a.finish_tasks}", file=sys.stderr)
        return 2
    for name in ("tasks", "cores"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            print(f"curate plan: error: --{name} must be >= 1, got {getattr(a, name)}", file=sys.stderr)
            return 2
    if "auto" in a.levels:
        if a.levels != ["auto"]:
            print(f"curate plan: error: --levels auto stands alone, got {' '.join(map(str, a.levels))}",
                  file=sys.stderr)
            return 2
        from curation.kmeans.hierarchical import auto_levels  # what a run with rebalance.levels: auto clusters

        a.levels = auto_levels(pool)
        print(f"--levels auto: {' '.join(f'{k:,}' for k in a.levels)} clusters (bottom-up, ~{pool / a.levels[0]:.0f} "
              f"rows per bottom cluster)")
    try:
        rates = load_rates(a.rates)
    except InputError as e:
        print(f"curate plan: error: {e}", file=sys.stderr)
        return 2
    steps = plan(pool, a.dim, a.index, a.pq_m, a.nodes, a.gpus_per_node, a.gpu, a.cpus_per_task, a.node_mem,
                 a.k, a.nprobe, a.nlist, a.eval, pairs_per_image=a.pairs_per_image, scan_rate=a.scan_rate,
                 embed_rate=a.embed_rate, levels=a.levels, resampling=a.resampling, sample_size=a.sample_size,
                 tasks=a.tasks, cores=a.cores,
                 search_tasks=a.search_tasks, kmeans_tasks=a.kmeans_tasks, embed_tasks=a.embed_tasks, rates=rates,
                 finish_tasks=a.finish_tasks, eval_views=a.eval_views)
    hw = f"{a.nodes} nodes x {a.gpus_per_node} {a.gpu.upper()}" if a.gpus_per_node else f"{a.nodes} CPU nodes"
    print(render(steps, f"{pool:,} x {a.dim}-d, {a.index}, {hw}"))
    print(render_sources(rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
