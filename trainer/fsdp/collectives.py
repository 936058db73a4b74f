"""Asynchronous collectives with accounting, trace and the time the compute path waits on them.

CPU (gloo): `async_op=True` work handles; gloo's own threads move the bytes while the caller
computes, and the caller blocks in `wait()` only when it needs the result. Gloo copies the input
of a reduce-scatter when it is issued (not an all-gather's: tests/fsdp/test_gloo_premises.py
checks both), and its work object holds that copy until it is waited for: the caller's input is
not kept, so a unit's unsharded gradient is freed the moment its reduce-scatter is issued
instead of living twice (ours and gloo's) until it retires. Gloo's all-gather, on the other hand,
gathers into a temporary of the whole output and copies it out at the end: in flight behind a
unit's compute that is a second gathered unit alive at once. On the CPU the engine's all-gather
is therefore point-to-point on gloo (`_PointToPointGather`): each rank sends its shard to every
peer and receives theirs straight into its slice of the output, the bytes a ring moves, no
temporary (other CPU backends, such as the tests' threaded one, keep the collective).

CUDA (NCCL): each kind runs on its own high-priority stream, so a collective issued while a
long kernel queue is pending starts as soon as the link is free. The collective stream first
waits for the issuing stream's work (wait_stream, or only for an earlier collective's event when
it consumes nothing else: HYBRID_SHARD's all-reduce after its reduce-scatter). The consumer waits
on an event recorded after the collective, never with record_stream: a buffer is released
exactly when the event says it may be. The cast of a shard to the compute dtype before a gather
runs on the gather stream, so the copy it allocates belongs to that stream's pool and is reused
only after the gather that read it.

Exposed communication is measured where it happens: on the CPU the seconds a wait() blocks; on
CUDA a pair of timing events around the compute stream's wait_event, whose elapsed time is how
long that stream stalled for the collective (read on logging steps only: reading it syncs).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .accounting import Accounting

# torch 2.13 renamed the tensor collectives; keep working on older releases.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

OPS = ("all_gather", "reduce_scatter", "all_reduce")
HIGH_PRIORITY = -1  # torch's highest stream priority on current GPUs (lower is higher)


class Handle:
    """One issued collective. wait() makes its result usable on the current stream."""

    def __init__(self, acct: Accounting, op: str, unit: str, work=None, event=None, keep=()):
        self._acct, self.op, self.unit = acct, op, unit
        self._work, self._event = work, event
        self._keep = keep  # buffers that must live until the collective finished
        self.done = False

    @property
    def event(self) -> Optional[torch.cuda.Event]:
        return self._event

    def wait(self) -> None:
        if self.done:
            return
        if self._work is not None:
            t0 = time.perf_counter()
            self._work.wait()
            self._acct.record_wait(self.op, time.perf_counter() - t0)
            self._work = None  # gloo's work object holds a copy of the input until it dies
        if self._event is not None:
            stream = torch.cuda.current_stream()
            start, end = _timing_event(), _timing_event()
            start.record(stream)
            stream.wait_event(self._event)
            end.record(stream)
            self._acct.record_wait_events(self.op, start, end)
        self._keep = ()
        self.done = True
        self._acct.event("wait", self.op, self.unit)


class _PointToPointGather:
    """An all-gather on the CPU as sends and receives: this rank's shard to every peer, theirs
    into their slices of `out` (gloo writes a receive straight into the tensor), its own copied
    in. Every rank posts them in the same order (peers by group rank), so the messages of two
    gathers in flight between a pair never cross."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, group, size: int):
        me = dist.get_group_rank(group, dist.get_rank()) if group is not None else 0
        chunks = out.chunk(size)
        self._works = []
        for peer in range(size):
            if peer != me:
                self._works.append(dist.isend(inp, group=group, group_dst=peer))
                self._works.append(dist.irecv(chunks[peer], group=group, group_src=peer))
        chunks[me].copy_(inp)

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class Collectives:
    def __init__(self, acct: Accounting, device: torch.device):
        self.acct = acct
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.streams = {op: torch.cuda.Stream(device, priority=HIGH_PRIORITY) for op in OPS}

    def _issue(
        self, op: str, unit: str, fn, payload_bytes: int, group_size: int, after=None
    ) -> Handle:
        """fn(async_op) issues the collective and returns (work, buffers to keep alive)."""
        self.acct.record_comm(op, payload_bytes, group_size)
        self.acct.event("issue", op, unit)
        if not self.cuda:
            if after is not None:
                after.wait()
            work, keep = fn(True)
            return Handle(self.acct, op, unit, work=work, keep=keep)
        stream = self.streams[op]
        if after is not None:
            stream.wait_event(after.event)
        else:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _, keep = fn(False)
            event = torch.cuda.Event()
            event.record(stream)
        return Handle(self.acct, op, unit, event=event, keep=(keep, after))

    def all_gather(
        self, out: torch.Tensor, source: Callable[[], torch.Tensor], group, size: int, unit: str
    ) -> Handle:
        """Gather the shard `source()` returns into `out`. On the gather stream: source() (which
        may copy an offloaded shard in from the host) and the cast to out's dtype."""

        def fn(a):
            shard = source()
            inp = shard if shard.dtype == out.dtype else shard.to(out.dtype)
            if not self.cuda and dist.get_backend(group) == "gloo":
                return _PointToPointGather(out, inp, group, size), (inp,)
            return _all_gather(out, inp, group=group, async_op=a), (inp,)

        return self._issue("all_gather", unit, fn, out.numel() * out.element_size(), size)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, group, size: int, unit: str
    ) -> Handle:
        fn = lambda a: (
            _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=a),
            (inp,) if self.cuda else (),  # gloo works on its own copy (see the docstring)
        )
        return self._issue("reduce_scatter", unit, fn, inp.numel() * inp.element_size(), size)

    def all_reduce(
        self,
        t: torch.Tensor,
        group,
        size: int,
        unit: str,
        op: Optional[dist.ReduceOp] = None,
        after: Optional[Handle] = None,
    ) -> Handle:
        """All-reduce `t` in place. `after`: the collective that produces `t` (on CUDA this one
        is ordered after it on the device, without the host waiting; on the CPU it is waited
        for first)."""
        fn = lambda a: (
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group, async_op=a),
            (),
        )
        return self._issue("all_reduce", unit, fn, t.numel() * t.element_size(), size, after)
