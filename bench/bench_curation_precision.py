"""Precision / recall of copy verification and of decontamination on real pixels, per kind of pool.

    nice -n 10 python bench/bench_curation_precision.py --work /tmp/precision \\
        --json bench/results/curation_precision.json

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
* decontamination verified: the same candidates (nearest eval tile) verified by
  ``curation.leakverify.LeakVerifier``; and the verifier alone on every (leak, its eval tile) pair (its recall
  when the candidate stage finds the pair).
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
from curation.descriptor import PCADescriptor  # noqa: E402
from curation.leakverify import LeakVerifier  # noqa: E402
from curation.verify import PixelVerifier  # noqa: E402

SHIPPED_DECONTAM = 0.45


def _embed(files: list[str]) -> np.ndarray:
    return PCADescriptor().embed_images([Image.open(f).convert("RGB") for f in files])


def measure(root: str, kind: str, seed: int, n_leaks: int, n_copies: int, k: int) -> dict:
    t = build_pool(root, kind, seed=seed, n_leaks=n_leaks, n_copies=n_copies)
    ev = [os.path.join(root, "eval", r) for r in t["eval"]]
    clean = [os.path.join(root, "pool", r) for r in t["clean"]]
    leaks = [os.path.join(root, "pool", p) for p, _, _ in t["leaks"]]
    copies = [os.path.join(root, "pool", p) for _, p, _ in t["copies"]]
    files = ev + clean + leaks + copies
    ne, nc, nl = len(ev), len(clean), len(leaks)
    E, C, L = _embed(ev), _embed(clean), _embed(leaks)
    out: dict = {"kind": kind, "eval": ne, "clean": nc, "leaks": nl, "copies": len(copies),
                 "sources": t["sources"]}

    # dedup: planted copies and each clean tile's k nearest clean tiles (all distinct)
    pv = PixelVerifier(lambda i: Image.open(files[i]))
    ci = {r: i for i, r in enumerate(t["clean"])}
    orig = np.array([ne + ci[o] for o, _, _ in t["copies"]])
    cop = ne + nc + nl + np.arange(len(copies))
    copy_ok = pv(orig, cop)
    sim = C @ C.T
    np.fill_diagonal(sim, -np.inf)
    nn = np.argsort(-sim, axis=1)[:, :k]
    a = np.repeat(np.arange(nc), nn.shape[1])
    b = nn.ravel()
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    keys = np.unique(lo * nc + hi)
    lo, hi = keys // nc, keys % nc
    t0 = time.perf_counter()
    sc = pv.scores(ne + lo, ne + hi)
    wrong = sc > pv.threshold
    joined = np.zeros(nc, bool)
    joined[lo[wrong]] = joined[hi[wrong]] = True
    out["dedup"] = {"copies_grouped": float(copy_ok.mean()) if len(copy_ok) else None,
                    "distinct_pairs": int(len(keys)), "distinct_pairs_accepted": int(wrong.sum()),
                    "distinct_kept": float(1 - joined.mean()),
                    "worst_distinct": [[t["clean"][i], t["clean"][j], round(float(s), 3)] for i, j, s in
                                       sorted(zip(lo[wrong], hi[wrong], sc[wrong]), key=lambda r: -r[2])[:5]],
                    "seconds": round(time.perf_counter() - t0, 1)}

    # decontamination: the nearest eval tile of each clean tile / leak, by the descriptor
    ei = {r: i for i, r in enumerate(t["eval"])}
    sc_clean, sc_leak = C @ E.T, L @ E.T
    near_c, near_l = sc_clean.argmax(1), sc_leak.argmax(1)
    max_c, max_l = sc_clean.max(1), sc_leak.max(1)
    truth_l = np.array([ei[e] for _, e, _ in t["leaks"]])
    out["decontam_shipped"] = {"threshold": SHIPPED_DECONTAM,
                               "false_removals": float((max_c > SHIPPED_DECONTAM).mean()),
                               "leaks_removed": float((max_l > SHIPPED_DECONTAM).mean())}
    lv = LeakVerifier(lambda i: Image.open(files[i]))
    t0 = time.perf_counter()
    v_clean = lv(near_c, ne + np.arange(nc))
    v_leak = lv(near_l, ne + nc + np.arange(nl)) & (near_l == truth_l)
    v_oracle = lv(truth_l, ne + nc + np.arange(nl))
    scores = lv.scores(truth_l, ne + nc + np.arange(nl))
    out["decontam_verified"] = {
        "threshold": lv.threshold, "false_removals": float(v_clean.mean()), "leaks_removed": float(v_leak.mean()),
        "candidate_recall": float((near_l == truth_l).mean()), "verifier_recall": float(v_oracle.mean()),
        "missed": [[t["leaks"][j][2], round(float(scores[j]), 3)] for j in np.flatnonzero(~v_oracle)][:10],
        "seconds": round(time.perf_counter() - t0, 1), "pairs": int(nc + 3 * nl)}
    return out


def render(res: dict) -> str:
    rows = ["| pool | clean / eval / leaks / copies | dedup: copies grouped | distinct kept (pairs accepted) "
            "| decontam. shipped (cos > 0.45): false removals / leaks removed | verified: false removals / "
            "leaks removed | candidate recall | verifier recall |", "|" + "---|" * 8]
    for r in res["pools"]:
        d, s, v = r["dedup"], r["decontam_shipped"], r["decontam_verified"]
        rows.append(f"| {r['kind']} | {r['clean']} / {r['eval']} / {r['leaks']} / {r['copies']} | "
                    f"{d['copies_grouped']:.2f} | {d['distinct_kept']:.3f} ({d['distinct_pairs_accepted']} of "
                    f"{d['distinct_pairs']}) | {s['false_removals']:.3f} / {s['leaks_removed']:.2f} | "
                    f"{v['false_removals']:.3f} / {v['leaks_removed']:.2f} | {v['candidate_recall']:.2f} | "
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
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    res = {"args": vars(a), "pools": []}
    for kind in a.pools:
        r = measure(os.path.join(a.work, kind), kind, a.seed, a.leaks, a.copies, a.k)
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
