"""The order of the units and the prefetch: whose all-gather to issue next, and how far ahead.

Both orders are observed, not assumed. The forward order is recorded in the first forward (the
units as their forward hooks fire); the backward order in the first backward (as their
pre-backward hooks fire), so a unit whose backward never runs (frozen leading blocks, a branch
without gradients) is never gathered for a backward that will not come, and a model whose
backward visits its units in another order than reversed forward is prefetched as it runs.
Until an order is known the scheduler prefetches nothing in forward and, in the first backward,
follows the reversed forward order.

`max_gathers_in_flight` = k means what it says at any value: while a unit computes, the next k
units of the order have their all-gathers issued (in flight or done, not yet used), and no
more. The root unit is not one of them: it holds what the model's own forward touches outside
every unit (the final norm; with tied embeddings also the embedding) and is gathered for the
whole step, like FSDP2's root.

So gathered parameters at any moment are at most root + (1 + k) x the largest unit (the unit
computing and k ahead), the number DESIGN.md holds the engine to.
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
    ):
        self.root, self.units = root, units
        self.ahead = max_gathers_in_flight
        self.forward_prefetch, self.backward_prefetch = forward_prefetch, backward_prefetch
        self.order: list[FSDPUnit] = []  # forward execution order of the non-root units
        self.order_known = False
        self.backward_order: list[FSDPUnit] = []  # the order their backward hooks fired
        self.backward_known = False

    # ---- recording ---------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """A forward of the whole model starts: the first records the order, later ones use it."""
        if self.order and not self.order_known:
            self.order_known = True
        elif not self.order_known:
            self.order = []

    def record(self, u: FSDPUnit) -> None:
        if not self.order_known:
            self.order.append(u)

    def record_backward(self, u: FSDPUnit) -> None:
        if not self.backward_known and u not in self.backward_order:
            self.backward_order.append(u)

    def end_backward(self) -> None:
        """The first complete backward fixes the backward order."""
        if self.backward_order:
            self.backward_known = True

    def keeps_after_forward(self, u: FSDPUnit) -> bool:
        """The last unit of the forward keeps its parameters for the backward that starts right
        after it (resharding would free them only to gather them again at once)."""
        return self.order_known and bool(self.order) and u is self.order[-1]

    # ---- what to prefetch when ---------------------------------------------------------------
    def prefetch_first(self) -> None:
        """At the root's forward: the first k units."""
        if self.order_known and self.forward_prefetch:
            self._issue(self.order[: self.ahead])

    def prefetch_after(self, u: FSDPUnit) -> None:
        """Forward of `u` about to compute: the next k units."""
        if self.order_known and self.forward_prefetch:
            self._issue(self._next(self.order, u))

    def prefetch_backward_start(self) -> None:
        """The loss gradient arrived: the first k units of the backward."""
        if self.backward_prefetch:
            self._issue(self._backward()[: self.ahead])

    def prefetch_before(self, u: FSDPUnit) -> None:
        """Backward of `u` about to compute: the next k units of the backward."""
        if self.backward_prefetch:
            self._issue(self._next(self._backward(), u))

    # ---- internals ---------------------------------------------------------------------------
    def _backward(self) -> list[FSDPUnit]:
        return self.backward_order if self.backward_known else self.order[::-1]

    def _next(self, order: list[FSDPUnit], u: FSDPUnit) -> list[FSDPUnit]:
        i = _index(order, u)
        return [] if i is None else order[i + 1 : i + 1 + self.ahead]

    @staticmethod
    def _issue(targets: list[FSDPUnit]) -> None:
        for t in targets:
            t.issue_gather()  # a no-op for a unit already gathered or in flight


def _index(order: list[FSDPUnit], u: FSDPUnit) -> Optional[int]:
    for i, x in enumerate(order):
        if x is u:
            return i
    return None
