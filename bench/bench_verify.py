"""Pixel verification rate: candidate pairs per second per core on real images, main's verifier vs this one.

    python bench/bench_verify.py                 # retina + micrograph tiles, ~3k candidate pairs, 1 thread
    python bench/bench_verify.py --device cuda   # the batched path on a GPU (pairs per second per GPU)

Pairs: every tile of bench_copy's retina and micrograph pools (real scikit-image images, 224 px JPEGs) with
its planted copy and its ``--k`` nearest tiles by the copy descriptor (the candidates a kNN proposes on
homogeneous data: most are distinct tiles of one scene). Both verifiers read the JPEG files themselves
(decode included), pairs sorted by their first image, as ``copy_dedup_from_pairs`` passes them. 'before'
is the verifier of main (git show main:curation/verify/pixels.py, loaded as a module); 'after' this one. Printed:
pairs per second per core, the ratio, and whether both reach the same verdicts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_copy import POOLS, build_tile_pool  # noqa: E402
from curation.embed.descriptor import PCADescriptor  # noqa: E402
from curation.verify.pixels import PixelVerifier  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main_verifier(tmp: str, path: str | None = None):
    """curation/verify/pixels.py as on the main branch (or the file ``path``; None when neither is there)."""
    if path is not None:
        with open(path) as f:
            src = f.read()
    else:
        try:
            src = subprocess.run(["git", "-C", ROOT, "show", "main:curation/verify/pixels.py"], check=True,
                                 capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
    path = os.path.join(tmp, "verify_main.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("verify_main", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PixelVerifier


def candidate_pairs(files: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    desc = PCADescriptor()
    e = desc.embed_images([Image.open(f).convert("RGB") for f in files])
    sim = e @ e.T
    np.fill_diagonal(sim, -np.inf)
    nn = np.argsort(-sim, axis=1)[:, :k]
    a = np.repeat(np.arange(len(files)), k)
    lo, hi = np.minimum(a, nn.ravel()), np.maximum(a, nn.ravel())
    key = np.unique(lo * len(files) + hi)
    return key // len(files), key % len(files)


def rate(cls, files, a, b, **kw) -> tuple[float, np.ndarray]:
    v = cls(lambda p: Image.open(files[p]).convert("RGB"), **kw)
    t0 = time.perf_counter()
    ok = v(a, b)
    return len(a) / (time.perf_counter() - t0), ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-pairs", type=int, default=3000)
    p.add_argument("--before", default=None, help="main's verify.py as a file (default: git show main:...)")
    p.add_argument("--json", default=None, help="also write the rate here (bench/tools/rates_from_bench.py reads it)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="bench_verify_")
    files = []
    for name in ("retina", "micrographs"):
        root = os.path.join(tmp, name)
        build_tile_pool(root, POOLS[name])
        files += sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".jpg"))
    a, b = candidate_pairs(files, args.k)
    a, b = a[:args.max_pairs], b[:args.max_pairs]
    print(f"images: {len(files)}  candidate pairs: {len(a)}  threads: {args.threads}  device: {args.device}")
    before_cls = _main_verifier(tmp, args.before)
    after, ok_after = rate(PixelVerifier, files, a, b, **({"device": args.device} if args.device != "cpu" else {}))
    per_core = args.threads if args.device == "cpu" else 1
    print(f"verify_after_pairs_per_s_per_core: {after / per_core:.1f}")
    if before_cls is not None:
        before, ok_before = rate(before_cls, files, a, b)
        print(f"verify_before_pairs_per_s_per_core: {before / per_core:.1f}")
        print(f"verify_speedup: {after / before:.2f}")
        print(f"verify_same_verdicts_pct: {100 * (ok_before == ok_after).mean():.2f}")
    print(f"verified_copies: {int(ok_after.sum())} of {len(a)}")
    if args.json:
        from bench.run_meta import run_meta

        with open(args.json, "w") as f:
            json.dump({"pairs_per_s_per_core": after / per_core, "pairs": int(len(a)), "images": len(files),
                       "threads": args.threads, "device": args.device, "copies": int(ok_after.sum()),
                       "meta": run_meta(argv)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
