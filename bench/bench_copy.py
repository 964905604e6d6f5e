"""Copy detection with precision: distinct tiles kept vs planted copies found, before / after.

    python bench/bench_copy.py            # all tile pools + the quickstart pool (~5 min on 2 cores)
    python bench/bench_copy.py --quick    # retina tiles + a 300-image quickstart pool

Pools: non-overlapping 96 px tiles of the real micrographs and photos shipped in scikit-image, each
upscaled to 224 px (JPEG q92) — homogeneous data where distinct images of one scene look alike at
64 px. Every *textured* tile (luma std >= 5 grey levels and >= 2 in each quadrant: no blank part)
gets one planted copy: shifted by up to 3 px in the source, cropped by up to 5% (split unevenly
between borders), brightness x0.85-1.15, resized to 60-100%, JPEG q50-85. Blank tiles are real
duplicates of one another and are not counted.

Per pool and mode, on the real pipeline (``step_embed`` + ``step_dedup``: pHash pre-dedup, kNN
k=64 at cosine > 0.6 on the copy descriptor, then grouping):
  kept      textured tiles whose content survives (the tile or its copy kept), %
  recall    planted copies in the same group as their original, %
  largest   size of the largest copy group and how many distinct source tiles it mixes
'before' is DINOv2's recipe as main ran it (descriptor edges, connected components); 'after' adds
pixel verification of every candidate and star groups (no chaining). The quickstart pool
(dinopipe/data/samples.py, as ``make quickstart`` builds it) gives the planted-copy recall there.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from curation.config import DedupConfig, EmbedConfig  # noqa: E402
from curation.core.embstore import open_embeddings
from curation.core.stepfiles import load_step  # noqa: E402
from curation.dedup.step import step_dedup  # noqa: E402
from curation.embed.step import step_embed  # noqa: E402
from dinopipe.data.samples import _to_rgb_uint8, build_sample_pool  # noqa: E402

POOLS = {
    "retina": ["retina"],
    "micrographs": ["immunohistochemistry", "cell", "hubble_deep_field"],
    "textures": ["brick", "gravel", "grass"],
    "photos": ["astronaut", "camera", "coffee", "chelsea", "rocket", "coins", "moon"],
}
MODES = {"before": {"verify": False, "grouping": "components"},
         "after": {"verify": True, "grouping": "star"}}
TILE, UP = 96, 224
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)


def _jpeg(arr: np.ndarray, path: str, quality: int) -> None:
    Image.fromarray(arr).save(path, format="JPEG", quality=quality)


def textured(tile: np.ndarray) -> bool:
    y = tile.astype(np.float32) @ _LUMA
    h = TILE // 2
    quads = [y[i:i + h, j:j + h].std() for i in (0, h) for j in (0, h)]
    return bool(y.std() >= 5 and min(quads) >= 2)


def planted_copy(arr: np.ndarray, y: int, x: int, rng: np.random.Generator) -> np.ndarray:
    H, W = arr.shape[:2]
    dy, dx = rng.integers(-3, 4, 2)
    y0, x0 = int(np.clip(y + dy, 0, H - TILE)), int(np.clip(x + dx, 0, W - TILE))
    tile = arr[y0:y0 + TILE, x0:x0 + TILE].astype(np.float32)
    crop = rng.uniform(0, 0.05, 2)  # total fraction cut per axis
    left = rng.uniform(0, 1, 2) * crop
    x1, y1 = int(round(left[0] * TILE)), int(round(left[1] * TILE))
    x2, y2 = TILE - int(round((crop[0] - left[0]) * TILE)), TILE - int(round((crop[1] - left[1]) * TILE))
    tile = np.clip(tile[y1:y2, x1:x2] * rng.uniform(0.85, 1.15), 0, 255).astype(np.uint8)
    side = int(UP * rng.uniform(0.6, 1.0))
    return np.asarray(Image.fromarray(tile).resize((side, side), Image.BICUBIC))


def build_tile_pool(root: str, names: list[str], seed: int = 0) -> dict:
    """Write tiles (+ copies of textured ones); return {tile rel path: (textured, copy rel path)}."""
    import skimage.data as skd

    rng = np.random.default_rng(seed)
    info = {}
    for name in names:
        arr = _to_rgb_uint8(getattr(skd, name)())
        os.makedirs(os.path.join(root, name), exist_ok=True)
        os.makedirs(os.path.join(root, "copies", name), exist_ok=True)
        for y in range(0, arr.shape[0] - TILE + 1, TILE):
            for x in range(0, arr.shape[1] - TILE + 1, TILE):
                tile = arr[y:y + TILE, x:x + TILE]
                rel = f"{name}/t{y // TILE:02d}_{x // TILE:02d}.jpg"
                up = np.asarray(Image.fromarray(tile).resize((UP, UP), Image.BICUBIC))
                _jpeg(up, os.path.join(root, rel), 92)
                tex = textured(tile)
                copy_rel = None
                if tex:
                    copy_rel = f"copies/{rel}"
                    _jpeg(planted_copy(arr, y, x, rng), os.path.join(root, copy_rel),
                          int(rng.integers(50, 86)))
                info[rel] = (tex, copy_rel)
    return info


def evaluate(out: str, src_name: str, pairs: dict) -> dict:
    """pairs: {original rel: (counted, copy rel or None)} -> kept %, recall %, largest group."""
    emb = open_embeddings(os.path.join(out, "embeddings", "descriptor"))
    dd = load_step(out, "dedup")
    status, comp = dd["status"], dd["component"]
    names = list(pairs) + [c for _, c in pairs.values() if c]
    found = emb.positions_of([f"{src_name}/{n}" for n in names])  # through the path table
    pos = {n: int(p) for n, p in zip(names, found) if p >= 0}
    at = {i: pos[i] for i in pairs if i in pos}
    atc = {i: pos[c] for i, (_, c) in pairs.items() if c and c in pos}
    counted = [i for i, (t, _) in pairs.items() if t]
    kept = sum(status[at[i]] == 0 or (i in atc and status[atc[i]] == 0) for i in counted)
    with_copy = [i for i in counted if i in atc]
    found = sum(comp[at[i]] == comp[atc[i]] for i in with_copy)
    _, inv, sizes = np.unique(comp, return_inverse=True, return_counts=True)
    g = int(np.argmax(sizes))
    members = emb.id_strings(np.flatnonzero(inv.ravel() == g))
    # a member's source tile: its path with the copies/ prefix removed
    distinct = {m.split("/", 1)[1].replace("copies/", "") for m in members}
    return {"counted": len(counted), "kept": 100.0 * kept / max(1, len(counted)),
            "copies": len(with_copy), "recall": 100.0 * found / max(1, len(with_copy)),
            "largest": int(sizes[g]), "largest_sources": len(distinct)}


def run_pool(name: str, root: str, pairs: dict, out: str, k: int = 64, index: str = "auto") -> dict:
    t0 = time.perf_counter()
    step_embed([root], out, EmbedConfig(batch_size=64, num_workers=0), progress=False)
    t_embed = time.perf_counter() - t0
    res = {}
    for mode, kw in MODES.items():
        t0 = time.perf_counter()
        d = step_dedup(out, DedupConfig(k=k, index=index, **kw), progress=False, sources=[root])
        r = evaluate(out, os.path.basename(root), pairs)
        r.update(seconds=time.perf_counter() - t0, candidates=d["candidates"], edges=d["edges"],
                 verify_seconds=d["verify_seconds"], embed_seconds=t_embed)
        res[mode] = r
        print(f"{name}_{mode}: counted {r['counted']} kept {r['kept']:.1f}% | copies {r['copies']} "
              f"recall {r['recall']:.1f}% | largest group {r['largest']} from {r['largest_sources']} "
              f"tiles | candidates {r['candidates']} edges {r['edges']} | dedup {r['seconds']:.1f} s "
              f"(verify {r['verify_seconds']:.1f} s; embed {t_embed:.1f} s)", flush=True)
    return res


def quickstart_pairs(root: str) -> dict:
    pairs = {}
    for f in sorted(os.listdir(os.path.join(root, "copies"))):
        stem = f[: -len("_copy.jpg")]
        pairs[f"{stem}.jpg"] = (True, f"copies/{f}")
    return pairs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="retina tiles + a 300-image quickstart pool")
    p.add_argument("--keep", default=None, help="write pools here (default: a temporary folder)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(2)
    pools = {"retina": POOLS["retina"]} if args.quick else POOLS
    tmp = args.keep or tempfile.mkdtemp(prefix="bench_copy_")
    totals = {m: {"counted": 0, "kept": 0.0, "copies": 0, "recall": 0.0} for m in MODES}
    vsec, ncand = 0.0, 0
    for name, images in pools.items():
        root = os.path.join(tmp, name, "tiles")
        pairs = build_tile_pool(root, images)
        res = run_pool(name, root, pairs, os.path.join(tmp, name, "out"))
        for m, r in res.items():
            totals[m]["counted"] += r["counted"]
            totals[m]["kept"] += r["kept"] * r["counted"] / 100
            totals[m]["copies"] += r["copies"]
            totals[m]["recall"] += r["recall"] * r["copies"] / 100
        vsec += res["after"]["verify_seconds"]
        ncand += res["after"]["candidates"]
    for m, t in totals.items():
        print(f"tiles_{m}_kept_pct: {100 * t['kept'] / max(1, t['counted']):.1f}")
        print(f"tiles_{m}_copy_recall_pct: {100 * t['recall'] / max(1, t['copies']):.1f}")
    print(f"verify_ms_per_candidate_pair: {1000 * vsec / max(1, ncand):.2f}")
    n_images = 300 if args.quick else 1500  # configs/pipeline/quickstart.yaml: sample.n_images
    qs = os.path.join(tmp, "quickstart")
    build_sample_pool(qs, n_images=n_images)
    root = os.path.join(qs, "pool")
    res = run_pool("quickstart", root, quickstart_pairs(root), os.path.join(qs, "out"), k=16,
                   index="flat")  # configs/curation/quickstart.yaml
    for m, r in res.items():
        print(f"quickstart_{m}_copy_recall_pct: {r['recall']:.1f}")
        print(f"quickstart_{m}_largest_group: {r['largest']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
