"""The gradient reductions in flight: issued the moment a unit's flat gradient is complete, folded
into the fp32 gradient shards in order, bounded so unsharded gradients never pile up.

FULL_SHARD / SHARD_GRAD_OP reduce-scatter inside the shard group; NO_SHARD all-reduces across the
replicas; HYBRID_SHARD reduce-scatters inside the node, then all-reduces its shard across nodes.
Gradients are summed, never averaged: the loss is already divided by the global token count.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Optional

import torch

from .accounting import Accounting
from .collectives import Collectives, Handle
from .flat_param import FlatParameter
from .mesh import ShardMesh

if TYPE_CHECKING:
    from .unit import FSDPUnit


class Reducer:
    def __init__(
        self,
        mesh: ShardMesh,
        comm: Collectives,
        acct: Accounting,
        reduce_dtype: torch.dtype,
        max_in_flight: int,
    ):
        self.mesh, self.comm, self.acct = mesh, comm, acct
        self.reduce_dtype, self.max_in_flight = reduce_dtype, max_in_flight
        # Reductions issued and not yet folded into the gradient shards, oldest first.
        self._pending: collections.deque = collections.deque()

    def reduce(self, u: FSDPUnit, i: int, g: torch.Tensor) -> None:
        """Launch the reduction of flat i of unit u; fold in the oldest pending one past the bound.

        Invariant: at most max_in_flight unsharded gradients are alive after this call (one more
        while the newest is issued), whatever the depth of the model."""
        g = g if g.dtype == self.reduce_dtype else g.to(self.reduce_dtype)
        self.acct.alloc("unsharded_grads", g.numel() * g.element_size())
        flat, m = u.flats[i], self.mesh
        if m.shard_size > 1:
            out = torch.empty(flat.shard_numel, dtype=self.reduce_dtype, device=g.device)
            h = self.comm.reduce_scatter(out, g, m.shard_group, m.shard_size, u.name)
        else:
            out = g
            h = (
                self.comm.all_reduce(out, m.replicate_group, m.replicate_size, u.name)
                if m.replicate_size > 1
                else None
            )
        self._pending.append((u, i, out, h, g.numel() * g.element_size()))
        while len(self._pending) > self.max_in_flight:
            self._complete(*self._pending.popleft())

    def finish(self) -> None:
        """End of backward: wait for every reduction and write the fp32 gradient shards."""
        m = self.mesh
        pending, self._pending = list(self._pending), collections.deque()
        hybrid = []
        if m.shard_size > 1 and m.replicate_size > 1:
            # HYBRID: all shards' reduce-scatters first, then their all-reduces across replicas,
            # overlapped
            for u, i, out, h, gbytes in pending:
                if h is not None:
                    h.wait()
                hybrid.append(
                    self.comm.all_reduce(out, m.replicate_group, m.replicate_size, u.name)
                )
            for hy in hybrid:
                hy.wait()
        for u, i, out, h, gbytes in pending:
            self._complete(u, i, out, h, gbytes, hybrid_done=bool(hybrid))

    def _complete(
        self,
        u: FSDPUnit,
        i: int,
        out: torch.Tensor,
        h: Optional[Handle],
        gbytes: int,
        hybrid_done: bool = False,
    ) -> None:
        """Wait for one reduction (and, for HYBRID, its all-reduce across replicas); fold it in."""
        if h is not None:
            h.wait()
        m = self.mesh
        if m.shard_size > 1 and m.replicate_size > 1 and not hybrid_done:
            self.comm.all_reduce(out, m.replicate_group, m.replicate_size, u.name).wait()
        self._accumulate(u.flats[i], out)
        self.acct.free("unsharded_grads", gbytes)

    def _accumulate(self, flat: FlatParameter, out: torch.Tensor) -> None:
        """Into the flat's fp32 gradient shard (allocated at the first reduction, then kept)."""
        if flat.grad is None:
            flat.grad = torch.zeros(flat.shard_numel, dtype=torch.float32, device=out.device)
            self.acct.alloc("sharded_grads", flat.shard_numel * 4)
            flat.attach_grad_views()
        if flat.grad_is_zero:
            flat.grad.copy_(out)
        else:
            flat.grad.add_(out)
        flat.grad_is_zero = False
