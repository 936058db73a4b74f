"""Human-readable plan and recommendation. Memory in GiB (2^30, as devices report it), or MiB for
small models; bytes on the wire in GB (10^9, as link bandwidths are quoted), or MB."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .planner import MemoryPlan

GiB, MiB = 2**30, 2**20
WIDTH = 40


def format_plan(p: "MemoryPlan") -> str:
    peak, tl = p.peak_phase, p.timeline
    unit, name = (GiB, "GiB") if p.total >= GiB else (MiB, "MiB")

    def size(n: int) -> str:
        return f"{n / unit:.2f}"

    rows = [
        ("sharded parameters (fp32)", p.sharded_params, p.sharded_params),
        ("sharded gradients (fp32)", peak.sharded_grads, tl.max_of("sharded_grads")),
        ("optimizer state (AdamW, fp32)", p.optim_state, p.optim_state),
        (
            f"gathered parameters ({p.param_dtype})",
            peak.gathered_params,
            tl.max_of("gathered_params"),
        ),
        (
            f"unsharded gradients ({p.reduce_dtype})",
            peak.unsharded_grads,
            tl.max_of("unsharded_grads"),
        ),
        ("communication buffers", peak.comm_buffers, tl.max_of("comm_buffers")),
        ("activations: blocks", peak.block_activations, tl.max_of("block_activations")),
        (
            "activations: embedding, logits, loss",
            peak.root_activations,
            tl.max_of("root_activations"),
        ),
    ]
    ckpt = "on" if p.activation_checkpointing else "off"
    replicas = f"{p.replicate_size} replica{'s' if p.replicate_size > 1 else ''}"
    lines = [
        f"Memory plan per worker: model {p.model} ({_count(p.num_params)} parameters; "
        f"units: {_units(p.unit_kinds)})",
        f"  {p.strategy} on {p.world_size} workers (shard group {p.shard_size} x {replicas}); "
        f"params {p.param_dtype}, reduce {p.reduce_dtype}",
        f"  micro-batch {p.rows} x {p.seq_len} tokens, {p.micro_batches} per step; "
        f"activation checkpointing {ckpt}",
        "",
        f"  {name:<{WIDTH}} {'at peak':>10} {'step max':>10}",
    ]
    lines += [f"  {label:{WIDTH}} {size(at):>10} {size(mx):>10}" for label, at, mx in rows]
    lines.append("  " + "-" * (WIDTH + 22))
    lines.append(f"  {'peak, during ' + peak.name:{WIDTH}} {size(p.total):>10}   {_verdict(p)}")
    lines.append("")
    if p.host_state:
        lines.append(
            f"  host memory (optimizer offloaded: fp32 master, gradients, AdamW state): "
            f"{_mem(p.host_state)}"
        )
    if p.snapshot_host:
        lines.append(
            f"  host memory for in-memory snapshots (train.snapshot_every): "
            f"{_mem(p.snapshot_host)} per worker (a staging copy of its shard state and its "
            "share of the keepers' 2 copies x 2 generations)"
        )
    lines.append(
        f"  activations alone at their peak: {_mem(p.activations_without_checkpointing)} without "
        f"checkpointing, {_mem(p.activations_with_checkpointing)} with"
    )
    moved = ", ".join(f"{op.replace('_', '-')} {_wire(b)}" for op, b in p.bytes_moved.items() if b)
    lines.append(
        f"  sent per step per worker: {_wire(p.total_bytes_moved)}"
        + (f" ({moved})" if moved else "")
    )
    return "\n".join(lines)


def format_recommendation(options: list["MemoryPlan"], configured: "MemoryPlan") -> str:
    head = (
        f"On {configured.world_size} workers of {_mem(configured.device_memory_bytes)} "
        f"(params {configured.param_dtype}, reduce {configured.reduce_dtype}, "
        f"micro-batch {configured.rows} x {configured.seq_len}):"
    )
    if not options:
        return (
            f"{head}\n  nothing fits. Valid: more workers, sharding.param_dtype=bfloat16,\n"
            "  sharding.reduce_dtype=bfloat16, fewer sequences per micro-batch (a larger\n"
            "  train.micro_batches) or a shorter data.seq_len."
        )
    first = options[0]
    lines = [
        head,
        f"  recommended: {first.label()} ({_mem(first.total)} peak, "
        f"{_wire(first.total_bytes_moved)} sent per step)",
    ]
    lines += [
        f"  also fits:   {o.label()} ({_mem(o.total)}, {_wire(o.total_bytes_moved)})"
        for o in options[1:]
    ]
    return "\n".join(lines)


def _units(kinds: tuple) -> str:
    """('embedding', 'block', 'block', 'head') -> 'embedding, 2 blocks, head'."""
    out = []
    for kind in dict.fromkeys(kinds):
        n = kinds.count(kind)
        out.append(f"{n} {kind}s" if n > 1 else kind)
    return ", ".join(out)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _mem(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def _wire(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _verdict(p: "MemoryPlan") -> str:
    of = f"of {_mem(p.device_memory_bytes)}"
    if p.fits:
        return f"{of}: fits ({_mem(p.device_memory_bytes - p.total)} free)"
    return f"{of}: DOES NOT FIT (short by {_mem(p.total - p.device_memory_bytes)})"
