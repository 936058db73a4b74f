"""The gradient reductions in flight: issued the moment a unit's flat gradient is complete, folded
into the fp32 gradient shards in order, bounded so unsharded gradients never pile up.

Each flat is reduced over its own placement on the mesh (flat.placement: units may carry their
own strategy). FULL_SHARD / SHARD_GRAD_OP reduce-scatter inside the shard group; NO_SHARD
all-reduces across the replicas; HYBRID_SHARD reduce-scatters inside the node, then all-reduces
its shard across nodes:
on CUDA that all-reduce is queued on its own stream right behind the reduce-scatter (ordered by
the reduce-scatter's event, the host never waits), on the CPU it is issued once the
reduce-scatter is retired; either way it is waited for only when backward ends.

Gradients are summed, never averaged: the loss is already divided by the global token count.
They are reduced in reduce_dtype (a bf16 reduce-scatter moves half the bytes) and the shard that
comes back is accumulated into the fp32 gradient shard: only the 1/N shard is ever upcast.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Optional

import torch

from .accounting import Accounting
from .collectives import Collectives, Handle
from .flat_param import FlatParameter
from .offload import HostGrads


@dataclass
class _Reduction:
    flat: FlatParameter
    unit: str
    out: torch.Tensor  # the reduced shard (reduce_dtype), or the whole gradient for NO_SHARD
    handle: Optional[Handle]  # the reduce-scatter (or NO_SHARD's all-reduce)
    across: Optional[Handle]  # HYBRID_SHARD's all-reduce across replicas, once issued
    grad_bytes: int  # the unsharded gradient, alive until `handle` is retired


class Reducer:
    def __init__(
        self,
        comm: Collectives,
        acct: Accounting,
        reduce_dtype: torch.dtype,
        max_in_flight: int,
        host_grads: Optional[HostGrads] = None,
    ):
        """`host_grads`: where the fp32 gradient shards of offloaded flats are folded in (the
        engine builds one when offloading; None otherwise)."""
        self.comm, self.acct = comm, acct
        self.reduce_dtype, self.max_in_flight = reduce_dtype, max_in_flight
        self.host_grads = host_grads
        # Issued and not yet retired (their unsharded gradients alive), oldest first.
        self._pending: collections.deque[_Reduction] = collections.deque()
        # HYBRID_SHARD: retired reduce-scatters whose all-reduce across replicas is in flight.
        self._across: list[_Reduction] = []

    def reduce(self, flat: FlatParameter, unit: str, g: torch.Tensor) -> None:
        """Launch the reduction of `flat`'s complete gradient `g` (`unit` names it in the
        accounting); retire the oldest pending one past the bound.

        Invariant: at most max_in_flight unsharded gradients are alive after this call, the newest
        included (one more while the newest arrives, before the oldest is retired), whatever the
        depth of the model. The default, 1, is FSDP2's: the previous reduction is waited for (on
        CUDA: by the stream, not the host) when the next gradient is ready, which still leaves
        each reduction the next unit's backward to hide behind."""
        g = g if g.dtype == self.reduce_dtype else g.to(self.reduce_dtype)
        gbytes = g.numel() * g.element_size()
        self.acct.alloc("unsharded_grads", gbytes)
        # Retire before issuing: the oldest gradients (and their outputs) go before this one's
        # output is allocated, as FSDP2 frees the previous reduce-scatter's buffers.
        while len(self._pending) >= self.max_in_flight:
            self._retire(self._pending.popleft())
        m = flat.placement
        across = None
        if m.shard_size > 1:
            out = torch.empty(flat.shard_numel, dtype=self.reduce_dtype, device=g.device)
            h = self.comm.reduce_scatter(out, g, m.shard_group, m.shard_size, unit)
            if m.hybrid and self.comm.cuda:
                across = self._all_reduce_across(flat, out, unit, after=h)
        else:
            out = g
            h = (
                self.comm.all_reduce(out, m.replicate_group, m.replicate_size, unit)
                if m.replicate_size > 1
                else None
            )
        self._pending.append(_Reduction(flat, unit, out, h, across, gbytes))

    def finish(self) -> None:
        """End of backward: retire every reduction, wait for the all-reduces across replicas,
        write the fp32 gradient shards."""
        while self._pending:
            self._retire(self._pending.popleft())
        across, self._across = self._across, []
        for r in across:
            r.across.wait()
            self._accumulate(r.flat, r.out)
        if self.host_grads is not None:
            self.host_grads.finish()

    def _retire(self, r: _Reduction) -> None:
        """The reduce-scatter is done: its unsharded gradient goes. Fold the shard in now, or, for
        HYBRID_SHARD, once its all-reduce across replicas is done (at finish)."""
        if r.handle is not None:
            r.handle.wait()
            r.handle = None
        self.acct.free("unsharded_grads", r.grad_bytes)
        if not r.flat.placement.hybrid:
            self._accumulate(r.flat, r.out)
            return
        if r.across is None:  # CPU: the shard is final only now
            r.across = self._all_reduce_across(r.flat, r.out, r.unit)
        self._across.append(r)

    def _all_reduce_across(self, flat: FlatParameter, out: torch.Tensor, unit: str, after=None):
        m = flat.placement
        return self.comm.all_reduce(out, m.replicate_group, m.replicate_size, unit, after=after)

    def _accumulate(self, flat: FlatParameter, out: torch.Tensor) -> None:
        """Into the flat's fp32 gradient shard: here, or (offloaded) on the host."""
        if flat.host:
            self.host_grads.add(flat, out)
        else:
            self.acct.alloc("sharded_grads", flat.add_grad(out))
