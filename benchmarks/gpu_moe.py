"""The GPU check's mixture-of-experts stage: the experts' grouped matmul against the loop, and a
mixture trained on our engine, with its MFU counted on the FLOPs a token actually computes.

    python3 -m benchmarks.gpu_moe --file moe.json             # on the GPU (gpu_stages: 08 moe)
    python -m benchmarks.gpu_moe --device cpu --quick --file F  # the same code path, small, here

1. Experts, forward + backward, bf16, one device: the sparse layer's expert SwiGLU over rows
   sorted by expert (trainer/model/moe.py Experts.forward: silu(x W1) * (x W3), then W2) with
   each projection as `grouped_mm` (torch._grouped_mm where `grouped_mm_ok` says it runs, which
   is what training uses; `path` says which ran) and as `grouped_mm_loop` (one matmul per
   expert), the two alternating, `reps` timed iterations each after `warmup`, medians by CUDA
   events. Shapes (SHAPES): Qwen3-30B-A3B's layer (128 experts, dim 2048, width 768, top-8) on
   16k tokens, and Mixtral-8x7B's (8 experts, 4096 x 14336, top-2) on 4k tokens (its 2.8 GB of
   bf16 experts; more tokens only lengthen the run). Routing: the top-k of random logits (about
   balanced, as a trained router's is on average). Reported: ms, achieved TFLOP/s
   (3 projections x 2 S D F, x3 with backward), loop/grouped, and the largest difference of the
   outputs over the largest output (bf16: ~1e-2).
2. Training at world size 1 (a process group of one, NCCL), FULL_SHARD, bf16 parameters over
   fp32 master weights (as trainer/loop.py builds it: trainer/build.py, trainer/step.py): a
   ~0.67B-parameter Qwen3-MoE-shaped mixture (TRAIN: dim 1024, 8 layers, 64 experts of width 384,
   top-8, 16 heads over 4 key/value heads, vocab 32000; 0.15B active) on 8 x 2048 tokens a step,
   3 warmup and 12 timed steps, and the dense model of the same active parameters (ffn_dim =
   top_k x expert width) the same way. MFU = trainer.model.flops_per_token (6 x the ACTIVE
   parameters, the input embedding left out, + 12 L H Q T for attention) x tokens/s over the
   device's dense bf16 peak (trainer.device.PEAK_FLOPS; the GPU check's table). Peak memory:
   torch.cuda.max_memory_allocated above the allocation when the run started.

The result file is rewritten after each part (a stage killed at its limit keeps what it did) and
the last line printed is the same JSON. Exit 1 if a loss is not finite or the two matmul paths
disagree beyond BF16_TOLERANCE. Estimated on one H200 (no GPU has run it yet): ~10 s of start
(torch, CUDA, NCCL), ~5 s for part 1, ~20 s for part 2 (0.67B initialised on the host, ~5 s;
~50 ms steps); its stage's limit is 90 s.
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
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.gpu_stages import resolve_device
from trainer.build import build
from trainer.config import OptimConfig, ShardingConfig, TrainerConfig, model_config
from trainer.device import peak_flops
from trainer.fsdp import build_mesh
from trainer.model import count_params, flops_per_token, initializer
from trainer.model.moe import grouped_mm, grouped_mm_loop, grouped_mm_ok
from trainer.step import train_step

SEED = 0
BF16_TOLERANCE = 5e-2
"""Largest |grouped - loop| over the largest |output| the two bf16 paths may differ by."""


@dataclass(frozen=True)
class ExpertShape:
    """One sparse layer's experts and the tokens routed through them."""

    name: str
    experts: int
    dim: int
    ffn: int
    top_k: int
    tokens: int
    warmup: int = 2
    reps: int = 8

    @property
    def flops(self) -> float:
        """Forward + backward: 3 projections of 2 S D F each, backward twice the forward."""
        return 3 * 3 * 2 * self.tokens * self.top_k * self.dim * self.ffn


@dataclass(frozen=True)
class TrainSetup:
    """The mixture part 2 trains, and the run."""

    overrides: dict
    batch: int
    seq: int
    warmup: int
    steps: int

    def configs(self):
        """(the mixture, the dense model of its active parameters)."""
        moe = model_config("tiny", max_seq_len=self.seq, **self.overrides)
        dense = dict(self.overrides, ffn_dim=moe.moe_top_k * moe.moe_ffn_dim, family="qwen3")
        dense = {k: v for k, v in dense.items() if not k.startswith(("moe_", "router_"))}
        return moe, model_config("tiny", max_seq_len=self.seq, **dense)


SHAPES = (
    ExpertShape("qwen3-30b-a3b", experts=128, dim=2048, ffn=768, top_k=8, tokens=16384),
    ExpertShape("mixtral-8x7b", experts=8, dim=4096, ffn=14336, top_k=2, tokens=4096),
)
QUICK_SHAPES = (ExpertShape("tiny", experts=8, dim=64, ffn=32, top_k=2, tokens=256, reps=3),)
QWEN_LIKE = dict(family="qwen3_moe", qk_norm=True, moe_norm_topk=True, router_aux_loss_coef=1e-3)
TRAIN = TrainSetup(
    dict(QWEN_LIKE, vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4,
         moe_experts=64, moe_top_k=8, moe_ffn_dim=384),
    batch=8, seq=2048, warmup=3, steps=12,
)  # fmt: skip
QUICK_TRAIN = TrainSetup(
    dict(QWEN_LIKE, dim=64, n_layers=2, n_heads=4, moe_experts=4, moe_top_k=2, moe_ffn_dim=32),
    batch=2, seq=32, warmup=1, steps=2,
)  # fmt: skip


# ---- part 1: the experts' matmuls ----------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], None], device: torch.device) -> float:
    """One call of `fn`, milliseconds (CUDA events on the GPU, the wall clock on the CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t0)


def expert_inputs(s: ExpertShape, device, dtype) -> dict:
    """Rows sorted by expert (top-k of random logits), the stacked weights, an output gradient."""
    g = torch.Generator(device=device).manual_seed(SEED)
    chosen = torch.randn(s.tokens, s.experts, generator=g, device=device).topk(s.top_k).indices
    counts = torch.bincount(chosen.flatten(), minlength=s.experts)
    rows = s.tokens * s.top_k

    def draw(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    w = {k: draw(s.experts, s.ffn, s.dim, std=0.02) for k in ("w1", "w3")}
    w["w2"] = draw(s.experts, s.dim, s.ffn, std=0.02)
    return dict(
        xs=draw(rows, s.dim).requires_grad_(),
        ends=torch.cumsum(counts, 0),
        grad=draw(rows, s.dim),
        **{k: v.requires_grad_() for k, v in w.items()},
    )


def swiglu(mm, xs, w1, w3, w2, ends, grad=None) -> torch.Tensor:
    """Experts.forward with `mm` as the grouped matmul; backward too when `grad` is given."""
    y = mm(F.silu(mm(xs, w1, ends)) * mm(xs, w3, ends), w2, ends)
    if grad is not None:
        y.backward(grad)
    return y


def time_experts(s: ExpertShape, device, dtype=torch.bfloat16) -> dict:
    """Part 1 for one shape: grouped and loop alternating, medians of `reps` each."""
    t = expert_inputs(s, device, dtype)
    ok = grouped_mm_ok(device.type, dtype, s.dim, s.ffn) and grouped_mm_ok(
        device.type, dtype, s.ffn, s.dim
    )
    with torch.no_grad():
        a = swiglu(grouped_mm, t["xs"], t["w1"], t["w3"], t["w2"], t["ends"]).float()
        b = swiglu(grouped_mm_loop, t["xs"], t["w1"], t["w3"], t["w2"], t["ends"]).float()
        diff = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    del a, b
    times: dict[str, list] = {"grouped": [], "loop": []}
    for i in range(s.warmup + s.reps):
        for name, mm in (("grouped", grouped_mm), ("loop", grouped_mm_loop)):
            ms = timed_ms(lambda mm=mm: swiglu(mm, **t), device)
            for p in ("xs", "w1", "w3", "w2"):
                t[p].grad = None
            if i >= s.warmup:
                times[name].append(ms)
    grouped, loop = (statistics.median(times[k]) for k in ("grouped", "loop"))
    return dict(
        **asdict(s),
        dtype=str(dtype).removeprefix("torch."),
        grouped_mm_ok=ok,
        path="torch._grouped_mm" if ok else "loop (grouped_mm_ok said no)",
        grouped_ms=grouped,
        loop_ms=loop,
        loop_over_grouped=loop / grouped,
        grouped_tflops=s.flops / grouped / 1e9,
        loop_tflops=s.flops / loop / 1e9,
        max_rel_diff=diff,
    )


# ---- part 2: training ----------------------------------------------------------------------------
def train_one(cfg, setup: TrainSetup, device) -> dict:
    """Build `cfg` as the loop does (bf16 FULL_SHARD at world 1), warm up, time the steps."""
    sharding = ShardingConfig(strategy="FULL_SHARD", param_dtype="bfloat16")
    job = TrainerConfig(model=cfg, sharding=sharding, optim=OptimConfig(lr=1e-3))
    base = _allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    built = build(job, build_mesh(sharding, 0, 1), device, initializer(SEED))
    g = torch.Generator().manual_seed(SEED)
    toks = torch.randint(0, cfg.vocab_size, (setup.batch, setup.seq + 1), generator=g).to(device)
    mb = [(toks[:, :-1].contiguous(), toks[:, 1:].contiguous(), 1.0)]
    times, losses, out = [], [], None
    for i in range(setup.warmup + setup.steps):
        sync(device)
        t0 = time.perf_counter()
        out = train_step(
            built.model, built.optimizer, mb, global_tokens=toks[:, 1:].numel(), grad_clip=1.0,
            device=device,
        )  # fmt: skip
        losses.append(float(out.loss))  # waits for the device
        if i >= setup.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens_per_s = setup.batch * setup.seq / step_s
    peak = peak_flops(device, "bfloat16")
    fpt = flops_per_token(cfg, setup.seq)
    result = dict(
        params=count_params(cfg),
        active_params=count_params(cfg, active=True),
        flops_per_token=fpt,
        step_ms=1000 * step_s,
        tokens_per_s=tokens_per_s,
        mfu=fpt * tokens_per_s / peak if peak else None,
        peak_gib=(_peak(device) - base) / 2**30 if device.type == "cuda" else None,
        first_loss=losses[0],
        last_loss=losses[-1],
        finite=all(math.isfinite(x) for x in losses),
        load_max=None if out.load is None else float(out.load.max()),
        aux=None if out.aux is None else float(out.aux),
    )
    del built, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _allocated(device) -> int:
    sync(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _peak(device) -> int:
    sync(device)
    return torch.cuda.max_memory_allocated(device)


def train(setup: TrainSetup, device) -> dict:
    """The mixture and its dense twin, one after the other (each freed before the next)."""
    moe_cfg, dense_cfg = setup.configs()
    moe, dense = train_one(moe_cfg, setup, device), train_one(dense_cfg, setup, device)
    return dict(
        batch=setup.batch,
        seq=setup.seq,
        timed_steps=setup.steps,
        model={k: v for k, v in asdict(moe_cfg).items() if k != "hf_path"},
        moe=moe,
        dense=dense,
        moe_over_dense_step_time=moe["step_ms"] / dense["step_ms"],
    )


# ---- entry ---------------------------------------------------------------------------------------
def problems(result: dict) -> list[str]:
    out = [
        f"{r['name']}: grouped and loop differ by {r['max_rel_diff']:.2e} (allowed "
        f"{BF16_TOLERANCE})"
        for r in result.get("experts", [])
        if not r["max_rel_diff"] <= BF16_TOLERANCE
    ]
    for who in ("moe", "dense"):
        if who in result.get("train", {}) and not result["train"][who]["finite"]:
            out.append(f"train {who}: a loss is not finite")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", type=Path, required=True, help="the result JSON (rewritten per part)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes and model (the CPU test)")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    t0 = time.perf_counter()
    result: dict = dict(
        benchmark="gpu_moe",
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        quick=args.quick,
        experts=[],
    )

    def write() -> None:
        result["elapsed_s"] = time.perf_counter() - t0
        args.file.write_text(json.dumps(result, indent=2) + "\n")

    for shape in QUICK_SHAPES if args.quick else SHAPES:
        result["experts"].append(time_experts(shape, device))
        print(json.dumps(result["experts"][-1]), flush=True)
        write()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    try:
        result["train"] = train(QUICK_TRAIN if args.quick else TRAIN, device)
    finally:
        dist.destroy_process_group()
    result["failed"] = problems(result)
    write()
    print(json.dumps(result), flush=True)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
