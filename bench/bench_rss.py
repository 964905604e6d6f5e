"""Peak host memory per rank while a multi-rank run builds its task, before and after models are born on
``meta`` (``dinopipe/train/run.py:build_sharded_task``).

    python bench/bench_rss.py                       # vit_l14 continued from a released-layout file, W = 1, 2, 4
    python bench/bench_rss.py --worlds 1,2 --model vit_b14 --skip-before-above-gib 14
    python bench/bench_rss.py --source dinov3,hf,dcp --model vit_l16plus_dinov3 --modes after   # issue 31

The released file is written once (official DINOv2 hub layout, ``export_dinov2`` of a random init; ~1.2 GB for
vit_l14). ``--source`` picks other sources of a DINOv3 model (issue 31): ``dinov3`` the official DINOv3 ``.pth``
(SwiGLU ``w1``/``w2`` packed into ``fc1`` and the masked key bias rewritten at load), ``hf`` a Hugging Face
``DINOv3ViTModel`` folder (q/k/v packed into ``qkv``, gate/up into ``fc1``), ``dcp`` a pretraining run's DCP
checkpoint folder (``RUN/checkpoints/step_N``, the teacher's backbone); each is converted per slice
(``utils/lazy_rows.py``), so every rank should stay at task / W + a constant for these too.

Each configuration runs as its own torchrun job of W gloo ranks on the CPU (one at a time); every
rank builds the pretraining task (student from the file + DINO/iBOT heads + EMA teacher), shards it with FSDP2
and reports its peak resident set (``VmHWM``) and its resident set after importing torch (the constant).

- ``before``: the code before issue 20: every rank builds the whole task (reading the file itself), then shards.
- ``rank0-broadcast``: ``build_rank0_broadcast`` (the first meta-build version, now the fallback): rank 0 builds
  (deep copies share its tensors), the others build on ``meta``; all shard, ``to_empty`` and receive the
  weights tensor by tensor.
- ``eager`` (``--source`` other than dinov2): ``after`` as it was before issue 31: packed tensors converted and
  DCP tensors read whole on every rank before the replay.
- ``after``: ``build_sharded_task``: every rank records the build on ``meta`` (``train/meta_init.py``), shards,
  ``to_empty`` and replays each tensor's init into its shard (a tensor copied from the file: only its slice).

Prints per configuration the peak RSS of rank 0 and of the largest other rank, ratios
``rss_after_over_before_wW_rankR``, and ``rss_rank0_over_fp32_model_per_W_wW`` /
``rss_other_ranks_over_fp32_model_per_W_wW``: (peak - constant) over (fp32 student bytes / W); the task holds
the student and its EMA teacher, so shards alone give 2.0. The goal is per-rank RSS <= fp32 model bytes / W +
a constant, for every rank.
A "before" run whose estimated total (W x one rank's W=1 peak) exceeds ``--skip-before-above-gib`` is skipped
(the machine is shared) and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def probe(mode: str, model: str, weights: str, out: str) -> None:
    """One rank of a torchrun job: build, shard, report peak RSS."""
    import torch

    from dinopipe.config import load_config
    from dinopipe.ssl.config import PretrainConfig
    from dinopipe.ssl.task import SSLTask
    from dinopipe.train.dist import all_reduce_sum_fn, destroy, init_distributed
    from dinopipe.train.run import build_rank0_broadcast, build_sharded_task, build_task, parallelize_task

    base = _status_kib("VmRSS")
    cfg = load_config(PretrainConfig, str(REPO / "configs/pretrain/quickstart.yaml"),
                      ["data.paths=[x]", f"model.name={model}", f"model.pretrained={weights}", "model.img_size=224",
                       "parallel.param_dtype=fp32", "parallel.compile=false"])
    info = init_distributed("cpu")
    if mode == "before":  # train/run.py before issue 20
        torch.manual_seed(cfg.train.seed)
        task = build_task(SSLTask, cfg, all_reduce_fn=all_reduce_sum_fn()).to(info.device)
        parallelize_task(task, info, cfg.parallel)
    elif mode == "rank0-broadcast":
        task = build_rank0_broadcast(SSLTask, cfg, info, cfg.parallel)
    else:
        if mode == "eager":  # main before issue 31: packed and DCP tensors converted / read whole on every rank
            from dinopipe import hub
            from dinopipe.utils import safe_dcp

            hub.lazy_cat = torch.cat
            safe_dcp.lazy_tensors = lambda path, keys=None, md=None: safe_dcp.read_tensors(path, keys, md=md)
        task = build_sharded_task(SSLTask, cfg, info, cfg.parallel)
        if info.distributed and task.init_report["path"] != "replay":
            raise RuntimeError(f"the replay path was not taken: {task.init_report}")
    student = sum(p.numel() for p in task.student.parameters())  # a DTensor's numel is the global one
    rec = {"rank": info.rank, "world": info.world_size, "base": base, "peak": _status_kib("VmHWM"),
           "rss_file_end": _status_kib("RssFile"),
           "student_fp32_bytes": 4 * student}
    Path(out, f"rank{info.rank}.json").write_text(json.dumps(rec))
    destroy()


def run(mode: str, world: int, model: str, weights: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = ["nice", "-n", "10", sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", __file__, "--probe", mode, model, weights, d]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"{mode} W={world} failed:\n{r.stderr[-4000:]}")
        return sorted((json.loads(p.read_text()) for p in Path(d).glob("rank*.json")), key=lambda x: x["rank"])


def write_released(model: str, path: Path, source: str = "dinov2") -> Path:
    """Write ``model`` (random init) as ``source``; returns what ``model.pretrained`` should name."""
    import torch

    from dinopipe.export import export
    from dinopipe.models import create_model

    torch.manual_seed(0)
    if source == "dinov2":
        export(create_model(model, img_size=518), "dinov2", path)
        return path
    m = create_model(model)
    if source == "dinov3":
        return export(m, "dinov3", path)
    if source == "hf":
        return export(m, "hf", path)
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from dinopipe.train.checkpoint import ModelOptimState

    ckpt = path / "checkpoints" / "step_00000001"
    ckpt.parent.mkdir(parents=True)
    dcp.save({"teacher": ModelOptimState(nn.ModuleDict({"backbone": m}))}, checkpoint_id=str(ckpt), no_dist=True)
    (path / "config.yaml").write_text(f"model:\n  name: {model}\n")
    return ckpt


_SUFFIX = {"dinov2": "_dinov2.pth", "dinov3": "_dinov3.pth", "hf": "_hf", "dcp": "_dcp_run"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_l14")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--weights", default=None, help="a released-layout .pth (written when missing; --source dinov2)")
    p.add_argument("--source", default="dinov2", help="comma list of dinov2 | dinov3 | hf | dcp (see above)")
    p.add_argument("--skip-before-above-gib", type=float, default=14.0)
    p.add_argument("--modes", default="before,rank0-broadcast,after", help="which builds to measure")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results: dict = {}
    for source in args.source.split(","):
        results.update({(k if source == "dinov2" else f"{source}/{k}"): v
                        for k, v in measure(args, source).items()})
    if not results:
        return
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def measure(args, source: str) -> dict:
    weights = Path(args.weights) if args.weights and source == "dinov2" else \
        Path(tempfile.gettempdir()) / f"bench_rss_{args.model}{_SUFFIX[source]}"
    pretrained = weights / "checkpoints" / "step_00000001" if source == "dcp" else weights
    if not weights.exists():
        pretrained = write_released(args.model, weights, source)
    print(f"{source} source: {pretrained} ({_size(weights) / GiB:.2f} GiB)")
    results: dict = {}
    one_rank_before = None
    for world in [int(w) for w in args.worlds.split(",")]:
        for mode in args.modes.split(","):
            if mode == "before" and one_rank_before and world * one_rank_before / GiB > args.skip_before_above_gib:
                print(f"  before W={world}: skipped (~{world * one_rank_before / GiB:.1f} GiB estimated on a shared "
                      f"machine > {args.skip_before_above_gib} GiB)")
                continue
            if mode in ("rank0-broadcast", "eager") and world == 1:
                continue  # one process: the same path as "after"
            ranks = run(mode, world, args.model, str(pretrained))
            results[f"{mode}_w{world}"] = ranks
            if mode == "before" and world == 1:
                one_rank_before = ranks[0]["peak"]
            others = max((r["peak"] for r in ranks[1:]), default=None)
            print(f"  {source:<6} {mode:<15} W={world}: student+heads fp32 "
                  f"{ranks[0]['student_fp32_bytes'] / GiB:.2f} GiB, rank 0 peak {ranks[0]['peak'] / GiB:.2f} GiB"
                  + (f", largest other rank {others / GiB:.2f} GiB" if others else "")
                  + f", constant (after import) {ranks[0]['base'] / GiB:.2f} GiB, all ranks "
                  f"{sum(r['peak'] for r in ranks) / GiB:.2f} GiB")
    return results


def report(results: dict) -> None:
    for key, ranks in results.items():
        model_bytes = ranks[0]["student_fp32_bytes"]
        source, _, rest = key.rpartition("/")  # "" for the DINOv2 layout (the names before issue 31)
        mode, world = rest.split("_w")
        tag = (f"{source}_" if source else "") + ("" if mode == "after" else f"{mode}_")
        before = results.get(f"{source + '/' if source else ''}before_w{world}")
        if before and mode != "before":
            print(f"rss_{tag}after_over_before_w{world}_rank0: {ranks[0]['peak'] / before[0]['peak']:.3f}")
            if len(ranks) > 1:
                print(f"rss_{tag}after_over_before_w{world}_other_ranks: "
                      f"{max(r['peak'] for r in ranks[1:]) / max(r['peak'] for r in before[1:]):.3f}")
        print(f"rss_{tag}rank0_over_fp32_model_per_W_w{world}: "
              f"{(ranks[0]['peak'] - ranks[0]['base']) / (model_bytes / int(world)):.3f}")
        if len(ranks) > 1:
            worst = max(ranks[1:], key=lambda r: r["peak"])
            print(f"rss_{tag}other_ranks_over_fp32_model_per_W_w{world}: "
                  f"{(worst['peak'] - worst['base']) / (model_bytes / int(world)):.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        probe(*sys.argv[2:6])
    else:
        main()
