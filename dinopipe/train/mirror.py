"""Mixed precision at one rank without FSDP2: fp32 master parameters, a bf16 compute copy made with one
multi-tensor cast per forward, gradients cast back to fp32 with one multi-tensor copy after backward.

Why: on a one-rank process group FSDP2 still "unshards" every parameter before each forward -- a cast and a copy
per parameter (~680 launches per ViT-S/14 step for the student and the teacher, where FSDP1's flat parameter
needs 3). The shard is the whole parameter, so none of that moves data between ranks. This module keeps FSDP2's
numerics -- ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32)``: the forward and backward run on
``compute``-dtype parameters, the gradient of each parameter is produced in ``compute`` dtype and then cast to
fp32 (a one-rank reduction is the identity, so the reduce dtype changes nothing), the root casts its floating
inputs -- with a handful of launches:

- before a forward the module's parameters are swapped for persistent ``compute``-dtype leaves, refreshed from
  the masters by one ``torch._foreach_copy_`` (a multi-tensor launch per chunk of tensors, casting as it copies);
- the leaves stay in place through backward (activation checkpointing recomputes with them, as FSDP2 keeps them
  with ``reshard_after_forward=False``); when backward ends their gradients are cast into the masters' ``.grad``
  by one more multi-tensor copy (added when a micro-batch already left one) and the masters are put back;
- a forward without gradients (the teachers) puts the masters back when it returns.

Between steps the module holds its fp32 masters, so the optimizer, the EMA, clipping, DCP checkpoints and
exports see exactly what a plain fp32 module shows them; the copy's storage is freed then (as FSDP2 frees its
unsharded parameters). The leaves keep their identity from step to step, so a compiled block sees the same
parameters every call.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..utils import torch_compat as compat


class Bf16Mirror:
    """The compute-dtype copy of ``module``'s parameters (shared parameters once) and the swap in / out."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self.module, self.dtype = module, dtype
        self.slots: list[tuple[nn.Module, str, int]] = []  # (owner, name, index into masters)
        self.masters: list[nn.Parameter] = []
        self.leaves: list[nn.Parameter] = []
        self.installed = False
        self._versions: list[int] = []
        self._queued = False

    def _scan(self) -> None:
        """The module's parameters as they are now: a task built on meta gets new ones from ``to_empty`` after
        parallelize, and a checkpoint load may replace them."""
        slots, masters, index = [], [], {}
        for mod in self.module.modules():
            for name, p in mod._parameters.items():
                if p is None:
                    continue
                if id(p) not in index:
                    index[id(p)] = len(masters)
                    masters.append(p)
                slots.append((mod, name, index[id(p)]))
        if [id(p) for p in masters] != [id(p) for p in self.masters] or any(
                m.device != leaf.device for m, leaf in zip(masters, self.leaves)):
            self.slots, self.masters = slots, masters
            self._make_leaves()

    def _make_leaves(self) -> None:
        self.leaves = []
        for m in self.masters:
            leaf = nn.Parameter(torch.empty_like(m, dtype=self.dtype), requires_grad=m.requires_grad)
            if m.requires_grad:
                leaf.register_post_accumulate_grad_hook(self._on_grad)
            self.leaves.append(leaf)

    def install(self) -> bool:
        """Swap the compute copy in (refreshed from the masters); False when it already is, and current."""
        if self.installed:
            if self._versions == [compat.tensor_version(m) for m in self.masters]:
                return False
            self.restore()  # masters changed since (a forward whose backward never ran, then an update)
        self._scan()
        for leaf in self.leaves:  # storage back (freed when the masters were last swapped back)
            storage = leaf.untyped_storage()
            if storage.size() == 0:
                storage.resize_(leaf.numel() * leaf.element_size())
        with torch.no_grad():
            torch._foreach_copy_(self.leaves, [m.detach() for m in self.masters])
        for mod, name, i in self.slots:
            mod._parameters[name] = self.leaves[i]
        self._versions = [compat.tensor_version(m) for m in self.masters]
        self.installed = True
        return True

    def restore(self) -> None:
        """The masters back in the module; the copy's storage freed (FSDP2's reshard: the same memory between
        uses as its sharded parameters at one rank), its Parameter objects kept, so compiled code sees the same
        parameters next time."""
        for mod, name, i in self.slots:
            mod._parameters[name] = self.masters[i]
        for leaf in self.leaves:
            leaf.untyped_storage().resize_(0)
        self.installed = False

    def _on_grad(self, leaf: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            compat.queue_backward_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """After backward: compute-dtype gradients -> fp32 masters' .grad (one multi-tensor copy; one more add
        when accumulating over micro-batches), the leaves' gradients freed, the masters swapped back."""
        self._queued = False
        fresh, fresh_src, acc, acc_src = [], [], [], []
        for m, leaf in zip(self.masters, self.leaves):
            if leaf.grad is None:
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
                fresh.append(m.grad)
                fresh_src.append(leaf.grad)
            else:
                acc.append(m.grad)
                acc_src.append(leaf.grad)
        with torch.no_grad():
            if fresh:
                torch._foreach_copy_(fresh, fresh_src)
            if acc:
                tmp = [torch.empty_like(g) for g in acc]
                torch._foreach_copy_(tmp, acc_src)
                torch._foreach_add_(acc, tmp)
        for leaf in self.leaves:
            leaf.grad = None
        self.restore()


def _cast_input(dtype: torch.dtype, x: Any) -> Any:
    """FSDP2's root input cast (``cast_forward_inputs``): floating tensors to the compute dtype."""
    if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
        return x.to(dtype)
    return x


def apply_mirror(module: nn.Module, dtype: torch.dtype, methods: tuple[str, ...]) -> Bf16Mirror:
    """Wrap ``module``'s entry ``methods`` so that a call runs on the compute copy (see the module's text)."""
    mirror = getattr(module, "_dinopipe_mirror", None)
    if mirror is not None:
        return mirror
    mirror = Bf16Mirror(module, dtype)
    cast = functools.partial(_cast_input, dtype)
    for name in methods:
        fn = getattr(module, name, None)
        if fn is None:
            continue

        def call(*args, _fn=fn, **kwargs):
            mine = mirror.install()
            args, kwargs = compat.tree_map(cast, (args, kwargs))
            try:
                return _fn(*args, **kwargs)
            finally:
                # no backward will follow: put the masters back now (a trained module keeps the copy until its
                # backward ends, in _finish_backward)
                if mine and not (torch.is_grad_enabled() and any(m.requires_grad for m in mirror.masters)):
                    mirror.restore()

        setattr(module, name, functools.wraps(fn)(call))
    module._dinopipe_mirror = mirror
    return mirror


__all__ = ["Bf16Mirror", "apply_mirror"]
