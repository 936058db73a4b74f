"""Always-on, cheap accounting: bytes each collective kind moves, live engine bytes by kind, and an
optional event trace of collective issue/wait and unit compute start/end.

Network bytes are what one rank sends (= receives) under ring algorithms, the convention of the
ZeRO paper: all-gather of an output of T bytes over N ranks moves T*(N-1)/N, reduce-scatter of an
input of T bytes moves T*(N-1)/N, all-reduce of T bytes moves 2*T*(N-1)/N.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

COMM_OPS = ("all_gather", "reduce_scatter", "all_reduce")
HOST_KINDS = ("host_params", "host_grads", "host_optim_state")
"""sharding.offload=optimizer or params: state in host memory, reported apart (never in the device
total). With offload=params the device's sharded_params is 0 and the shard copied in for a gather
counts as gathered_params while the gather is in flight."""
MEMORY_KINDS = (
    "sharded_params",
    "sharded_grads",
    "optim_state",
    "gathered_params",
    "unsharded_grads",
)


@dataclass
class Event:
    kind: str  # "issue", "wait", "compute_start", "compute_end"
    op: str  # "all_gather", "reduce_scatter", "all_reduce", "forward", "backward"
    unit: str
    t: float


@dataclass
class Accounting:
    trace_enabled: bool = False
    comm_bytes: dict = field(default_factory=lambda: defaultdict(int))
    comm_calls: dict = field(default_factory=lambda: defaultdict(int))
    live: dict = field(default_factory=lambda: defaultdict(int))
    peak: dict = field(default_factory=lambda: defaultdict(int))
    events: list = field(default_factory=list)
    exposed_s: dict = field(default_factory=lambda: defaultdict(float))
    """Seconds the compute path waited on each collective kind this step (CPU: measured at the
    wait; CUDA: resolved from `_wait_events` when metrics are read)."""
    _wait_events: list = field(default_factory=list)

    # ---- communication -------------------------------------------------------------------
    def record_comm(self, op: str, payload_bytes: int, group_size: int) -> None:
        if group_size <= 1:
            return
        factor = 2 if op == "all_reduce" else 1
        self.comm_bytes[op] += factor * payload_bytes * (group_size - 1) // group_size
        self.comm_calls[op] += 1

    def record_sent(self, op: str, sent_bytes: int, seconds: float) -> None:
        """A synchronous exchange (a mixture's all-to-all): the bytes this rank sent and the
        seconds the compute path spent in it (all of it exposed)."""
        self.comm_bytes[op] += sent_bytes
        self.comm_calls[op] += 1
        self.exposed_s[op] += seconds

    def record_wait(self, op: str, seconds: float) -> None:
        self.exposed_s[op] += seconds

    def record_wait_events(self, op: str, start, end) -> None:
        """CUDA: timing events around the compute stream's wait; elapsed = its stall."""
        self._wait_events.append((op, start, end))

    def exposed_ms(self) -> dict[str, float]:
        """Milliseconds the compute path waited on each kind of collective this step. On CUDA
        this synchronises with the last wait of the step: call it on logging steps only."""
        for op, start, end in self._wait_events:
            end.synchronize()
            self.exposed_s[op] += start.elapsed_time(end) / 1000.0
        self._wait_events.clear()
        # the synchronous exchanges too when this model has them (all_to_all, context)
        ops = (*COMM_OPS, *sorted(op for op in self.exposed_s if op not in COMM_OPS))
        return {op: 1000.0 * self.exposed_s.get(op, 0.0) for op in ops}

    def reset_step(self) -> None:
        """Start a new step: zero per-step comm counters, waits and peaks (peaks restart from
        live)."""
        self.comm_bytes.clear()
        self.comm_calls.clear()
        self.exposed_s.clear()
        self._wait_events.clear()
        self.peak = defaultdict(int, self.live)
        self.peak["total"] = self.total_live()

    # ---- memory --------------------------------------------------------------------------
    def alloc(self, kind: str, nbytes: int) -> None:
        self.live[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.live[kind])
        self.peak["total"] = max(self.peak["total"], self.total_live())

    def free(self, kind: str, nbytes: int) -> None:
        self.live[kind] -= nbytes
        assert self.live[kind] >= 0, f"accounting underflow for {kind}"

    def set(self, kind: str, nbytes: int) -> None:
        """For state whose size is read rather than tracked (optimizer state)."""
        self.live[kind] = nbytes
        self.peak[kind] = max(self.peak[kind], nbytes)
        self.peak["total"] = max(self.peak["total"], self.total_live())

    def total_live(self) -> int:
        return sum(self.live[k] for k in MEMORY_KINDS)

    def persistent_bytes(self) -> int:
        """Per-rank state that lives across steps: params, grads and optimizer state shards."""
        return self.live["sharded_params"] + self.live["sharded_grads"] + self.live["optim_state"]

    # ---- trace ---------------------------------------------------------------------------
    def event(self, kind: str, op: str, unit: str) -> None:
        if self.trace_enabled:
            self.events.append(Event(kind, op, unit, time.perf_counter()))

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for op in COMM_OPS:
            out[f"comm/{op}_bytes"] = float(self.comm_bytes.get(op, 0))
        out["comm/total_bytes"] = float(sum(self.comm_bytes.values()))
        exposed = self.exposed_ms()
        for op in COMM_OPS:
            out[f"comm/exposed_{op}_ms"] = exposed[op]
        # the synchronous exchanges: a mixture's all-to-all (expert axis), the K/V gather
        # (context axis)
        for op in ("all_to_all", "context"):
            if op in self.comm_bytes:
                out[f"comm/{op}_bytes"] = float(self.comm_bytes[op])
                out[f"comm/exposed_{op}_ms"] = exposed.get(op, 0.0)
        out["comm/exposed_ms"] = sum(exposed.values())  # theirs included
        for k in MEMORY_KINDS:
            out[f"mem/{k}_bytes"] = float(self.live.get(k, 0))
            out[f"mem/peak_{k}_bytes"] = float(self.peak.get(k, 0))
        out["mem/peak_total_bytes"] = float(self.peak.get("total", 0))
        for k in HOST_KINDS:
            if self.live.get(k):
                out[f"mem/{k}_bytes"] = float(self.live[k])
        return out
