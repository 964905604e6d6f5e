"""A real-image run of `curate run`: tens of thousands of tiles of real photos, W = 1 then W = 4 tasks.

    nice -n 10 python bench/bench_curation_real.py --tiles 20000 --tasks 1 4 --work /tmp/real --json real.json

The pool: JPEG tiles cropped from the photos that ship inside installed packages (scikit-image's data module,
scikit-learn's sample images, matplotlib's Grace Hopper: ``dinopipe.data.samples.real_photos``). Each photo is
resized to a few scales and cut into 32 px tiles on two grids (offset 0 and 16 px), written 2x upscaled as
64 px JPEGs (q90); ``--tiles`` of these candidates are drawn with a fixed seed (the same pool every run). Blank
tiles (sky, paper, scan background) stay in: they are real duplicates of one another, as in any pool.
Planted: ``--copy-fraction`` of the textured tiles get a copy in ``copies/`` (the copy kinds the tests plant,
``dinopipe.data.samples.make_copy``: resized to half, re-encoded at q30, cropped 5 %, all three); an eval
folder of ``--eval`` tiles, ``--eval-copies`` of them near-copies of textured pool tiles and the rest tiles
the pool does not hold.

Then the real CLI, ``python -m curation.cli run`` (the ``curate`` console script), with the settings a CPU user
would give it: the copy descriptor (no model), hash dedup, the IVF pool index on disk, kNN candidates verified
on pixels, star grouping, decontamination against the eval folder, hierarchical rebalancing -- once per W in a
fresh output folder, with ``--progress`` (one JSON line per step: every task it ran, each task's wall time,
peak heap and peak RSS). Printed: a table per step (tasks, slowest task, largest task's heap and peak RSS, the
orchestrator's), the wall time of each run, the sha256 of decisions.tsv (the same for every W, or the bench
exits 1) and the recall of the planted copies and eval overlaps.

``--block ROWS`` sets the debug hook ``curate_block`` (rows per block a task owns; 65,536 by default, so a pool
below that is one block and only task 0 of W would own rows in the block-owned steps).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dinopipe.data.samples import COPY_KINDS, encode, make_copy, real_photos  # noqa: E402

TILE, OUT = 32, 64  # source pixels per tile side, written side
SCALES = (1.0, 0.8, 0.64, 0.5, 0.4)
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)


def textured(tile: np.ndarray) -> bool:
    """Detail in every quadrant (no blank part): a copy of it is told from other tiles by its content."""
    y = tile.astype(np.float32) @ _LUMA
    h = y.shape[0] // 2
    return bool(y.std() >= 5 and min(y[i:i + h, j:j + h].std() for i in (0, h) for j in (0, h)) >= 2)


def candidates(photos: dict[str, np.ndarray]) -> tuple[list[tuple], dict]:
    """Every tile the photos give: (name, scale, offset, y, x), and the resized photos."""
    out, scaled = [], {}
    for name in sorted(photos):
        for s in SCALES:
            arr = photos[name]
            if s != 1.0:
                h, w = arr.shape[:2]
                arr = np.asarray(Image.fromarray(arr).resize((max(TILE, round(w * s)), max(TILE, round(h * s))),
                                                            Image.BICUBIC))
            scaled[name, s] = arr
            for off in (0, TILE // 2):
                for y in range(off, arr.shape[0] - TILE + 1, TILE):
                    for x in range(off, arr.shape[1] - TILE + 1, TILE):
                        out.append((name, s, off, y, x))
    return out, scaled


def _tile(scaled: dict, c: tuple) -> np.ndarray:
    name, s, _off, y, x = c
    crop = scaled[name, s][y:y + TILE, x:x + TILE]
    return np.asarray(Image.fromarray(crop).resize((OUT, OUT), Image.BICUBIC))


def _rel(c: tuple) -> str:
    name, s, off, y, x = c
    return f"{name}/s{round(100 * s):03d}o{off:02d}_{y:04d}_{x:04d}.jpg"


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def build(work: str, n_tiles: int, copy_fraction: float, n_eval: int, n_eval_copies: int, seed: int) -> dict:
    """Write ``work/pool`` and ``work/eval`` (reused when built with the same parameters); return the truth:
    planted (original, copy) and (eval near-copy, pool tile) pairs as paths relative to their folder."""
    params = {"tiles": n_tiles, "copy_fraction": copy_fraction, "eval": n_eval, "eval_copies": n_eval_copies,
              "seed": seed, "tile": TILE, "out": OUT, "scales": list(SCALES)}
    truth_path = os.path.join(work, "truth.json")
    if os.path.exists(truth_path):
        with open(truth_path) as f:
            truth = json.load(f)
        if truth["params"] == params:
            return truth
    for d in ("pool", "eval"):
        shutil.rmtree(os.path.join(work, d), ignore_errors=True)
    cands, scaled = candidates(real_photos())
    if n_tiles + n_eval > len(cands):
        raise SystemExit(f"--tiles + --eval: at most {len(cands)} tiles from the shipped photos")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(cands))
    pool, rest = [cands[i] for i in order[:n_tiles]], [cands[i] for i in order[n_tiles:]]
    tex = []
    for c in pool:
        arr = _tile(scaled, c)
        _write(os.path.join(work, "pool", _rel(c)), encode(arr, quality=90))
        if textured(arr):
            tex.append(c)
    n_copies = round(copy_fraction * n_tiles)
    pick = rng.choice(len(tex), n_copies + n_eval_copies, replace=False)
    copies, eval_pairs = [], []
    for j, i in enumerate(pick[:n_copies]):
        kind = COPY_KINDS[j % len(COPY_KINDS)]
        rel = _rel(tex[i])
        copy_rel = f"copies/{rel[:-4]}__{kind}.jpg"
        _write(os.path.join(work, "pool", copy_rel), encode(make_copy(_tile(scaled, tex[i]), kind), quality=90))
        copies.append([rel, copy_rel, kind])
    for j, i in enumerate(pick[n_copies:]):
        kind = COPY_KINDS[j % len(COPY_KINDS)]
        rel = _rel(tex[i])
        eval_rel = f"near/{rel[:-4]}__{kind}.jpg"
        _write(os.path.join(work, "eval", eval_rel), encode(make_copy(_tile(scaled, tex[i]), kind), quality=90))
        eval_pairs.append([eval_rel, rel, kind])
    for c in rest[:n_eval - n_eval_copies]:
        _write(os.path.join(work, "eval", "other", _rel(c)), encode(_tile(scaled, c), quality=90))
    truth = {"params": params, "candidates": len(cands), "pool_files": n_tiles + n_copies, "textured": len(tex),
             "copies": copies, "eval_overlap": eval_pairs, "eval_files": n_eval}
    with open(truth_path, "w") as f:
        json.dump(truth, f)
    return truth


def curate_args(work: str, out: str, tasks: int, levels: list[int], k: int, progress: str) -> list[str]:
    """`curate run` as a CPU user runs it on this pool (configs/curation/default.yaml + overrides)."""
    return ["run", "--config", os.path.join(ROOT, "configs", "curation", "default.yaml"), "--progress", progress,
            f"input.paths=[{os.path.join(work, 'pool')}]", f"input.eval_paths=[{os.path.join(work, 'eval')}]",
            f"output.dir={out}", "progress=false", "embed.batch_size=64", "embed.num_workers=1",
            "embed.shard_size=2000", "dedup.index=ivf", f"dedup.k={k}", "rebalance.mode=hierarchical",
            f"rebalance.levels=[{','.join(map(str, levels))}]", "write.shard_size=2000", "report.enabled=false",
            f"tasks.count={tasks}", "tasks.launcher=local"]


def run_curate(work: str, tasks: int, levels: list[int], k: int, block: int | None) -> dict:
    """One `curate run` in a fresh output folder; its wall time, progress lines and decisions."""
    out = os.path.join(work, f"run-w{tasks}")
    shutil.rmtree(out, ignore_errors=True)
    progress = out + ".progress.jsonl"
    if os.path.exists(progress):
        os.remove(progress)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if block:
        env["DINOPIPE_DEBUG_HOOKS"] = f"curate_block={block}"
    cmd = [sys.executable, "-m", "curation.cli"] + curate_args(work, out, tasks, levels, k, progress)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    with open(out + ".log", "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"curate run (W={tasks}) exited {proc.returncode}; log: {out}.log\n{proc.stderr[-3000:]}")
    with open(progress) as f:
        steps = [json.loads(line) for line in f]
    with open(os.path.join(out, "manifest.json")) as f:
        counts = json.load(f)["counts"]
    digest = hashlib.sha256()
    with open(os.path.join(out, "decisions.tsv"), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return {"tasks": tasks, "wall_s": round(wall, 1), "steps": steps, "counts": counts,
            "decisions_sha256": digest.hexdigest(), "out": out}


def decisions(out: str) -> dict[str, tuple[str, str]]:
    """path relative to its input folder -> (status, group): a bench-sized table read whole."""
    table = {}
    with open(os.path.join(out, "decisions.tsv")) as f:
        next(f)
        for line in f:
            name, _src, status, group = line.rstrip("\n").split("\t")
            table[name] = (status, group)
    return table


def _key(table: dict, rel: str, folder: str) -> str:
    """The decisions id of a file: ids are paths; match on the part relative to the input folder."""
    for cand in (rel, f"{folder}/{rel}"):
        if cand in table:
            return cand
    raise KeyError(f"{rel} not in decisions.tsv")


def recall(out: str, truth: dict) -> dict:
    """Planted copies found (the copy in its original's group) and eval overlaps
    removed (the pool tile decontaminated, or its group's kept tile)."""
    table = decisions(out)
    found = 0
    for rel, copy_rel, _kind in truth["copies"]:
        # group_or_reason: the id of the row's copy group (hash or verified copy), whatever its final status
        found += table[_key(table, rel, "pool")][1] == table[_key(table, copy_rel, "pool")][1]
    removed = 0
    for _eval_rel, rel, _kind in truth["eval_overlap"]:
        s, g = table[_key(table, rel, "pool")]
        removed += s == "decontaminated" or (s in ("hash_duplicates", "copy_duplicates")
                                             and table.get(g, ("",))[0] == "decontaminated")
    return {"copies": found / max(1, len(truth["copies"])),
            "eval_overlap": removed / max(1, len(truth["eval_overlap"]))}


def _call_cell(call: dict | None) -> str:
    if call is None:
        return ""
    reps = call["reports"]
    rss = "/".join(f"{r['peak_rss_mb']:.0f}" for r in reps)
    return (f"{call['tasks']}{' inline' if len(reps) == 1 and call['tasks'] == 1 else ''}: "
            f"{max(r['wall_s'] for r in reps):.1f} s, heap {max(r['heap_mb'] for r in reps):.0f}, RSS {rss}")


def render(res: dict) -> str:
    """Markdown: per step its wall time and the orchestrator's peak heap / RSS, then per runner call (matched by
    position between the runs) the tasks, the slowest task's s, the largest task heap and each task's peak RSS."""
    runs = res["runs"]
    t = res["truth"]
    lines = [f"{res['pool_files']:,} pool files ({res['tiles']:,} tiles + {len(t['copies'])} planted copies), "
             f"{t['eval_files']} eval tiles ({len(t['eval_overlap'])} near-copies of pool tiles); block "
             f"{res['block'] or 65536} rows; k-means levels {res['levels']}; dedup.k {res['k']}", "",
             "step rows: wall s, orchestrator peak heap / peak RSS MB; call rows: tasks: slowest task s, largest "
             "task heap MB (RssAnon above its start), each task's peak RSS MB (VmHWM, interpreter and imports "
             "included; an inline task's is the orchestrator's)", "",
             "| step / runner call | " + " | ".join(f"W = {r['tasks']}" for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    by_step = [{s["step"]: s for s in r["steps"]} for r in runs]
    for name in [s["step"] for s in runs[0]["steps"]]:
        steps = [b.get(name) for b in by_step]
        lines.append(f"| **{name}** | " + " | ".join(
            "" if s is None else f"{s['wall_s']:.1f} s, {s['orchestrator_heap_mb']:.0f} / "
            f"{s['orchestrator_peak_rss_mb']:.0f} MB" for s in steps) + " |")
        for i in range(max(len(s["runs"]) if s else 0 for s in steps)):
            calls = [s["runs"][i] if s and i < len(s["runs"]) else None for s in steps]
            fns = " / ".join(dict.fromkeys(c["fn"] for c in calls if c))
            lines.append(f"| &nbsp;&nbsp;{fns} | " + " | ".join(_call_cell(c) for c in calls) + " |")
    lines.append("| **total wall** | " + " | ".join(f"{r['wall_s']:.1f} s" for r in runs) + " |")
    lines.append("| recall: planted copies / eval overlap | " + " | ".join(
        f"{r['recall']['copies']:.3f} / {r['recall']['eval_overlap']:.3f}" for r in runs) + " |")
    lines.append("| decisions.tsv sha256 | " + " | ".join(r["decisions_sha256"][:16] for r in runs) + " |")
    lines += [""] + [f"counts (W = {r['tasks']}): " + ", ".join(f"{v} {k}" for k, v in r["counts"].items())
                     for r in runs]
    lines.append(f"decisions identical for W = {', '.join(str(r['tasks']) for r in runs)}: {res['identical']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", type=int, default=20000, help="pool tiles (planted copies come on top)")
    p.add_argument("--copy-fraction", type=float, default=0.02)
    p.add_argument("--eval", type=int, default=300, help="eval tiles")
    p.add_argument("--eval-copies", type=int, default=100, help="eval tiles that are near-copies of pool tiles")
    p.add_argument("--tasks", type=int, nargs="+", default=[1, 4])
    p.add_argument("--levels", type=int, nargs="+", default=None,
                   help="hierarchical k-means levels (default: ~sqrt(N), ~N^(1/4))")
    p.add_argument("--k", type=int, default=16, help="dedup.k: kNN candidates per image")
    p.add_argument("--block", type=int, default=None, help="rows per task block (debug hook curate_block)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="scratch folder (pool, eval, runs)")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true", help="keep the output folders of the runs")
    p.add_argument("--render", default=None, metavar="JSON", help="print the table of a saved --json and exit")
    a = p.parse_args(argv)
    if a.render:
        with open(a.render) as f:
            print(render(json.load(f)))
        return 0
    if not a.work:
        p.error("--work is required")
    os.makedirs(a.work, exist_ok=True)
    t0 = time.perf_counter()
    truth = build(a.work, a.tiles, a.copy_fraction, a.eval, a.eval_copies, a.seed)
    print(f"pool: {truth['pool_files']:,} files ({truth['textured']:,} textured tiles; {truth['candidates']:,} "
          f"candidate tiles from the shipped photos), built in {time.perf_counter() - t0:.1f} s", flush=True)
    levels = a.levels or [max(2, round(truth["pool_files"] ** 0.5)), max(2, round(truth["pool_files"] ** 0.25))]
    runs = []
    for w in a.tasks:
        run = run_curate(a.work, w, levels, a.k, a.block)
        run["recall"] = recall(run["out"], truth)
        print(f"W={w}: {run['wall_s']:.1f} s, decisions.tsv sha256 {run['decisions_sha256']}, recall {run['recall']}",
              flush=True)
        if not a.keep:
            shutil.rmtree(run["out"], ignore_errors=True)
        runs.append(run)
    res = {"tiles": a.tiles, "pool_files": truth["pool_files"], "block": a.block, "levels": levels, "k": a.k,
           "truth": {k: truth[k] for k in ("copies", "eval_overlap", "eval_files", "textured", "candidates")},
           "runs": runs, "identical": len({r["decisions_sha256"] for r in runs}) == 1,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(render(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
