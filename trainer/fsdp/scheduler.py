"""The order of the units and the prefetch: which unit's all-gather to issue next, within a bound.

The forward order is recorded in the first iteration (the root first, then the units as their
forward hooks fire); from the second on, the next unit's gather is issued before the current unit
computes (forward prefetch), and in backward the previous unit's gather is issued before the
current unit's gradients are computed (backward prefetch). `max_gathers_in_flight` bounds the
units holding gathered parameters besides the one computing (the root counts: it stays gathered
through forward and backward).
"""

from __future__ import annotations

from typing import Optional

from .unit import FSDPUnit


class Scheduler:
    def __init__(
        self,
        root: FSDPUnit,
        units: list[FSDPUnit],
        max_gathers_in_flight: int,
        forward_prefetch: bool,
        backward_prefetch: bool,
        reshard_after_forward: bool,
    ):
        self.root, self.units = root, units
        self.max_gathers_in_flight = max_gathers_in_flight
        self.forward_prefetch, self.backward_prefetch = forward_prefetch, backward_prefetch
        # Units that keep their parameters until backward ends (SHARD_GRAD_OP) are not prefetch
        # memory: only gathers still in flight count for them.
        self.count_resident = reshard_after_forward
        self.order: list[FSDPUnit] = []  # forward execution order of the non-root units
        self.order_known = False

    def begin_forward(self) -> None:
        """A forward of the whole model starts: the first records the order, later ones use it."""
        if self.order and not self.order_known:
            self.order_known = True
        elif not self.order_known:
            self.order = []

    def record(self, u: FSDPUnit) -> None:
        if not self.order_known:
            self.order.append(u)

    # ---- what to prefetch when ---------------------------------------------------------------
    def prefetch_first(self) -> None:
        """At the root's forward: the first unit's gather overlaps the root's, bound allowing."""
        if self.order_known and self.forward_prefetch and self.order:
            self._prefetch(self.order[0], current=None)

    def prefetch_after(self, u: FSDPUnit) -> None:
        """Forward of `u` about to compute: the next unit's gather."""
        if self.order_known and self.forward_prefetch:
            nxt = self._neighbour(u, +1)
            if nxt is not None:
                self._prefetch(nxt, current=u)

    def prefetch_last(self) -> None:
        """Backward starts at the root: the last unit's gather."""
        if self.backward_prefetch and self.order:
            self._prefetch(self.order[-1], current=self.root)

    def prefetch_before(self, u: FSDPUnit) -> None:
        """Backward of `u` about to compute: the previous unit's gather."""
        if self.backward_prefetch:
            prev = self._neighbour(u, -1)
            if prev is not None:
                self._prefetch(prev, current=u)

    # ---- internals ---------------------------------------------------------------------------
    def _neighbour(self, u: FSDPUnit, step: int) -> Optional[FSDPUnit]:
        if u not in self.order:
            return None
        i = self.order.index(u) + step
        return self.order[i] if 0 <= i < len(self.order) else None

    def _prefetch(self, target: FSDPUnit, current: Optional[FSDPUnit]) -> None:
        """Issue target's gather if the bound on resident units (other than `current`) allows."""
        if target.is_resident():
            return
        resident = sum(
            1
            for x in (self.root, *self.units)
            if x is not current
            and (x.gather_in_flight() or (self.count_resident and x.is_resident()))
        )
        if resident < self.max_gathers_in_flight:
            target.issue_gather()
