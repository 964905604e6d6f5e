"""Record a task's construction on ``meta``, replay it tensor by tensor into each rank's shards.

A multi-rank run builds its task on the ``meta`` device on every rank (rank 0 included) under
:class:`InitRecorder`, a ``TorchDispatchMode`` that notes, for every storage the build creates, the ops that
gave it its value: how it was created (a factory, a clone of another tracked tensor, a copy of a tensor read
from a file) and every in-place op on it or on a view of it since its last full overwrite (``trunc_normal_`` is
``uniform_, erfinv_, mul_, add_, clamp_``; ``load_state_dict`` is ``copy_`` from a memory-mapped file tensor).

Random ops on ``meta`` draw nothing from the CPU generator, so for each one the recorder snapshots the default
generator (``torch.get_rng_state()``, ~5 KB) and advances it exactly as the real op would, by running the same op
on a CPU scratch tensor of that shape, stride and dtype (freed at once). After the build the generator is where a
one-process build leaves it.

After sharding (FSDP2 on ``meta``, ``to_empty``) :meth:`InitRecorder.materialize` replays each parameter's and
buffer's chain on a full-size CPU temporary (restoring each random op's snapshot first), copies this rank's
slice into its local shard and frees the temporary; a chain that is one ``copy_`` of a file tensor copies only
the local slice (a rank touches 1/W of the file's pages; a tensor a converter packed from several file tensors
or a DCP folder's tensor is a ``LazyRows`` (``utils/lazy_rows.py``) that reads only those rows). At the end
the generator is put back where the build left it. What cannot be replayed exactly (a storage resized or
``set_``, an op with an explicit generator, a meta tensor built outside the recorder, a file tensor modified
after it was copied) is reported by :meth:`InitRecorder.unreplayable` so the caller can fall back to building
on one rank and broadcasting.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..utils import torch_compat as compat
from ..utils.lazy_rows import LazyRows
from ..utils.torch_compat import tree_flatten, tree_map

DeviceContext = compat.device_context_cls()
TorchDispatchMode = compat.torch_dispatch_mode_cls()

_RANDOM = torch.Tag.nondeterministic_seeded
# in-place ops that write every element without reading the old values: a chain restarts there
_OVERWRITES = {"copy_", "fill_", "zero_", "uniform_", "normal_", "random_", "exponential_", "geometric_", "cauchy_",
               "log_normal_", "bernoulli_"}
_UNSUPPORTED = ("resize", "set_", "as_strided_")


_TRIM_BYTES = 1 << 20


def _trim() -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim``). Full-size temporaries come and go one
    after another; glibc raises its mmap threshold after the first large free and then serves them from the
    heap, whose freed pages it keeps: without this a rank's resident set grows by about a model while recording
    or replaying, though no more than one tensor is alive at a time."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def _file_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed private mappings (``/proc/self/maps``; [] elsewhere)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[4] != "0" and parts[1].endswith("p"):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out.append((lo, hi))
    except OSError:
        pass
    return out


def _in_ranges(t: Tensor, ranges: list[tuple[int, int]]) -> bool:
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(lo <= start and end <= hi for lo, hi in ranges)


def _drop_pages(t: Tensor) -> None:
    """Ask the kernel to reclaim the pages of a memory-mapped file tensor this process has read
    (``MADV_PAGEOUT`` on the whole pages inside it, Linux >= 5.4): clean pages of the file mapping leave the
    resident set and are re-read from the file if touched again; a page this process wrote (copy-on-write) is
    anonymous and stays (no swap), so values never change. A no-op where the call is not available."""
    global _madvise
    if _madvise is None:
        try:
            import ctypes

            _madvise = ctypes.CDLL(None, use_errno=True).madvise
            _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _madvise = False
    if not _madvise or t.numel() == 0:
        return
    import mmap

    page = mmap.PAGESIZE
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // page) * page, end // page * page
    if hi > lo:
        _madvise(lo, hi - lo, 21)  # MADV_PAGEOUT


_madvise = None


def _rows(src: Tensor, index: tuple) -> Tensor:
    """``src[index]``; of a ``LazyRows`` (a packed or DCP tensor) only the rows of ``index[0]`` are read."""
    if isinstance(src, LazyRows) and index and src.dim():
        return src.rows(index[0].start, index[0].stop)[(slice(None), *index[1:])]
    return src[index]


def _key(t: Tensor) -> int:
    return compat.storage_key(t)


def _geom(t: Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


@dataclass(frozen=True)
class _Tracked:
    """The value of a tracked storage after its first ``pos`` entries, seen through a view ``geom``."""
    key: int
    pos: int
    geom: tuple


@dataclass(frozen=True)
class _Real:
    """A real (CPU) tensor the build handed to an op, e.g. a memory-mapped file tensor; read at replay time."""
    tensor: Tensor
    version: int


@dataclass
class _Entry:
    func: Any
    args: Any  # pytree of args/kwargs, tensors replaced by _Tracked / _Real
    kwargs: Any
    create: bool  # the op created this storage (out_index: which output); else an in-place write
    resets: bool  # a chain restarts here (creation or full overwrite)
    rng: Optional[Tensor] = None
    out_index: int = 0
    geom: Optional[tuple] = None  # creation: the output's geometry (checked at replay)
    why: Optional[str] = None  # why this entry cannot be replayed (harmless if a later full overwrite follows)


class _Storage:
    __slots__ = ("entries", "dtype", "numel", "keep", "implicit")

    def __init__(self, t: Tensor, implicit: bool) -> None:
        self.entries: list[_Entry] = []
        # on meta only because the build is recorded (a one-process build makes it on the CPU); False for a tensor
        # the build itself puts on meta (e.g. a head built under torch.device("meta") to check shapes): its
        # random ops draw nothing in a one-process build either
        self.implicit = implicit
        self.dtype = t.dtype
        self.numel = t.untyped_storage().nbytes() // t.element_size()
        self.keep = t  # the meta tensor keeps the storage (and its id) alive


def _is_meta(x: Any) -> bool:
    return isinstance(x, Tensor) and x.device.type == "meta"


def _written_args(func, args, kwargs) -> list[Tensor]:
    """The tensors an aten op writes (schema alias_info.is_write), in-place self or out= included."""
    out = []
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = kwargs.get(a.name) if (a.kwarg_only or i >= len(args)) else args[i]
        for t in tree_flatten(v)[0]:
            if isinstance(t, Tensor):
                out.append(t)
    return out


class _DefaultMeta(DeviceContext):
    """``torch.device("meta")`` as the default device, telling the recorder which factory calls got ``meta``
    from it (rather than from an explicit ``device="meta"`` or a nested ``torch.device("meta")``)."""

    def __init__(self, rec: "InitRecorder") -> None:
        super().__init__("meta")
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        implicit = func in compat.device_constructors() and kwargs.get("device") is None
        if implicit:
            kwargs["device"] = self.device
        self.rec._implicit += implicit
        self.rec._in_tf += 1  # this mode is off the stack while it handles a call
        try:
            return func(*args, **kwargs)
        finally:
            self.rec._implicit -= implicit
            self.rec._in_tf -= 1


class InitRecorder(TorchDispatchMode):
    """Use as ``with rec.recording(): task = build()`` (meta is the default device, every op recorded); then
    ``rec.bind(task)``, shard the task, ``to_empty`` it and call ``rec.materialize(task)``."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, _Storage] = {}
        self.random_ops = 0
        self.names: dict[str, tuple[int, tuple]] = {}
        self.rng_after_build: Optional[Tensor] = None
        # bytes of the full-size CPU temporaries alive at once: while recording (scratch tensors of random ops)
        # and while replaying (a tensor + the ones it was cloned from); tests check it stays far below a model
        self.peak_scratch_bytes = 0
        self.peak_replay_bytes = 0
        self._live = 0
        self._implicit = 0
        self._in_tf = 0
        self._ctx: Optional[_DefaultMeta] = None

    @contextlib.contextmanager
    def recording(self):
        self._ctx = _DefaultMeta(self)
        with self._ctx, self, warnings.catch_warnings():
            # load_state_dict into a meta module: the copy_ is recorded (replayed later), not lost
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
            yield self
        self.rng_after_build = torch.get_rng_state()

    # -- recording ---------------------------------------------------------------------------------------

    def _default_is_mine(self) -> bool:
        """Whether the default device now is the recorder's meta, not a nested ``torch.device("meta")`` (which
        goes on top of the recorder's). Approximate inside a call under a nested context; used only for tensors
        made without a dispatched op (``torch.tensor(0)``)."""
        contexts = [m for m in compat.function_mode_stack() if isinstance(m, DeviceContext)]
        return self._in_tf > 0 or (bool(contexts) and contexts[-1] is self._ctx)

    def _ref(self, t: Tensor, problems: list):
        if not _is_meta(t):
            return _Real(t, compat.tensor_version(t))
        st = self.storages.get(_key(t))
        if st is None:  # e.g. torch.tensor(0, device="meta") (BatchNorm's num_batches_tracked): data never dispatched
            # torch.tensor(data) takes the default device without a torch function call: implicit when the
            # default device is the recorder's (a nested torch.device("meta") replaces it while it is active)
            st = self.storages[_key(t)] = _Storage(t, self._implicit > 0 or self._default_is_mine())
            st.entries.append(_Entry(None, (), {}, create=True, resets=True,
                                     why=f"a {tuple(t.shape)} meta tensor made without a recorded op"))
        if t.dtype != st.dtype:
            problems.append(f"a {st.dtype} storage viewed as {t.dtype}")
        return _Tracked(_key(t), len(st.entries), _geom(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        if not any(_is_meta(x) for x in flat) and kwargs.get("device") != torch.device("meta"):
            return func(*args, **kwargs)  # real tensors only (a file being read): nothing to record
        if any(_is_meta(x) for x in flat) and "device" in kwargs and kwargs["device"] is not None \
                and torch.device(kwargs["device"]).type == "cpu":
            kwargs = {**kwargs, "device": torch.device("meta")}  # module.to("cpu") of a meta module stays on meta
        problems: list = []
        ref_args = tree_map(lambda x: self._ref(x, problems) if isinstance(x, Tensor) else x, args)
        ref_kwargs = tree_map(lambda x: self._ref(x, problems) if isinstance(x, Tensor) else x, kwargs)
        metas = [self.storages[_key(x)].implicit for x in flat if _is_meta(x)]
        name = func.__name__.split(".")[0]
        if any(u in name for u in _UNSUPPORTED):
            problems.append(f"{name} on a meta tensor")
        written = [t for t in _written_args(func, args, kwargs) if _is_meta(t)]
        if len({_key(t) for t in written}) > 1:
            problems.append(f"{name} writes several tensors")
        implicit = self.storages[_key(written[0])].implicit if written else \
            self._implicit > 0 or (bool(metas) and all(metas))
        if implicit and not all(metas):
            problems.append(f"{name} reads a tensor the build itself puts on meta")
        rng = None
        if _RANDOM in func.tags and implicit:  # on the CPU in a one-process build: draw as it would
            if kwargs.get("generator") is not None:
                problems.append(f"{func} with an explicit generator")
            rng = torch.get_rng_state()
            self._advance(func, args, kwargs)
        for t in written:
            st = self.storages[_key(t)]
            full = t.numel() == st.numel and t.is_contiguous() and t.storage_offset() == 0
            st.entries.append(_Entry(func, ref_args, ref_kwargs, create=False, resets=full and name in _OVERWRITES,
                                     rng=rng, why=problems[0] if problems else None))
        out = func(*args, **kwargs)
        outs = tree_flatten(out)[0]
        for i, t in enumerate(outs):
            if not _is_meta(t) or _key(t) in self.storages:
                continue  # a view or the written input itself
            st = self.storages[_key(t)] = _Storage(t, implicit)
            st.entries.append(_Entry(func, ref_args, ref_kwargs, create=True, resets=True, rng=rng, out_index=i,
                                     geom=_geom(t), why=(problems[0] if problems else None) if implicit else
                                     "the build itself puts it on meta"))
        if rng is not None:
            self.random_ops += 1
        return out

    def _advance(self, func, args, kwargs) -> None:
        """Run a random op on CPU scratch tensors of the same geometry: the generator moves as the real op's."""
        made: list[int] = []

        def scratch(x):
            if _is_meta(x):
                t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu").zero_()
                made.append(t.untyped_storage().nbytes())
                return t
            return x
        a = tree_map(scratch, args)
        k = tree_map(scratch, kwargs)
        self.peak_scratch_bytes = max(self.peak_scratch_bytes, sum(made))
        if "device" in k:
            k["device"] = torch.device("cpu")
        func(*a, **k)
        del a, k
        if sum(made) >= _TRIM_BYTES:
            _trim()

    # -- after the build ---------------------------------------------------------------------------------

    @staticmethod
    def _tensors(module: nn.Module):
        seen = set()
        for fqn, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
            if fqn not in seen:
                seen.add(fqn)
                yield fqn, t

    def bind(self, module: nn.Module) -> None:
        """Note which storage (and view of it) every parameter and buffer is; call before sharding."""
        for fqn, t in self._tensors(module):
            if t is not None:
                self.names[fqn] = (_key(t), _geom(t)) if _is_meta(t) else (None, t)

    def unreplayable(self) -> Optional[str]:
        """Why the bound tensors cannot be replayed exactly (None: they can)."""
        for fqn, (key, geom) in self.names.items():
            if key is None:
                return f"{fqn} is a real tensor, not built on meta"
            why = self._check(key, len(self.storages[key].entries) if key in self.storages else 0, set())
            if why:
                return f"{fqn}: {why}"
        return None

    def _check(self, key: int, pos: int, seen: set) -> Optional[str]:
        if (key, pos) in seen:
            return None
        seen.add((key, pos))
        st = self.storages.get(key)
        if st is None:
            return "built outside the recorder"
        for e in st.entries[self._start(st, pos):pos]:
            if e.why:
                return e.why
            for r in tree_flatten((e.args, e.kwargs))[0]:
                if isinstance(r, _Real) and compat.tensor_version(r.tensor) != r.version:
                    return "a tensor it was copied from changed after the copy"
                if isinstance(r, _Tracked) and r.key != key:
                    why = self._check(r.key, r.pos, seen)
                    if why:
                        return why
        return None

    @staticmethod
    def _start(st: _Storage, pos: int) -> int:
        return max(i for i in range(pos) if st.entries[i].resets)

    # -- replay ------------------------------------------------------------------------------------------

    def value(self, key: int, pos: Optional[int] = None) -> Tensor:
        """The storage's content after its first ``pos`` entries, as a CPU tensor over a fresh storage (views
        of it by absolute ``as_strided``)."""
        st = self.storages[key]
        pos = len(st.entries) if pos is None else pos
        start = self._start(st, pos)
        buf: Optional[Tensor] = None
        for i in range(start, pos):
            e = st.entries[i]
            nested: list[int] = []

            def arg(r, i=i):
                if isinstance(r, _Real):
                    return r.tensor
                if isinstance(r, _Tracked):
                    if r.key == key and r.pos == i:
                        return buf.as_strided(*r.geom)
                    base = self.value(r.key, r.pos)
                    nested.append(base.untyped_storage().nbytes())  # alive until this op has run
                    return base.as_strided(*r.geom)
                return r

            if buf is None and not e.create:
                buf = torch.empty(st.numel, dtype=st.dtype)
                self._account(buf.untyped_storage().nbytes())
            a, k = tree_map(arg, e.args), tree_map(arg, e.kwargs)
            if "device" in k:
                k["device"] = torch.device("cpu")
            if e.rng is not None:
                torch.set_rng_state(e.rng)
            out = e.func(*a, **k)
            if e.create:
                buf = tree_flatten(out)[0][e.out_index]
                self._account(buf.untyped_storage().nbytes())
                if _geom(buf) != e.geom:
                    raise RuntimeError(f"replaying {e.func} gave {_geom(buf)}, recorded {e.geom}")
            del a, k, out
            self._live -= sum(nested)
        return buf

    def _account(self, nbytes: int) -> None:
        self._live += nbytes
        self.peak_replay_bytes = max(self.peak_replay_bytes, self._live)

    def _copy_source(self, key: int, geom: tuple, pos: Optional[int] = None, depth: int = 0) -> Optional[Tensor]:
        """The real tensor (a file's, memory-mapped) that the view ``geom`` of a storage equals after ``pos``
        entries, when its chain is one full ``copy_`` from it, or a clone of such a storage (an EMA teacher
        copied from a student loaded from a file), every storage on the way of one dtype; else None."""
        st = self.storages[key]
        pos = len(st.entries) if pos is None else pos
        start = self._start(st, pos)
        if pos - start != 1 or depth > 16:
            return None
        e = st.entries[start]
        aten = torch.ops.aten
        if e.create and e.func in (aten.clone.default, aten._to_copy.default) \
                and set(e.kwargs) <= {"memory_format", "dtype", "device", "layout", "non_blocking"} \
                and e.kwargs.get("dtype") in (None, st.dtype):
            src, dst_geom = e.args[0], e.geom
        elif not e.create and e.func is aten.copy_.default:
            src, dst_geom = e.args[1], e.args[0].geom
        else:
            return None
        if isinstance(src, _Real):
            t = src.tensor
        elif isinstance(src, _Tracked) and self.storages[src.key].dtype == st.dtype:
            t = self._copy_source(src.key, src.geom, src.pos, depth + 1)
        else:
            return None
        whole = (tuple(t.shape), tuple(torch.empty(t.shape, device="meta").stride()), 0) if t is not None else None
        if t is None or t.numel() != st.numel or dst_geom != whole or geom != whole:
            return None
        return t

    @torch.no_grad()
    def materialize(self, module: nn.Module) -> None:
        """Fill every parameter and buffer of the sharded, ``to_empty``'d module with its replayed value (this
        rank's shard of it); the CPU generator ends where the build left it."""
        from torch.distributed.tensor import DTensor

        done = set()
        files = _file_ranges()  # memory-mapped files (released weights): their pages are dropped once read
        try:
            for fqn, t in self._tensors(module):
                if t is None or id(t) in done:
                    continue
                done.add(id(t))
                key, geom = self.names[fqn]
                if isinstance(t, DTensor):
                    shape, offset = compat.local_shape_and_global_offset(t)
                    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
                    dst = t.to_local()
                else:
                    index, dst = (), t
                src = self._copy_source(key, geom)
                if src is None:
                    full = self.value(key)
                    dst.copy_(full.as_strided(*geom)[index])
                    self._live -= full.untyped_storage().nbytes()
                    big = full.untyped_storage().nbytes() >= _TRIM_BYTES
                    del full
                    if big:
                        _trim()
                else:  # one copy_ of a file tensor: read only this rank's slice
                    dst.copy_(_rows(src, index))
                    for f in (src.sources if isinstance(src, LazyRows) else [src]):
                        if f.is_contiguous() and _in_ranges(f, files):
                            _drop_pages(f)
        finally:
            torch.set_rng_state(self.rng_after_build)


__all__ = ["InitRecorder"]
