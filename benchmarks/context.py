"""Context parallelism on our engine at world size 4 (gloo, the CPU): one sequence of 8,192 tokens
per forward, split over 1, 2 and 4 ranks of the mesh's context axis.

    python -m benchmarks.context --no-ac    # checkpointing on only: ~7 min on 2 busy cores
    python -m benchmarks.context            # on and off: about twice that
    python -m benchmarks.context --quick    # ~1 min: a tiny model at 512 tokens

The model (FULL): a Llama-style decoder, dim 64, 2 layers, 4 heads over 2 key/value heads
(grouped-query: the gathered K/V are the kv heads'), ffn 192, vocab 1024, fp32, FULL_SHARD, built
by trainer/build.py and stepped by trainer/step.py as the loop does (AdamW, lr 3e-4). Small on
purpose: at 8,192 tokens attention is the cost (fwd + bwd ~ dim x T^2; the CPU flash kernel at
dim 256 takes ~5 s a layer on one thread, so dim 256 x 4 layers would be ~40 s a step with four
ranks on two cores); the sequence is the issue's 8k.

The batch: a global batch of 4 sequences of 8,192 tokens (random ids), the same ones for every
contestant. The loop's micro-batch is one sequence: a rank of context degree N reads 4 / (4 / N)
= N sequences as N micro-batches of one sequence each (gradients accumulated under no_sync) and
computes 8192 / N tokens of each. So every contestant trains the same tokens a step and every
rank computes 8,192 token positions a step; what the split changes is the tokens of ONE forward
(8192 / N), hence the activations alive at once. (Two sequences in one micro-batch at cp2 would
hold as many activations as cp1: the split is for the sequence one device cannot hold.)

Contestants, all in one set of 4 ranks: `cp1`, `cp2`, `cp4` (train.context_parallel; world 4:
cp1 is 4 data ranks, cp2 2 data x 2 context, cp4 one data group of 4 context ranks), each with
activation checkpointing on (`_ac`) and off (`_noac`, unless --no-ac). Their losses must agree
(`loss_rel_diff`: the same model, batches and normaliser; tests/fsdp/test_context.py proves it
to 1e-5).

Peak activation memory, per rank: one extra, untimed step under torch.profiler
(profile_memory=True): the torch CPU allocator's live bytes replayed from its allocation events
(benchmarks/engine.py's way); the peak between the first forward's start and the last
backward's end minus the live bytes at the first forward's start. It counts everything the
forward and backward allocate: saved activations, the recomputation under checkpointing, the
logits and loss, the gathered K/V and their gradients, and the engine's
gathered parameters and unsharded gradients (the engine's accounting of those, `acct transient`,
is printed beside it: well under 1 MiB here). Gloo's own buffers are not torch allocations.
These sequences hold no packed documents, so no rank builds an attention mask: a split chunk
attends to its visible prefix and its causal square by two flash attentions merged by their
log-sum-exp (trainer/model/context.py, causal_chunk_attention), as cp1 attends with is_causal.

Timing as benchmarks/engine.py and benchmarks/moe.py do it: contestants alternate inside every
repetition, the first rotating; each step is bracketed by barriers (a step is the slowest
rank's); the first repetition runs `warmup` untimed steps per contestant, later ones one.
Reported: rank 0's median step; ratios paired (per repetition, the ratio of the two medians;
the median over repetitions).

Exposed communication: the engine's accounting (fsdp.acct.exposed_ms() after every timed step:
the compute path's wait on all_gather and reduce_scatter of the parameters and gradients, and
`context`: the K/V all-gather per layer and its reduce-scatter in backward, synchronous, so all
of it); per rank the median over timed steps, the table shows the mean of the 4 ranks. Bytes:
fsdp.acct.comm_bytes["context"] of one step (what each rank sends).

The planner's activation term (issue 37: within 15% of the measured): PLANNER_HOOK below.

Ends with a table and one JSON line (HEADLINE_KEYS and the figures per contestant).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import torch
import torch.distributed as dist
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.ranks import run_ranks
from trainer.build import build
from trainer.config import ModelConfig, OptimConfig, ShardingConfig, TrainerConfig, model_config
from trainer.fsdp import build_mesh
from trainer.model import count_params, initializer
from trainer.step import train_step

SEED, WORLD = 1234, 4
COMM = ("all_gather", "reduce_scatter", "context")
HEADLINE_KEYS = (
    "activation_ratio",
    "step_time_ratio",
    "activation_peak_bytes",
    "step_ms",
    "tokens_per_s",
    "exposed_ms",
    "context_bytes",
    "loss_rel_diff",
    "predicted_activation_bytes",
    "config",
    "params",
)
"""Keys of the final JSON line (tests/benchmarks/test_context_bench.py checks them)."""


@dataclass(frozen=True)
class Bench:
    """The model and the run (plain values: it pickles to the ranks)."""

    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 192
    vocab: int = 1024
    seq: int = 8192
    sequences: int = 4  # the global batch; one sequence per micro-batch
    degrees: tuple = (1, 2, 4)
    checkpointing: tuple = (True, False)
    warmup: int = 1
    steps: int = 1  # timed per contestant per repetition
    reps: int = 3
    lr: float = 3e-4

    def model(self) -> ModelConfig:
        return model_config(
            "tiny", dim=self.dim, n_layers=self.layers, n_heads=self.heads,
            n_kv_heads=self.kv_heads, ffn_dim=self.ffn, vocab_size=self.vocab,
            max_seq_len=self.seq,
        )  # fmt: skip

    def contestants(self) -> list[tuple[str, int, bool]]:
        """(name, context degree, activation checkpointing), checkpointing on first."""
        return [
            (f"cp{n}_{'ac' if ac else 'noac'}", n, ac)
            for ac in self.checkpointing
            for n in self.degrees
        ]

    @property
    def tokens(self) -> int:
        """Tokens of a step, all ranks (the global batch)."""
        return self.sequences * self.seq


FULL = Bench()
QUICK = replace(FULL, dim=32, vocab=256, seq=512, warmup=1, steps=1, reps=2)


# ---- on each rank ------------------------------------------------------------------------------
@dataclass
class Contestant:
    name: str
    degree: int
    fsdp: object
    optimizer: torch.optim.Optimizer
    rows: tuple  # (lo, hi): this rank's sequences of the global batch
    times: list = field(default_factory=list)  # (repetition, seconds) of each timed step
    exposed: list = field(default_factory=list)  # {op: ms} of each timed step
    losses: list = field(default_factory=list)
    context_bytes: int = 0
    done: int = 0


def build_contestant(name: str, degree: int, ac: bool, bench: Bench, rank: int) -> Contestant:
    sharding = ShardingConfig(strategy="FULL_SHARD", activation_checkpointing=ac)
    job = TrainerConfig(model=bench.model(), sharding=sharding, optim=OptimConfig(lr=bench.lr))
    job.train.context_parallel = degree
    mesh = build_mesh(sharding, rank, WORLD, local_world_size=WORLD, context=degree)
    assert mesh.size("context") == degree, mesh.shape
    built = build(job, mesh, "cpu", initializer(SEED))
    per = bench.sequences // mesh.data_size
    rows = (mesh.data_rank * per, (mesh.data_rank + 1) * per)
    return Contestant(name, degree, built.model, built.optimizer, rows)


def global_batch(bench: Bench, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + step)
    return torch.randint(0, bench.vocab, (bench.sequences, bench.seq + 1), generator=g)


def micro_batches(bench: Bench, c: Contestant) -> list:
    """This rank's sequences of the step, one per micro-batch (the whole sequence: the model
    keeps its chunks)."""
    toks = global_batch(bench, c.done)
    lo, hi = c.rows
    return [(toks[r : r + 1, :-1], toks[r : r + 1, 1:], 1.0) for r in range(lo, hi)]


def step(c: Contestant, bench: Bench, phase=None):
    """The loop's step on this contestant's next batch (every contestant sees the same ones)."""
    kwargs = {} if phase is None else dict(phase=phase)
    out = train_step(
        c.fsdp, c.optimizer, micro_batches(bench, c), global_tokens=bench.tokens, grad_clip=1.0,
        world=WORLD, **kwargs,
    )  # fmt: skip
    c.done += 1
    c.losses.append(float(out.loss))
    return out


def timed_step(c: Contestant, bench: Bench, rep: Optional[int]) -> None:
    """Barrier to barrier; recorded under `rep` unless it is None (warmup)."""
    dist.barrier()
    t0 = time.perf_counter()
    step(c, bench)
    dist.barrier()
    seconds = time.perf_counter() - t0
    if rep is None:
        return
    c.times.append((rep, seconds))
    c.exposed.append(c.fsdp.acct.exposed_ms())
    c.context_bytes = int(c.fsdp.acct.comm_bytes.get("context", 0))


PHASE = "bench::"


def _phase(name: str):
    return record_function(PHASE + name)


def activation_peak(prof: profile) -> int:
    """The allocator's live bytes replayed from the trace: the peak between the first forward's
    start and the last backward's end, minus the live bytes at the first forward's start."""
    allocs, ranges = [], []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size))
        elif node.name in (PHASE + "forward", PHASE + "backward"):
            ranges.append((node.start_time_ns, node.end_time_ns))
        stack.extend(node.children)
    start, end = min(s for s, _ in ranges), max(e for _, e in ranges)
    live, base, peak = 0, None, 0
    for t, size in sorted(allocs):
        if t >= start and base is None:
            base = peak = live
        live += size
        if start <= t <= end:
            peak = max(peak, live)
    return peak - (base or 0)


def memory(c: Contestant, bench: Bench) -> dict:
    """One untimed step under the profiler: the activation peak, and the engine's transient
    bytes (gathered parameters, unsharded gradients) at their peak in that step."""
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(c, bench, phase=_phase)
    peak = c.fsdp.acct.peak
    return dict(
        activation_peak_bytes=activation_peak(prof),
        acct_transient_bytes=int(peak["gathered_params"] + peak["unsharded_grads"]),
    )


def bench_rank(rank: int, world: int, bench: Bench) -> dict:
    """Every contestant on this rank: alternating repetitions, then one memory step each."""
    cs = [build_contestant(n, d, ac, bench, rank) for n, d, ac in bench.contestants()]
    for rep in range(bench.reps):
        for c in cs[rep % len(cs) :] + cs[: rep % len(cs)]:
            for _ in range(bench.warmup if rep == 0 else 1):
                timed_step(c, bench, None)
            for _ in range(bench.steps):
                timed_step(c, bench, rep)
    out = {}
    for c in cs:
        losses = list(c.losses)  # before the memory step adds one
        out[c.name] = dict(
            times=c.times, losses=losses, context_bytes=c.context_bytes,
            exposed_ms={op: statistics.median(e.get(op, 0.0) for e in c.exposed) for op in COMM},
            **memory(c, bench),
        )  # fmt: skip
    return out


# ---- the planner -------------------------------------------------------------------------------
def predicted_activation_bytes(bench: Bench, degree: int, checkpointing: bool) -> Optional[int]:
    """PLANNER_HOOK: the planner's activation term per rank for one micro-batch of one sequence
    split over `degree` context ranks (trainer/plan/context.py activation_bytes: fp32, the
    whole logits as train_step's default). None while trainer/plan/ has no such function."""
    try:  # landing beside this benchmark (issue 37's planner part): absent, the hook says so
        from trainer.plan.context import activation_bytes  # noqa: PLC0415
    except ImportError:
        return None
    return activation_bytes(
        bench.model(), rows=1, seq_len=bench.seq, context=degree, checkpointing=checkpointing,
        param_dtype="float32", loss_chunk_tokens=0, device="cpu",
    )  # fmt: skip


# ---- figures -----------------------------------------------------------------------------------
def paired(a: list, b: list) -> float:
    """Median over repetitions of the ratio of a's and b's medians in that repetition."""
    reps = sorted({r for r, _ in a})
    per = [
        statistics.median(s for r, s in a if r == rep)
        / statistics.median(s for r, s in b if r == rep)
        for rep in reps
    ]
    return statistics.median(per)


def figures(ranks: list, bench: Bench) -> dict:
    """The headline from every rank's raw figures (step times: rank 0's, barrier-bracketed)."""
    r0 = ranks[0]
    names = [n for n, _, _ in bench.contestants()]
    step_ms = {n: 1000 * statistics.median(s for _, s in r0[n]["times"]) for n in names}
    act = {n: [r[n]["activation_peak_bytes"] for r in ranks] for n in names}
    ratio, time_ratio, loss_diff, predicted = {}, {}, {}, {}
    for n, degree, ac in bench.contestants():
        base = f"cp1_{'ac' if ac else 'noac'}"
        if degree != 1:  # the worst rank of each over the worst rank of cp1
            ratio[n] = max(act[n]) / max(act[base])
            time_ratio[n] = paired(r0[n]["times"], r0[base]["times"])
            loss_diff[n] = max(
                abs(a - b) / abs(b) for a, b in zip(r0[n]["losses"], r0[base]["losses"])
            )
        p = predicted_activation_bytes(bench, degree, ac)
        if p is not None:
            predicted[n] = dict(bytes=p, over_measured=p / max(act[n]))
    return dict(
        benchmark="context",
        world=WORLD,
        strategy="FULL_SHARD",
        param_dtype="float32",
        config=asdict(bench),
        params=count_params(bench.model()),
        tokens_per_step=bench.tokens,
        tokens_per_forward={n: bench.seq // d for n, d, _ in bench.contestants()},
        activation_peak_bytes=act,
        activation_ratio=ratio,
        step_time_ratio=time_ratio,
        step_ms=step_ms,
        tokens_per_s={n: bench.tokens / (ms / 1000) for n, ms in step_ms.items()},
        exposed_ms={
            n: {op: statistics.fmean(r[n]["exposed_ms"][op] for r in ranks) for op in COMM}
            for n in names
        },
        context_bytes={n: [r[n]["context_bytes"] for r in ranks] for n in names},
        acct_transient_bytes={n: max(r[n]["acct_transient_bytes"] for r in ranks) for n in names},
        loss_rel_diff=loss_diff,
        final_loss={n: r0[n]["losses"][-1] for n in names},
        predicted_activation_bytes=predicted or None,
    )


def table(head: dict, bench: Bench) -> str:
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    lines = [
        f"{'contestant':10} {'tok/fwd':>7} {'act peak MiB (r0/r1/r2/r3)':>27} {'vs cp1':>6} "
        f"{'ms/step':>8} {'vs cp1':>6} {'tok/s':>7} {'exposed ms ag/rs/ctx':>21} "
        f"{'ctx MiB':>8} {'acct tr MiB':>11}"
    ]
    for n, _, _ in bench.contestants():
        act = "/".join(mib(b) for b in head["activation_peak_bytes"][n])
        e = head["exposed_ms"][n]
        exposed = "/".join(f"{e[op]:.1f}" for op in COMM)
        ratio = head["activation_ratio"].get(n)
        t_ratio = head["step_time_ratio"].get(n)
        lines.append(
            f"{n:10} {head['tokens_per_forward'][n]:>7} {act:>27} "
            f"{'' if ratio is None else f'{ratio:.3f}':>6} {head['step_ms'][n]:>8.0f} "
            f"{'' if t_ratio is None else f'{t_ratio:.3f}':>6} {head['tokens_per_s'][n]:>7,.0f} "
            f"{exposed:>21} {mib(max(head['context_bytes'][n])):>8} "
            f"{mib(head['acct_transient_bytes'][n]):>11}"
        )
    lines.append("")
    for ac in bench.checkpointing:
        tag = "ac" if ac else "noac"
        parts = [
            f"cp{d}/cp1 {head['activation_ratio'][f'cp{d}_{tag}']:.3f}"
            for d in bench.degrees
            if d != 1
        ]
        times = [
            f"cp{d}/cp1 {head['step_time_ratio'][f'cp{d}_{tag}']:.3f}"
            for d in bench.degrees
            if d != 1
        ]
        lines.append(
            f"checkpointing {'on ' if ac else 'off'}: activation peak {', '.join(parts)} "
            f"(goal cp2 <= 0.6); paired step time {', '.join(times)}"
        )
    worst = max(head["loss_rel_diff"].values(), default=0.0)
    lines.append(f"losses against cp1 (same batches): max rel diff {worst:.1e}")
    predicted = head["predicted_activation_bytes"]
    if predicted is None:
        lines.append("planner's activation term: not available (PLANNER_HOOK in this file)")
    else:
        for n, p in predicted.items():
            lines.append(
                f"planner {n}: predicted {mib(p['bytes'])} MiB, measured "
                f"{mib(max(head['activation_peak_bytes'][n]))} MiB, predicted/measured "
                f"{p['over_measured']:.3f} (goal within 15%)"
            )
    lines.append(
        "act peak: torch CPU allocator, first forward to last backward, above the bytes live "
        "before it (one sequence per forward); exposed: the engine's wait per step (mean of "
        "ranks); ctx MiB: K/V bytes a rank sends a step; acct tr: the engine's gathered params "
        "+ unsharded grads at their peak."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model at 512 tokens (~10 s)")
    p.add_argument("--reps", type=int, help="repetitions (default: the run's)")
    p.add_argument("--no-ac", action="store_true", help="checkpointing on only (no _noac rows)")
    args = p.parse_args(argv)
    bench = QUICK if args.quick else FULL
    if args.reps:
        bench = replace(bench, reps=args.reps)
    if args.no_ac:
        bench = replace(bench, checkpointing=(True,))
    t0 = time.perf_counter()
    ranks = run_ranks(bench_rank, WORLD, bench, timeout=1800)
    head = figures(ranks, bench)
    head["elapsed_s"] = time.perf_counter() - t0
    print(table(head, bench))
    print(json.dumps(head), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
