"""Bytes one worker sends per optimizer step, by collective, under the engine's own convention.

The engine's Accounting.record_comm is replayed for each collective the schedule issues, so the
numbers are the ones a training step reports (ring algorithms: an all-gather of T output bytes or
a reduce-scatter of T input bytes over N ranks moves T(N-1)/N; an all-reduce twice that).

Each unit by its own placement (sharding.modules may give it another strategy than the mesh's).
Per micro-batch: FULL_SHARD / HYBRID_SHARD units gather in forward and again in backward, but
the root (gathered all step) and the last unit of the forward (kept for the backward that
starts with it); SHARD_GRAD_OP units gather once; NO_SHARD units gather nothing. Once per step,
on the last micro-batch (every micro-batch with sharding.sharded_grad_accumulation): a
reduce-scatter of every flat gradient inside its shard group, then (HYBRID_SHARD) an all-reduce
of the shard across replicas; NO_SHARD all-reduces the whole gradient.

pcie_per_step: the bytes over the worker's own host <-> device link with the optimizer or the
parameters offloaded (levers.py prices them): the gradients down once per reduction, and the
compute copy up once a step (offload=optimizer) or every gather's master slice up
(offload=params, at every use of a unit: also where one rank per shard group makes the gather a
local copy).
"""

from __future__ import annotations

from trainer.config import ShardingConfig
from trainer.fsdp.accounting import Accounting

from .layout import Layout, UnitLayout
from .levers import pcie_bytes_per_step

OPS = ("all_gather", "reduce_scatter", "all_reduce")
"""The engine's collectives; a mixture on the expert axis adds "all_to_all"."""


def bytes_per_step(
    lay: Layout,
    sharding: ShardingConfig,
    micro_batches: int,
    all_to_all: int = 0,
    context: int = 0,
) -> dict[str, int]:
    """Each collective's bytes this worker sends a step; `all_to_all`: a mixture's token
    exchange (all_to_all_bytes), `context`: the context split's K/V exchange (context_bytes),
    given by the planner, which knows the tokens."""
    acct = Accounting()
    p, r = sharding.param_dtype.itemsize, sharding.reduce_dtype.itemsize
    for _ in range(micro_batches):
        for unit in _gathered_per_micro_batch(lay):
            for padded, size in zip(unit.padded, _sizes(unit)[0]):
                acct.record_comm("all_gather", padded * p, size)
    reductions = micro_batches if sharding.sharded_grad_accumulation else 1
    for _ in range(reductions):
        for unit in lay.all_units:
            shards, replicas = _sizes(unit)
            for padded, shard, trainable, size, reps in zip(
                unit.padded, unit.shard, unit.trainable, shards, replicas
            ):
                if not trainable:
                    continue
                if size > 1:
                    acct.record_comm("reduce_scatter", padded * r, size)
                    acct.record_comm("all_reduce", shard * r, reps)
                else:
                    acct.record_comm("all_reduce", padded * r, reps)
    out = {op: acct.comm_bytes.get(op, 0) for op in OPS}
    if all_to_all:
        out["all_to_all"] = all_to_all
    if context:
        out["context"] = context
    return out


def _sizes(unit: UnitLayout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shard group, replicas) of each of the unit's flats (a mixture's experts have their own)."""
    n = len(unit.padded)
    shards = unit.flat_shard_sizes or (unit.shard_size,) * n
    return shards, unit.flat_replicate_sizes or (unit.replicate_size,) * n


def all_to_all_bytes(
    model, tokens: int, expert_parallel: int, param_bytes: int, checkpointing: bool
) -> int:
    """What a worker sends a step in a mixture's token exchange over the expert axis, with the
    routing balanced: each of its `tokens` goes to k experts, (N - 1) / N of those rows to other
    ranks, in each sparse layer, 4 times a step (out and back, forward and backward; 6 with
    activation checkpointing, whose recomputation runs the forward's two again)."""
    if expert_parallel <= 1 or not model.sparse_layers:
        return 0
    passes = 6 if checkpointing else 4
    rows = tokens * model.moe_top_k * (expert_parallel - 1) / expert_parallel
    return int(len(model.sparse_layers) * passes * rows * model.dim * param_bytes)


def pcie_per_step(lay: Layout, sharding: ShardingConfig, micro_batches: int) -> dict[str, int]:
    """{'host_to_device': bytes, 'device_to_host': bytes} of one worker's step."""
    uses = _uses_per_micro_batch(lay)
    return pcie_bytes_per_step(
        lay.offload,
        lay.shard_elements,
        lay.grad_elements,
        sum(sum(u.shard) for u in uses),
        micro_batches=micro_batches,
        reductions=micro_batches if sharding.sharded_grad_accumulation else 1,
        param_dtype=str(sharding.param_dtype),
        master=str(sharding.master_dtype),
        reduce_bytes=sharding.reduce_dtype.itemsize,
    )


def _gathered_per_micro_batch(lay: Layout) -> list[UnitLayout]:
    """Every unit in forward; FULL_SHARD / HYBRID_SHARD units again in backward but the last of
    the forward, which keeps its parameters into the backward that starts with it. A flat with
    one rank per shard group only casts its shard: nothing on the wire (its size is 1)."""
    return [u for u in _uses_per_micro_batch(lay) if any(n > 1 for n in _sizes(u)[0])]


def _uses_per_micro_batch(lay: Layout) -> list[UnitLayout]:
    """The units each micro-batch gathers (or, with one rank per shard group, casts), in order:
    a unit whose backward never runs (a frozen tower, leading frozen blocks) is not gathered
    again for it."""
    again = [u for u in lay.units[:-1] if u.reshard_after_forward and u.backward]
    return [*lay.all_units, *again]


def context_bytes(model, tokens: int, context: int, param_bytes: int, checkpointing: bool) -> int:
    """What a worker sends a step in the context split's K/V exchange (trainer/fsdp/context.py):
    per layer the keys and values of its `tokens` ([tokens, kv_heads, 2 head_dim] in the
    compute dtype) to the N - 1 other ranks of its group, in the forward's all-gather (again in
    the recomputation under activation checkpointing) and the backward's reduce-scatter of
    their gradients (ring collectives: (N - 1) pieces of that size sent)."""
    if context <= 1:
        return 0
    piece = tokens * model.kv_heads * 2 * model.head_size * param_bytes
    passes = 3 if checkpointing else 2
    return int(model.n_layers * passes * (context - 1) * piece)
