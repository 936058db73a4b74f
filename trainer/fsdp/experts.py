"""A mixture of experts on the mesh's expert axis: each rank keeps its experts only, and tokens
travel to the ranks that hold their experts and back.

    localize_experts(model, mesh)      # in parallelize, before the units are flattened

With sharding.expert_parallel = N (the `expert` axis of the mesh), the rank at expert
coordinate c keeps experts [c E/N, (c+1) E/N) of every sparse layer (the model's `Experts`
modules, `stacked_experts`: their flats are placed apart, wrap.py) and routes through an
all-to-all over the expert group (the N ranks that hold the N slices, consecutive ranks):

1. the counts: rows this rank sends to each rank's experts (counts [E] as [N, E/N]) are
   exchanged, so each rank knows how many rows it receives from each (one all-to-all of N E/N
   integers, then one host read of the splits: the token all-to-all needs them);
2. the rows, sorted by global expert, go out as N contiguous blocks (all_to_all_single, its
   splits from 1); a rank receives, from each source in rank order, that source's rows for each
   of its experts, and reorders them expert-major for its grouped matmuls;
3. the outputs go back by the same two steps reversed; an all-to-all keeps the order of rows
   within each (source, destination) pair, so each row comes back where it left.

Backward runs the same exchanges with the splits swapped (`_AllToAll`). Dropless: a rank
receives whatever its experts were sent. Expert gradients reduce-scatter over the ranks holding
the same experts (their placement, mesh.py): each one's gradient covers every token of its
expert group, and the sum over the groups is the whole batch's.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from .accounting import Accounting
from .config import ConfigError
from .mesh import Mesh


def localize_experts(model: torch.nn.Module, mesh: Mesh, acct: Optional[Accounting]) -> None:
    """Cut every `stacked_experts` module to this rank's experts and route its layer through
    the all-to-all (nothing to do with one rank on the expert axis)."""
    ep = mesh.size("expert")
    if ep == 1:
        return
    group, coord = mesh.group("expert"), mesh.coord("expert")
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if not getattr(experts, "stacked_experts", False):
            continue
        if experts.total % ep:
            valid = [d for d in range(1, ep + 1) if experts.total % d == 0 and ep % d == 0]
            raise ConfigError(
                f"invalid config: sharding.expert_parallel={ep} does not divide the "
                f"{experts.total} experts; valid: {', '.join(map(str, valid))} (divisors of both "
                "the experts and the ranks it is cut from)"
            )
        local = experts.total // ep
        experts.localize(coord * local, local)
        module.dispatch = AllToAllDispatch(group, ep, local, acct)


class AllToAllDispatch:
    """A layer's dispatch over the expert group (the module docstring's three steps)."""

    def __init__(self, group, size: int, local: int, acct: Optional[Accounting] = None):
        self.group, self.size, self.local, self.acct = group, size, local, acct

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        """xs [S, D] sorted by global expert, counts [E] -> the experts' outputs, same order."""
        send = counts.view(self.size, self.local)  # rows for each rank's experts
        recv = torch.empty_like(send)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        both = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # one host read
        if self.acct is not None:  # the host waited for the router and the counts
            self.acct.record_wait("all_to_all", time.perf_counter() - t0)
        sent, received = both[0], both[1]
        rows = _AllToAll.apply(xs, received, sent, self.group, self.acct)
        # rank-major (source, local expert) blocks -> expert-major for the grouped matmuls
        blocks = torch.repeat_interleave(
            torch.arange(recv.numel(), device=xs.device), recv.flatten()
        )
        order = torch.argsort((blocks % self.local) * self.size + blocks // self.local, stable=True)
        out = experts(rows[order], recv.sum(0))
        back = torch.empty_like(out)
        back[order] = out
        return _AllToAll.apply(back, sent, received, self.group, self.acct)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows: `out_splits` rows from each rank, `in_splits` to each; its
    backward sends the gradients back the same way, splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, acct):
        ctx.splits, ctx.group, ctx.acct = (out_splits, in_splits), group, acct
        return _exchange(x, out_splits, in_splits, group, acct)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.acct), None, None, None, None


def _exchange(x: torch.Tensor, out_splits, in_splits, group, acct) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    cuda = x.is_cuda and acct is not None
    if cuda:  # NCCL returns at once: the stall is the compute stream's, timed by events
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )
    if acct is not None:  # what left this rank for others (its own rows stay)
        row = math.prod(x.shape[1:]) * x.element_size()
        mine = in_splits[dist.get_rank(group)]
        seconds = 0.0 if cuda else time.perf_counter() - t0
        acct.record_sent("all_to_all", row * (sum(in_splits) - mine), seconds)
        if cuda:
            end.record()
            acct.record_wait_events("all_to_all", start, end)
    return out
