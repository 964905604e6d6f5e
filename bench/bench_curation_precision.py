"""Precision / recall of copy verification and of decontamination on real pixels, per kind of pool.

    nice -n 10 python bench/bench_curation_precision.py --work /tmp/precision --pools mixed --leak-kind hard \\
        --max-pool 200 --max-eval 100 --json mixed-hard.json    # one process per pool kind and leak kind

Pools (bench/precision_pools.py): the real photos packages ship, split by source photo into thirds (eval =
tiles of one third, pool = tiles of the others, so the clean pool shares no pixel with the eval set); kinds
``mixed``, ``retina`` (one domain) and ``lowdetail``. Planted: ``--leaks`` eval tiles leaked into the pool
(crop to 50-100 % a side, resize, colour, mirror, rotation <= 8 degrees, border, JPEG) and ``--copies`` pool
tiles copied as the web copies them.

Measured per pool, on pairs (the candidates a kNN on the copy descriptor proposes, then the pixel verdict):

* dedup: ``PixelVerifier`` on each planted (original, copy) pair (recall) and on each clean tile with its
  ``--k`` nearest clean tiles (all distinct: false accepts, and the share of clean tiles in none);
* decontamination, as shipped: pool tiles whose nearest eval tile has cosine > 0.45 (false removals of the
  clean pool, leaks removed);
* decontamination verified: the candidates (each pool tile's nearest row of the eval index: every view of every eval
  tile, curation.decontaminate.views, unless ``--no-views``) verified by
  ``curation.decontaminate.leakverify.LeakVerifier``; and the verifier alone on every (leak, its eval tile) pair (its recall
  when the candidate stage finds the pair). Leaks of constant eval tiles (luma std < 2 levels: the black corner of
  a fundus photo) are counted apart (``constant_leaks``): the same picture as any constant pool tile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.precision_pools import POOL_KINDS, build_pool  # noqa: E402
from curation.embed.descriptor import PCADescriptor  # noqa: E402
from curation.config import DecontaminateConfig, decontam_threshold  # noqa: E402
from curation.decontaminate.leakverify import LeakVerifier  # noqa: E402
from curation.decontaminate.views import VIEW_BOXES, eval_position, view_of  # noqa: E402
from curation.verify.pixels import PixelVerifier  # noqa: E402

SHIPPED_DECONTAM = 0.45


def _embed(files: list[str]) -> np.ndarray:
    return PCADescriptor().embed_images([Image.open(f).convert("RGB") for f in files])


def _embed_views(files: list[str]) -> np.ndarray:
    """The eval index's rows as ``curate`` writes them (curation.decontaminate.views): every view of every eval
    image, view-major."""
    ims = [Image.open(f).convert("RGB") for f in files]
    return np.concatenate([PCADescriptor().embed_images([view_of(im, box) for im in ims]) for box in VIEW_BOXES])


def _blank(path: str) -> bool:
    """No structure at all (luma std < 2 levels): two such images are the same picture whatever their source."""
    y = np.asarray(Image.open(path).convert("L"), np.float32)
    return bool(y.std() < 2.0)


def measure_dedup(files: list[str], t: dict, ne: int, C: np.ndarray, k: int) -> dict:
    """PixelVerifier on the planted copies and on each clean tile's k nearest clean tiles (all distinct)."""
    nc = len(t["clean"])
    ci = {r: i for i, r in enumerate(t["clean"])}
    copies0 = ne + nc + len(t["leaks"])
    orig = np.array([ne + ci[o] for o, _, _ in t["copies"]], np.int64)
    cop = copies0 + np.arange(len(t["copies"]))
    sim = C @ C.T
    np.fill_diagonal(sim, -np.inf)
    nn = np.argsort(-sim, axis=1)[:, :k]
    a, b = np.repeat(np.arange(nc), nn.shape[1]), nn.ravel()
    keys = np.unique(np.minimum(a, b) * nc + np.maximum(a, b))
    lo, hi = keys // nc, keys % nc
    blank = np.array([_blank(files[ne + i]) for i in range(nc)])
    both_blank = blank[lo] & blank[hi]
    out = {}
    for name, structure in (("before", False), ("after", True)):
        pv = PixelVerifier(lambda i: Image.open(files[i]), structure=structure)
        t0 = time.perf_counter()
        copy_ok = pv(orig, cop)
        sc = pv.scores(ne + lo, ne + hi)
        wrong = (sc > pv.threshold) & ~both_blank
        joined = np.zeros(nc, bool)
        joined[lo[wrong]] = joined[hi[wrong]] = True
        out[name] = {"copies_grouped": float(copy_ok.mean()), "distinct_pairs": int((~both_blank).sum()),
                     "distinct_pairs_accepted": int(wrong.sum()), "distinct_kept": float(1 - joined[~blank].mean()),
                     "blank_pairs": int(both_blank.sum()),
                     "low_detail_accepted": int((wrong & ~blank[lo] & ~blank[hi]
                                                 & (np.minimum(_detail(files, ne + lo), _detail(files, ne + hi))
                                                    <= LOW_DETAIL)).sum()),
                     "accepted": [[t["clean"][i], t["clean"][j], round(float(x), 3)] for i, j, x in
                                  sorted(zip(lo[wrong], hi[wrong], sc[wrong]), key=lambda r: -r[2])[:8]],
                     "seconds": round(time.perf_counter() - t0, 1)}
    return out


LOW_DETAIL = 3.0  # mean luma gradient (levels / px): bench/precision_pools' low-detail bound


def _detail(files: list[str], pos: np.ndarray) -> np.ndarray:
    from bench.precision_pools import detail

    return np.array([detail(np.asarray(Image.open(files[i]).convert("RGB"))) for i in pos])


def measure_decontam(files: list[str], t: dict, ne: int, C: np.ndarray, E: np.ndarray, L: np.ndarray,
                     V: np.ndarray | None = None) -> dict:
    """The shipped rule before (cosine > 0.45 to the whole eval tiles ``E``), and the candidates (cosine > the
    config's candidate threshold to the eval index's rows ``V``: the views, or ``E`` without) verified by
    LeakVerifier; the verifier alone on every (leak, its eval tile)."""
    nc, nl = len(C), len(L)
    ei = {r: i for i, r in enumerate(t["eval"])}
    V = E if V is None else V
    sc_c, sc_l = C @ V.T, L @ V.T
    near_c, near_l = eval_position(sc_c.argmax(1), ne), eval_position(sc_l.argmax(1), ne)
    max_c, max_l = sc_c.max(1), sc_l.max(1)
    whole_c, whole_l = (C @ E.T).max(1), (L @ E.T).max(1)
    truth = np.array([ei[e] for _, e, _ in t["leaks"]])
    cand = DecontaminateConfig()
    thr = decontam_threshold(cand, copy_model=False)
    lv = LeakVerifier(lambda i: Image.open(files[i]), size=cand.verify_size, threshold=cand.verify_threshold,
                      min_scale=cand.min_scale)
    t0 = time.perf_counter()
    c_idx = np.flatnonzero(max_c > thr)
    v_clean = np.zeros(nc, bool)
    v_clean[c_idx] = lv(near_c[c_idx], ne + c_idx)
    s_oracle = lv.scores(truth, ne + nc + np.arange(nl))
    ok_oracle = s_oracle > lv.threshold
    found = (max_l > thr) & (near_l == truth)  # the candidate is the right eval tile
    # a leak whose nearest eval tile is another one: verified against that one
    other = np.flatnonzero((max_l > thr) & (near_l != truth))
    v_other = lv(near_l[other], ne + nc + other) if len(other) else np.zeros(0, bool)
    removed = found & ok_oracle
    removed[other] = v_other
    # a leaked constant tile (no structure at all) is the same picture as every constant tile of the clean pool: no
    # verifier can tell it from them, so such leaks are counted apart (as dedup counts pairs of constant tiles apart)
    real = ~np.array([_blank(files[i]) for i in truth])
    return {"shipped": {"threshold": SHIPPED_DECONTAM, "false_removals": float((whole_c > SHIPPED_DECONTAM).mean()),
                        "leaks_removed": float((whole_l > SHIPPED_DECONTAM).mean())},
            "verified": {"candidate_threshold": thr, "verify_threshold": lv.threshold, "views": len(V) // ne,
                         "candidates": int(len(c_idx)), "false_removals": float(v_clean.mean()),
                         "constant_leaks": int((~real).sum()),
                         "leaks_removed": float(removed[real].mean()), "candidate_recall": float(found[real].mean()),
                         "verifier_recall": float(ok_oracle[real].mean()),
                         "false": [[t["clean"][i], t["eval"][near_c[i]]] for i in np.flatnonzero(v_clean)][:8],
                         "missed": [[t["leaks"][j][2], round(float(s_oracle[j]), 3)]
                                    for j in np.flatnonzero(~ok_oracle & real)][:12],
                         "seconds": round(time.perf_counter() - t0, 1)}}


def measure(root: str, kind: str, seed: int, n_leaks: int, n_copies: int, k: int, max_pool: int | None = None,
            max_eval: int | None = None, leak_kind: str = "hard", views: bool = True) -> dict:
    t = build_pool(root, kind, seed=seed, n_leaks=n_leaks, n_copies=n_copies, max_pool=max_pool, max_eval=max_eval,
                   leaks=leak_kind)
    ev = [os.path.join(root, "eval", r) for r in t["eval"]]
    clean = [os.path.join(root, "pool", r) for r in t["clean"]]
    leaks = [os.path.join(root, "pool", p) for p, _, _ in t["leaks"]]
    copies = [os.path.join(root, "pool", p) for _, p, _ in t["copies"]]
    files = ev + clean + leaks + copies
    E, C, L = _embed(ev), _embed(clean), _embed(leaks)
    V = _embed_views(ev) if views else None
    return {"kind": kind, "leak_kind": leak_kind, "eval": len(ev), "clean": len(clean), "leaks": len(leaks),
            "copies": len(copies), "sources": t["sources"], "dedup": measure_dedup(files, t, len(ev), C, k),
            "decontam": measure_decontam(files, t, len(ev), C, E, L, V)}


def render(res: dict) -> str:
    rows = ["| pool (leaks) | clean / eval / leaks / copies | dedup before: copies grouped / distinct kept / low-detail "
            "pairs accepted | dedup after | decontam. before (cos > 0.45): false removals / leaks removed | "
            "after (verified): false removals / leaks removed | candidate recall / verifier recall |",
            "|" + "---|" * 7]
    for r in res["pools"]:
        d0, d1 = r["dedup"]["before"], r["dedup"]["after"]
        s, v = r["decontam"]["shipped"], r["decontam"]["verified"]
        def cell(d):
            return (f"{d['copies_grouped']:.2f} / {d['distinct_kept']:.3f} / {d['low_detail_accepted']}")
        sizes = f"{r['clean']} / {r['eval']} / {r['leaks']} / {r['copies']}"
        rows.append(f"| {r['kind']} ({r.get('leak_kind', 'hard')}) | {sizes} | {cell(d0)} | "
                    f"{cell(d1)} | {s['false_removals']:.3f} / {s['leaks_removed']:.2f} | "
                    f"{v['false_removals']:.3f} / {v['leaks_removed']:.2f} | {v['candidate_recall']:.2f} / "
                    f"{v['verifier_recall']:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/precision")
    p.add_argument("--pools", nargs="+", default=list(POOL_KINDS), choices=POOL_KINDS)
    p.add_argument("--leaks", type=int, default=30)
    p.add_argument("--copies", type=int, default=30)
    p.add_argument("--k", type=int, default=4, help="clean neighbours per clean tile verified (dedup)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-pool", type=int, default=None, help="clean pool tiles per pool (a seeded sample)")
    p.add_argument("--max-eval", type=int, default=None, help="eval tiles per pool (a seeded sample)")
    p.add_argument("--leak-kind", choices=("hard", "single", "mild"), default="hard",
                   help="hard: crops to half, mirrors, rotations, borders, colour, all at once; single: one of "
                   "them per leak; mild: issue 49's measured setup")
    p.add_argument("--no-views", action="store_true", help="the eval index holds whole eval tiles only "
                   "(decontaminate.views: false)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    res = {"args": vars(a), "pools": []}
    for kind in a.pools:
        r = measure(os.path.join(a.work, f"{kind}-{a.leak_kind}"), kind, a.seed, a.leaks, a.copies, a.k, a.max_pool,
                    a.max_eval, a.leak_kind, not a.no_views)
        print(json.dumps(r), flush=True)
        res["pools"].append(r)
    print(render(res))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
