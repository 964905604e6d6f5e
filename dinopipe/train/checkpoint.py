"""One checkpoint manager: torch.distributed.checkpoint (DCP) saves, keep-last-k, an atomic ``latest``.

Layout: ``RUN/checkpoints/step_00000100/`` (a DCP folder, sharded by rank) and ``RUN/checkpoints/latest``
(a text file naming the last *complete* checkpoint, replaced atomically after every rank finished
writing). A run killed mid-save resumes from the previous complete one. DCP reshards on load, so a run
saved with N processes resumes with M.

Everything resumable implements ``state_dict()/load_state_dict()`` (DCP's Stateful protocol) and is passed
as one dict of named states.

Checkpoints in a bucket follow the store rule (dinopipe/utils/storage.py): only a definite "not found" of
``latest`` means "no checkpoint yet"; any other failure to read it, or a checkpoint, or to save one, is retried
for the store's budget and then ends the run with 75 ("rerun the same command"), nothing written or deleted.
Old checkpoints are pruned by step number, never the newest.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..utils import debug_hooks, safe_dcp, storage
from ..utils.torch_compat import dcp_fsspec_classes
from ..utils.io import atomic_write
from ..utils.safe_load import CheckpointError
from .dist import barrier, broadcast_object, get_info
from .signals import maybe_test_signal
from ..utils.run_layout import TrainLayout

log = logging.getLogger(__name__)


class ModelOptimState:
    """A model and its optimizer as one Stateful (FQN-keyed, works sharded or not)."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, sd["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class ValueState:
    """Plain values (step, data position, schedule state...) as a Stateful; tensors keep them exact."""

    def __init__(self, **values: Any) -> None:
        self.values = dict(values)

    def state_dict(self) -> dict[str, Any]:
        return {k: torch.tensor(v) if isinstance(v, (int, float)) else v for k, v in self.values.items()}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        for k, v in sd.items():
            old = self.values.get(k)
            self.values[k] = type(old)(v.item()) if isinstance(v, torch.Tensor) and isinstance(old, (int, float)) else v


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict on every rank (for exports); a no-op gather in a single process."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


class CheckpointManager:
    """``location``: where the checkpoints go instead of ``run_dir/checkpoints`` -- a folder, or an fsspec URL
    (``s3://bucket/run/checkpoints``): DCP's fsspec writer, the safe reader, and ``latest`` as one object written
    after every rank's files and ``.metadata`` are complete (an object PUT is atomic), so a preempted job on
    another machine resumes from the bucket."""

    def __init__(self, run_dir: str | Path, keep_last: int = 3, location: Optional[str] = None) -> None:
        self.url = location.rstrip("/") if location and storage.is_url(location) else None
        self.dir = Path(location) if location and self.url is None else TrainLayout(run_dir).checkpoints
        self.keep_last = max(1, keep_last)

    @staticmethod
    def name(step: int) -> str:
        return f"step_{step:08d}"

    def latest(self) -> Optional[Path]:
        if debug_hooks.get("stale_latest") == str(get_info().rank):
            return None  # test hook: this rank's view of a shared filesystem has not seen ``latest`` yet
        if self.url is not None:
            return self._remote_latest()
        pointer = self.dir / "latest"
        if not pointer.is_file():
            return None
        path = self.dir / pointer.read_text().strip()
        return path if (path / ".metadata").is_file() else None

    def latest_step(self) -> Optional[int]:
        p = self.latest()
        return _step_of(p) if p else None

    def save(self, step: int, states: Mapping[str, Any]) -> Path:
        if self.url is not None:
            return self._remote_save(step, states)
        path = self.dir / self.name(step)
        info = get_info()
        if info.is_main and path.exists():  # a half-written save of this step from a killed run
            shutil.rmtree(path)
        barrier()
        maybe_test_signal("save", step, info.rank)
        dcp.save(dict(states), checkpoint_id=str(path), no_dist=not info.distributed)  # one process: say so
        barrier()
        if info.is_main:
            atomic_write(self.dir / "latest", path.name + "\n")  # readers see the old or the new name, never half
            self._prune(keep=path.name)
        barrier()
        log.info("saved checkpoint %s", path)
        return path

    def resume_point(self) -> Optional[Path]:
        """The checkpoint to resume from, as rank 0 sees it, on every rank. Each rank reading ``latest``
        itself can disagree on a shared filesystem with attribute caching (a rank starting fresh while the
        others enter the collective load hangs them all), so one rank decides."""
        mine = self.latest() if get_info().is_main else None
        name = broadcast_object(_name_of(mine) if mine is not None else None)
        if name and self.url is not None:
            return storage.join(self.url, name)
        return self.dir / name if name else None

    def load(self, states: Mapping[str, Any], path: Optional[Path] = None) -> Optional[int]:
        """Load the given checkpoint (default: rank 0's latest) into ``states`` in place; returns its step or
        None."""
        path = path or self.resume_point()
        if path is None:
            return None
        # The safe reader: .metadata through the restricted unpickler, bytes entries weights_only (a run
        # folder can come from anywhere; DCP's own reader would unpickle whatever it holds).
        if storage.is_url(str(path)):
            try:
                _store_op(str(path), lambda: safe_dcp.load(dict(states), path, no_dist=not get_info().distributed))
            except (Exception, CheckpointException) as exc:
                if storage.classify(_cause(exc))[0] != storage.MISSING:
                    raise
                raise CheckpointError(f"{path}: a file of this checkpoint is missing ({_cause(exc)}); it was deleted "
                                      f"after it was written: restore it or point `latest` at another") from None
        else:
            safe_dcp.load(dict(states), path, no_dist=not get_info().distributed)
        log.info("resumed from %s", path)
        return _step_of(path)

    # ------------------------------------------------------------------------------- checkpoints at a URL
    def _remote_latest(self) -> Optional[str]:
        fs, base = storage.filesystem(self.url)
        where = storage.join(self.url, "latest")
        fs.invalidate_cache(base)  # the answer must come from the store, not from a listing cached earlier
        try:
            name = storage.call(lambda: fs.cat_file(f"{base}/latest"), where).decode().strip()
        except storage.Unreadable as e:
            if e.reason == storage.MISSING:
                return None  # a definite not-found: no checkpoint yet
            raise storage.StoreUnavailable(f"{where}: cannot be read ({e.reason})") from None
        if not _STEP_NAME.match(name):
            raise CheckpointError(f"{where}: names {name!r}, not a checkpoint (step_N)")
        path = storage.join(self.url, name)
        try:
            storage.call(lambda: fs.info(f"{base}/{name}/.metadata"), path)
        except storage.Unreadable as e:
            if e.reason != storage.MISSING:
                raise storage.StoreUnavailable(f"{path}/.metadata: cannot be read ({e.reason})") from None
            raise CheckpointError(f"{where} names {name}, but {path}/.metadata does not exist (deleted by hand?); "
                                  f"point `latest` at a complete checkpoint or start a new run folder") from None
        return path

    def _remote_save(self, step: int, states: Mapping[str, Any]) -> str:
        writer_cls, _ = dcp_fsspec_classes()
        name, info = self.name(step), get_info()
        fs, base = storage.filesystem(self.url)
        path = storage.join(self.url, name)
        if info.is_main:
            fs.invalidate_cache(base)
            if storage.call(lambda: fs.exists(f"{base}/{name}"), path):
                storage.call(lambda: fs.rm(f"{base}/{name}", recursive=True), path)  # a killed run's half save
        barrier()
        maybe_test_signal("save", step, info.rank)
        _store_op(path, lambda: dcp.save(dict(states), storage_writer=writer_cls(path, **storage.fsspec_options(path)),
                                         no_dist=not info.distributed))
        barrier()
        if info.is_main:  # one PUT after every rank's files and .metadata: readers see the old or the new name
            storage.call(lambda: fs.pipe_file(f"{base}/latest", (name + "\n").encode()), self.url)
            fs.invalidate_cache(base)
            listed = storage.call(lambda: fs.ls(base, detail=False), self.url)
            for stale in _stale([p.rstrip("/").rsplit("/", 1)[-1] for p in listed], name, self.keep_last):
                storage.call(lambda s=stale: fs.rm(f"{base}/{s}", recursive=True), self.url)
        barrier()
        log.info("saved checkpoint %s", path)
        return path

    def _prune(self, keep: str) -> None:
        ckpts = {p.name: p for p in self.dir.glob("step_*") if p.is_dir()}
        for name in _stale(ckpts, keep, self.keep_last):
            shutil.rmtree(ckpts[name], ignore_errors=True)


_STEP_NAME = re.compile(r"step_(\d+)$")


def _stale(names: Any, keep: str, keep_last: int) -> list[str]:
    """The checkpoints to delete: all but the ``keep_last`` highest step numbers (parsed, not name order), never
    ``keep`` (the one just saved) nor the highest step present; names that are not ``step_N`` are left alone."""
    steps = sorted((int(m.group(1)), n) for n in names if (m := _STEP_NAME.match(n)))
    if not steps:
        return []
    newest = steps[-1][1]
    return [n for _, n in steps[:-keep_last] if n not in (keep, newest)]


def _cause(exc: BaseException) -> BaseException:
    """The error behind DCP's CheckpointException (it gathers each rank's error with its traceback)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        first = next(iter(exc.failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return exc


def _store_op(url: str, fn: Any) -> Any:
    """A whole DCP save or load at ``url`` under the store rule (retried whole while the store fails
    transiently, then 75; a refusal 2); any other error is raised as it is."""
    return storage.retry_transient(fn, url, catch=(Exception, CheckpointException), unwrap=_cause)


def _name_of(path: Any) -> str:
    return path.name if isinstance(path, Path) else str(path).rstrip("/").rsplit("/", 1)[-1]


def _step_of(path: Any) -> int:
    return int(_name_of(path).split("_")[1])


__all__ = ["CheckpointManager", "ModelOptimState", "ValueState", "full_state_dict"]
