"""The hooks that drive the units through a step, in this order:

  forward:  the root (the final norm) gathers, kept until backward ends; unit i waits for its
            gather, issues the gathers of the next k units (forward prefetch), computes,
            reshards (the last unit keeps its parameters: backward starts with it).
  backward: the hook on unit i's output gathers unit i (already prefetched), issues the gathers
            of the next k units of the backward order (backward prefetch); when unit i's flat
            gradient is complete its reduction is issued at once and the unit reshards; a
            callback at the end of backward waits for every reduction and writes the fp32
            gradient shards.
  no_grad:  every unit reshards after its forward, whatever the strategy (evaluation and
            generation hold one unit's parameters at a time, plus the prefetched ones).

Who owns what: each unit (unit.py) owns its storage and its state transitions; the scheduler
(scheduler.py) the execution order and the prefetch; the reducer (reducer.py) the reductions in
flight. `StepHooks` only decides when to call them.
"""

from __future__ import annotations

import weakref

import torch

from .accounting import Accounting
from .reducer import Reducer
from .scheduler import Scheduler
from .unit import FSDPUnit
from .wrap import ROOT


class StepHooks:
    def __init__(
        self,
        module: torch.nn.Module,
        root: FSDPUnit,
        units: list[FSDPUnit],
        scheduler: Scheduler,
        reducer: Reducer,
        acct: Accounting,
    ):
        self.root, self.units, self.scheduler = root, units, scheduler
        self.reducer, self.acct = reducer, acct
        self.in_backward = False
        self.step_open = False  # a step's accounting runs from its first forward to zero_grad
        module.register_forward_pre_hook(self._root_pre_forward)
        module.register_forward_hook(self._root_post_forward)
        for u in units:
            first, last = u.modules[0], u.modules[-1]  # a unit of several runs them in a row
            first.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u))
            last.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out))

    def all_units(self) -> list[FSDPUnit]:
        return [self.root, *self.units]

    def _root_pre_forward(self, module, args):
        if self.in_backward:
            raise RuntimeError("forward called before the previous backward finished")
        if not self.step_open:
            self.acct.reset_step()
            self.step_open = True
        self.scheduler.begin_forward()
        for u in self.all_units():
            u.begin_iteration()
        self.acct.event("compute_start", "forward", ROOT)
        self.root.issue_gather()
        self.scheduler.prefetch_first()  # overlaps the root's gather if the bound allows two
        self.root.wait_gather()
        self.root.use_views()

    def _root_post_forward(self, module, args, output):
        self.acct.event("compute_end", "forward", ROOT)
        if torch.is_grad_enabled():
            register_output_hooks(output, weakref.WeakMethod(self._root_pre_backward))
        else:  # inference: nothing will come back for these parameters
            for u in self.all_units():
                u.end_iteration()
        return output

    def _pre_forward(self, u: FSDPUnit):
        self.scheduler.record(u)
        u.pre_forward(prefetch=lambda: self.scheduler.prefetch_after(u))

    def _post_forward(self, u: FSDPUnit, output):
        u.post_forward(keep=self.scheduler.keeps_after_forward(u))
        if torch.is_grad_enabled():
            me = weakref.ref(self)  # see register_output_hooks
            register_output_hooks(output, lambda g, u=u: me()._pre_backward(u))
        return output

    def _root_pre_backward(self, grad):
        if self.in_backward:
            return grad
        self.in_backward = True
        self.root.pre_backward(prefetch=self.scheduler.prefetch_backward_start)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        return grad

    def _pre_backward(self, u: FSDPUnit):
        self.scheduler.record_backward(u)
        u.pre_backward(prefetch=lambda: self.scheduler.prefetch_before(u))

    def _finish_backward(self) -> None:
        """End of backward: every reduction folded into the gradient shards; units reshard."""
        self.reducer.finish()
        for u in self.all_units():
            u.end_iteration()
        self.scheduler.end_backward()
        self.in_backward = False


def register_output_hooks(output, hook) -> None:
    """Call hook(grad) when the gradient of any tensor in `output` arrives (before its backward).

    The hook lives on the tensor in C++, out of the collector's sight, and an output can outlive
    its step (a caller keeps the logits, a thread's last collective its inputs): it must not
    hold the engine strongly, or the engine's shards stay alive with it. `hook` is a
    weakref.WeakMethod, or a function that reaches the engine through a weak reference."""
    if isinstance(hook, weakref.WeakMethod):
        weak, hook = hook, lambda g: weak()(g)
    tensors = (
        [output]
        if torch.is_tensor(output)
        else [t for t in _flatten_out(output) if torch.is_tensor(t)]
    )
    for t in tensors:
        if t.requires_grad:
            t.register_hook(lambda g: (hook(g), g)[1])


def _flatten_out(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten_out(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flatten_out(y)
    else:
        yield x
