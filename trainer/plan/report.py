"""Human-readable plan and recommendation. Memory in GiB (2^30, as devices report it), or MiB for
small models; bytes on the wire in GB (10^9, as link bandwidths are quoted), or MB.

Below the step's rows and its peak, the device's memory less the headroom (headroom.py) gives
what is usable for tensors, and the verdict is against that; a plan without headroom
(headroom=False) is judged against the whole device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .headroom import FRAGMENTATION_FLOOR_BYTES, FRAGMENTATION_FRACTION
from .levers import BYTES

if TYPE_CHECKING:
    from .choose import Option
    from .hardware import Hardware
    from .planner import MemoryPlan

GiB, MiB = 2**30, 2**20
WIDTH = 48


def format_plan(p: "MemoryPlan") -> str:
    peak, tl = p.peak_phase, p.timeline
    unit, name = (GiB, "GiB") if p.total >= GiB else (MiB, "MiB")

    def size(n: int) -> str:
        return f"{n / unit:.2f}"

    params = {
        "none": f"sharded parameters ({_short(p.master_dtype)})",
        "optimizer": f"sharded parameters ({_short(p.param_dtype)} copy; master on host)",
        "params": "sharded parameters (on the host)",
    }[p.offload_level]
    state = f"optimizer state (AdamW, {_short(p.state_dtype)}"
    state += f" + {p.master_rounding})" if _compensates(p) else ")"
    rows = [
        (params, p.sharded_params, p.sharded_params),
        (
            f"sharded gradients ({_short(p.master_dtype)})",
            peak.sharded_grads,
            tl.max_of("sharded_grads"),
        ),
        (state, p.optim_state, p.optim_state),
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
        *_experts_line(p),
        *_frozen_lines(p),
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
        of = f"of {mem(p.device_memory_bytes)}: "
        lines.append(
            f"  {'peak, during ' + peak.name:{WIDTH}} {size(p.total):>10}   {of}{_verdict(p)}"
        )
    lines.append("")
    if p.host_state:
        what = "optimizer" if p.offload_level == "optimizer" else "parameters and optimizer"
        lines.append(
            f"  host memory ({what} offloaded: master, gradients, AdamW state): "
            f"{mem(p.host_state)}, + {mem(p.host_staging)} pinned gradient staging"
        )
        lines.append(
            f"  over PCIe per step: {_wire(p.pcie['host_to_device'])} host to device, "
            f"{_wire(p.pcie['device_to_host'])} device to host"
        )
    if p.snapshot_host:
        lines.append(
            f"  host memory for in-memory snapshots (train.snapshot_every): "
            f"{mem(p.snapshot_host)} per worker (a staging copy of its shard state and its "
            "share of the keepers' 2 copies x 2 generations)"
        )
    lines.append(
        f"  activations alone at their peak: {mem(p.activations_without_checkpointing)} without "
        f"checkpointing, {mem(p.activations_with_checkpointing)} with"
    )
    if p.host_memory_bytes is not None:
        verdict = "fits" if p.fits_host else "DOES NOT FIT"
        lines.append(
            f"  host memory per node: {p.workers_per_node} workers x "
            f"{mem(p.host_per_worker)} = {mem(p.host_per_node)} of "
            f"{mem(p.host_memory_bytes)}: {verdict}"
        )
    moved = ", ".join(f"{op.replace('_', '-')} {_wire(b)}" for op, b in p.bytes_moved.items() if b)
    lines.append(
        f"  sent per step per worker: {_wire(p.total_bytes_moved)}"
        + (f" ({moved})" if moved else "")
    )
    return "\n".join(lines)


def _frozen_lines(p) -> list[str]:
    """train.freeze, and a vision tower's input (what its activations were priced at)."""
    out = []
    if p.frozen_params:
        out.append(
            f"  frozen (train.freeze): {_count(p.frozen_params)} of {_count(p.num_params)} "
            "parameters: no gradient, no AdamW state, no reduce-scatter for them"
        )
    if p.image_patches:
        out.append(
            f"  vision tower: {p.image_patches:,} patches a micro-batch (every token an image "
            f"token), keeping {mem(p.tower_activations)} for its backward (in the "
            "activations' rows)"
        )
    return out


def _experts_line(p) -> list[str]:
    """A mixture of experts: active parameters, experts a worker holds, the token exchange."""
    if not p.experts_per_rank:
        return []
    a2a = p.bytes_moved.get("all_to_all", 0)
    exchange = f"; all-to-all {_wire(a2a)} a step (balanced routing)" if a2a else ""
    return [
        f"  mixture of experts: {_count(p.active_params)} of the {_count(p.num_params)} active "
        f"a token; {p.experts_per_rank} experts of every sparse layer on each worker{exchange}; "
        f"routers {mem(p.router_activations)} of the activations (logits, probabilities, "
        "top-k of every sparse layer)"
    ]


def format_recommendation(options: list["MemoryPlan"], configured: "MemoryPlan") -> str:
    """Each option's peak against the memory usable for tensors: the device's less that option's
    headroom (its NCCL communicators and fragmentation margin differ)."""
    head = (
        f"On {configured.world_size} workers of {mem(configured.device_memory_bytes)} "
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
            "  train.micro_batches), a shorter data.seq_len, or the memory levers\n"
            "  optim.state_dtype, sharding.master_dtype and sharding.offload\n"
            "  (python -m cluster.plan lists them)."
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
        return f"the device's {mem(p.device_memory_bytes)}"
    return (
        f"the {mem(p.usable)} usable for tensors of the device's {mem(p.device_memory_bytes)} "
        f"(less {mem(p.headroom.total)} for the CUDA context, NCCL buffers and fragmentation)"
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
        return f"{mem(o.total)} peak"
    return f"{mem(o.total)} peak of {mem(o.usable)} usable"


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(str(dtype), str(dtype))


def _compensates(p: "MemoryPlan") -> bool:
    return p.master_dtype != "float32" and BYTES["compensation"].get(p.master_rounding, 0) > 0


def _units(kinds: tuple) -> str:
    """('embedding', 'block', 'block', 'head') -> 'embedding, 2 blocks, head'."""
    out = []
    for kind in dict.fromkeys(kinds):
        n = kinds.count(kind)
        out.append(f"{n} {kind}s" if n > 1 else kind)
    return ", ".join(out)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def mem(n: int) -> str:
    """Bytes as memory is reported: GiB (2^30), or MiB below one GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def duration(seconds: float) -> str:
    """A step time: 29.14 s, 577 ms, 1.27 ms."""
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _wire(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _verdict(p: "MemoryPlan") -> str:
    """The peak against the usable memory (the whole device without headroom)."""
    if p.fits:
        return f"fits ({mem(p.usable - p.total)} free)"
    return f"DOES NOT FIT (short by {mem(p.total - p.usable)})"


def format_options(opts: list["Option"], rows: list["Option"], hw: "Hardware") -> str:
    """The table: a row per option of `rows` (choose.best_per_levers: one per combination of the
    device's memory levers; cluster/plan.py puts the answer first) with its strategy, device and
    host memory per worker, the bytes over PCIe and the step-time estimate. `opts` is
    choose.options' whole list."""
    first = opts[0].plan
    host = "" if first.host_memory_bytes is None else f", {mem(first.host_memory_bytes)} host"
    unit, name = (GiB, "GiB") if max(o.plan.total for o in rows) >= GiB else (MiB, "MiB")
    lines = [
        f"Memory levers on {first.world_size} workers of {mem(first.device_memory_bytes)}"
        f"{host} per node of {first.workers_per_node} workers (micro-batches of "
        f"{first.seq_len} tokens); step time on {hw.describe()}, PCIe {hw.pcie_gbs:g} GB/s, "
        f"host memory {hw.host_bandwidth_gbs:g} GB/s per node:",
        "",
        f"  {'levers':<58} {'strategy':<13} {'ckpt':>4} {'micro':>5} {'device':>15} "
        f"{'host/worker':>11} {'host/node':>10} {'PCIe/step':>9} {'step':>9}  verdict",
    ]
    for o in rows:
        p = o.plan
        micro = f"{p.micro_batches}{'s' if p.sharded_grad_accumulation else ''}"
        device = f"{_fig(p.total / unit)}+{_fig(p.headroom.total / unit)}"
        lines.append(
            f"  {_lever_names(o):<58} {_mesh(o):<13} "
            f"{'on' if p.activation_checkpointing else 'off':>4} {micro:>5} {device:>15} "
            f"{_fig(p.host_per_worker / GiB):>11} {_fig(p.host_per_node / GiB):>10} "
            f"{p.pcie_bytes / 1e9:>8.1f}G {duration(o.step_s):>9}  {_fit_word(o)}"
        )
    n_fit = sum(o.fits for o in opts)
    lines += [
        "",
        f"  device: the step's peak + headroom (CUDA context, NCCL, fragmentation), {name}; host "
        "in GiB; micro: micro-batches per step (s: sharded gradient accumulation);",
        "  a row is a combination of the device's memory levers, with its fastest strategy, "
        "checkpointing and micro-batches that fit (else the nearest to fitting); the "
        "recommendation's row comes first;",
        f"  no snapshots only where the host needs it; {n_fit} of {len(opts)} configurations fit.",
    ]
    return "\n".join(lines)


def _mesh(o: "Option") -> str:
    """The strategy, HYBRID_SHARD with its shard group: HYBRID/32."""
    return f"HYBRID/{o.hybrid_group}" if o.hybrid_group else o.plan.strategy


def _lever_names(o: "Option") -> str:
    p = o.plan
    names = []
    if p.state_dtype != "float32":
        names.append(f"{_short(p.state_dtype)} moments")
    if p.master_dtype != "float32":
        names.append(f"{_short(p.master_dtype)} master")
    if p.offload_level != "none":
        names.append(f"offload={p.offload_level}")
    if o.snapshots_off:
        names.append("no snapshots")
    return ", ".join(names) or "none"


def _fit_word(o: "Option") -> str:
    if o.fits:
        return "fits"
    short = [w for w, ok in (("device", o.plan.fits), ("host", o.plan.fits_host)) if not ok]
    return "over on " + " and ".join(short)


def _fig(x: float) -> str:
    """About three significant figures: 0.08, 12.4, 464.7, 1067."""
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"
