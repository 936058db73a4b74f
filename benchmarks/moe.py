"""A mixture of experts on our engine at world size 2 (gloo, the CPU): the experts over the
expert axis against not, and the mixture against the dense model of its active parameters.

    python -m benchmarks.moe            # ~50 s on 2 cores (2 ranks of one thread)
    python -m benchmarks.moe --quick    # ~10 s: the smoke test's run

The model (FULL): a Llama-style decoder, dim 256, 4 layers, 4 heads, vocab 256, every layer
sparse with 8 experts of width 384, top-2, router_aux_loss_coef 0.01; per rank 4 rows of 256
tokens a step (2,048 tokens a step in all), fp32, FULL_SHARD, built by trainer/build.py and
stepped by trainer/step.py as the loop does, AdamW at lr 0 (--lr to change it): the optimizer
does all its work but the weights stay put, so the routing keeps its initial spread (the
busiest expert of the worst layer about 2x the mean; printed under the table). On these random
tokens a fresh router learns at lr 1e-3 within ten steps to send nearly every token to one
expert (4x the mean at top-2 of 8; at lr 1e-4, 3x by step 15): that would time a collapsed
router, one rank doing the experts' work, not the expert axis.

Contestants, all in one pair of ranks, trained on the same batches:
- moe_ep1: the mixture, sharding.expert_parallel=1: every unit's flat parameters, the experts'
  included, sharded over both ranks; all-gathered for forward and backward, gradients
  reduce-scattered;
- moe_ep2: the same with expert_parallel=2: each rank keeps 4 whole experts per layer (never
  gathered) and the tokens travel to them and back by all-to-all (trainer/fsdp/experts.py);
  its losses must equal moe_ep1's (the same model and batches: `loss_rel_diff_ep2_vs_ep1`);
- dense: the dense model of the same ACTIVE parameters (ffn_dim = top_k x expert width = 768,
  same dim, layers and heads; the routers are the only difference).

Timing as benchmarks/engine.py does it: contestants alternate inside every repetition, the
first rotating; each step is bracketed by barriers (a step is the slowest rank's); the first
repetition runs `warmup` untimed steps per contestant, later ones one. Reported: medians of the
timed steps; the headline ratios are paired (per repetition, the ratio of the two contestants'
medians; the median over repetitions). Below 1: the first is faster.

All-to-all wait: the engine's accounting (comm/exposed_all_to_all_ms of FSDPModel.metrics, read
after every timed step): the wall time each rank spends inside dist.all_to_all_single of the
token rows, forward and backward (gloo runs it synchronously, so this includes waiting for the
other rank to arrive). The small exchange of the routing counts and its host read that precede
each layer's token exchange are not in it. Per rank, the median over the timed steps; the
headline is the mean of the two ranks', in ms and as a fraction of the step. `exposed` is the
engine's comm/exposed_ms: every collective's wait (gathers, reductions and the all-to-all).

Memory, per rank, two ways: `acct` the engine's accounting (peak of its own bytes in a step:
parameter and gradient shards, gathered parameters, optimizer state; no activations); `torch`
the torch CPU allocator (bytes held between steps, shards and AdamW state, plus the high-water
of what one extra, untimed step allocates, from torch.profiler's memory events, as
benchmarks/engine.py). Process RSS is not used: the contestants share each process.

The experts' matmul on this CPU (`grouped_mm`): whether torch._grouped_mm runs here
(trainer.model.moe.grouped_mm_ok, the path training takes) and the expert SwiGLU's forward +
backward over one rank's routed rows, grouped against the loop (benchmarks/gpu_moe.py's
time_experts, fp32, one thread), before the ranks start.

Ends with a table and one JSON line (HEADLINE_KEYS and the figures per contestant).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine import allocation_high_water, held_bytes, optimizer_tensors
from benchmarks.gpu_moe import ExpertShape, time_experts
from benchmarks.ranks import run_ranks
from trainer.build import build
from trainer.config import ModelConfig, OptimConfig, ShardingConfig, TrainerConfig, model_config
from trainer.fsdp import build_mesh
from trainer.model import count_params, initializer
from trainer.step import train_step

SEED, WORLD = 1234, 2
CONTESTANTS = {"moe_ep1": (True, 1), "moe_ep2": (True, 2), "dense": (False, 1)}
"""name -> (a mixture?, sharding.expert_parallel)."""
PAIRS = (("moe_ep2", "moe_ep1"), ("moe_ep1", "dense"), ("moe_ep2", "dense"))
HEADLINE_KEYS = (
    "step_time_ratio_ep2_vs_ep1",
    "step_time_ratio_moe_vs_dense",
    "step_time_ratio_moe_ep2_vs_dense",
    "step_ms",
    "tokens_per_s",
    "all_to_all_ms",
    "all_to_all_fraction",
    "acct_peak_bytes",
    "torch_peak_bytes",
    "loss_rel_diff_ep2_vs_ep1",
    "grouped_mm",
    "config",
    "params",
)
"""Keys of the final JSON line (tests/benchmarks/test_moe_bench.py checks them)."""


@dataclass(frozen=True)
class Bench:
    """The model and the run (plain values: it pickles to the ranks)."""

    dim: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 256
    experts: int = 8
    top_k: int = 2
    moe_ffn: int = 384
    coef: float = 0.01
    seq: int = 256
    batch: int = 4  # rows per rank
    warmup: int = 2
    steps: int = 3  # timed per contestant per repetition
    reps: int = 10
    lr: float = 0.0  # the module docstring says why

    def model(self, mixture: bool) -> ModelConfig:
        shape = dict(dim=self.dim, n_layers=self.layers, n_heads=self.heads, max_seq_len=self.seq)
        shape.update(vocab_size=self.vocab, ffn_dim=self.top_k * self.moe_ffn)
        if not mixture:
            return model_config("tiny", **shape)
        moe = dict(moe_experts=self.experts, moe_top_k=self.top_k, moe_ffn_dim=self.moe_ffn)
        return model_config("tiny", router_aux_loss_coef=self.coef, **moe, **shape)

    @property
    def tokens(self) -> int:
        """Tokens of a step, both ranks."""
        return WORLD * self.batch * self.seq


FULL = Bench()
QUICK = replace(FULL, dim=64, layers=2, moe_ffn=96, seq=64, batch=2, warmup=1, steps=1, reps=2)


# ---- on each rank ------------------------------------------------------------------------------
@dataclass
class Contestant:
    name: str
    fsdp: object
    optimizer: torch.optim.Optimizer
    times: list  # (repetition, seconds) of each timed step
    a2a_ms: list  # all-to-all wait of each timed step, this rank
    exposed_ms: list
    losses: list
    loads: list  # the busiest expert over the mean, worst layer, each step
    acct_peak: int = 0
    comm_bytes: int = 0
    done: int = 0


def build_contestant(name: str, bench: Bench, rank: int) -> Contestant:
    mixture, ep = CONTESTANTS[name]
    cfg = bench.model(mixture)
    sharding = ShardingConfig(strategy="FULL_SHARD", expert_parallel=ep)
    job = TrainerConfig(model=cfg, sharding=sharding, optim=OptimConfig(lr=bench.lr))
    mesh = build_mesh(sharding, rank, WORLD, local_world_size=WORLD, experts=cfg.moe_experts)
    built = build(job, mesh, "cpu", initializer(SEED))
    return Contestant(name, built.model, built.optimizer, [], [], [], [], [])


def batch(bench: Bench, step: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(SEED + 1000 * step + rank)
    toks = torch.randint(0, bench.vocab, (bench.batch, bench.seq + 1), generator=g)
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous(), 1.0


def step(c: Contestant, bench: Bench, rank: int):
    """The loop's step on this contestant's next batch (every contestant sees the same ones)."""
    out = train_step(
        c.fsdp, c.optimizer, [batch(bench, c.done, rank)], global_tokens=bench.tokens,
        grad_clip=1.0, world=WORLD,
    )  # fmt: skip
    c.done += 1
    c.losses.append(float(out.loss))
    if out.load is not None:
        c.loads.append(float(out.load.max()))
    return out


def timed_step(c: Contestant, bench: Bench, rank: int, rep) -> None:
    """Barrier to barrier; recorded under `rep` unless it is None (warmup)."""
    dist.barrier()
    t0 = time.perf_counter()
    step(c, bench, rank)
    dist.barrier()
    seconds = time.perf_counter() - t0
    if rep is None:
        return
    m = c.fsdp.metrics(c.optimizer)
    c.times.append((rep, seconds))
    c.a2a_ms.append(m.get("comm/exposed_all_to_all_ms", 0.0))
    c.exposed_ms.append(m["comm/exposed_ms"])
    c.acct_peak = max(c.acct_peak, int(m["mem/peak_total_bytes"]))
    c.comm_bytes = int(m["comm/total_bytes"])


def memory(c: Contestant, bench: Bench, rank: int) -> dict:
    """The torch allocator's view: bytes held between steps + one step's high-water."""
    shards = [t for f in c.fsdp.flats() for t in (f.shard, f.grad) if t is not None]
    held = held_bytes(shards + optimizer_tensors(c.optimizer))
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(c, bench, rank)
    return dict(held_bytes=held, torch_peak_bytes=held + allocation_high_water(prof))


def bench_rank(rank: int, world: int, bench: Bench) -> dict:
    """Every contestant on this rank: alternating repetitions, then one memory step each."""
    cs = [build_contestant(name, bench, rank) for name in CONTESTANTS]
    for rep in range(bench.reps):
        for c in cs[rep % len(cs) :] + cs[: rep % len(cs)]:
            for _ in range(bench.warmup if rep == 0 else 1):
                timed_step(c, bench, rank, None)
            for _ in range(bench.steps):
                timed_step(c, bench, rank, rep)
    out = {}
    for c in cs:
        out[c.name] = dict(
            times=c.times, a2a_ms=c.a2a_ms, exposed_ms=c.exposed_ms, losses=c.losses,
            loads=c.loads, acct_peak_bytes=c.acct_peak, comm_bytes=c.comm_bytes,
            **memory(c, bench, rank),
        )  # fmt: skip
    return out


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


def figures(ranks: list, bench: Bench, grouped: dict) -> dict:
    """The headline from every rank's raw figures (step times: rank 0's, barrier-bracketed)."""
    r0 = ranks[0]
    step_ms = {n: 1000 * statistics.median(s for _, s in r0[n]["times"]) for n in CONTESTANTS}
    a2a = {n: [statistics.median(r[n]["a2a_ms"]) for r in ranks] for n in CONTESTANTS}
    ep1, ep2 = r0["moe_ep1"]["losses"], r0["moe_ep2"]["losses"]
    loads = r0["moe_ep1"]["loads"]
    return dict(
        benchmark="moe",
        world=WORLD,
        strategy="FULL_SHARD",
        param_dtype="float32",
        config=asdict(bench),
        params={
            n: dict(total=count_params(bench.model(m)), active=count_params(bench.model(m), True))
            for n, (m, _) in CONTESTANTS.items()
        },
        tokens_per_step=bench.tokens,
        **{f"step_time_ratio_{_pair_name(a, b)}": paired(r0[a]["times"], r0[b]["times"])
           for a, b in PAIRS},
        step_ms=step_ms,
        tokens_per_s={n: bench.tokens / (ms / 1000) for n, ms in step_ms.items()},
        all_to_all_ms={n: statistics.fmean(v) for n, v in a2a.items()},
        all_to_all_ms_per_rank=a2a,
        all_to_all_fraction={n: statistics.fmean(v) / step_ms[n] for n, v in a2a.items()},
        exposed_ms={n: [statistics.median(r[n]["exposed_ms"]) for r in ranks] for n in CONTESTANTS},
        comm_bytes={n: [r[n]["comm_bytes"] for r in ranks] for n in CONTESTANTS},
        acct_peak_bytes={n: [r[n]["acct_peak_bytes"] for r in ranks] for n in CONTESTANTS},
        held_bytes={n: [r[n]["held_bytes"] for r in ranks] for n in CONTESTANTS},
        torch_peak_bytes={n: [r[n]["torch_peak_bytes"] for r in ranks] for n in CONTESTANTS},
        loss_rel_diff_ep2_vs_ep1=max(abs(a - b) / abs(b) for a, b in zip(ep2, ep1)),
        load_max_median=statistics.median(loads) if loads else None,
        final_loss={n: r0[n]["losses"][-1] for n in CONTESTANTS},
        grouped_mm=grouped,
    )  # fmt: skip


def _pair_name(a: str, b: str) -> str:
    return {"moe_ep2/moe_ep1": "ep2_vs_ep1", "moe_ep1/dense": "moe_vs_dense"}.get(
        f"{a}/{b}", f"{a}_vs_{b}"
    )


def grouped_check(bench: Bench) -> dict:
    """grouped_mm against the loop on this CPU, one rank's routed rows, fp32, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shape = ExpertShape(
            "cpu", bench.experts, bench.dim, bench.moe_ffn, bench.top_k, bench.batch * bench.seq,
            warmup=1, reps=5,
        )  # fmt: skip
        r = time_experts(shape, torch.device("cpu"), torch.float32)
    finally:
        torch.set_num_threads(threads)
    keys = ("grouped_mm_ok", "path", "grouped_ms", "loop_ms", "loop_over_grouped", "max_rel_diff")
    return {k: r[k] for k in keys}


def table(head: dict) -> str:
    mib = lambda v: "/".join(f"{b / 2**20:.1f}" for b in v)  # noqa: E731
    lines = [
        f"{'contestant':10} {'params':>10} {'active':>10} {'ms/step':>8} {'tok/s':>8} "
        f"{'a2a ms':>7} {'a2a %':>6} {'exposed ms r0/r1':>17} {'comm MiB':>11} "
        f"{'acct peak MiB':>13} {'torch peak MiB':>15}"
    ]
    for n in CONTESTANTS:
        p = head["params"][n]
        exposed = "/".join(f"{v:.1f}" for v in head["exposed_ms"][n])
        lines.append(
            f"{n:10} {p['total']:>10,} {p['active']:>10,} {head['step_ms'][n]:>8.1f} "
            f"{head['tokens_per_s'][n]:>8,.0f} {head['all_to_all_ms'][n]:>7.1f} "
            f"{head['all_to_all_fraction'][n]:>6.1%} {exposed:>17} "
            f"{mib(head['comm_bytes'][n]):>11} "
            f"{mib(head['acct_peak_bytes'][n]):>13} {mib(head['torch_peak_bytes'][n]):>15}"
        )
    g = head["grouped_mm"]
    lines += [
        "",
        f"paired step-time ratios: ep2/ep1 {head['step_time_ratio_ep2_vs_ep1']:.3f}, "
        f"moe(ep1)/dense {head['step_time_ratio_moe_vs_dense']:.3f}, "
        f"moe(ep2)/dense {head['step_time_ratio_moe_ep2_vs_dense']:.3f} (below 1: the first is "
        "faster)",
        f"losses ep2 vs ep1: max rel diff {head['loss_rel_diff_ep2_vs_ep1']:.1e}; busiest expert "
        f"over the mean (worst layer, median step): {head['load_max_median']:.2f}",
        f"grouped_mm on this CPU: {g['path']}; expert SwiGLU fwd+bwd {g['grouped_ms']:.1f} ms "
        f"grouped vs {g['loop_ms']:.1f} ms loop (loop/grouped {g['loop_over_grouped']:.2f})",
        "a2a: the engine's all-to-all wait per step (mean of ranks); exposed: every collective's "
        "wait; acct: the engine's own bytes; torch: allocator held + one step's high-water.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, a few steps (~20 s)")
    p.add_argument("--reps", type=int, help="repetitions (default: the run's)")
    p.add_argument("--lr", type=float, default=0.0, help="AdamW's (0: the routing stays put)")
    args = p.parse_args(argv)
    bench = replace(QUICK if args.quick else FULL, lr=args.lr)
    if args.reps:
        bench = replace(bench, reps=args.reps)
    t0 = time.perf_counter()
    grouped = grouped_check(bench)
    ranks = run_ranks(bench_rank, WORLD, bench, timeout=1800)
    head = figures(ranks, bench, grouped)
    head["elapsed_s"] = time.perf_counter() - t0
    print(table(head))
    print(json.dumps(head), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
