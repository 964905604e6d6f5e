"""The training input path per CPU core, dinopipe vs the official DINOv2 augmentation, in one run (issue 29).

    python bench/bench_input.py                      # ~1 min; the official source: .official/dinov2 or fetched
    python bench/bench_input.py --dinov2 PATH        # a dinov2 checkout (PATH/dinov2/data/augmentations.py)

Input: real photos shipped in pip packages (scikit-image, scikit-learn, matplotlib), re-encoded as 500x375
JPEGs (quality 90) into two webdataset tar shards. Each path runs in this process on one thread
(``torch.set_num_threads(1)``, no DataLoader workers), the recipe's 2 x 224 + 8 x 98 crops:

* ``dinopipe``: the training loader itself (``open_pool`` index over the shards -> ``build_train_loader`` with
  ``num_workers=0``: read, ``safe_decode`` with draft, ``MultiCropAugmentation(uint8_output=True)``,
  ``MultiCropCollator`` with its iBOT masks). What the training loader builds (``train/highres.py``).
* ``official``: ``webdataset.WebDataset(...).decode("pil")`` -> ``DataAugmentationDINO`` -> its
  ``collate_data_and_cast`` (fp16 crops, as its training casts them) with its ``MaskingGenerator``. The source
  is never vendored: ``--dinov2`` names a checkout, else ``.official/dinov2`` (``make official-src``), else
  ``bench/tools/fetch_official.sh`` extracts it from ``--mirror`` (a git directory or URL) into a temporary folder.
  Absent all: "official: not available".
* ``gpu path, host side``: what the workers do with ``data.augment_on=gpu`` (bytes, header, draws, masks);
  the device's decode and crops are timed by ``make gpu-bench``.
* ``--ideas``: the per-idea variants of the dinopipe path (the v2 reference, draft on / off, float / uint8
  output; draft on / off on 2000 x 1500 JPEGs, where it can pay) and single-op timings (blur, hue) on a
  224 px crop.

Rates are images per CPU-second of this process (``time.process_time``: the machines are shared, and a
process waiting for a core is not spending one), variants interleaved in rounds, medians printed; the ratio
is the median of the per-round ratios. Then the cores per GPU each backbone needs at a GPU step rate: ViT-S/14
at the rates docs/gpu.md measured (bare step, b=64, bf16, compile: 401 img/s H100, 485 H200), the larger
ones *estimated* from it by the planner's FLOPs per image (dinopipe.plan: student fwd+bwd on all crops,
teacher fwd on the global crops, heads left out), i.e. at the same MFU. Output lines ``name: value``.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Iterator, Optional

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dinopipe.data.loader import DataPosition, build_train_loader  # noqa: E402
from dinopipe.data.pool_index import open_pool  # noqa: E402
from dinopipe.data.samples import real_photos  # noqa: E402
from dinopipe.data.transforms import MultiCropAugmentation, MultiCropCollator  # noqa: E402

BENCH = os.path.dirname(os.path.abspath(__file__))
OFFICIAL = os.path.join(BENCH, "..", ".official", "dinov2")  # `make official-src`
MIRROR = "https://github.com/facebookresearch/dinov2"
RECIPE = dict(global_size=224, local_size=98, n_local=8)
STEP_RATES = {"H100": 401.0, "H200": 485.0}  # vit_s14, docs/gpu.md (b=64, bf16, compile, synthetic batch)


# -- the shards -------------------------------------------------------------------------------------------
def photo_jpegs(width: int = 500, height: int = 375, quality: int = 90) -> list[bytes]:
    """Every sample photo (and its mirror image) centre-cropped to 4:3 and resized to width x height."""
    out = []
    for name, arr in sorted(real_photos().items()):
        img = Image.fromarray(arr)
        w, h = img.size
        if w * height > h * width:
            cw = h * width // height
            img = img.crop(((w - cw) // 2, 0, (w - cw) // 2 + cw, h))
        else:
            ch = w * height // width
            img = img.crop((0, (h - ch) // 2, w, (h - ch) // 2 + ch))
        img = img.resize((width, height), Image.BICUBIC)
        for im in (img, img.transpose(Image.FLIP_LEFT_RIGHT)):
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=quality)
            out.append(buf.getvalue())
    return out


def write_shards(root: str, jpegs: list[bytes], n_shards: int = 2) -> list[str]:
    paths = []
    for s in range(n_shards):
        path = os.path.join(root, f"photos-{s:06d}.tar")
        with tarfile.open(path, "w") as tar:
            for i in range(s, len(jpegs), n_shards):
                info = tarfile.TarInfo(f"{i:06d}.jpg")
                info.size = len(jpegs[i])
                tar.addfile(info, io.BytesIO(jpegs[i]))
        paths.append(path)
    return paths


# -- the paths --------------------------------------------------------------------------------------------
def dinopipe_batches(shards: list[str], cache: str, batch: int, **aug_kwargs) -> Iterator[int]:
    """Images per batch of the training loader (forever, epoch after epoch)."""
    pool = open_pool([os.path.join(os.path.dirname(shards[0]), "*.tar")], cache_dir=cache)
    draft = aug_kwargs.pop("draft", True)
    aug = MultiCropAugmentation(**RECIPE, **aug_kwargs)
    aug.draft = draft
    loader = build_train_loader(pool, pool.read, aug, MultiCropCollator(14, (0.1, 0.5), 0.5), batch, 0, 1, 0,
                                DataPosition(), num_workers=0)
    for b in loader:
        yield b["n_images"]


def gpu_host_batches(shards: list[str], cache: str, batch: int) -> Iterator[int]:
    """The GPU path's host side (data.augment_on=gpu): read bytes, parse the JPEG header, draw the crops'
    parameters, collate bytes + parameters + masks. Decoding and cropping happen on the device (not timed)."""
    from dinopipe.data.gpu_augment import EncodedCollator, EncodedCrops

    pool = open_pool([os.path.join(os.path.dirname(shards[0]), "*.tar")], cache_dir=cache)
    aug = MultiCropAugmentation(**RECIPE)
    loader = build_train_loader(pool, pool.read, EncodedCrops(aug.recipe, aug.mean, aug.std),
                                EncodedCollator(14, RECIPE["global_size"]), batch, 0, 1, 0, DataPosition(),
                                num_workers=0)
    for b in loader:
        yield b["n_images"]


def device_rate(shards: list[str], cache: str, batch: int, device: str, seconds: float) -> float:
    """Images/s of the GPU path's device side (batched decode_jpeg, crops, photometrics, normalisation) on
    ``device`` (wall time, synchronised), over host batches prepared beforehand."""
    from dinopipe.data.device_stage import DeviceStage
    from dinopipe.data.gpu_augment import EncodedCollator, EncodedCrops, GpuMultiCrop

    dev = torch.device(device)
    pool = open_pool([os.path.join(os.path.dirname(shards[0]), "*.tar")], cache_dir=cache)
    aug = MultiCropAugmentation(**RECIPE)
    loader = build_train_loader(pool, pool.read, EncodedCrops(aug.recipe, aug.mean, aug.std),
                                EncodedCollator(14, RECIPE["global_size"]), batch, 0, 1, 0, DataPosition(),
                                num_workers=0)
    it = iter(loader)
    host = [next(it) for _ in range(4)]
    stage = DeviceStage(host, dev, aug.mean, aug.std, augment=GpuMultiCrop(aug.recipe, dev))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in stage:  # warm-up (nvJPEG handles, kernels)
        pass
    sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for b in stage:
            n += b["global_crops"].shape[0] // 2
        sync()
    return n / (time.perf_counter() - t0)


def official_source(path: Optional[str], mirror: str, tmp: str) -> Optional[str]:
    """A folder holding the dinov2 package: ``path``; else ``.official/dinov2`` (``make official-src``); else
    extracted from ``mirror`` (a git directory or URL) by ``bench/tools/fetch_official.sh``; None if none works."""
    def has_it(d: str) -> bool:
        return os.path.isfile(os.path.join(d, "dinov2", "data", "augmentations.py"))

    if path:
        return path if has_it(path) else None
    if has_it(OFFICIAL):
        return OFFICIAL
    dest = os.path.join(tmp, "dinov2-src")
    r = subprocess.run(["bash", os.path.join(BENCH, "tools", "fetch_official.sh"), mirror, dest], capture_output=True)
    return dest if r.returncode == 0 and has_it(dest) else None


def official_batches(src: str, shards: list[str], batch: int) -> Iterator[int]:
    sys.path.insert(0, src)
    import webdataset as wds
    from dinov2.data.augmentations import DataAugmentationDINO
    from dinov2.data.collate import collate_data_and_cast
    from dinov2.data.masking import MaskingGenerator

    aug = DataAugmentationDINO((0.32, 1.0), (0.05, 0.32), RECIPE["n_local"], RECIPE["global_size"],
                               RECIPE["local_size"])
    n_tokens = (RECIPE["global_size"] // 14) ** 2
    masks = MaskingGenerator(input_size=(16, 16), max_num_patches=0.5 * n_tokens)
    while True:
        ds = wds.WebDataset(shards, shardshuffle=False, empty_check=False).decode("pil").to_tuple("jpg")
        samples = []
        for (img,) in ds:
            samples.append((aug(img), None))
            if len(samples) == batch:
                collate_data_and_cast(samples, (0.1, 0.5), 0.5, torch.half, n_tokens, masks)
                yield len(samples)
                samples = []


def measure(paths: dict[str, Iterator[int]], rounds: int, seconds: float) -> dict[str, list[float]]:
    """Images per CPU-second of each path, ``rounds`` interleaved rounds of ~``seconds`` wall time each."""
    for it in paths.values():  # warm-up: one batch each (imports, index, first-call costs)
        next(it)
    rates: dict[str, list[float]] = {k: [] for k in paths}
    for r in range(rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for name in order:
            n, c0, t0 = 0, time.process_time(), time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                n += next(paths[name])
            rates[name].append(n / max(time.process_time() - c0, 1e-9))
    return rates


def op_times(repeat: int = 20) -> dict[str, float]:
    """Milliseconds of single photometric ops on one 224 px crop: torchvision's uint8 kernels vs ours."""
    from torchvision.transforms.v2 import functional as F

    from dinopipe.data import photometric as P

    x = torch.from_numpy(np.asarray(Image.fromarray(next(iter(real_photos().values()))).resize((224, 224)))
                         ).permute(2, 0, 1).contiguous()
    xf = x.unsqueeze(0).float()
    ops = {"blur torchvision 9x9 (ms)": lambda: F.gaussian_blur(x, [9, 9], [1.0, 1.0]),
           "blur separable taps (ms)": lambda: P.blur(xf, 1.0),
           "hue torchvision HSV round trip (ms)": lambda: F.adjust_hue(x, 0.05),
           "hue closed form (ms)": lambda: P.hue(xf, 0.05)}
    out = {}
    for name, fn in ops.items():
        fn()
        c0 = time.process_time()
        for _ in range(repeat):
            fn()
        out[name] = (time.process_time() - c0) / repeat * 1e3
    return out


# -- cores per GPU ----------------------------------------------------------------------------------------
def flops_per_image(name: str) -> float:
    """Planner FLOPs per image of the recipe's step: student 3 x fwd on 2 x 224 + 8 x 98, teacher fwd on 2 x 224."""
    import dinopipe
    from dinopipe.plan import backbone_arch, crop_forward_flops

    with torch.device("meta"):
        arch = backbone_arch(dinopipe.create_model(name, img_size=224))
    g, loc = (crop_forward_flops(arch, RECIPE[k]) for k in ("global_size", "local_size"))
    return 3 * (2 * g + RECIPE["n_local"] * loc) + 2 * g


def cores_table(per_core: dict[str, float]) -> list[str]:
    base = flops_per_image("vit_s14")
    lines = ["| backbone | GPU | step images/s | " + " | ".join(f"cores/GPU {k}" for k in per_core) + " |",
             "|---|---|---|" + "---|" * len(per_core)]
    for name in ("vit_s14", "vit_b14", "vit_l14", "vit_g14"):
        ratio = base / flops_per_image(name)
        for gpu, rate in STEP_RATES.items():
            step = rate * ratio
            how = "measured" if name == "vit_s14" else "estimated"
            cells = " | ".join(f"{step / r:.1f}" for r in per_core.values())
            lines.append(f"| {name} | {gpu} | {step:.0f} ({how}) | {cells} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dinov2", default=None, help="a dinov2 checkout (default: extract from --mirror)")
    p.add_argument("--mirror", default=os.environ.get("DINOV2_MIRROR", MIRROR), help="a dinov2 git dir or URL")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0, help="wall seconds per path and round")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ideas", action="store_true", help="also the per-idea variants and single-op timings")
    p.add_argument("--device", default=None, help="also time the GPU path's device side here (cuda; cpu works)")
    p.add_argument("--h100", type=float, default=STEP_RATES["H100"], help="vit_s14 step images/s on an H100")
    p.add_argument("--h200", type=float, default=STEP_RATES["H200"], help="vit_s14 step images/s on an H200")
    args = p.parse_args(argv)
    STEP_RATES.update(H100=args.h100, H200=args.h200)
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="bench_input_") as tmp:
        os.makedirs(os.path.join(tmp, "shards"))
        shards = write_shards(os.path.join(tmp, "shards"), photo_jpegs())
        cache = os.path.join(tmp, "index")
        paths: dict[str, Iterator[int]] = {"dinopipe": dinopipe_batches(shards, cache, args.batch, uint8_output=True)}
        paths["gpu path, host side"] = gpu_host_batches(shards, cache, args.batch)
        if args.ideas:
            paths.update({
                "v2 reference (before)": dinopipe_batches(shards, cache, args.batch, fast=False),
                "fast, no draft, float out": dinopipe_batches(shards, cache, args.batch, draft=False),
                "fast, draft, float out": dinopipe_batches(shards, cache, args.batch),
                "fast, no draft, uint8 out": dinopipe_batches(shards, cache, args.batch, draft=False,
                                                              uint8_output=True)})
        src = official_source(args.dinov2, args.mirror, tmp)
        if src is not None:
            try:
                paths["official"] = official_batches(src, shards, args.batch)
                next(paths["official"])
            except Exception as e:  # an import the checkout needs is missing here
                print(f"official: not available ({type(e).__name__}: {e})")
                paths.pop("official")
        else:
            print("official: not available (no --dinov2 checkout, no .official/dinov2, --mirror not readable)")
        if args.ideas:  # draft decoding pays on photos larger than the crops need: 2000 x 1500 shards
            os.makedirs(os.path.join(tmp, "large"))
            large = write_shards(os.path.join(tmp, "large"), photo_jpegs(2000, 1500)[:16])
            lcache = os.path.join(tmp, "index_large")
            paths["2000x1500, draft"] = dinopipe_batches(large, lcache, args.batch, uint8_output=True)
            paths["2000x1500, no draft"] = dinopipe_batches(large, lcache, args.batch, uint8_output=True, draft=False)
        rates = measure(paths, args.rounds, args.seconds)
        on_device = device_rate(shards, cache, 32, args.device, args.seconds) if args.device else None

    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"images: {len(photo_jpegs())} photos as 500x375 JPEG; crops 2x{RECIPE['global_size']} + "
          f"{RECIPE['n_local']}x{RECIPE['local_size']}; 1 thread; batch {args.batch}")
    for k, v in med.items():
        print(f"{k} images/s per core: {v:.1f}")
    if "official" in rates:
        for k in rates:
            if k != "official" and not k.startswith("2000x1500"):
                ratio = statistics.median(a / b for a, b in zip(rates[k], rates["official"]))
                print(f"{k} / official: {ratio:.2f}")
    if "2000x1500, draft" in rates:
        ratio = statistics.median(a / b for a, b in zip(rates["2000x1500, draft"], rates["2000x1500, no draft"]))
        print(f"2000x1500 draft / no draft: {ratio:.2f}")
    if args.ideas:
        for k, v in op_times().items():
            print(f"{k}: {v:.2f}")
    if on_device is not None:
        print(f"gpu path device side on {args.device} images/s: {on_device:.1f}")
    per_core = {k: med[k] for k in ("dinopipe", "official", "gpu path, host side") if k in med}
    print("\n".join(cores_table(per_core)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
