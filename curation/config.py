"""The curation config schema (``curate --config configs/curation/X.yaml key=value ...``).

Defaults are DINOv2's LVD-142M values (Oquab et al. 2023, App. A) where the paper gives one, and
Vo et al. 2024's hierarchical k-means for ``rebalance.mode=hierarchical``. ``validate`` does the
cross-field checks the types cannot, raising :class:`~dinopipe.config.ConfigError` naming the key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from dinopipe.config import ConfigError, check_choices, choices
from dinopipe.utils.proc import usable_cores

# The choices and defaults the engines and steps read from here (one list each; config imports no step).
GPU_MAX_K = 2048  # faiss-gpu's top-k selection (and nprobe) stop at 2048 (GPU_MAX_SELECTION_K)
KINDS = ("auto", "flat", "ivf", "ivf_sq8", "ivf_pq")
MODES = ("none", "sample", "cluster", "hierarchical")
INITS = ("auto", "kmeans++", "random")
# pHash copies measured on real photos: resized / recompressed copies differ by <= 4 bits,
# 5%-cropped ones by up to ~20, and distinct photos by >= 18. 4 keeps this pass "near-exact";
# crops are left to the embedding-based copy dedup.
DEFAULT_MAX_DISTANCE = 4

IndexKind = choices("IndexKind", KINDS, __name__)
Grouping = choices("Grouping", ("star", "components"), __name__)
Precision = choices("Precision", ("auto", "fp32", "bf16"), __name__)
RebalanceMode = choices("RebalanceMode", MODES, __name__)
Strategy = choices("Strategy", ("r", "c"), __name__)
KMeansInit = choices("KMeansInit", INITS, __name__)


@dataclass
class DescriptorConfig:
    size: int = 64  # thumbnail side
    luma_freqs: int = 10  # keep DCT frequencies u, v < this for luminance (minus the DC term)
    chroma_freqs: int = 4  # ... and u, v < this for each chroma channel (DC kept: mean colour)
    freq_power: float = 1.0  # whitening under the natural-image prior (power ~ 1/f^2)
    pool_whiten: float = 0.0  # >0: extra PCA whitening fitted on the pool (power; 0.5 = half)
    shrink: float = 10.0  # pool-PCA eigenvalue regulariser, as a multiple of the mean eigenvalue


@dataclass
class InputConfig:
    paths: list[str] = field(default_factory=list)
    """The pool: image folders (recursive), file lists (.txt, one path a line) or webdataset
    shards (.tar, globs and {000..009} ranges). Several at once; the id is '<source>/<path>'."""
    eval_paths: list[str] = field(default_factory=list)
    """Evaluation images to decontaminate against (same kinds of sources). Empty: skip."""
    seed_paths: list[str] = field(default_factory=list)
    """Curated seed images for retrieval rebalancing (rebalance.mode=sample|cluster)."""


@dataclass
class OutputConfig:
    dir: str = ""
    """The curation output folder (embeddings/, steps/, shards/, manifest.json, report/)."""


@dataclass
class EmbedConfig:
    model: Optional[str] = None
    """Backbone for retrieval/clustering embeddings: a registry name (random init: only for smoke
    tests), or anything ``dinopipe.load`` accepts (official DINOv2 .pth, dinopipe run/export
    folder, timm state dict). null: descriptor only (rebalancing then uses the descriptor)."""
    batch_size: int = 64
    """Images per forward pass of the embedding backbone."""
    num_workers: int = 4
    """DataLoader workers decoding and resizing images."""
    image_size: int = 224
    """Eval crop size (resize shorter side to size*256/224, centre crop); a multiple of the
    model's patch size."""
    shard_size: int = 10000
    """Images per embedding shard: the unit of resumption (complete shards are skipped)."""
    task_index: int = 0
    """This task's share of the pool (a Slurm array sets it from SLURM_ARRAY_TASK_ID)."""
    num_tasks: int = 1
    """Tasks the pool is split over (a Slurm array sets it from SLURM_ARRAY_TASK_COUNT)."""
    device: str = "auto"
    """auto (CUDA when available) | cpu | cuda | cuda:N"""
    precision: Precision = Precision.auto
    """auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16"""


@dataclass
class HashDedupConfig:
    enabled: bool = True
    """Cheap perceptual-hash pre-pass removing exact / near-exact copies before the kNN search."""
    max_distance: int = DEFAULT_MAX_DISTANCE
    """Hamming distance (of 64 bits) under which two pHashes count as the same image."""


@dataclass
class DedupConfig:
    k: int = 64
    """Neighbours per image in the kNN graph (DINOv2: 64)."""
    threshold: Optional[float] = None
    """kNN cosine (copy descriptor or dedup.model) above which two images are a candidate pair.
    null: 0.45 with dedup.verify (the pixels decide; 0.45 finds copies 0.6 misses), DINOv2's 0.6
    without (the cosine decides alone)."""
    index: IndexKind = IndexKind.auto
    """auto (exact flat up to 50k images, IVF above) | flat | ivf (fp16 codes) | ivf_sq8 (1 B/dim) |
    ivf_pq (knn.pq_m B/vector: when even SQ8 does not fit; pairs are rescored exactly)"""
    nprobe: int = 16
    """IVF lists visited per query (recall vs speed)."""
    verify: bool = True
    """Verify every kNN candidate on pixels (aligned normalised correlation at verify_size px)
    before it becomes a copy edge. false: trust the descriptor (DINOv2's way; on homogeneous
    data such as retina or micrograph tiles it removes distinct images)."""
    verify_threshold: float = 0.5
    """Normalised correlation above which a candidate pair is a copy (copies measured >= 0.7,
    distinct tiles of one scene <= 0.45; bench/bench_copy.py)."""
    verify_size: int = 128
    """Side (px) at which pairs are compared; the descriptor sees 64."""
    grouping: Grouping = Grouping.star
    """star: an image is removed only as a verified copy of its group's kept image (no
    chaining) | components: connected components (DINOv2; chains A~B~C)."""
    model: Optional[str] = None
    """Copy-detection model in place of the offline descriptor: a TorchScript file (e.g. SSCD's
    sscd_disc_mixup.torchscript.pt) or anything dinopipe.load reads. null: the descriptor."""
    image_size: int = 224
    """dedup.model input side (the whole image is resized to it, no crop)."""
    trust_code: bool = False
    """Allow a TorchScript dedup.model: loading one runs the code it contains, so it is refused unless you
    set this (only for a file from someone you trust, e.g. SSCD's release)."""


@dataclass
class KnnConfig:
    """The sharded kNN behind dedup and decontamination (`curate index`, then `curate search` array
    tasks; `curate run` does both in one process). Same decisions for any num_tasks."""

    task_index: int = 0
    """This search task's chunks (a Slurm array sets it from SLURM_ARRAY_TASK_ID)."""
    num_tasks: int = 1
    """Search tasks the chunks are split over (a Slurm array sets it from SLURM_ARRAY_TASK_COUNT)."""
    chunk_size: int = 65536
    """Queries per chunk file: the unit of resumption and of the task split."""
    batch_size: int = 8192
    """Queries per faiss search call."""
    nlist: Optional[int] = None
    """IVF lists; null: max(4 sqrt(N), N / 4000), HNSW coarse quantizer from 40,000 lists (curation.knn.index.ivf_nlist)."""
    pq_m: int = 0
    """dedup.index=ivf_pq: bytes per vector (must divide the dimension); 0: dim/16."""
    train_size: Optional[int] = None
    """Vectors the IVF is trained on; null: 64 per list."""
    use_gpu: str = "auto"
    """auto (faiss-gpu when it sees GPUs) | true | false"""


TaskLauncher = choices("TaskLauncher", ("local", "inline", "srun"), __name__)


@dataclass
class TasksConfig:
    """W: how many tasks each sharded step after embedding runs as in `curate run` / `curate index`
    (index add, kNN search, the hierarchical k-means tree, sampling; curation.core.runner). Decisions do not
    depend on W."""

    count: Optional[int] = None
    """W. null: 1 below one block of rows (65,536, where the tasks would have nothing to split),
    else min(CPU cores, 8)."""
    launcher: TaskLauncher = "local"
    """local: W fresh processes on this machine, the cores shared out between them (each task's peak
    memory is its own; the k-means tree's W processes form a gloo group); inline: the W tasks one after
    another in this process (no process start; the k-means tree as one rank: the same tree);
    srun: inside a Slurm job allocated W or more tasks (``sbatch --nodes=K --ntasks=W``, slurm/submit_curation.sh
    --finish-tasks W), each step's W tasks run as one ``srun --ntasks=W`` job step across the allocation's nodes
    (cores: SLURM_CPUS_PER_TASK each; the call handed over as an HMAC-authenticated spec file in the output
    folder; the k-means tree's W tasks form the gloo group), while this process -- the batch script's --
    orchestrates; null count: SLURM_NTASKS. W = 1 runs inline unless ``isolate``. Slurm arrays / torchrun: the
    per-step commands (`curate search` tasks, `curate kmeans`)."""
    isolate: bool = False
    """true: with W = 1 too, each step's task runs in a fresh process (launcher local), as the W > 1 tasks do:
    this process never holds a task's arrays, and each task's peak memory is its own (the growth bench's W = 1
    baseline, bench/bench_curation_scale.py). false: W = 1 runs inline (no process start)."""


@dataclass
class DecontaminateConfig:
    threshold: Optional[float] = None
    """Cosine (copy descriptor or dedup.model) to the nearest eval image above which a pool image is a candidate.
    null: with verify, DECONTAM_CANDIDATE for the offline descriptor (calibrated on
    bench/bench_curation_precision.py: leaks' cosines are low) and DINOv2's 0.45 for a copy model (SSCD); without
    verify, 0.45 (DINOv2: cosine > 0.45 drops the whole copy group)."""
    verify: bool = True
    """Verify every candidate on pixels (curation.decontaminate.leakverify: crops down to min_scale, resizes, mirrors, small
    rotations, borders, colour changes) before it counts; false: the cosine decides alone (DINOv2's way)."""
    verify_threshold: float = 0.5
    """Noise-aware correlation above which a candidate is a view of its eval image (with local agreement and a
    unique alignment; bench figures in docs/curation.md)."""
    verify_size: int = 128
    """Side (px) at which candidates are compared."""
    min_scale: float = 0.5
    """Smallest scale searched between a pool image and its eval image (0.5: crops down to half a side)."""
    views: bool = True
    """Embed each eval image as 98 views too (whole, crops of 80-90 % a side at 3 places per axis, mirrored;
    curation.decontaminate.views), so a pool image cut from an eval image finds it in the kNN; false: the whole
    eval image only (an eval index 98x smaller, for eval sets of millions)."""


DECONTAM_CANDIDATE = 0.2
"""decontaminate.threshold with verification on the offline descriptor (bench/bench_curation_precision.py)."""


def decontam_threshold(d: "DecontaminateConfig", copy_model: bool, verify: bool | None = None) -> float:
    """The candidate cosine decontamination uses (see DecontaminateConfig.threshold); ``verify``: whether the
    candidates are verified on pixels (default ``d.verify``; False where there are no pixels, e.g. a simulation)."""
    if d.threshold is not None:
        return float(d.threshold)
    return DECONTAM_CANDIDATE if (d.verify if verify is None else verify) and not copy_model else 0.45


@dataclass
class RebalanceConfig:
    mode: RebalanceMode = RebalanceMode.none
    """none | sample (k nearest pool images per seed) | cluster (clusters holding >= min_seeds
    seeds) | hierarchical (hierarchical k-means + balanced sampling, no seeds needed)"""
    k: int = 4
    """mode=sample: pool images retrieved per seed image (DINOv2: 4)."""
    n_clusters: int = 100000
    """mode=cluster: k-means clusters of the pool (DINOv2: 100k)."""
    max_per_cluster: int = 10000
    """mode=cluster: images taken from each chosen cluster (DINOv2: 10k)."""
    min_seeds: int = 3
    """mode=cluster: seeds a cluster must hold to be chosen."""
    levels: Any = "auto"
    """mode=hierarchical: clusters per level, bottom-up, or auto: Vo et al. 2024's 4 levels (DINOv3's 5 above
    ~4.5B rows) scaled to the pool, bottom clusters of ~120 rows (curation.rebalance.modes.auto_levels); a list is
    capped at the pool size."""
    target_size: Optional[int] = None
    """mode=hierarchical: images to keep; null = half the deduplicated pool."""
    strategy: Strategy = Strategy.r
    """mode=hierarchical: 'r' random or 'c' closest-to-centroid within bottom clusters."""
    n_resampling_steps: int = 10
    """mode=hierarchical: resampling steps of hierarchical k-means per level (0: one k-means per level)."""
    sample_size: int = 10
    """Points per cluster in each resampling step."""
    kmeans_init: KMeansInit = KMeansInit.auto
    """mode=hierarchical k-means seeding: auto (k-means++ up to 20k clusters, random rows above)
    | kmeans++ | random. k-means++ cut level-1 SSE by 3.5-4% (bench/bench_kmeans.py)."""
    kmeans_init_sample: int = 4
    """k-means++ runs on a random sample of this many points per cluster (4 and 8: same SSE)."""
    kmeans_niter: int = 50
    """Most Lloyd iterations per k-means (the early stop usually ends them sooner)."""
    kmeans_tol: float = 1e-4
    """Early stop: an iteration that lowers the objective by less than this (relative) ends it."""
    kmeans_dir: Optional[str] = None
    """mode=hierarchical: take the k-means tree from this folder (relative: under output.dir),
    written by ``curate kmeans --curate`` over many processes, instead of
    clustering in the rebalance step; it must be for the same rows and rebalance.* settings."""
    kmeans_n_init: int = 1
    """Restarts keeping the lowest SSE (each costs a full k-means; 2 gained <0.1% SSE)."""
    balance_clusters: Optional[int] = None
    """Clusters used to report balance (entropy) before/after; null: the mode's own clustering."""
    seed: int = 0
    """Seed of k-means and of the balanced sampling (the same selection on every rerun)."""


@dataclass
class WriteConfig:
    shard_size: int = 1000
    """Images per output webdataset tar shard."""
    shards: bool = True
    """false: decisions.tsv and manifest.json only, no tar shards (a dry run; `curate simulate`, whose rows
    have no pixels)."""


@dataclass
class ReportConfig:
    enabled: bool = True
    """Write report/ (PNG plots + summary.md) at the end of `curate run`."""
    n_examples: int = 8
    """Duplicate groups shown in the contact sheet."""


@dataclass
class CurationConfig:
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    descriptor: DescriptorConfig = field(default_factory=DescriptorConfig)
    hash_dedup: HashDedupConfig = field(default_factory=HashDedupConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    knn: KnnConfig = field(default_factory=KnnConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    decontaminate: DecontaminateConfig = field(default_factory=DecontaminateConfig)
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    write: WriteConfig = field(default_factory=WriteConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    progress: bool = True
    """tqdm progress bars on the long steps."""


def _need(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


SRUN_STEPS = ("dedup", "decontaminate", "rebalance", "write", "index")
"""The steps that run tasks (tasks.launcher=srun is checked against the allocation before they start)."""


def check_launcher(cfg: CurationConfig, steps) -> None:
    """tasks.launcher=srun where ``steps`` run tasks: this process must be inside a Slurm job allocated at least
    tasks.count tasks (ConfigError naming the key otherwise). Checked when the steps are about to run, not by
    :func:`validate` (a submitter validates the config on a login node, outside the job)."""
    if str(cfg.tasks.launcher) != "srun" or not set(steps) & set(SRUN_STEPS):
        return
    have = os.environ.get("SLURM_NTASKS") or os.environ.get("SLURM_NPROCS")
    _need(bool(have), "tasks.launcher", "srun runs each step's tasks in this Slurm job's allocation, but "
          "SLURM_NTASKS is not set: submit with sbatch --ntasks=W (slurm/submit_curation.sh --finish-tasks W) "
          "or use tasks.launcher=local")
    _need(cfg.tasks.count is None or cfg.tasks.count <= int(have), "tasks.count",
          f"{cfg.tasks.count} tasks, but this Slurm job has SLURM_NTASKS={have}: submit with "
          f"--ntasks={cfg.tasks.count} or lower tasks.count")


def validate(cfg: CurationConfig, step: str = "run") -> None:
    """Cross-field checks; raise ConfigError naming the key. ``step`` is the CLI command."""
    check_choices(cfg)  # the enum fields, for a config built or changed in Python
    _need(bool(cfg.output.dir), "output.dir", "set the output folder (output.dir=OUT)")
    _need(bool(cfg.input.paths), "input.paths",
          "give at least one image folder, file list or tar shard (input.paths=[a,b])")
    for key, paths in (("input.paths", cfg.input.paths), ("input.eval_paths", cfg.input.eval_paths),
                       ("input.seed_paths", cfg.input.seed_paths)):
        for p in paths:
            if step in ("run", "embed") or key != "input.paths":
                # tar globs / brace ranges are expanded later; check the plain ones now
                _need(any(c in p for c in "*?{") or "://" in p or os.path.exists(p), key, f"'{p}' does not exist")
    e = cfg.embed
    _need(e.num_tasks >= 1, "embed.num_tasks", f"must be >= 1, got {e.num_tasks}")
    _need(0 <= e.task_index < e.num_tasks, "embed.task_index",
          f"must be in [0, embed.num_tasks={e.num_tasks}), got {e.task_index}")
    if step == "run":
        _need(e.num_tasks == 1, "embed.num_tasks", "`curate run` embeds the whole pool; split "
              "it with `curate embed` array tasks (slurm/curate.sbatch), then `curate dedup ...`")
    for key, val in (("embed.batch_size", e.batch_size), ("embed.shard_size", e.shard_size),
                     ("embed.image_size", e.image_size), ("dedup.k", cfg.dedup.k),
                     ("dedup.nprobe", cfg.dedup.nprobe), ("write.shard_size", cfg.write.shard_size),
                     ("rebalance.k", cfg.rebalance.k), ("rebalance.n_clusters", cfg.rebalance.n_clusters),
                     ("rebalance.max_per_cluster", cfg.rebalance.max_per_cluster)):
        _need(val >= 1, key, f"must be >= 1, got {val}")
    _need(e.num_workers >= 0, "embed.num_workers", f"must be >= 0, got {e.num_workers}")
    _need(e.device == "auto" or e.device == "cpu" or e.device.split(":")[0] == "cuda",
          "embed.device", f"expected auto | cpu | cuda | cuda:N, got '{e.device}'")
    if e.model is not None:
        _check_model(e.model, e.image_size)
    _need(0 <= cfg.hash_dedup.max_distance <= 32, "hash_dedup.max_distance",
          f"expected 0..32 bits, got {cfg.hash_dedup.max_distance}")
    _validate_dedup(cfg.dedup)
    _validate_knn(cfg)
    _need(cfg.tasks.count is None or cfg.tasks.count >= 1, "tasks.count",
          f"must be >= 1 or null (auto), got {cfg.tasks.count}")
    for key, t in (("dedup.threshold", cfg.dedup.threshold),
                   ("decontaminate.threshold", cfg.decontaminate.threshold)):
        if t is None:
            continue
        _need(-1.0 <= t <= 1.0, key, f"a cosine similarity in [-1, 1], got {t}")
    _validate_decontaminate(cfg.decontaminate)
    _validate_rebalance(cfg)


def _validate_decontaminate(d: DecontaminateConfig) -> None:
    _need(isinstance(d.verify, bool), "decontaminate.verify", f"true or false, got {d.verify!r}")
    _need(-1.0 <= d.verify_threshold <= 1.0, "decontaminate.verify_threshold",
          f"a normalised correlation in [-1, 1], got {d.verify_threshold}")
    _need(d.verify_size >= 32, "decontaminate.verify_size", f"must be >= 32 px, got {d.verify_size}")
    _need(0.5 <= d.min_scale <= 1.0, "decontaminate.min_scale", f"a scale in [0.5, 1], got {d.min_scale}")


def _validate_dedup(d: DedupConfig) -> None:
    _need(-1.0 <= d.verify_threshold <= 1.0, "dedup.verify_threshold",
          f"a normalised correlation in [-1, 1], got {d.verify_threshold}")
    _need(d.verify_size >= 32, "dedup.verify_size", f"must be >= 32 px, got {d.verify_size}")
    _need(d.image_size >= 16, "dedup.image_size", f"must be >= 16 px, got {d.image_size}")
    _need(d.model is None or os.path.exists(d.model), "dedup.model",
          f"'{d.model}' does not exist (a TorchScript copy model such as SSCD's "
          f".torchscript.pt, or a checkpoint dinopipe.load reads)")
    _need(d.model is None or d.trust_code or not is_torchscript(d.model), "dedup.trust_code",
          f"dedup.model '{d.model}' is a TorchScript program: loading it runs the code it contains. Set "
          f"dedup.trust_code=true only if you trust whoever made the file")


def is_torchscript(path: str) -> bool:
    """TorchScript archives are zip files holding ``*/code/`` (plain state dicts do not)."""
    import zipfile

    if not os.path.isfile(path) or not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any("/code/" in name for name in z.namelist())


def _validate_knn(cfg: CurationConfig) -> None:
    n = cfg.knn
    _need(n.num_tasks >= 1, "knn.num_tasks", f"must be >= 1, got {n.num_tasks}")
    _need(0 <= n.task_index < n.num_tasks, "knn.task_index",
          f"must be in [0, knn.num_tasks={n.num_tasks}), got {n.task_index}")
    for key, val in (("knn.chunk_size", n.chunk_size), ("knn.batch_size", n.batch_size)):
        _need(val >= 1, key, f"must be >= 1, got {val}")
    _need(n.nlist is None or n.nlist >= 1, "knn.nlist", f"must be >= 1 or null, got {n.nlist}")
    _need(n.pq_m >= 0, "knn.pq_m", f"must be >= 0, got {n.pq_m}")
    n.use_gpu = str(n.use_gpu).lower()  # YAML / dotlist turn true into a bool, the str field into 'True'
    _need(n.use_gpu in ("auto", "true", "false"), "knn.use_gpu",
          f"expected auto | true | false, got '{n.use_gpu}'")
    if n.use_gpu == "true":  # (with auto, the search says so if it lands on a GPU)
        # faiss-gpu selects at most 2048 neighbours (and lists) per query; k+1 includes the image
        _need(cfg.dedup.k + 1 <= GPU_MAX_K, "dedup.k", f"{cfg.dedup.k} + 1 exceeds faiss-gpu's limit "
              f"of {GPU_MAX_K} neighbours; lower it or set knn.use_gpu=false")
        _need(cfg.dedup.nprobe <= GPU_MAX_K, "dedup.nprobe", f"{cfg.dedup.nprobe} exceeds faiss-gpu's "
              f"limit of {GPU_MAX_K}; lower it or set knn.use_gpu=false")


def knn_kwargs(cfg: CurationConfig) -> dict:
    """The ``knn`` dict of the kNN steps (curation.dedup.knn, decontaminate.nearest, rebalance.retrieval) for this config
    (or its knn section)."""
    n = getattr(cfg, "knn", cfg)
    return {"chunk_size": n.chunk_size, "batch_size": n.batch_size, "nlist": n.nlist, "pq_m": n.pq_m,
            "train_size": n.train_size, "use_gpu": {"auto": "auto", "true": True, "false": False}[str(n.use_gpu).lower()]}


def knn_dict(knn: KnnConfig | None) -> dict | None:
    """The ``knn`` dict of those steps (None: its defaults)."""
    return None if knn is None else knn_kwargs(knn)


def task_plan(cfg: CurationConfig, n: int = 0, cores: int | None = None) -> dict:
    """``{"tasks": W, "launcher": ...}`` of the sharded steps for ``n`` rows (tasks.count null: auto, from
    ``cores``: the CPUs this process may use -- its affinity, as a Slurm allocation sets it, not the node's count
    (:func:`dinopipe.utils.proc.usable_cores`) -- unless given: `curate plan` passes the planned machine's)."""
    t = getattr(cfg, "tasks", cfg)
    cores = cores if cores is not None else usable_cores()
    if t.count is not None:
        w = t.count
    elif str(t.launcher) == "srun" and os.environ.get("SLURM_NTASKS"):  # the allocation's tasks
        w = 1 if n <= 65536 else int(os.environ["SLURM_NTASKS"])
    else:
        w = 1 if n <= 65536 else min(cores, 8)
    if w == 1:  # nothing to spread: inline, or (isolate) one fresh local process
        return {"tasks": 1, "launcher": "local" if t.isolate and str(t.launcher) != "inline" else "inline"}
    return {"tasks": int(w), "launcher": str(t.launcher)}


def _check_model(model: str, image_size: int) -> None:
    from dinopipe.models import list_models, model_defaults

    if model in list_models() and not os.path.exists(model):
        patch = model_defaults(model)["patch_size"]
        _need(image_size % patch == 0, "embed.image_size",
              f"{image_size} is not a multiple of {model}'s patch size {patch}")
        return
    _need(os.path.exists(model), "embed.model",
          f"'{model}' is neither a registry model ({', '.join(list_models()[:4])}, ...) nor an "
          f"existing checkpoint file or run folder")


def _validate_rebalance(cfg: CurationConfig) -> None:
    r = cfg.rebalance
    if r.mode in ("sample", "cluster"):
        _need(bool(cfg.input.seed_paths), "input.seed_paths",
              f"rebalance.mode={r.mode} retrieves around curated seed images: set "
              f"input.seed_paths, or use rebalance.mode=hierarchical|none")
    if r.levels != "auto":
        _need(isinstance(r.levels, list) and bool(r.levels)
              and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in r.levels),
              "rebalance.levels", f"auto, or a non-empty list of positive cluster counts, got {r.levels!r}")
        _need(list(r.levels) == sorted(r.levels, reverse=True), "rebalance.levels",
              f"levels go bottom-up, each with fewer clusters than the one below: {list(r.levels)}")
    _need(r.target_size is None or r.target_size >= 1, "rebalance.target_size",
          f"must be >= 1 or null, got {r.target_size}")
    _need(r.min_seeds >= 1, "rebalance.min_seeds", f"must be >= 1, got {r.min_seeds}")
    _need(r.n_resampling_steps >= 0, "rebalance.n_resampling_steps",
          f"must be >= 0, got {r.n_resampling_steps}")
    for key in ("kmeans_init_sample", "kmeans_niter", "kmeans_n_init"):
        _need(getattr(r, key) >= 1, f"rebalance.{key}", f"must be >= 1, got {getattr(r, key)}")
    _need(r.kmeans_tol >= 0, "rebalance.kmeans_tol", f"must be >= 0, got {r.kmeans_tol}")
    _need(r.kmeans_dir is None or (r.mode == "hierarchical" and r.kmeans_dir != ""),
          "rebalance.kmeans_dir", f"a k-means folder serves rebalance.mode=hierarchical only "
          f"(got mode={r.mode}, kmeans_dir='{r.kmeans_dir}')")


def kmeans_dir(cfg: CurationConfig, default: Optional[str] = None) -> Optional[str]:
    """rebalance.kmeans_dir (or ``default``) as a path; relative paths are under output.dir."""
    d = cfg.rebalance.kmeans_dir or default
    return None if d is None else os.path.join(cfg.output.dir, os.path.expanduser(d))


def rebalance_kwargs(r: RebalanceConfig) -> dict:
    """The keyword arguments of :func:`curation.rebalance.modes.rebalance` for this config."""
    return {"k": r.k, "n_clusters": r.n_clusters, "max_per_cluster": r.max_per_cluster,
            "min_seeds": r.min_seeds, "levels": r.levels if r.levels == "auto" else tuple(r.levels), "target_size": r.target_size,
            "strategy": r.strategy, "n_resampling_steps": r.n_resampling_steps,
            "sample_size": r.sample_size, "balance_clusters": r.balance_clusters, "seed": r.seed,
            "kmeans": {"init": r.kmeans_init, "init_sample": r.kmeans_init_sample,
                       "niter": r.kmeans_niter, "tol": r.kmeans_tol, "n_init": r.kmeans_n_init}}


__all__ = ["CurationConfig", "validate", "check_launcher", "rebalance_kwargs", "knn_kwargs", "kmeans_dir", "task_plan"]
