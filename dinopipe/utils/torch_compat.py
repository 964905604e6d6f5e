"""Every private torch API dinopipe uses, each behind one named function (torch 2.9 to 2.14).

torch's underscore names carry no compatibility promise, and pyproject.toml admits every torch from the floor
(2.9.1, ``make test-floor``) to the development pin (2.14.1). So the product never reaches into ``torch.*._*``
itself: it calls the functions here, each of which either works on every torch of that range or raises
:class:`TorchCompatError` naming the missing internal, the torch version and what needs it, instead of an
``AttributeError`` deep inside a run. ``tests/utils/test_torch_compat.py`` exercises each one, on both torches.

No monkeypatch outlives a ``with`` block: the two that patch torch (:func:`own_fake_mode_for_sharding_propagation`,
:func:`deepcopies_share_parameters`) restore the original on exit, exception or not.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from typing import Any, Callable, Iterator

import torch
from torch import nn

SUPPORTED = "2.9 to 2.14"


class TorchCompatError(RuntimeError):
    """A private torch API dinopipe relies on is missing or changed in the installed torch."""


def _missing(what: str, needed_for: str, err: BaseException | None = None) -> TorchCompatError:
    msg = (f"torch {torch.__version__} has no {what}, which dinopipe uses for {needed_for} (dinopipe supports "
           f"torch {SUPPORTED}); install a torch in that range or report this with your torch version")
    if err is not None:
        msg += f" ({type(err).__name__}: {err})"
    return TorchCompatError(msg)


@functools.lru_cache(maxsize=None)  # some are called on every op a recorder sees
def _attr(module: str, name: str, needed_for: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise _missing(f"{module}.{name}", needed_for, e) from e


# -- dispatch / function modes (the meta-init recorder, the trace's byte counter) ------------------------------

def torch_dispatch_mode_cls() -> type:
    """``TorchDispatchMode``, the base class of a mode that sees every op below autograd."""
    return _attr("torch.utils._python_dispatch", "TorchDispatchMode", "recording ops (meta init, plan --trace)")


def device_context_cls() -> type:
    """``DeviceContext``: the function mode ``with torch.device(...)`` pushes."""
    return _attr("torch.utils._device", "DeviceContext", "recording a build on meta")


def device_constructors() -> set:
    """The torch functions that take the default device when called without ``device=``."""
    return _attr("torch.utils._device", "_device_constructors", "recording a build on meta")()


def function_mode_stack() -> list:
    """The active ``__torch_function__`` modes, innermost last."""
    return _attr("torch.overrides", "_get_current_function_mode_stack", "recording a build on meta")()


def storage_key(t: torch.Tensor) -> int:
    """An integer that is the same for every view of one storage and differs between live storages (meta
    tensors included, whose data pointers are all 0)."""
    storage = t.untyped_storage()
    key = getattr(storage, "_cdata", None)
    if key is None:
        raise _missing("UntypedStorage._cdata", "telling storages apart while recording a build on meta")
    return key


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's in-place modification counter (autograd's), bumped by every in-place op on it or a view."""
    try:
        return t._version
    except AttributeError as e:
        raise _missing("Tensor._version", "noticing a file tensor modified after it was read", e) from e


def tree_flatten(tree: Any):
    """``(leaves, spec)`` of nested lists, tuples and dicts (torch's Python pytree: no optree dependency)."""
    return _attr("torch.utils._pytree", "tree_flatten", "walking an op's arguments")(tree)


def tree_map(fn: Callable, tree: Any):
    return _attr("torch.utils._pytree", "tree_map", "walking an op's arguments")(fn, tree)


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the running backward pass has finished (autograd engine's ``queue_callback``, what FSDP
    uses for its post-backward work). Only valid from inside a backward (a hook)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not callable(getattr(engine, "queue_callback", None)):
        raise _missing("torch.autograd.Variable._execution_engine.queue_callback", "one-rank mixed precision")
    engine.queue_callback(fn)


def wrapper_tensor(cls: type, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of class ``cls`` (a ``torch.Tensor`` subclass with ``__torch_dispatch__``) that has a shape
    and dtype but no storage (``Tensor._make_wrapper_subclass``)."""
    make = getattr(torch.Tensor, "_make_wrapper_subclass", None)
    if make is None:
        raise _missing("Tensor._make_wrapper_subclass", "reading packed checkpoint tensors by rows")
    return make(cls, tuple(shape), dtype=dtype, device=torch.device("cpu"), requires_grad=False)


def disabled_torch_function() -> Any:
    """The ``__torch_function__`` that makes a tensor subclass's ops return plain tensors."""
    return _attr("torch._C", "_disabled_torch_function_impl", "reading packed checkpoint tensors by rows")


# -- DTensor / process groups --------------------------------------------------------------------------------

def local_shape_and_global_offset(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard of the DTensor ``t``: its shape and where it starts in the global tensor (uneven
    shards included: the last ranks may hold fewer rows, or none)."""
    fn = _attr("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset",
               "materialising each rank's shard")
    shape, offset = fn(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)


def fake_store() -> Any:
    """A store for ``init_process_group("fake", ...)``: torch's fake process group (collectives return at once,
    no peers), which importing its module registers as backend ``fake``."""
    return _attr("torch.testing._internal.distributed.fake_pg", "FakeStore", "plan --trace's fake process group")()


def fake_tensor_mode(**kwargs: Any) -> Any:
    """A ``FakeTensorMode``: tensors with shapes, dtypes and devices, no storage, no compute."""
    return _attr("torch._subclasses.fake_tensor", "FakeTensorMode", "plan --trace")(**kwargs)


@contextlib.contextmanager
def own_fake_mode_for_sharding_propagation() -> Iterator[None]:
    """DTensor's sharding propagation runs each op once on *global-shape* fake tensors to learn the output's
    metadata, in ``detect_fake_mode() or FakeTensorMode()``: in a real run a private fake mode, which the memory
    tracker skips (it counts only ops under the fake mode active at its entry); under the trace's fake mode it
    finds that one, so the tracker counted those full-size shadows as real memory (~4 x the student's numel
    through the foreach AdamW ops). Inside this block the propagation gets a private fake mode, as in a real run;
    the module attribute is put back on exit. torch 2.9 (no ``detect_fake_mode`` in that module) always makes
    a private ``FakeTensorMode()`` there: nothing to patch."""
    prop = importlib.import_module("torch.distributed.tensor._sharding_prop")
    if not hasattr(prop, "detect_fake_mode"):
        yield
        return
    saved = prop.detect_fake_mode
    prop.detect_fake_mode = lambda *a, **k: None
    try:
        yield
    finally:
        prop.detect_fake_mode = saved


_TRACKER_HOOKS = ("_fsdp_state_pre_forward", "_fsdp_param_group_pre_backward", "_fsdp_param_group_post_backward")


def fsdp_mem_tracker(root: nn.Module, optimizer: Any, roots: nn.Module | None = None) -> Any:
    """torch's ``FSDPMemTracker`` for ``root`` and ``optimizer``, made to tolerate FSDP units entered through
    registered forward methods (a task calls ``forward_features_list``, which FSDP2 hooks directly, not through
    the module hooks the tracker wraps) and roots called once per micro-batch (``train.accumulate``).
    ``roots``: a module holding every FSDP root the step runs (the task: student, heads, teachers)."""
    mod = "torch.distributed._tools.fsdp2_mem_tracker"
    base = _attr(mod, "FSDPMemTracker", "plan --trace's memory count")
    stats = _attr(mod, "_FSDPModMemStats", "plan --trace's memory count")
    for hook in _TRACKER_HOOKS:
        if not callable(getattr(base, hook, None)):
            raise _missing(f"{mod}.FSDPMemTracker.{hook}", "plan --trace's memory count")

    class Tracker(base):
        def _ensure(self, mod) -> None:
            if mod not in self.memory_tracking:
                self.memory_tracking[mod] = stats(type(mod).__name__)

        def _fsdp_state_pre_forward(self, fsdp_mod, orig):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def again(*a, **k):
                # A root called again in forward: the next micro-batch of train.accumulate, not a new iteration
                # (the tracker refuses that); its per-module stats start over, the global peak is kept.
                if not self._mod_tracker.is_bw and fsdp_mod in self.memory_tracking:
                    parents = self._mod_tracker.parents - {self._mod_tracker.get_known_fqn(fsdp_mod)}
                    if len(parents) == 1 and "Global" in parents:
                        del self.memory_tracking[fsdp_mod]
                return inner(*a, **k)

            return again

        def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
            inner = super()._fsdp_param_group_pre_backward(fsdp_mod, orig)
            return lambda *a, **k: (self._ensure(fsdp_mod), inner(*a, **k))[1]

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
            inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig)
            return lambda *a, **k: (self._ensure(fsdp_mod), inner(*a, **k))[1]

    tracker = Tracker(root, optimizer)
    if roots is not None:
        if not hasattr(tracker, "_root_mod"):
            raise _missing(f"{mod}.FSDPMemTracker._root_mod", "plan --trace's memory count of several roots")
        tracker._root_mod = roots
    return tracker


def mem_tracker(root: nn.Module, optimizer: Any) -> Any:
    """torch's ``MemTracker`` over ``root`` and ``optimizer``: the trace's memory count when no module is
    FSDP-sharded (one rank, train/mirror.py). ``track_inputs`` is accepted and does nothing (inputs are counted
    as they are allocated)."""
    base = _attr("torch.distributed._tools.mem_tracker", "MemTracker", "plan --trace's memory count")
    if not callable(getattr(base, "_track_module_params_and_buffers", None)):
        raise _missing("MemTracker._track_module_params_and_buffers", "plan --trace's memory count at one rank")

    class Tracker(base):
        def track_inputs(self, inputs: Any) -> None:
            pass

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # the tracker hooks every parameter's gradient, which a frozen teacher's refuse; their memory is
            # counted all the same (gradients are tracked as they are allocated)
            hooks = install_grad_hooks and all(p.requires_grad for p in module.parameters())
            return super()._track_module_params_and_buffers(module, install_grad_hooks=hooks)

    tracker = Tracker()
    tracker.track_external(root, optimizer)
    return tracker


# -- torch.compile (gpu-check) -------------------------------------------------------------------------------

def dynamo_counters() -> Any:
    """torch.compile's event counters (``counters["graph_break"]``: the graph breaks since the last clear)."""
    return _attr("torch._dynamo.utils", "counters", "gpu-check's graph-break count")


def inductor_fallback_random(on: bool = True) -> None:
    """Make inductor draw random numbers with eager's generator (``fallback_random``), so a compiled block's
    dropout / drop-path subsets equal eager's and the two can be compared."""
    config = importlib.import_module("torch._inductor.config")
    if not hasattr(config, "fallback_random"):
        raise _missing("torch._inductor.config.fallback_random", "gpu-check's compiled-vs-eager comparison")
    config.fallback_random = on


# -- distributed checkpoint ------------------------------------------------------------------------------------

def dcp_set_element(root: dict, path: Any, value: Any) -> None:
    """Put ``value`` at the object path ``path`` (a DCP ``OBJ_PATH``) inside the nested state dict ``root``."""
    _attr("torch.distributed.checkpoint._traverse", "set_element", "loading a DCP checkpoint")(root, path, value)


# -- optimizer internals (ssl/adamw.py: AdamW on each rank's local shards) ------------------------------------

def functional_adam() -> Callable:
    """torch's functional Adam/AdamW update (``torch.optim.adam.adam``: fused, foreach or per tensor), which
    :class:`~dinopipe.ssl.adamw.ShardLocalAdamW` hands the local shards."""
    return _attr("torch.optim.adam", "adam", "AdamW on the local shards (ssl/adamw.py)")


def adam_init_group() -> Callable:
    """``Adam._init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)``:
    fills the lists for one param group and creates the state (moments, step) a parameter does not have yet."""
    adam = _attr("torch.optim", "Adam", "AdamW on the local shards (ssl/adamw.py)")
    fn = getattr(adam, "_init_group", None)
    if fn is None:
        raise _missing("torch.optim.Adam._init_group", "AdamW on the local shards (ssl/adamw.py)")
    return fn


# -- process groups, norm layers -------------------------------------------------------------------------------

def default_process_group() -> Any:
    """The default (world) process group object of this process (``distributed_c10d._get_default_group``):
    its identity tells one ``init_process_group`` from the next (train/parallel.py's mesh cache)."""
    return _attr("torch.distributed.distributed_c10d", "_get_default_group", "caching the FSDP device mesh")()


def batchnorm_base() -> type:
    """The base class of every BatchNorm (1d/2d/3d, SyncBatchNorm, lazy ones): ``nn.modules.batchnorm._BatchNorm``
    (running statistics that FSDP and the EMA teacher must treat as buffers, train/parallel.py)."""
    return _attr("torch.nn.modules.batchnorm", "_BatchNorm", "handling BatchNorm running statistics")


def norm_base() -> type:
    """The base class of BatchNorm and InstanceNorm (``nn.modules.batchnorm._NormBase``): the layers with
    optional running statistics (the EMA teacher copies them; their weights get no weight decay)."""
    return _attr("torch.nn.modules.batchnorm", "_NormBase", "handling norm layers' statistics and weight decay")


def dcp_fsspec_classes() -> tuple[type, type]:
    """(FsspecWriter, FsspecReader): DCP over any fsspec URL (checkpoints in object storage)."""
    where = "torch.distributed.checkpoint._fsspec_filesystem"
    need = "checkpoints at a URL (train.checkpoint_dir=s3://...)"
    return _attr(where, "FsspecWriter", need), _attr(where, "FsspecReader", need)


# -- copying modules -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def deepcopies_share_parameters() -> Iterator[None]:
    """In this thread, while the block runs, ``copy.deepcopy`` of a module gives new Parameter objects over the
    SAME tensors (a build then holds each initial model once, not once per EMA copy); other threads, and this
    one after the block, get real copies. ``nn.Parameter.__deepcopy__`` is patched only for the block's length
    and restored on exit, exception or not."""
    owner = threading.get_ident()
    had_own = "__deepcopy__" in nn.Parameter.__dict__
    original = nn.Parameter.__deepcopy__

    def share(self, memo):
        if threading.get_ident() != owner:
            return original(self, memo)
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(self.data, self.requires_grad)
        return memo[id(self)]

    nn.Parameter.__deepcopy__ = share
    try:
        yield
    finally:
        if had_own:
            nn.Parameter.__deepcopy__ = original
        else:
            del nn.Parameter.__deepcopy__


__all__ = ["TorchCompatError", "SUPPORTED", "torch_dispatch_mode_cls", "device_context_cls", "device_constructors",
           "function_mode_stack", "storage_key", "tensor_version", "tree_flatten", "tree_map", "local_shape_and_global_offset",
           "fake_store", "fake_tensor_mode", "own_fake_mode_for_sharding_propagation", "fsdp_mem_tracker",
           "dynamo_counters", "inductor_fallback_random", "dcp_set_element", "deepcopies_share_parameters",
           "wrapper_tensor", "disabled_torch_function", "functional_adam", "adam_init_group", "default_process_group",
           "batchnorm_base", "norm_base", "dcp_fsspec_classes", "queue_backward_callback", "mem_tracker"]
