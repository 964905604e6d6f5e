"""AdamW whose update runs on each rank's local shards.

FSDP2 parameters, their gradients and the optimizer's moments are DTensors. torch's AdamW sends every
multi-tensor op of every parameter group through DTensor's dispatcher (sharding propagation in Python, per op
and group, every step) only to run the same op on the local tensors: the update is elementwise and the
shards of a parameter, its gradient and its moments are laid out alike, so nothing crosses ranks. The
overhead is host time, which a launch-bound step (a ViT-S at 64 images per GPU) pays in full: pytorch #134191
measured AdamW at 2.5% of the step under FSDP1 and 33% under FSDP2; torch >= 2.11 builds also retain
sharding-propagation objects per foreach call (NeMo Automodel #2888, prime-rl #3305).

:class:`ShardLocalAdamW` keeps the optimizer torch's AdamW in every other respect -- its param groups, its state
(the moments stay DTensors, so DCP's sharded optimizer state dicts and resharding on resume are unchanged),
its hooks -- and hands torch's own functional ``adam`` (the fused CUDA kernel or the foreach one) the local
tensors. The arithmetic is torch's: the same weights as the stock AdamW, bit for bit
(tests/ssl/test_adamw_local.py). Plain tensors (one process, no FSDP) pass through unchanged. Pure torch:
DTensors are recognised by ``to_local``, as ssl/ema.py does, so this layer never imports torch.distributed.
"""

from __future__ import annotations

import inspect

import torch

from ..utils import torch_compat as compat
from .ema import local_tensor

try:  # torch's private Adam internals, through torch_compat; missing -> the stock step runs
    _ADAM_ARGS = set(inspect.signature(compat.functional_adam()).parameters)
    _INIT_ARGS = list(inspect.signature(compat.adam_init_group()).parameters)
except compat.TorchCompatError:
    _ADAM_ARGS, _INIT_ARGS = set(), []
SUPPORTED = ("decoupled_weight_decay" in _ADAM_ARGS
             and _INIT_ARGS[:8] == ["self", "group", "params_with_grad", "grads", "exp_avgs", "exp_avg_sqs",
                                    "max_exp_avg_sqs", "state_steps"])
"""This torch's AdamW is ``Adam(decoupled_weight_decay=True)`` with the ``_init_group`` / ``adam`` pair the
step below drives (torch 2.9 to 2.14 are); otherwise the stock step runs."""


def _local(ts: list) -> list:
    return [local_tensor(t) for t in ts]


class ShardLocalAdamW(torch.optim.AdamW):
    """torch's AdamW, its update applied to the local shards of DTensor parameters (see the module's text)."""

    @torch.no_grad()
    def step(self, closure=None):
        if not SUPPORTED:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = [], [], [], [], [], []
            has_complex = compat.adam_init_group()(self, group, params, grads, exp_avgs, exp_avg_sqs,
                                                   max_exp_avg_sqs, state_steps)
            beta1, beta2 = group["betas"]
            compat.functional_adam()(
                _local(params), _local(grads), _local(exp_avgs), _local(exp_avg_sqs), _local(max_exp_avg_sqs),
                state_steps, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=True)
        return loss


__all__ = ["ShardLocalAdamW", "SUPPORTED"]
