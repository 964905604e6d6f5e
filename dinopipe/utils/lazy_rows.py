"""A tensor whose rows are read on demand: converted checkpoint weights that are not built whole on every rank.

A converter that packs released tensors (DINOv3's SwiGLU ``w1``/``w2`` -> ``fc1``, Hugging Face's q/k/v ->
``qkv``) or a DCP folder read without a process group would otherwise allocate every tensor in full on every
rank. :class:`LazyRows` is a tensor (``torch`` wrapper subclass, no storage) that knows only its shape, dtype
and how to read rows ``[start, stop)``; slicing its first dimension (``t[a:b]``, what
``train/meta_init.py`` does to copy one rank's shard) reads only those rows, any other op reads the whole
tensor first and runs on a plain tensor (``param.copy_(t)`` in a one-process ``load_state_dict``: one tensor
at a time), and an op that also takes a ``meta`` tensor (``load_state_dict`` into a model built on ``meta``)
reads nothing. :func:`lazy_cat` is ``torch.cat`` along dim 0 of memory-mapped file tensors without the copy.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from . import torch_compat as compat

_aten = torch.ops.aten


class LazyRows(Tensor):
    """``shape``/``dtype`` of a tensor and ``read(start, stop)`` -> its rows (a plain tensor).
    ``sources``: the file tensors it reads from (a caller may release their pages after a read)."""

    @staticmethod
    def __new__(cls, shape: Sequence[int], dtype: torch.dtype, read: Callable[[int, int], Tensor],
                sources: Sequence[Tensor] = ()):
        return compat.wrapper_tensor(cls, shape, dtype)

    def __init__(self, shape, dtype, read, sources=()) -> None:
        self._read = read
        self.sources = list(sources)

    def __repr__(self) -> str:
        return f"LazyRows(shape={tuple(self.shape)}, dtype={self.dtype})"

    def rows(self, start: int, stop: int) -> Tensor:
        n = self.shape[0] if self.dim() else 1
        start, stop = max(0, min(start, n)), max(0, min(stop, n))
        return self._read(start, max(start, stop))

    def full(self) -> Tensor:
        return self.rows(0, self.shape[0] if self.dim() else 1)

    __torch_function__ = compat.disabled_torch_function()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.slice.Tensor and isinstance(args[0], LazyRows) and args[0].dim():
            t, dim, start, stop, step = (list(args) + [0, None, None, 1][len(args) - 1:])[:5]
            dim = dim % t.dim()
            if dim == 0 and step == 1:
                n = t.shape[0]
                start = 0 if start is None else (start + n if start < 0 else start)
                stop = n if stop is None else (stop + n if stop < 0 else stop)
                return t.rows(start, stop)
        if func in (_aten.detach.default, _aten.alias.default) and isinstance(args[0], LazyRows):
            t = args[0]
            return LazyRows(t.shape, t.dtype, t._read, t.sources)
        metas = any(isinstance(x, Tensor) and not isinstance(x, LazyRows) and x.device.type == "meta"
                    for x in compat.tree_flatten((args, kwargs))[0])

        def swap(x):
            if not isinstance(x, LazyRows):
                return x
            # an op on meta (a build being recorded) needs shapes only: nothing is read
            return torch.empty(x.shape, dtype=x.dtype, device="meta") if metas else x.full()
        return func(*compat.tree_map(swap, args), **compat.tree_map(swap, kwargs))


def _cat_rows(parts: Sequence[Tensor], offsets: Sequence[int], start: int, stop: int) -> Tensor:
    pieces = []
    for p, lo in zip(parts, offsets):
        a, b = max(start, lo), min(stop, lo + p.shape[0])
        if b > a:
            pieces.append(p[a - lo:b - lo] if not isinstance(p, LazyRows) else p.rows(a - lo, b - lo))
    if not pieces:
        return torch.empty((0, *parts[0].shape[1:]), dtype=parts[0].dtype)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()


def lazy_cat(parts: Sequence[Tensor]) -> Tensor:
    """``torch.cat(parts)`` (dim 0) as a :class:`LazyRows` reading only the rows asked for (``torch.cat`` when
    a part is 0-d or the parts disagree in dtype or trailing shape: torch.cat raises the usual error)."""
    parts = list(parts)
    if not parts or any(p.dim() == 0 for p in parts) or len({(p.dtype, tuple(p.shape[1:])) for p in parts}) > 1:
        return torch.cat(parts)
    offsets, n = [], 0
    for p in parts:
        offsets.append(n)
        n += p.shape[0]
    return LazyRows((n, *parts[0].shape[1:]), parts[0].dtype,
                    lambda a, b: _cat_rows(parts, offsets, a, b),
                    sources=[s for p in parts for s in (p.sources if isinstance(p, LazyRows) else [p])])


__all__ = ["LazyRows", "lazy_cat"]
