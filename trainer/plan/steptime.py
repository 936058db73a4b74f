"""How long one training step takes on a mesh: compute at the device's rate, each collective on
the links it crosses, and what of it hides behind compute, by replaying the engine's schedule.

    from trainer.plan.hardware import hardware
    from trainer.plan.steptime import step_time
    t = step_time(cfg, 1024, hardware("h100"))   # cfg: a TrainerConfig
    t.step_s, t.tokens_per_s_per_gpu, t.exposed_s    # the step, throughput, what did not hide

    python -m cluster.plan model=70b cluster.num_workers=1024 ...   # every mesh, the fastest

The schedule (timeline.py's docstring, trainer/fsdp/engine.py): per micro-batch, forward over
the units with the next `max_gathers_in_flight` gathers issued when a unit starts computing,
then backward in reverse (FULL_SHARD / HYBRID_SHARD units gather again, all but the last of the
forward; with activation checkpointing a block recomputes its forward first); on the reducing
micro-batch each unit's gradient is reduce-scattered the moment it is complete (HYBRID_SHARD:
then all-reduced across replicas on its own stream), the oldest retired (the compute stream waits
for it) once `max_reductions_in_flight` are pending; backward ends when every reduction is done;
then the optimizer step. A collective runs on the links it crosses, one at a time per link (the
engine's three streams share them); compute runs beside them on a GPU, not on CPU workers
(gloo's threads use the cores the compute does).

A collective over n ranks, g of them on each of its nodes (steptime.spread), moving T bytes
(all-gather output, reduce-scatter input, all-reduce buffer), per rank S = T(n-1)/n (x2 for an
all-reduce), as NCCL's tuning model prices it (hardware.py): ring: base + (n-1-(nodes-1)) intra
steps + (nodes-1) network steps of latency, and S(g-1)/g over NVLink against S/g over each
GPU's NIC (a ring crosses each node boundary once per channel, so a node's NICs together carry
S: the slower of the two). An all-reduce across nodes may take NCCL's tree instead (a chain in
the node, a binary tree across nodes: log2(nodes) network levels): the faster is taken.

Not hidden: the first gather of each micro-batch, a reduction that outlasts the next unit's
backward, the reductions still in flight when backward ends, the optimizer step, the all-reduces
of the gradient norm and the loss, a mixture's token all-to-all and the context split's K/V
exchange (they block the layer), and offload traffic (PCIe copies and the host's optimizer step,
levers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from trainer.config import TrainerConfig
from trainer.data import rank_range
from trainer.fsdp.mesh import mesh_shape
from trainer.model import flops_per_token

from .hardware import TREE_NET_LATENCY_US, Hardware
from .layout import Layout, UnitLayout, layout
from .levers import host_step_bytes
from .tokens import context_tokens
from .traffic import all_to_all_bytes, context_bytes, pcie_per_step


@dataclass(frozen=True)
class Collective:
    """One collective of one rank: its time and the links it occupies."""

    op: str
    seconds: float
    links: tuple[str, ...]
    latency_s: float


@dataclass(frozen=True)
class StepTime:
    """One step of rank 0 (the one with the most rows), in seconds."""

    compute_s: float
    """Forward + backward at the device's rate."""
    recompute_s: float
    """Activation checkpointing's recomputed forwards."""
    exposed_s: float
    """Communication the compute waited for: first gathers, stalled gathers and reductions, the
    reductions at the end of backward, the all-reduces of the gradient norm and the loss."""
    exchange_s: float
    """A mixture's token all-to-all and the context split's K/V exchange (blocking)."""
    optimizer_s: float
    """The device's AdamW step (memory-bound); 0 when offloaded (host_step_s)."""
    pcie_s: float
    host_step_s: float
    tokens_per_step: int
    """The global batch's tokens."""
    world_size: int
    link_busy_s: dict = field(default_factory=dict)
    """Seconds each link ("intra", "inter") carried collectives."""
    first_gather_s: float = 0.0
    """Of exposed_s: waiting for each micro-batch's first gathers."""
    tail_s: float = 0.0
    """Of exposed_s: reductions still in flight when the last gradient was computed."""
    state_bytes: int = 0
    """This rank's shard state (master + moments): what a snapshot or a checkpoint copies
    (goodput.py prices it)."""

    @property
    def step_s(self) -> float:
        return (
            self.compute_s
            + self.recompute_s
            + self.exposed_s
            + self.exchange_s
            + self.optimizer_s
            + self.pcie_s
            + self.host_step_s
        )

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.world_size / self.step_s

    def tflops_per_gpu(self, flops_per_token: float) -> float:
        """Model TFLOP/s a GPU (flops_per_token: trainer.model's convention, or another's)."""
        return self.tokens_per_s_per_gpu * flops_per_token / 1e12


# ----------------------------------------------------------------------------- collectives


def spread(n: int, ratio: int, local: int) -> tuple[int, int]:
    """(ranks per node, nodes) of a group of n ranks whose members are every `ratio`-th block of
    the rank order (1: consecutive ranks) on nodes of `local` ranks."""
    per_node = max(1, min(n, local // max(1, ratio)))
    return per_node, max(1, n // per_node)


def collective(op: str, nbytes: int, n: int, ratio: int, hw: Hardware) -> Optional[Collective]:
    """One rank's `op` of `nbytes` (module docstring) over n ranks spread as `spread` says;
    None when there is nothing to send."""
    if n <= 1 or nbytes <= 0:
        return None
    g, nodes = spread(n, ratio, hw.gpus_per_node)
    times = 2 if op == "all_reduce" else 1
    sent = times * nbytes * (n - 1) / n
    intra = sent * (g - 1) / g / (hw.intra.gbs * 1e9) if g > 1 else 0.0
    inter = sent / g / (hw.inter.gbs * 1e9) if nodes > 1 else 0.0
    steps, inter_steps = times * (n - 1), times * (nodes - 1)
    us = hw.base_latency_us + (steps - inter_steps) * hw.intra.step_latency_us
    us += inter_steps * hw.inter.step_latency_us
    if op == "all_reduce" and nodes > 1:  # NCCL's tree, where its latency is lower
        tree = 2 * (
            (g - 1) * hw.intra.step_latency_us + math.ceil(math.log2(nodes)) * TREE_NET_LATENCY_US
        )
        us = min(us, hw.base_latency_us + tree)
    links = tuple(name for name, t in (("intra", intra), ("inter", inter)) if t > 0)
    return Collective(op, us * 1e-6 + max(intra, inter), links, us * 1e-6)


# ----------------------------------------------------------------------------- the units


@dataclass
class _Unit:
    """One engine unit's collectives and compute per token."""

    name: str
    gathers: list  # Collective per group of flats (a mixture's experts have their own)
    again: bool  # gathers again in backward
    reductions: list  # (reduce-scatter or None, all-reduce or None) per group of trainable flats
    fwd_per_token: float  # seconds
    bwd_per_token: float
    recompute_per_token: float


def _units(lay: Layout, cfg: TrainerConfig, hw: Hardware, recompute: float) -> list[_Unit]:
    """The root first, then the forward order; each with its collectives and compute."""
    sh, model, seq = cfg.sharding, cfg.model, cfg.data.seq_len
    head = 6.0 * model.vocab_size * model.dim
    block = (flops_per_token(model, seq) - head) / max(1, model.n_layers)
    per_token = {"block": block, "head": head}
    if not any(u.kind == "head" for u in lay.units):  # tied embeddings: the root's projection
        per_token["root"] = head
    p, r = sh.param_dtype.itemsize, sh.reduce_dtype.itemsize
    out = []
    last = len(lay.units) - 1
    for i, u in enumerate((lay.root, *lay.units)):
        flops = per_token.get(u.kind, 0.0) / hw.flops
        again = i - 1 != last and u.reshard_after_forward and u is not lay.root
        rec = recompute * flops / 3 if u.kind == "block" else 0.0
        out.append(
            _Unit(
                u.name,
                _gathers(u, p, hw),
                again,
                _reductions(u, r, hw),
                flops / 3,
                2 * flops / 3,
                rec,
            )
        )
    return out


def _groups(u: UnitLayout) -> dict[tuple[int, int], list[int]]:
    """The unit's flats by (shard group, replicate group): indexes into its flats."""
    n = len(u.padded)
    shards = u.flat_shard_sizes or (u.shard_size,) * n
    reps = u.flat_replicate_sizes or (u.replicate_size,) * n
    out: dict[tuple[int, int], list[int]] = {}
    for k in range(n):
        out.setdefault((shards[k], reps[k]), []).append(k)
    return out


def _gathers(u: UnitLayout, param_bytes: int, hw: Hardware) -> list:
    out = []
    for (shard, _), flats in _groups(u).items():
        ratio = max(1, u.shard_size // shard)  # expert flats: every E-th block of the group
        c = collective(
            "all_gather", param_bytes * sum(u.padded[k] for k in flats), shard, ratio, hw
        )
        if c is not None:
            out.append(c)
    return out


def _reductions(u: UnitLayout, reduce_bytes: int, hw: Hardware) -> list:
    out = []
    for (shard, reps), flats in _groups(u).items():
        flats = [k for k in flats if u.trainable[k]]
        if not flats:
            continue
        if shard > 1:
            ratio = max(1, u.shard_size // shard)
            rs = collective(
                "reduce_scatter", reduce_bytes * sum(u.padded[k] for k in flats), shard, ratio, hw
            )
            ar = collective(
                "all_reduce", reduce_bytes * sum(u.shard[k] for k in flats), reps, u.shard_size, hw
            )
        else:
            rs = None
            ar = collective(
                "all_reduce", reduce_bytes * sum(u.padded[k] for k in flats), reps, 1, hw
            )
        if rs or ar:
            out.append((rs, ar))
    return out


# ----------------------------------------------------------------------------- the schedule


class _Schedule:
    """The engine's step replayed on a compute lane and one lane per link (one lane for all on
    CPU workers, whose collectives use the compute's cores)."""

    def __init__(self, units: list[_Unit], hw: Hardware, cfg: TrainerConfig):
        sh = cfg.sharding
        self.units, self.overlap = units, hw.device.overlap
        self.forward_k = sh.max_gathers_in_flight if sh.forward_prefetch else 0
        self.backward_k = sh.max_gathers_in_flight if sh.backward_prefetch else 0
        self.bound = sh.max_reductions_in_flight
        self.free = {"compute": 0.0, "intra": 0.0, "inter": 0.0}
        self.busy = {"intra": 0.0, "inter": 0.0}
        self.computed = self.first_gather = self.tail = 0.0

    def _lane(self, link: str) -> str:
        return link if self.overlap else "compute"

    def run(self, c: Optional[Collective], at: float) -> float:
        """Issue `c` at `at`; when it ends."""
        if c is None:
            return at
        lanes = {self._lane(link) for link in c.links}
        end = max([at] + [self.free[lane] for lane in lanes]) + c.seconds
        for lane in lanes:
            self.free[lane] = end
        for link in c.links:
            self.busy[link] += c.seconds
        return end

    def compute(self, seconds: float, ready: float) -> float:
        """Compute for `seconds` once `ready`; when it starts."""
        start = max(self.free["compute"], ready)
        self.free["compute"] = start + seconds
        self.computed += seconds
        return start

    def gather(self, i: int, at: float) -> float:
        return max([at] + [self.run(c, at) for c in self.units[i].gathers])

    def forward(self, tokens: int) -> None:
        ready = {}
        for i, u in enumerate(self.units):
            if i not in ready:
                ready[i] = self.gather(i, self.free["compute"])
            before = self.free["compute"]
            start = self.compute(u.fwd_per_token * tokens, ready[i])
            if i <= 1:  # the root's and the first unit's gathers: nothing to hide behind
                self.first_gather += start - before
            for j in range(i + 1, min(i + 1 + self.forward_k, len(self.units))):
                if j not in ready:
                    ready[j] = self.gather(j, start)

    def backward(self, tokens: int, reduce: bool) -> None:
        order = list(reversed(range(len(self.units))))
        ready, pending, across = {}, [], []
        for pos, i in enumerate(order):
            u = self.units[i]
            if u.again and i not in ready:
                ready[i] = self.gather(i, self.free["compute"])
            start = self.compute(
                (u.recompute_per_token + u.bwd_per_token) * tokens, ready.get(i, 0.0)
            )
            for j in order[pos + 1 : pos + 1 + self.backward_k]:
                if self.units[j].again and j not in ready:
                    ready[j] = self.gather(j, start)
            if reduce and u.reductions:
                while len(pending) >= self.bound:  # the compute stream waits for the oldest
                    self.free["compute"] = max(self.free["compute"], pending.pop(0))
                pending.append(self._reduce(u, across))
        if reduce:
            last = self.free["compute"]
            self.free["compute"] = max([last, *pending, *across])
            self.tail += self.free["compute"] - last

    def _reduce(self, u: _Unit, across: list) -> float:
        """Issue the unit's reductions now; when the one the engine retires ends (its
        reduce-scatter, or NO_SHARD's all-reduce); the all-reduces across replicas go to
        `across`, waited for when backward ends."""
        t, handle = self.free["compute"], self.free["compute"]
        for rs, ar in u.reductions:
            if rs is None:
                handle = max(handle, self.run(ar, t))
                continue
            end = self.run(rs, t)
            handle = max(handle, end)
            across.append(self.run(ar, end))
        return handle


def micro_batch_rows(cfg: TrainerConfig, world_size: int, micro_batches: int) -> list[int]:
    """Rank 0's rows in each micro-batch (its share split as trainer.data.Batcher splits it;
    an empty split runs one sequence)."""
    data = world_size // cfg.train.context_parallel
    lo, hi = rank_range(cfg.train.global_batch_size, data, 0)
    rows = max(1, hi - lo)
    return [max(1, len(s)) for s in np.array_split(np.arange(rows), micro_batches)]


def step_time(
    cfg: TrainerConfig,
    world_size: int,
    hw: Hardware,
    recompute: Optional[float] = None,
    lay: Optional[Layout] = None,
) -> StepTime:
    """The step of `cfg` (its strategy, levers, micro-batches, checkpointing) on `world_size`
    workers of `hw` (whose gpus_per_node is the job's local_world_size). recompute: the
    fraction of each block's forward recomputed (None: all of it with activation checkpointing,
    else none; a published selective checkpointing recomputes about half). lay: the layout
    (None: the engine's on the meta device, as plan() builds it; cached)."""
    sh, cp = cfg.sharding, cfg.train.context_parallel
    ckpt = bool(sh.activation_checkpointing)
    if recompute is None:
        recompute = 1.0 if ckpt else 0.0
    if lay is None:
        lay = layout(
            cfg.model,
            sh,
            world_size,
            hw.gpus_per_node,
            0,
            cfg.optim.state_dtype,
            cp,
            tuple(cfg.train.freeze),
        )
    micro = cfg.train.micro_batches
    sched = _Schedule(_units(lay, cfg, hw, recompute), hw, cfg)
    per_row = context_tokens(cfg.data.seq_len, cp)
    rows = micro_batch_rows(cfg, world_size, micro)
    for m, r in enumerate(rows):
        sched.forward(r * per_row)
        sched.backward(r * per_row, bool(sh.sharded_grad_accumulation) or m == len(rows) - 1)
    tokens = sum(rows) * per_row
    compute = sum(u.fwd_per_token + u.bwd_per_token for u in sched.units) * tokens
    recomputed = sum(u.recompute_per_token for u in sched.units) * tokens
    norm = collective("all_reduce", 4, world_size, 1, hw)  # the gradient norm's; the loss's too
    offloaded = lay.offload != "none"
    pcie = sum(pcie_per_step(lay, sh, micro).values())
    host = _host_step_bytes(lay, cfg) * min(hw.gpus_per_node, world_size) if offloaded else 0
    return StepTime(
        compute_s=compute,
        recompute_s=recomputed,
        exposed_s=sched.free["compute"] - sched.computed + (2 * norm.seconds if norm else 0.0),
        exchange_s=_exchange_s(cfg, world_size, hw, max(rows) * per_row * micro),
        optimizer_s=0.0 if offloaded else _host_step_bytes(lay, cfg) / (hw.device.memory_gbs * 1e9),
        pcie_s=pcie / (hw.pcie_gbs * 1e9),
        host_step_s=host / (hw.host_bandwidth_gbs * 1e9),
        tokens_per_step=cfg.train.global_batch_size * cfg.data.seq_len,
        world_size=world_size,
        link_busy_s=dict(sched.busy),
        first_gather_s=sched.first_gather,
        tail_s=sched.tail,
        state_bytes=lay.shard_state,
    )


def _host_step_bytes(lay: Layout, cfg: TrainerConfig) -> int:
    """What AdamW reads and writes over this rank's shard (levers.host_step_bytes): on the
    device it is the optimizer step's time at its memory bandwidth, offloaded the host's."""
    return host_step_bytes(
        lay.shard_elements,
        lay.grad_elements,
        lay.optim_elements,
        str(cfg.sharding.master_dtype),
        str(cfg.optim.state_dtype),
    )


def _exchange_s(cfg: TrainerConfig, world_size: int, hw: Hardware, tokens: int) -> float:
    """A mixture's all-to-all and the context split's K/V exchange (traffic.py's bytes for this
    rank's `tokens` a step) over their group's link (consecutive ranks: inside a node while the
    group fits in one), not hidden: the layer waits for them."""
    model, sh, cp = cfg.model, cfg.sharding, cfg.train.context_parallel
    ep = mesh_shape(sh, world_size, hw.gpus_per_node, model.moe_experts, cp)["expert"]
    ckpt, p = bool(sh.activation_checkpointing), sh.param_dtype.itemsize
    out = 0.0
    for n, nbytes in (
        (ep, all_to_all_bytes(model, tokens, ep, p, ckpt)),
        (cp, context_bytes(model, tokens, cp, p, ckpt)),
    ):
        if nbytes and n > 1:
            g, nodes = spread(n, 1, hw.gpus_per_node)
            rate = hw.intra.gbs if nodes == 1 else hw.inter.gbs * g
            out += nbytes / (rate * 1e9)
    return out
