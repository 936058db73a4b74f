"""The planner's one answer in words: the line that says what to set and why, and, where nothing
fits, the error line that says so and names the closest configuration.

    opts = options(cfg, 8, 80 * 2**30, strategies=strategies(cfg, 8, 8))
    best = choose(opts)
    print(format_answer(best, opts, plan(cfg, 8, 80 * 2**30)))  # 'recommended: sharding...'
    print(format_nothing_fits(opts))                             # 'error: nothing fits on ...'

The rule is choose.py's (CHOICE_RULE): the line quotes it, so what is printed and what is chosen
cannot drift apart.
"""

from __future__ import annotations

from .choose import CHOICE_RULE, Option, closest
from .planner import MemoryPlan
from .report import duration, mem


def format_answer(best: Option, opts: list[Option], configured: MemoryPlan) -> str:
    """One line: the overrides to set, the answer's peak against its usable memory (and its
    node's host memory against the host's), its predicted step time and the rule that chose it."""
    p = best.plan
    same = " (the job as configured)" if p == configured and not best.snapshots_off else ""
    host = (
        ""
        if p.host_memory_bytes is None
        else f", host {mem(p.host_per_node)} of {mem(p.host_memory_bytes)} a node"
    )
    n_fit = sum(o.fits for o in opts)
    return (
        f"recommended: {' '.join(best.overrides)}{same}  ({mem(p.total)} peak of "
        f"{mem(p.usable)} usable{host}, ~{duration(best.step_s)} a step; {n_fit} of {len(opts)} "
        f"configurations fit; the rule: {CHOICE_RULE})"
    )


def format_nothing_fits(opts: list[Option]) -> str:
    """One line for stderr: nothing of `opts` (choose.options' whole list) fits; what the closest
    needs and what would make room."""
    near = closest(opts)
    if near is None:
        return "error: nothing to plan: no configuration"
    p = near.plan
    short = []
    if not p.fits and p.usable <= 0:
        short.append(
            f"{mem(p.total)} peak on a device whose headroom alone ({mem(p.headroom.total)}: "
            "CUDA context, NCCL buffers, fragmentation margin) is more than its memory"
        )
    elif not p.fits:
        short.append(
            f"{mem(p.total)} peak of {mem(p.usable)} usable for tensors (short by "
            f"{mem(p.total - p.usable)})"
        )
    if not p.fits_host:
        short.append(
            f"host {p.workers_per_node} x {mem(p.host_per_worker)} = {mem(p.host_per_node)} a "
            f"node of {mem(p.host_memory_bytes)} (over on host by "
            f"{mem(p.host_per_node - p.host_memory_bytes)})"
        )
    workers = f"{p.world_size} worker{'s' if p.world_size > 1 else ''}"
    return (
        f"error: nothing fits on {workers} of {mem(p.device_memory_bytes)}: the job as "
        f"configured does not, nor does any of the {len(opts)} configurations of strategy, "
        f"activation checkpointing, micro-batches and memory levers; the closest, "
        f"{' '.join(near.overrides)}, needs {' and '.join(short)}; valid: more workers "
        "(cluster.num_workers), more device memory (device_memory_gb) or host memory "
        "(host_memory_gb), fewer sequences per worker (train.global_batch_size) or a shorter "
        "data.seq_len"
    )
