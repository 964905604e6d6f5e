"""Runs several FSDP2 setting combinations one after another in ONE process group (so a 2-rank matrix pays
torchrun's start-up once): per combination a 4-step run, and the same run stopped after 2 steps and resumed.
Rank 0 writes RESULTS/results.json; each run's export is the teacher the test compares.

    torchrun --nproc_per_node=2 tests/train/_fsdp_matrix_worker.py OUT POOL raf,ac,dtype [...]
    python tests/train/_fsdp_matrix_worker.py OUT POOL -,-,fp32 -,-,bf16          (1-process references)
"""

import json
import sys
from pathlib import Path

import torch

from dinopipe.config import load_config  # noqa: E402
from dinopipe.hub import load  # noqa: E402
from dinopipe.ssl.config import PretrainConfig  # noqa: E402
from dinopipe.ssl.config_checks import validate  # noqa: E402
from dinopipe.train.dist import destroy, get_info, init_distributed  # noqa: E402
from dinopipe.train.metrics import read_metrics  # noqa: E402
from dinopipe.train.pretrain import run  # noqa: E402
from tests.train.conftest import REPO, TINY  # noqa: E402  (torchrun runs this file; PYTHONPATH holds the repo)

# Same global batch (8) at any world size; KoLeo and iBOT masks are per-rank by design, so they are off.
SAME = ["train.epochs=1", "train.checkpoint_every=100", "dino.koleo_loss_weight=0.0", "ibot.mask_sample_probability=0.0"]
PHASE = "phases=[{{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: {b}}}]"


def overrides(combo: str, run_dir: Path, pool: str, world: int) -> list[str]:
    raf, ac, dtype = combo.split(",")
    o = [*TINY, *SAME, PHASE.format(b=8 // world), f"data.paths=[{pool}]", f"train.output_dir={run_dir}",
         f"parallel.param_dtype={dtype}"]
    if raf != "-":
        o.append(f"parallel.reshard_after_forward={raf}")
    if ac != "-":
        o.append(f"parallel.activation_checkpointing={ac}")
    return o


def train(combo: str, run_dir: Path, pool: str, world: int, *extra: str) -> int:
    cfg = load_config(PretrainConfig, str(REPO / "configs/pretrain/quickstart.yaml"),
                      overrides(combo, run_dir, pool, world) + list(extra))
    validate(cfg)
    return run(cfg)


def main() -> None:
    out, pool, combos = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    info = init_distributed("cpu")
    world = info.world_size
    # One uninterrupted run per dtype (default reshard, no AC); every combination is then run stopped after 2
    # steps and resumed, and must end exactly where that run did: AC and resharding change memory, not math.
    refs = {}
    for dtype in sorted({c.split(",")[2] for c in combos}):
        refs[dtype] = out / f"{dtype}_full"
        train(f"-,-,{dtype}", refs[dtype], pool, world)
    results = {}
    for combo in combos:
        split = out / combo.replace(",", "_")
        codes = []
        if world > 1:
            codes = [train(combo, split, pool, world, "train.stop_after=2"), train(combo, split, pool, world)]
        if not get_info().is_main:
            continue
        ref = refs[combo.split(",")[2]]
        a = read_metrics(ref)
        res = {"codes": codes, "export": str(split if world > 1 else ref), "steps": [r["step"] for r in a],
               "losses": [r["loss"] for r in a], "compute_dtype": a[0].get("compute_dtype")}
        if world > 1:
            b = read_metrics(split)
            res.update(resumed_steps=[r["step"] for r in b], resumed_losses=[r["loss"] for r in b],
                       resumed_from=(split / "checkpoints" / "latest").read_text().strip())
            sa, sb = load(ref).state_dict(), load(split).state_dict()
            res["resume_max_abs_diff"] = max(float((sa[k] - sb[k]).abs().max()) for k in sa)
        results[combo] = res
    if get_info().is_main:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    destroy()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
