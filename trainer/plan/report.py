"""Human-readable plan and recommendation. Memory in GiB (2^30, as devices report it), or MiB for
small models; bytes on the wire in GB (10^9, as link bandwidths are quoted), or MB.

Below the step's rows and its peak, the device's memory less the headroom (headroom.py) gives
what is usable for tensors, and the verdict is against that; a plan without headroom
(headroom=False) is judged against the whole device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .headroom import FRAGMENTATION_FLOOR_BYTES, FRAGMENTATION_FRACTION

if TYPE_CHECKING:
    from .planner import MemoryPlan

GiB, MiB = 2**30, 2**20
WIDTH = 48


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
    if p.headroom.total:
        lines.append(f"  {'peak, during ' + peak.name:{WIDTH}} {size(p.total):>10}")
        lines.append("")
        lines += [f"  {label:{WIDTH}} {size(n):>10}" for label, n in _usable_rows(p)]
        lines[-1] += f"   {_verdict(p)}"
    else:
        of = f"of {_mem(p.device_memory_bytes)}: "
        lines.append(
            f"  {'peak, during ' + peak.name:{WIDTH}} {size(p.total):>10}   {of}{_verdict(p)}"
        )
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
    """Each option's peak against the memory usable for tensors: the device's less that option's
    headroom (its NCCL communicators and fragmentation margin differ)."""
    head = (
        f"On {configured.world_size} workers of {_mem(configured.device_memory_bytes)} "
        f"(params {configured.param_dtype}, reduce {configured.reduce_dtype}, "
        f"micro-batch {configured.rows} x {configured.seq_len}):"
    )
    if not options:
        where = (
            " in the memory usable for tensors (the device's less the CUDA context,\n  NCCL "
            "buffers and fragmentation margin)"
            if configured.headroom.total
            else ""
        )
        return (
            f"{head}\n  nothing fits{where}. Valid: more workers, sharding.param_dtype=bfloat16,\n"
            "  sharding.reduce_dtype=bfloat16, fewer sequences per micro-batch (a larger\n"
            "  train.micro_batches) or a shorter data.seq_len."
        )
    first = options[0]
    lines = [
        head,
        f"  recommended: {first.label()} ({_peak_of(first)}, "
        f"{_wire(first.total_bytes_moved)} sent per step)",
    ]
    lines += [
        f"  also fits:   {o.label()} ({_peak_of(o)}, {_wire(o.total_bytes_moved)})"
        for o in options[1:]
    ]
    return "\n".join(lines)


def usable_memory(p: "MemoryPlan") -> str:
    """What the plan's peak must fit in, for an error message."""
    if not p.headroom.total:
        return f"the device's {_mem(p.device_memory_bytes)}"
    return (
        f"the {_mem(p.usable)} usable for tensors of the device's {_mem(p.device_memory_bytes)} "
        f"(less {_mem(p.headroom.total)} for the CUDA context, NCCL buffers and fragmentation)"
    )


def _usable_rows(p: "MemoryPlan") -> list[tuple[str, int]]:
    """The device's memory, each reserved term, and what is left for tensors."""
    h = p.headroom
    s = "" if h.nccl_communicators == 1 else "s"
    rule = (
        f"floor {FRAGMENTATION_FLOOR_BYTES / GiB:g} GiB"
        if h.fragmentation_at_floor
        else f"{FRAGMENTATION_FRACTION:.0%} of peak"
    )
    return [
        ("device memory", p.device_memory_bytes),
        ("- CUDA context and kernels", h.cuda_context),
        (f"- NCCL buffers ({h.nccl_communicators} communicator{s})", h.nccl_buffers),
        (f"- allocator fragmentation margin ({rule})", h.fragmentation),
        ("= usable for tensors", p.usable),
    ]


def _peak_of(o: "MemoryPlan") -> str:
    if not o.headroom.total:
        return f"{_mem(o.total)} peak"
    return f"{_mem(o.total)} peak of {_mem(o.usable)} usable"


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
    """The peak against the usable memory (the whole device without headroom)."""
    if p.fits:
        return f"fits ({_mem(p.usable - p.total)} free)"
    return f"DOES NOT FIT (short by {_mem(p.total - p.usable)})"
