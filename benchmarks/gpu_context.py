"""The GPU check's context-parallel stage: a 1b model training one 32k-token sequence on one GPU,
and what one rank of context degree N computes in attention against the whole sequence.

    python3 -m benchmarks.gpu_context --file context.json            # on the GPU (gpu_stages: 09)
    python -m benchmarks.gpu_context --device cpu --quick --file F   # the same code path, small

One GPU cannot run context 2 against context 1 (that needs two devices exchanging K/V), so this
stage measures the two halves that one device can:

1. Training at world size 1 (a process group of one, NCCL), FULL_SHARD, bf16 parameters over
   fp32 master weights, activation checkpointing on, as trainer/loop.py builds it
   (trainer/build.py, trainer/step.py): model_config("1b") (1.5B parameters) at max_seq_len
   32768, one sequence of 32,768 tokens a step (random ids), the loss in chunks as the loop
   resolves train.loss_chunk_tokens for its 128k vocabulary; 1 warmup and 3 timed steps.
   Reported: step ms, tokens/s, MFU (trainer.model.flops_per_token over the device's dense bf16
   peak), peak memory (torch.cuda.max_memory_allocated above the allocation when it started):
   what context 1 costs, the baseline a context degree divides.
2. Attention alone, forward + backward, bf16, the 1b layer's shape (32 query heads over 8
   key/value heads of 64) at 32,768 tokens:
   - `whole`: the unsplit model's attention (trainer/model/attention.py attend: SDPA with
     is_causal, the flash kernel) over the whole sequence;
   - `cp{N} rank r`: what rank r of context degree N computes: trainer/model/context.py's
     ContextSplit(N, r).shard picks its two chunks (r and 2N-1-r) and their key ranges, and
     SplitAttention.attend runs them, exactly as in training, except the K/V exchange: the
     `gather` is a local stand-in that returns this rank's own K/V (differentiable, the tensor
     the rank computed) in its slot and the other ranks' chunks cut from the whole sequence's
     K/V (constants) in theirs. So the figure is one rank's attention compute with no
     communication; the all-gather's bytes per layer are given beside it (`kv_gather_mib`), not
     timed. Masks are the dense bool masks (`block=False`, SDPA with a mask: the
     memory-efficient kernel); training on CUDA uses FlexAttention block masks, whose compile
     (per chunk shape) would not fit the stage's 90 s.
   N in 2, 4, 8; ranks 0 and N-1 (the split's balance: both hold one early and one late
   chunk). Reported: ms, `over_ideal` = ms / (whole ms / N) (1.0: a perfect split of the causal
   work; the dense-mask kernel skips no masked block, so above 1 is expected), peak memory.

The result file is rewritten after each part (a stage killed at its limit keeps what it did);
the last line printed is the same JSON. Exit 1 if a loss is not finite. Estimated on one H200
(no GPU has run it yet): ~10 s start, the 1b initialised on the host ~20 s, 4 steps of ~2 s
(9e14 FLOPs a step with the recomputation), attention ~10 s; its stage's limit is 90 s.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.gpu_moe import sync, timed_ms
from benchmarks.gpu_stages import resolve_device
from trainer.build import build
from trainer.config import OptimConfig, ShardingConfig, TrainerConfig, model_config
from trainer.device import peak_flops
from trainer.fsdp import build_mesh
from trainer.loss import resolve_chunk_tokens
from trainer.model import count_params, flops_per_token, initializer
from trainer.model.attention import attend
from trainer.model.context import ContextSplit, chunk_layout
from trainer.step import train_step

SEED = 0


@dataclass(frozen=True)
class Setup:
    model: str
    overrides: dict
    seq: int
    warmup: int
    steps: int
    heads: int  # attention part: the layer's shape
    kv_heads: int
    head_dim: int
    degrees: tuple
    reps: int


FULL = Setup("1b", {}, seq=32768, warmup=1, steps=3, heads=32, kv_heads=8, head_dim=64,
             degrees=(2, 4, 8), reps=3)  # fmt: skip
QUICK = Setup("tiny", dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256),
              seq=256, warmup=1, steps=2, heads=4, kv_heads=2, head_dim=16, degrees=(2, 4),
              reps=2)  # fmt: skip


# ---- part 1: one sequence, one GPU -------------------------------------------------------------
def _allocated(device) -> int:
    sync(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _reset_peak(device) -> int:
    base = _allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return base


def _peak_gib(device, base: int):
    if device.type != "cuda":
        return None
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30


def train(setup: Setup, device) -> dict:
    """Context 1: the whole sequence on this device, activation checkpointing on."""
    cfg = model_config(setup.model, max_seq_len=setup.seq, **setup.overrides)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    sharding = ShardingConfig(
        strategy="FULL_SHARD", param_dtype=dtype, activation_checkpointing=True
    )
    job = TrainerConfig(model=cfg, sharding=sharding, optim=OptimConfig(lr=1e-4))
    base = _reset_peak(device)
    built = build(job, build_mesh(sharding, 0, 1), device, initializer(SEED))
    g = torch.Generator().manual_seed(SEED)
    toks = torch.randint(0, cfg.vocab_size, (1, setup.seq + 1), generator=g).to(device)
    mb = [(toks[:, :-1].contiguous(), toks[:, 1:].contiguous(), 1.0)]
    chunk = resolve_chunk_tokens(None, cfg.vocab_size)
    times, losses = [], []
    for i in range(setup.warmup + setup.steps):
        sync(device)
        t0 = time.perf_counter()
        out = train_step(
            built.model, built.optimizer, mb, global_tokens=setup.seq, grad_clip=1.0,
            device=device, loss_chunk_tokens=chunk,
        )  # fmt: skip
        losses.append(float(out.loss))  # waits for the device
        if i >= setup.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    fpt = flops_per_token(cfg, setup.seq)
    peak = peak_flops(device, "bfloat16")
    result = dict(
        model=setup.model,
        params=count_params(cfg),
        seq=setup.seq,
        activation_checkpointing=True,
        loss_chunk_tokens=chunk,
        step_ms=1000 * step_s,
        tokens_per_s=setup.seq / step_s,
        mfu=fpt * setup.seq / step_s / peak if peak else None,
        peak_gib=_peak_gib(device, base),
        losses=losses,
        finite=all(math.isfinite(x) for x in losses),
    )
    del built, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---- part 2: attention, whole against one rank's chunks ----------------------------------------
def repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, T, kv, hd] -> [B, T, kv * rep, hd] (the model's Attention._repeat_kv)."""
    b, t, kv, hd = x.shape
    return x[:, :, :, None, :].expand(b, t, kv, rep, hd).reshape(b, t, kv * rep, hd)


def qkv(setup: Setup, device, dtype) -> tuple:
    g = torch.Generator(device=device).manual_seed(SEED)
    shape = lambda h: (1, setup.seq, h, setup.head_dim)  # noqa: E731
    return tuple(
        torch.randn(*shape(h), generator=g, device=device, dtype=dtype)
        for h in (setup.heads, setup.kv_heads, setup.kv_heads)
    )


class LocalGather:
    """The stand-in for the K/V all-gather (module docstring): this rank's slot is its own
    tensor (gradients flow to it), the other ranks' slots are their chunks of the whole K/V."""

    def __init__(self, whole_kv: torch.Tensor, degree: int, rank: int):
        self.degree, self.rank = degree, rank
        self.others = {
            r: whole_kv[:, rank_indices(degree, r, whole_kv.shape[1], whole_kv.device)]
            for r in range(degree)
            if r != rank
        }

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        slots = [x if r == self.rank else self.others[r] for r in range(self.degree)]
        return torch.stack(slots)


def rank_indices(degree: int, rank: int, length: int, device) -> torch.Tensor:
    """The global indices of rank's two chunks (the split's own layout)."""
    return chunk_layout(degree, rank, length)[2].to(device)


def time_whole(setup: Setup, q, k, v, device) -> dict:
    rep = setup.heads // setup.kv_heads

    def run():
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        out = attend(
            qs.transpose(1, 2), repeat_kv(ks, rep).transpose(1, 2),
            repeat_kv(vs, rep).transpose(1, 2), None,
        )  # fmt: skip
        out.backward(torch.ones_like(out))

    return _timed("whole", run, setup, device)


def time_rank(setup: Setup, q, k, v, degree: int, rank: int, device) -> dict:
    rep = setup.heads // setup.kv_heads
    tokens = torch.zeros(1, setup.seq, dtype=torch.long, device=device)
    whole_kv = torch.cat([k, v], dim=-1)
    split = ContextSplit(degree, rank, LocalGather(whole_kv, degree, rank))
    *_, attn = split.shard(tokens, None, tokens, 1.0, None, block=False)
    idx = rank_indices(degree, rank, setup.seq, device)
    ql, kl, vl = q[:, idx], k[:, idx], v[:, idx]

    def run():
        qs, ks, vs = (t.detach().requires_grad_() for t in (ql, kl, vl))
        out = attn.attend(qs, ks, vs, lambda x: repeat_kv(x, rep), attend)
        out.backward(torch.ones_like(out))

    r = _timed(f"cp{degree} rank {rank}", run, setup, device)
    kv_bytes = whole_kv.element_size() * whole_kv[0, idx].numel()
    r.update(degree=degree, rank=rank, kv_gather_mib=kv_bytes * (degree - 1) / 2**20)
    return r


def _timed(name: str, run, setup: Setup, device) -> dict:
    base = _reset_peak(device)
    run()  # warmup
    ms = statistics.median(timed_ms(run, device) for _ in range(setup.reps))
    return dict(name=name, ms=ms, peak_gib=_peak_gib(device, base))


def attention(setup: Setup, device) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = qkv(setup, device, dtype)
    whole = time_whole(setup, q, k, v, device)
    ranks = []
    for n in setup.degrees:
        for r in sorted({0, n - 1}):
            row = time_rank(setup, q, k, v, n, r, device)
            row["over_ideal"] = row["ms"] / (whole["ms"] / n)
            ranks.append(row)
            print(json.dumps(row), flush=True)
    shape = dict(seq=setup.seq, heads=setup.heads, kv_heads=setup.kv_heads, head_dim=setup.head_dim)
    return dict(dtype=str(dtype).removeprefix("torch."), masks="dense (block=False)", **shape,
                whole=whole, ranks=ranks)  # fmt: skip


# ---- entry -------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", type=Path, required=True, help="the result JSON (rewritten per part)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="a tiny model, 256 tokens (the CPU test)")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    setup = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    result: dict = dict(
        benchmark="gpu_context",
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        quick=args.quick,
        setup=asdict(setup),
    )

    def write() -> None:
        result["elapsed_s"] = time.perf_counter() - t0
        args.file.write_text(json.dumps(result, indent=2) + "\n")

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    try:
        result["train"] = train(setup, device)
    finally:
        dist.destroy_process_group()
    print(json.dumps(result["train"]), flush=True)
    write()
    result["attention"] = attention(setup, device)
    result["failed"] = [] if result["train"]["finite"] else ["train: a loss is not finite"]
    write()
    print(json.dumps(result), flush=True)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
