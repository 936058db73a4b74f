"""Asynchronous collectives with accounting and trace.

CPU (gloo): `async_op=True` work handles; the background gloo thread moves the bytes while the
caller computes. CUDA (NCCL): each kind runs on its own stream. The issuing stream's work is made
visible to the collective stream with wait_stream; the consumer waits on an event recorded after the
collective, never on record_stream, so a buffer is freed exactly when its event says it may be.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .accounting import Accounting

# torch 2.13 renamed the tensor collectives; keep working on older releases.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class Handle:
    """One issued collective. wait() makes its result usable on the current stream."""

    def __init__(self, acct: Accounting, op: str, unit: str, work=None, event=None, keep=()):
        self._acct, self.op, self.unit = acct, op, unit
        self._work, self._event = work, event
        self._keep = keep  # buffers that must live until the collective finished
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
            self._work = None  # gloo's work object holds a copy of the input until it dies
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        self._keep = ()
        self.done = True
        self._acct.event("wait", self.op, self.unit)


class Collectives:
    def __init__(self, acct: Accounting, device: torch.device):
        self.acct = acct
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.streams = {
                op: torch.cuda.Stream(device)
                for op in ("all_gather", "reduce_scatter", "all_reduce")
            }

    def _issue(self, op: str, unit: str, fn, payload_bytes: int, group_size: int, keep) -> Handle:
        self.acct.record_comm(op, payload_bytes, group_size)
        self.acct.event("issue", op, unit)
        if not self.cuda:
            return Handle(self.acct, op, unit, work=fn(True), keep=keep)
        stream = self.streams[op]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(False)
            event = torch.cuda.Event()
            event.record(stream)
        return Handle(self.acct, op, unit, event=event, keep=keep)

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, group, size: int, unit: str
    ) -> Handle:
        fn = lambda a: _all_gather(out, inp, group=group, async_op=a)
        return self._issue("all_gather", unit, fn, out.numel() * out.element_size(), size, (inp,))

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, group, size: int, unit: str
    ) -> Handle:
        fn = lambda a: _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=a)
        return self._issue(
            "reduce_scatter", unit, fn, inp.numel() * inp.element_size(), size, (inp,)
        )

    def all_reduce(
        self, t: torch.Tensor, group, size: int, unit: str, op: Optional[dist.ReduceOp] = None
    ) -> Handle:
        fn = lambda a: dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group, async_op=a)
        return self._issue("all_reduce", unit, fn, t.numel() * t.element_size(), size, ())
