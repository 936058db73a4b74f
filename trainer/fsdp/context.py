"""Context parallelism, the engine's half: the K/V exchange over the mesh's `context` axis.

    split_sequences(model, mesh, acct)    # in the engine, before the units are flattened

With train.context_parallel = N the model computes two chunks of every sequence per rank
(trainer/model/context.py) and each layer's attention all-gathers the keys and values of the N
ranks' chunks: one all-gather of [B, 2c, kv_heads, 2 head_dim] per layer in forward (again in
the recomputation under activation checkpointing), one reduce-scatter of its gradient in
backward, so the gradient of every key and value reaches the rank that computed it, summed over
the queries of all ranks (exact). The exchange is synchronous with the compute stream (the
attention needs it at once): its time is exposed and accounted as `context`.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from .accounting import Accounting
from .collectives import _all_gather, _reduce_scatter
from .mesh import Mesh


def split_sequences(model: torch.nn.Module, mesh: Mesh, acct: Optional[Accounting]) -> None:
    """Give the model its ContextSplit when the mesh has a context axis (nothing to do with one
    rank on it): the model's forward then keeps its chunks and gathers K/V over the group."""
    n = mesh.size("context")
    if n == 1 or not hasattr(model, "context_split"):
        return
    from trainer.model.context import ContextSplit  # noqa: PLC0415 -- the model's half

    gather = KVGather(mesh.group("context"), n, acct)
    model.context_split = ContextSplit(n, mesh.coord("context"), gather)


class KVGather:
    """x [B, 2c, ...] -> [N, B, 2c, ...]: every context rank's chunks, in context-rank order."""

    def __init__(self, group, size: int, acct: Optional[Accounting] = None):
        self.group, self.size, self.acct = group, size, acct

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherKV.apply(x, self)


class _GatherKV(torch.autograd.Function):
    """all_gather_into_tensor forward; reduce_scatter_tensor (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, gather: KVGather):
        ctx.gather = gather
        out = x.new_empty((gather.size * x.shape[0], *x.shape[1:]))  # ranks along dim 0
        _timed(gather, x, lambda: _all_gather(out, x.contiguous(), group=gather.group))
        return out.view(gather.size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        gather = ctx.gather
        mine = grad.new_empty(grad.shape[1:])
        whole = grad.contiguous().view(-1, *grad.shape[2:])
        _timed(gather, mine, lambda: _reduce_scatter(mine, whole, group=gather.group))
        return mine, None


def _timed(gather: KVGather, part: torch.Tensor, collective) -> None:
    """Run `collective` (an exchange of `part`-sized pieces over the group), accounting the bytes
    this rank sends (ring: (N-1) pieces) and the compute path's wait."""
    acct = gather.acct
    if acct is None:
        collective()
        return
    cuda = part.is_cuda
    if cuda:  # NCCL returns at once: the stall is the compute stream's, timed by events
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    collective()
    sent = part.numel() * part.element_size() * (gather.size - 1)
    acct.record_sent("context", sent, 0.0 if cuda else time.perf_counter() - t0)
    if cuda:
        end.record()
        acct.record_wait_events("context", start, end)
