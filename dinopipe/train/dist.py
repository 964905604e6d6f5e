"""Process group and device, chosen once.

Three ways to start: one plain process (no torch.distributed at all), ``torchrun`` (RANK/WORLD_SIZE/
LOCAL_RANK/MASTER_ADDR set), or ``srun`` with one task per GPU (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID;
the master address is the first host of SLURM_JOB_NODELIST, the port derived from the job id). CUDA + NCCL
when a GPU is visible, CPU + gloo otherwise.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..utils.proc import exit_now


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: Optional[str] = None  # None when no process group was created

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


_INFO: Optional[DistInfo] = None


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist like 'gpu[003-005,010],cpu1' (scontrol when available)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=10, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    m = re.match(r"([^,\[]+)(?:\[([0-9]+))?", nodelist)
    if not m:
        return "127.0.0.1"
    return m.group(1) + (m.group(2) or "")


class LaunchError(RuntimeError):
    """The process environment cannot form a process group (e.g. Slurm tasks without an srun step)."""


def _env_from_slurm() -> None:
    """Translate srun's variables into torchrun's when we were started by srun without torchrun.

    The batch script of ``sbatch --ntasks=4`` carries SLURM_NTASKS=4 and SLURM_PROCID=0 too, but it is one
    process: only an srun step (SLURM_STEP_NUM_TASKS set) has the other ranks. Believing SLURM_NTASKS there
    made rank "0 of 4" wait 30 minutes in init_process_group for ranks that never start, so it is an error.
    """
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    step_tasks = os.environ.get("SLURM_STEP_NUM_TASKS")
    ntasks = int(step_tasks or os.environ.get("SLURM_NTASKS", "1"))
    if ntasks <= 1:
        return
    if step_tasks is None:
        raise LaunchError(
            f"SLURM_NTASKS={ntasks} but this process is not part of an srun step (it runs in the batch script "
            f"itself, so the other {ntasks - 1} ranks would never start): launch it with `srun python -m ...` "
            f"(as slurm/pretrain.sbatch does) or torchrun, or submit with --ntasks=1")
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = str(ntasks)
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_ADDR", _first_slurm_host(os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")))
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def init_distributed(device: str = "auto", timeout_min: int = 30) -> DistInfo:
    """Create the process group (if launched with several processes) and pick the device. Idempotent."""
    global _INFO
    if _INFO is not None:
        return _INFO
    _env_from_slurm()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    backend = None
    if world > 1:
        backend = "nccl" if use_cuda else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_min),
                                    device_id=dev if use_cuda else None)
    _INFO = DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev, backend=backend)
    return _INFO


def get_info() -> DistInfo:
    return _INFO or DistInfo()


@contextlib.contextmanager
def use_info(info: DistInfo) -> Iterator[DistInfo]:
    """``get_info()`` answers ``info`` inside the block (a process group this process made itself, e.g. the
    fake one of ``plan --trace``), and what it answered before after it, exception or not."""
    global _INFO
    saved, _INFO = _INFO, info
    try:
        yield info
    finally:
        _INFO = saved


def all_reduce_sum_fn() -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """In-place sum across ranks, or None in a single process (model and loss code take it as an argument)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    return reduce


def all_gather_fn() -> Optional[Callable[[torch.Tensor], list[torch.Tensor]]]:
    """Every rank's copy of a tensor (rank order) with autograd (the backward sums each copy's gradient back on its
    owner), or None in a single process: what DINOv3's distributed KoLeo gathers (ssl/losses.py)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from torch.distributed.nn.functional import all_gather

    return lambda t: list(all_gather(t))


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_object(obj):
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_max_scalar(x: float) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return x
    t = torch.tensor([x], dtype=torch.float64, device=get_info().device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def launched_world_size() -> int:
    """World size when this process is one rank of a torchrun / srun launch, or of any launcher that starts one
    process per rank with torch's env:// variables (RANK, WORLD_SIZE, MASTER_ADDR: mpirun wrappers, a script) --
    its whole work is the stage it runs -- else 1."""
    env_launch = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_PROCID" in os.environ or env_launch
    return dist.get_world_size() if launched and dist.is_available() and dist.is_initialized() else 1


def destroy(clean: bool = True) -> None:
    """Orderly end of a multi-rank run, once: a last barrier so no rank tears down its connections while
    another still talks to it (a rank that left early made its peer abort in gloo's teardown), then the
    process group. Threads that talk over it (metrics, checkpoint) must be joined before this is called.
    ``clean=False`` (a rank failed on its own) skips the barrier, which the others might never reach."""
    global _INFO
    if dist.is_available() and dist.is_initialized():
        try:
            if clean:
                dist.barrier()
        finally:
            dist.destroy_process_group()
    _INFO = None


def end_rank(clean: bool, rc: int | None) -> None:
    """:func:`destroy`, then -- for a finished rank (``rc`` not None) of a torchrun / srun launch of more than one
    rank -- exit with ``rc`` at once (:func:`dinopipe.utils.proc.exit_now`): gloo's teardown at interpreter exit
    can abort a rank whose work is complete. A failed rank (``rc`` None) leaves by the normal path."""
    ranks = launched_world_size()
    destroy(clean)
    if rc is not None and ranks > 1:
        exit_now(rc)


__all__ = ["LaunchError", "DistInfo", "init_distributed", "get_info", "use_info", "all_reduce_sum_fn", "barrier",
           "launched_world_size", "end_rank",
           "broadcast_object", "all_reduce_max_scalar", "destroy"]
