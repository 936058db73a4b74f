"""Why the planner's answer is the answer, and what failures cost it, in the lines
`python -m cluster.plan` prints under `recommended:`.

    print(format_why(best, opts, hw))          # 'why: HYBRID_SHARD, shard groups of 256: ...'
    print(format_goodput(goodput_table(...), best.time, recovery))   # intervals and the table

The mesh's words come from where its collectives run (steptime.spread: a group inside a node is
on NVLink, one across nodes in rings over the network); the comparison is with the fastest
configuration of another mesh that fits (FULL_SHARD, unless the answer is FULL_SHARD).
"""

from __future__ import annotations

import math

from .choose import TIE_FRACTION, Option
from .goodput import FAILURES_PER_GPU_HOUR, SENSITIVITY, Recovery, Row
from .hardware import Hardware
from .steptime import StepTime, spread


def mesh_name(o: Option) -> str:
    p = o.plan
    if o.hybrid_group:
        return f"HYBRID_SHARD, shard groups of {o.hybrid_group:,}"
    return f"{p.strategy} over {p.world_size:,} ranks"


def where_gathers_go(o: Option, hw: Hardware) -> str:
    """Where the parameter gathers run and over how many ring steps."""
    p = o.plan
    if p.strategy == "NO_SHARD":
        return "no gathers, the whole gradient all-reduced"
    group = o.hybrid_group or p.world_size
    per_node, nodes = spread(group, 1, hw.gpus_per_node)
    if nodes == 1:
        where = f"parameter gathers stay on {hw.intra.name}"
    else:
        where = f"gathers in rings of {group:,} across {nodes:,} nodes ({hw.inter.name})"
    if o.hybrid_group:
        replicas = p.world_size // o.hybrid_group
        where += f", gradient shards all-reduced across {replicas:,} replicas"
    return where


def rival(best: Option, opts: list[Option]) -> Option | None:
    """The fastest fitting configuration of another mesh: FULL_SHARD's, unless best is."""
    fitting = [o for o in opts if o.fits and _mesh(o) != _mesh(best)]
    full = [o for o in fitting if o.plan.strategy == "FULL_SHARD"]
    pool = full if best.plan.strategy != "FULL_SHARD" and full else fitting
    return min(pool, key=lambda o: o.step_s, default=None)


def _mesh(o: Option) -> tuple:
    return (o.plan.strategy, o.hybrid_group)


def format_why(best: Option, opts: list[Option], hw: Hardware) -> str:
    """One line: the mesh, where its collectives go, how much of the step they expose, and its
    tokens/s against the fastest other mesh that fits."""
    t, p = best.time, best.plan
    exposed = (t.step_s - t.compute_s - t.recompute_s) / t.step_s
    line = (
        f"why: {mesh_name(best)}: {where_gathers_go(best, hw)}; {1 - exposed:.0%} of the "
        f"step computes ({t.tokens_per_s_per_gpu:,.0f} tokens/s a GPU)"
    )
    other = rival(best, opts)
    if other is None:
        return line + "; no other mesh fits"
    ratio = t.tokens_per_s_per_gpu / other.time.tokens_per_s_per_gpu
    line += f"; {ratio:.3f}x {short_name(other)}'s tokens/s at {p.world_size:,} GPUs"
    fastest = min((o for o in opts if o.fits), key=lambda o: o.step_s)
    if best.step_s > fastest.step_s:
        what = " ".join(fastest.levers) or "no lever"
        line += (
            f" (the fastest, {short_name(fastest)} with {what}, is "
            f"{best.step_s / fastest.step_s - 1:.2%} quicker: a tie, the rule keeps the milder)"
        )
    elif ratio < 1 + TIE_FRACTION:
        line += f" (within {TIE_FRACTION:.0%}: as fast, to the model's error)"
    return line


def short_name(o: Option) -> str:
    """FULL_SHARD, HYBRID_SHARD (groups of 32)."""
    groups = f" (groups of {o.hybrid_group:,})" if o.hybrid_group else ""
    return o.plan.strategy + groups


def format_goodput(rows: list[Row], t: StepTime, recovery: Recovery, chosen: int = 0) -> str:
    """The intervals picked for rows[chosen] (the configuration's own protection), its goodput
    and tokens a day, then the table of every variant (and the SENSITIVITY columns)."""
    g, tokens = rows[chosen].goodput, t.tokens_per_step
    rate = recovery.failures_per_gpu_hour
    source = " (Llama 3: 419 in 54 days on 16,384 H100)" if rate == FAILURES_PER_GPU_HOUR else ""
    snap = (
        f"in-memory snapshot every {g.snapshot_every:,} step{'s' if g.snapshot_every > 1 else ''}"
        f" ({_s(g.snapshot_every * g.step_s)}; Young/Daly {_s(g.young_daly_snapshot_s)})"
        if g.snapshot_every
        else "no in-memory snapshots"
    )
    extra = "".join(f" {'goodput, ' + name:>24}" for name, _ in SENSITIVITY)
    lines = [
        f"goodput: {rate:.3g} failures a GPU-hour{source}: one every {g.mtbf_s / 3600:.1f} h on "
        f"{t.world_size:,} GPUs; {snap}, durable checkpoint every {g.checkpoint_every:,} steps "
        f"({_s(g.checkpoint_every * g.step_s)}; Young/Daly {_s(g.young_daly_checkpoint_s)}); "
        f"expected goodput {g.goodput:.2%}, {g.tokens_per_day(tokens) / 1e9:,.2f}B tokens a day "
        f"({rows[chosen].label})",
        f"  {'protection':<46} {'snapshot':>9} {'checkpoint':>10} {'lost/failure':>12} "
        f"{'goodput':>8} {'tokens/day':>11}{extra}",
    ]
    for row in rows:
        v = row.goodput
        others = "".join(f" {c.goodput:>24.2%}" for c in row.columns)
        lines.append(
            f"  {row.label:<46} {v.snapshot_every or '-':>9} {v.checkpoint_every:>10,} "
            f"{_s(v.lost_per_failure_s):>12} {v.goodput:>8.2%} "
            f"{v.tokens_per_day(tokens) / 1e9:>10,.2f}B{others}"
        )
    return "\n".join(lines)


def _s(seconds: float) -> str:
    """12 s, 4.2 min, 3.1 h."""
    if math.isinf(seconds):
        return "never"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
