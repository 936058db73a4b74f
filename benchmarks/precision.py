"""The memory levers' price in quality and bytes: bf16 AdamW moments, a bf16 master with
stochastic rounding, and plain (nearest-rounded) bf16 master, against fp32, in one run.

    python -m benchmarks.precision                          # the tiny model, 300 steps
    python -m benchmarks.precision --model mid --steps 300  # benchmarks/engine.py's mid model
    python -m benchmarks.precision --model micro --steps 3  # a smoke run (seconds)

Every variant trains the same model from the same initialisation on the same batches, with the
same schedule (trainer/config.py's OptimConfig defaults: lr 3e-3, 10 warmup steps, cosine to
0.1x) on one process (the levers' numerics do not depend on the world size: tests/
test_optim_levers.py shows it), fp32 compute, so what differs is where the optimizer keeps its
numbers:
- fp32: fp32 master and moments (torch's AdamW);
- bf16 state: optim.state_dtype=bfloat16 (ours: moments in bf16, the update in fp32);
- bf16 master: and sharding.master_dtype=bfloat16 with master_rounding=stochastic;
- bf16 nearest: the same with master_rounding=nearest (plain bf16: small updates are lost).
The data is a synthetic bigram language (each token is followed by one of 4 tokens, with
odds 0.55/0.25/0.12/0.08, from a seeded table): its loss floor is the entropy of those odds,
1.14 nats, and a model that learns it goes there from ln(vocab). The quality figure is the mean
loss on 8 fixed held-out batches after the last step; the verdict is whether bf16 state and bf16
master end within 1% of fp32 and whether nearest rounding ends further off than stochastic.

Bytes per parameter are the engine's accounting (fsdp.metrics: sharded_params, optim_state, the
gradient shard during the step) and, in a second table, each offload level's device and host
bytes after a few steps. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.engine import MODELS as ENGINE_MODELS
from trainer.build import build
from trainer.config import OptimConfig, ShardingConfig, TrainConfig, TrainerConfig, model_config
from trainer.fsdp import build_mesh
from trainer.model import initializer, loss_sum
from trainer.optim import lr_at
from trainer.step import train_step

SEED = 1234
ODDS = (0.55, 0.25, 0.12, 0.08)
FLOOR = -sum(p * math.log(p) for p in ODDS)
MODELS = {
    "micro": dict(dim=32, n_layers=1, n_heads=2, ffn_dim=64, vocab_size=64),
    "small": dict(dim=128, n_layers=4, n_heads=4, ffn_dim=384),  # vocab 256, 0.92M parameters
    "tiny": {},  # model_config("tiny"): dim 256, 4 layers, vocab 256, 3.5M parameters
    "mid": ENGINE_MODELS["mid"].overrides,  # dim 512, 8 layers, vocab 8192, 35.7M parameters
}
VARIANTS = {
    "fp32": (dict(), "float32"),
    "bf16 state": (dict(), "bfloat16"),
    "bf16 master": (dict(master_dtype="bfloat16", master_rounding="stochastic"), "bfloat16"),
    "bf16 nearest": (dict(master_dtype="bfloat16", master_rounding="nearest"), "bfloat16"),
}
OFFLOAD = {
    "none": dict(),
    "optimizer": dict(offload="optimizer"),
    "params": dict(offload="params"),
    "params + bf16": dict(offload="params", master_dtype="bfloat16"),
}


@dataclass
class Args:
    model: str
    steps: int
    batch: int
    seq: int
    memory_steps: int


class Bigrams:
    """Sequences of a seeded bigram language: token t is followed by table[t, k] with ODDS[k]."""

    def __init__(self, vocab: int, seq: int):
        g = torch.Generator().manual_seed(SEED)
        self.table = torch.stack([torch.randperm(vocab, generator=g)[:4] for _ in range(vocab)])
        self.vocab, self.seq = vocab, seq

    def batch(self, seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        toks = torch.empty(n, self.seq + 1, dtype=torch.long)
        toks[:, 0] = torch.randint(0, self.vocab, (n,), generator=g)
        choice = torch.multinomial(torch.tensor(ODDS), n * self.seq, True, generator=g)
        choice = choice.view(n, self.seq)
        for i in range(self.seq):
            toks[:, i + 1] = self.table[toks[:, i], choice[:, i]]
        return toks[:, :-1], toks[:, 1:]


def engine(args: Args, sharding: dict, state_dtype: str):
    """The engine and its optimizer as the loop builds them (trainer/build.py), one rank."""
    job = TrainerConfig(
        model=model_config("tiny", **MODELS[args.model]),
        sharding=ShardingConfig(**sharding),
        optim=OptimConfig(state_dtype=state_dtype),
        train=TrainConfig(seed=SEED),
    )
    built = build(job, build_mesh(job.sharding, 0, 1), "cpu", initializer(SEED))
    return built.model, built.optimizer, job.optim


def per_param(fsdp, opt) -> dict:
    """Device and host bytes per parameter: resident between steps, and at the step's peak."""
    m = fsdp.metrics(opt)
    n = fsdp.num_params()
    resident = m["mem/sharded_params_bytes"] + m["mem/optim_state_bytes"]
    host = sum(m.get(f"mem/host_{k}_bytes", 0.0) for k in ("params", "optim_state"))
    grads = m["mem/peak_sharded_grads_bytes"]
    return dict(
        resident=resident / n,
        with_grads=(resident + grads) / n,
        host=host / n,
        host_with_grads=(host + m.get("mem/host_grads_bytes", 0.0)) / n,
        peak_gathered=m["mem/peak_gathered_params_bytes"] / n,
    )


def train(args: Args, name: str, data: Bigrams) -> dict:
    sharding, state_dtype = VARIANTS[name]
    fsdp, opt, optim = engine(args, sharding, state_dtype)
    losses, times = [], []
    for step in range(args.steps):
        x, y = data.batch(SEED + step, args.batch)
        t0 = time.perf_counter()
        out = train_step(
            fsdp,
            opt,
            [(x, y, 1.0)],
            global_tokens=x.numel(),
            grad_clip=optim.grad_clip,
            lr=lr_at(optim, args.steps, step),
        )
        times.append(time.perf_counter() - t0)
        losses.append(float(out.loss))
    bytes_ = per_param(fsdp, opt)  # before the evaluation's forward starts a new step's peaks
    with torch.no_grad():
        held_out = [data.batch(10**6 + i, args.batch) for i in range(8)]
        final = sum(float(loss_sum(fsdp(x), y)[0]) / y.numel() for x, y in held_out) / 8
    return dict(
        final=final,
        train_last=statistics.mean(losses[-10:]),
        first=losses[0],
        step_s=statistics.median(times),
        bytes=bytes_,
    )


def memory(args: Args, name: str, data: Bigrams) -> dict:
    state_dtype = "bfloat16" if "bf16" in name else "float32"
    fsdp, opt, _ = engine(args, OFFLOAD[name], state_dtype)
    times = []
    for step in range(args.memory_steps):
        x, y = data.batch(SEED + step, args.batch)
        t0 = time.perf_counter()
        train_step(fsdp, opt, [(x, y, 1.0)], global_tokens=x.numel(), grad_clip=1.0)
        times.append(time.perf_counter() - t0)
    return dict(step_s=statistics.median(times), bytes=per_param(fsdp, opt))


def quality_table(res: dict) -> list[str]:
    ref = res["fp32"]["final"]
    lines = [
        f"{'variant':<14}{'first':>8}{'final':>9}{'vs fp32':>9}{'train':>8}"
        f"{'B/param':>9}{'+grads':>8}{'step s':>8}",
    ]
    for name, r in res.items():
        lines.append(
            f"{name:<14}{r['first']:>8.3f}{r['final']:>9.4f}{r['final'] / ref - 1:>+9.2%}"
            f"{r['train_last']:>8.3f}{r['bytes']['resident']:>9.1f}"
            f"{r['bytes']['with_grads']:>8.1f}{r['step_s']:>8.3f}"
        )
    return lines


def memory_table(res: dict) -> list[str]:
    ref = res["none"]["step_s"]
    lines = [
        f"{'offload':<15}{'device B/param':>15}{'+grads':>8}{'host B/param':>14}{'+grads':>8}"
        f"{'step s':>8}{'vs none':>9}"
    ]
    for name, r in res.items():
        b = r["bytes"]
        lines.append(
            f"{name:<15}{b['resident']:>15.1f}{b['with_grads']:>8.1f}{b['host']:>14.1f}"
            f"{b['host_with_grads']:>8.1f}{r['step_s']:>8.3f}{r['step_s'] / ref:>9.2f}"
        )
    return lines


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="sequences a step")
    p.add_argument("--seq", type=int, default=64, help="tokens a sequence")
    p.add_argument("--memory-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: see below)")
    ns = vars(p.parse_args(argv))
    # One thread: on a loaded 2-core host two threads made small elementwise ops ~10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(ns.pop("threads"))
    try:
        return run(Args(**ns))
    finally:
        torch.set_num_threads(threads)  # main() may run inside a test process


def run(args: Args) -> dict:
    torch.manual_seed(SEED)
    cfg = model_config("tiny", **MODELS[args.model])
    data = Bigrams(cfg.vocab_size, args.seq)
    print(
        f"model {args.model} (dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}), "
        f"{args.steps} steps of {args.batch} x {args.seq} tokens, 1 process, fp32 compute; "
        f"loss floor {FLOOR:.3f}, start ln(vocab) = {math.log(cfg.vocab_size):.3f}",
        flush=True,
    )
    quality = {}
    for name in VARIANTS:
        quality[name] = train(args, name, data)
        print(f"  {name}: final {quality[name]['final']:.4f}", flush=True)
    mem = {name: memory(args, name, data) for name in OFFLOAD}
    ref = quality["fp32"]["final"]
    gap = {k: quality[k]["final"] / ref - 1 for k in quality}
    verdict = dict(
        bf16_state_within_1pct=abs(gap["bf16 state"]) <= 0.01,
        bf16_master_within_1pct=abs(gap["bf16 master"]) <= 0.01,
        nearest_drifts_further=abs(gap["bf16 nearest"]) > abs(gap["bf16 master"]),
    )
    print("\n".join(["", "quality (held-out loss after the last step)", *quality_table(quality)]))
    print("\n".join(["", "memory per parameter (engine accounting)", *memory_table(mem)]))
    print("\n" + ", ".join(f"{k}: {v}" for k, v in verdict.items()))
    summary = dict(
        benchmark="precision",
        model=args.model,
        steps=args.steps,
        final={k: round(v["final"], 5) for k, v in quality.items()},
        gap_vs_fp32={k: round(v, 5) for k, v in gap.items()},
        bytes_per_param={k: v["bytes"] for k, v in quality.items()},
        offload_bytes_per_param={k: v["bytes"] for k, v in mem.items()},
        offload_step_ratio={k: v["step_s"] / mem["none"]["step_s"] for k, v in mem.items()},
        **verdict,
    )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
