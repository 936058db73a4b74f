"""Our engine against torch FSDP2 and DDP: same model, batch, optimizer and ranks, in one run.

    python -m benchmarks.engine                          # tiny model, 2 gloo ranks, fp32
    python -m benchmarks.engine --param-dtype bfloat16   # bf16 compute (DDP stays fp32, labelled)
    python -m benchmarks.engine --steps 2 --reps 1 --warmup 1   # smoke run

Contestants, all built in the same process group and trained on the same batches:
- ours FULL_SHARD, SHARD_GRAD_OP and NO_SHARD (trainer/fsdp, one unit per block + root);
- torch FSDP2: fully_shard per block, then the root (MixedPrecisionPolicy when --param-dtype is
  not float32, gradients reduced in fp32 like ours);
- torch DDP (gradient_as_bucket_view=True, always fp32).

A step is what trainer/loop.py does: forward, loss, backward, global-norm clip, AdamW step
(foreach=False, weight decay on matrices only), zero_grad. Our loss is divided by the global token
count (the engine sums gradients); FSDP2 and DDP average over ranks, so theirs is multiplied by
the world size: every contestant computes the same gradient and the losses must agree (checked).

Timing: contestants alternate inside every repetition (the starting contestant rotates), so drift
of a shared, noisy machine hits all of them alike. Every step is bracketed by barriers on all
ranks, so a step's time is the slowest rank's. The first repetition runs --warmup untimed steps
per contestant, later ones one untimed step (caches went cold while the others ran). Reported:
the median over all timed steps, and the forward / backward / optimizer split (rank 0, medians).

Memory is measured in two ways, both per rank (rank 0 shown):
- ours, accounting: the engine's own peak total bytes in a step and its persistent bytes
  (sharded params + grads + optimizer state), from FSDPModel.acct;
- all contestants, torch CPU allocator: bytes of the tensors held between steps (parameters or
  shards, gradients, optimizer state; storages counted once) plus the peak of extra bytes the
  torch allocator handed out during one step, recorded by torch.profiler(profile_memory=True) on
  the main thread (autograd runs there on CPU). Gloo's own buffers are not torch allocations and
  are not seen. Process RSS is not used: all contestants share one process, so its peak is
  monotonic and the allocator's reuse blurs deltas.
Bytes moved per step per rank (ring convention, see trainer/fsdp/accounting.py): ours are the
engine's accounting; FSDP2's and DDP's are computed from their parameter sizes by the same
formulas (FSDP2 pads each parameter's dim 0 to the world size; its root is not resharded after
forward, like ours) and are labelled "computed". The gradient-norm all-reduce (4 bytes) is not
counted for anyone.

The last line of output is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._profiler import _EventType
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # the reference, here only
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from trainer.config import DType, ShardingConfig, model_config
from trainer.fsdp import FSDPModel, build_mesh, parallelize
from trainer.model import build_model, count_params, initializer, loss_sum

SEED = 1234
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
OURS = {"full_shard": "FULL_SHARD", "shard_grad_op": "SHARD_GRAD_OP", "no_shard": "NO_SHARD"}
ORDER = ("full_shard", "fsdp2", "ddp", "shard_grad_op", "no_shard")


# ----------------------------------------------------------------------------- contestants


@dataclass
class Contestant:
    """One way of training the model: the callable, its optimizer and how to clip and zero."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_scale: (
        float  # multiplies the global-token-normalised loss (world size for averaging wrappers)
    )
    clip: Callable[[float], object]
    zero_grad: Callable[[], None]
    held: Callable[[], list]  # tensors this contestant keeps between steps
    fsdp: Optional[FSDPModel] = None
    comm_bytes_computed: Optional[int] = None
    dtype_note: str = ""
    times: list = field(default_factory=list)  # (total, fwd, bwd, opt, rep) per timed step; seconds
    losses: list = field(default_factory=list)  # rank-local loss of every step, in order
    steps_done: int = 0


def adamw(decay: list, rest: list) -> torch.optim.Optimizer:
    groups = [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups, lr=LR, betas=BETAS, eps=EPS, foreach=False
    )  # as trainer/loop.py


def optimizer_tensors(opt: torch.optim.Optimizer) -> list:
    return [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def build_ours(name: str, args, rank: int, world: int) -> Contestant:
    cfg = ShardingConfig(strategy=OURS[name], param_dtype=args.param_dtype, reduce_dtype="float32")
    cfg.validate()
    mesh = build_mesh(cfg, rank, world, local_world_size=world)
    fsdp = parallelize(
        build_model(model_config(args.model), device="meta"),
        cfg,
        mesh,
        "cpu",
        init_fn=initializer(SEED),
    )
    groups = fsdp.param_groups(WD)
    opt = adamw(groups[0]["params"], groups[1]["params"])

    def held():
        return [
            t for f in fsdp.flats() for t in (f.shard, f.grad) if t is not None
        ] + optimizer_tensors(opt)

    return Contestant(name, fsdp, opt, 1.0, fsdp.clip_grad_norm_, fsdp.zero_grad, held, fsdp=fsdp)


def build_fsdp2(args, rank: int, world: int) -> Contestant:
    model = build_model(model_config(args.model), device="cpu", seed=SEED)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, args.param_dtype), reduce_dtype=torch.float32
    )
    for block in model.layers:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    opt = adamw(
        [p for p in model.parameters() if p.ndim >= 2],
        [p for p in model.parameters() if p.ndim < 2],
    )

    def held():
        out = [p.to_local() for p in model.parameters()]
        out += [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        return out + [t.to_local() if hasattr(t, "to_local") else t for t in optimizer_tensors(opt)]

    clip = lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m)
    return Contestant(
        "fsdp2",
        model,
        opt,
        float(world),
        clip,
        lambda: opt.zero_grad(set_to_none=False),
        held,
        comm_bytes_computed=fsdp2_comm_bytes(model, world, args.param_dtype),
    )


def build_ddp(args, rank: int, world: int) -> Contestant:
    plain = build_model(model_config(args.model), device="cpu", seed=SEED)
    model = DDP(plain, gradient_as_bucket_view=True)
    opt = adamw(
        [p for p in model.parameters() if p.ndim >= 2],
        [p for p in model.parameters() if p.ndim < 2],
    )

    def held():
        return (
            [p for p in model.parameters()]
            + [p.grad for p in model.parameters() if p.grad is not None]
            + optimizer_tensors(opt)
        )

    clip = lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m)
    n = sum(p.numel() for p in model.parameters())
    note = "" if args.param_dtype == "float32" else "fp32 (DDP has no param_dtype)"
    return Contestant(
        "ddp",
        model,
        opt,
        float(world),
        clip,
        lambda: opt.zero_grad(set_to_none=False),
        held,
        comm_bytes_computed=ring_bytes("all_reduce", n * 4, world),
        dtype_note=note,
    )


def build(name: str, args, rank: int, world: int) -> Contestant:
    if name in OURS:
        return build_ours(name, args, rank, world)
    return build_fsdp2(args, rank, world) if name == "fsdp2" else build_ddp(args, rank, world)


# ----------------------------------------------------------------------------- computed bytes


def ring_bytes(op: str, payload_bytes: int, world: int) -> int:
    """Bytes one rank sends under a ring algorithm (as trainer/fsdp/accounting.py counts)."""
    return (2 if op == "all_reduce" else 1) * payload_bytes * (world - 1) // world


def fsdp2_comm_bytes(model: torch.nn.Module, world: int, param_dtype: str) -> int:
    """FSDP2 per step per rank: blocks gathered in forward and again in backward, the root gathered
    once (FSDP2 keeps the root unsharded after forward), fp32 reduce-scatter of every gradient."""

    def padded(params) -> int:  # FSDP2 shards dim 0 of every parameter, padded to the world size
        return sum(
            math.ceil(p.shape[0] / world) * world * (p.numel() // max(p.shape[0], 1))
            for p in params
        )

    block_ids = {id(p) for b in model.layers for p in b.parameters()}
    blocks = padded(p for p in model.parameters() if id(p) in block_ids)
    root = padded(p for p in model.parameters() if id(p) not in block_ids)
    gather = ring_bytes("all_gather", (2 * blocks + root) * DType(param_dtype).itemsize, world)
    return gather + ring_bytes("reduce_scatter", (blocks + root) * 4, world)


# ----------------------------------------------------------------------------- one step


def batches(args, rank: int, n: int) -> list:
    """n (inputs, targets) pairs of this rank: args.batch x args.seq tokens each, seeded by
    (step, rank)."""
    out = []
    vocab = model_config(args.model).vocab_size
    for step in range(n):
        g = torch.Generator().manual_seed(SEED + 1000 * step + rank)
        toks = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
        out.append((toks[:, :-1].contiguous(), toks[:, 1:].contiguous()))
    return out


def train_step(
    c: Contestant, x, y, global_tokens: int, clip: float
) -> tuple[float, float, float, float]:
    """One training step as trainer/loop.py runs it: (forward s, backward s, optimizer s, loss)."""
    t0 = time.perf_counter()
    s, _ = loss_sum(c.model(x), y)
    t1 = time.perf_counter()
    (s * (c.loss_scale / global_tokens)).backward()
    t2 = time.perf_counter()
    if clip > 0:
        c.clip(clip)
    c.optimizer.step()
    c.zero_grad()
    t3 = time.perf_counter()
    if c.fsdp is not None:
        c.fsdp.metrics(c.optimizer)  # counts the optimizer state in the accounting
    loss = float(s.detach()) / (x.numel())
    c.losses.append(loss)
    c.steps_done += 1
    return t1 - t0, t2 - t1, t3 - t2, loss


def timed_step(c: Contestant, data: list, args, global_tokens: int, rep: Optional[int]) -> None:
    """One barrier-to-barrier step; recorded under repetition `rep` unless it is None (warmup)."""
    x, y = data[c.steps_done]
    dist.barrier()
    t0 = time.perf_counter()
    fwd, bwd, opt, _ = train_step(c, x, y, global_tokens, args.clip)
    dist.barrier()  # the step ends when the slowest rank is done
    if rep is not None:
        c.times.append((time.perf_counter() - t0, fwd, bwd, opt, rep))


def run_reps(contestants: list, data: list, args, global_tokens: int) -> None:
    """Alternate contestants; rotate who goes first in each repetition."""
    k = len(contestants)
    for rep in range(args.reps):
        order = contestants[rep % k :] + contestants[: rep % k]
        for c in order:
            for _ in range(args.warmup if rep == 0 else min(1, args.warmup)):
                timed_step(c, data, args, global_tokens, None)
            for _ in range(args.steps):
                timed_step(c, data, args, global_tokens, rep)


# ----------------------------------------------------------------------------- memory


def held_bytes(tensors: list) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes():
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def step_peak_allocated(c: Contestant, x, y, global_tokens: int, clip: float) -> int:
    """Peak of extra bytes the torch CPU allocator handed out (main thread) during one step."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(c, x, y, global_tokens, clip)
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


def measure_memory(c: Contestant, data: list, global_tokens: int, clip: float) -> dict:
    held = held_bytes(c.held())
    x, y = data[c.steps_done]
    dist.barrier()
    peak = step_peak_allocated(c, x, y, global_tokens, clip)
    out = {"held_bytes": held, "step_peak_extra_bytes": peak, "torch_peak_bytes": held + peak}
    if c.fsdp is not None:
        acct = c.fsdp.acct
        out.update(
            acct_peak_bytes=int(acct.peak["total"]),
            acct_persistent_bytes=int(acct.persistent_bytes()),
            comm_bytes=int(sum(acct.comm_bytes.values())),
        )
    else:
        out["comm_bytes"] = c.comm_bytes_computed
    return out


# ----------------------------------------------------------------------------- one rank


def summarise(c: Contestant, mem: dict, global_tokens: int) -> dict:
    med = [statistics.median(t[i] for t in c.times) for i in range(4)]
    reps = sorted({t[4] for t in c.times})
    rep_ms = [statistics.median(t[0] for t in c.times if t[4] == r) * 1e3 for r in reps]
    return dict(
        name=c.name,
        ms=med[0] * 1e3,
        fwd_ms=med[1] * 1e3,
        bwd_ms=med[2] * 1e3,
        opt_ms=med[3] * 1e3,
        min_ms=min(t[0] for t in c.times) * 1e3,
        rep_ms=rep_ms,
        n=len(c.times),
        tokens_per_s=global_tokens / med[0],
        comm_computed=c.fsdp is None,
        note=c.dtype_note,
        losses=c.losses,
        **mem,
    )


def rank_main(rank: int, world: int, args) -> Optional[dict]:
    global_tokens = world * args.batch * args.seq
    names = [n for n in ORDER if n in args.contestants]
    contestants = [build(n, args, rank, world) for n in names]
    n_steps = args.warmup + (args.reps - 1) * min(1, args.warmup) + args.reps * args.steps + 1
    data = batches(args, rank, n_steps)
    run_reps(contestants, data, args, global_tokens)
    mems = [measure_memory(c, data, global_tokens, args.clip) for c in contestants]
    if rank != 0:
        return None
    return dict(
        contestants=[summarise(c, m, global_tokens) for c, m in zip(contestants, mems)],
        world=world,
        model=args.model,
        params=count_params(model_config(args.model)),
        tokens_per_step=global_tokens,
        param_dtype=args.param_dtype,
        threads=torch.get_num_threads(),
        steps=args.steps,
        reps=args.reps,
        warmup=args.warmup,
    )


def _entry(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(args.threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, "ok", rank_main(rank, world, args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args) -> dict:
    """Run rank_main on args.world gloo ranks; return rank 0's result (raise with a rank's
    traceback)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, args.world, port, args, queue))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    result = None
    try:
        for _ in range(args.world):
            rank, status, value = queue.get(timeout=args.timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            if rank == 0:
                result = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return result


# ----------------------------------------------------------------------------- report

LABELS = {
    "full_shard": "ours FULL_SHARD",
    "shard_grad_op": "ours SHARD_GRAD_OP",
    "no_shard": "ours NO_SHARD",
    "fsdp2": "torch FSDP2",
    "ddp": "torch DDP",
}


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def loss_rel_diff(a: list, b: list) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def ratios(c: dict, ref: dict) -> dict:
    """c's step time over ref's three ways: medians of all steps (the headline), the median over
    repetitions of the ratio of same-repetition medians (paired: robust to slow drift of a shared
    machine) and the ratio of the fastest steps (the least disturbed)."""
    paired = statistics.median(a / b for a, b in zip(c["rep_ms"], ref["rep_ms"]))
    return dict(median=c["ms"] / ref["ms"], paired=paired, min=c["min_ms"] / ref["min_ms"])


def table(res: dict) -> str:
    by = {c["name"]: c for c in res["contestants"]}
    head = (
        f"{'contestant':20} {'median ms':>9} {'min ms':>8} {'fwd':>7} {'bwd':>7} {'opt':>7} "
        f"{'tok/s':>8} "
        f"{'held MiB':>8} {'peak MiB':>8} {'acct pk':>8} {'acct prs':>8} {'comm MiB':>9}"
    )
    lines = [head, "-" * len(head)]
    for c in res["contestants"]:
        comm = mib(c["comm_bytes"]) + ("*" if c["comm_computed"] else " ")
        lines.append(
            f"{LABELS[c['name']]:20} {c['ms']:9.1f} {c['min_ms']:8.1f} {c['fwd_ms']:7.1f} "
            f"{c['bwd_ms']:7.1f} {c['opt_ms']:7.1f} {c['tokens_per_s']:8.0f} "
            f"{mib(c['held_bytes']):>8} "
            f"{mib(c['torch_peak_bytes']):>8} {mib(c.get('acct_peak_bytes')):>8} "
            f"{mib(c.get('acct_persistent_bytes')):>8} {comm:>9}"
            + (f"  [{c['note']}]" if c["note"] else "")
        )
    lines += ["", f"{'step time ratio':20} {'ref':>6} {'median':>8} {'paired':>8} {'min':>8}"]
    for name in OURS:
        for ref in ("fsdp2", "ddp"):
            if name in by and ref in by:
                r = ratios(by[name], by[ref])
                lines.append(
                    f"{LABELS[name]:20} {ref:>6} {r['median']:8.3f} {r['paired']:8.3f} "
                    f"{r['min']:8.3f}"
                )
    lines += [
        "",
        f"model {res['model']} ({res['params']:,} params), world {res['world']} gloo ranks, "
        f"{res['tokens_per_step']} tokens/step (global), param_dtype {res['param_dtype']}, "
        f"{res['threads']} torch thread(s)/rank, {res['reps']} reps x {res['steps']} timed steps "
        f"(warmup {res['warmup']}), contestants alternating; 1-min load average "
        f"{res['load'][0]:.1f} "
        f"before, {res['load'][1]:.1f} after, on {os.cpu_count()} cores.",
        "ms: median (and min) step time, barrier to barrier (slowest rank); fwd/bwd/opt: "
        "rank-0 medians "
        "(opt = clip + AdamW + zero_grad).",
        "held: tensors kept between steps (params/shards, grads, AdamW state); peak: held + peak "
        "extra bytes from the torch CPU allocator during one step (torch.profiler profile_memory, "
        "main thread, rank 0).",
        "acct pk / acct prs: our engine's accounting, peak total bytes in a step / persistent "
        "bytes.",
        "comm: bytes sent per step per rank (ring convention); * = computed from parameter sizes, "
        "not measured.",
        "ratios: median = of all-step medians (headline); paired = median over reps of same-rep "
        "median "
        "ratios; min = of fastest steps.",
    ]
    return "\n".join(lines)


def headline(res: dict) -> dict:
    by = {c["name"]: c for c in res["contestants"]}
    out = {}
    for name in OURS:
        for ref in ("fsdp2", "ddp"):
            if name in by and ref in by:
                r = ratios(by[name], by[ref])
                out[f"{name}_step_time_vs_{ref}"] = round(r["median"], 4)
                out[f"{name}_step_time_vs_{ref}_paired"] = round(r["paired"], 4)
                out[f"{name}_step_time_vs_{ref}_min"] = round(r["min"], 4)
    for name, c in by.items():
        out[f"{name}_ms"] = round(c["ms"], 2)
        out[f"{name}_min_ms"] = round(c["min_ms"], 2)
        out[f"{name}_tokens_per_s"] = round(c["tokens_per_s"], 1)
        out[f"{name}_peak_bytes"] = c["torch_peak_bytes"]
        out[f"{name}_comm_bytes"] = c["comm_bytes"]
    if "full_shard" in by:
        out["full_shard_acct_peak_bytes"] = by["full_shard"]["acct_peak_bytes"]
        out["full_shard_acct_persistent_bytes"] = by["full_shard"]["acct_persistent_bytes"]
    if "fsdp2" in by:
        out["max_loss_rel_diff_vs_fsdp2"] = max(
            (
                loss_rel_diff(c["losses"], by["fsdp2"]["losses"])
                for n, c in by.items()
                if n != "fsdp2"
            ),
            default=0.0,
        )
    if "full_shard_step_time_vs_fsdp2" in out:
        out["goal_full_shard_le_fsdp2"] = out["full_shard_step_time_vs_fsdp2"] <= 1.0
    out.update(
        world=res["world"],
        model=res["model"],
        param_dtype=res["param_dtype"],
        tokens_per_step=res["tokens_per_step"],
        timed_steps=res["reps"] * res["steps"],
        threads=res["threads"],
        load_avg=[round(x, 2) for x in res["load"]],
    )
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="gloo ranks (processes)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per contestant per repetition")
    p.add_argument(
        "--reps", type=int, default=10, help="repetitions (contestants alternate inside each)"
    )
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per contestant in the first repetition"
    )
    p.add_argument("--model", default="tiny", help="model preset of trainer/model.py")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument(
        "--param-dtype", default="float32", choices=[d.value for d in DType], help="compute dtype"
    )
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0 disables)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads per rank (same for all)"
    )
    p.add_argument(
        "--contestants",
        default=",".join(ORDER),
        help=f"comma-separated subset of {','.join(ORDER)}",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the ranks")
    args = p.parse_args(argv)
    args.contestants = [c.strip() for c in args.contestants.split(",") if c.strip()]
    bad = [c for c in args.contestants if c not in ORDER]
    if bad:
        p.error(f"--contestants {bad[0]!r}: valid: {', '.join(ORDER)}")
    for key in ("world", "steps", "reps", "batch", "seq", "threads"):
        if getattr(args, key) < 1:
            p.error(f"--{key}={getattr(args, key)}: valid: an integer >= 1")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup}: valid: an integer >= 0")
    model_config(args.model)  # fails early with the valid preset names
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    res = spawn(args)
    res["load"] = (load_before, os.getloadavg()[0])
    print(table(res))
    print(json.dumps(headline(res)), flush=True)


if __name__ == "__main__":
    main()
