"""`make gpu-check`: our engine on one GPU against torch FSDP2, with the figures asked first.

    python -m benchmarks.gpu_check                        # one CUDA GPU: 125m and 1b
    python -m benchmarks.gpu_check --models 125m          # one of them
    python -m benchmarks.gpu_check --device cpu --quick   # the same code path: tiny model, gloo

For each model (125m: 32 x 2048 tokens a step, 1b: 8 x 2048), bf16 compute with fp32 master
weights and reductions, FULL_SHARD, without and with activation checkpointing:
- ours, built and stepped as trainer/loop.py does (parallelize, build_optimizer: fused AdamW on
  CUDA, loss sum over the global token count, clip_grad_norm_, step, zero_grad);
- torch FSDP2 on the same model, weights and batch: fully_shard units as torchtitan makes them
  (the embedding, each block, [norm, output] kept gathered after forward, then the root),
  MixedPrecisionPolicy(bf16 params, fp32 reduce), the same AdamW and activation checkpointing.
Each trains `warmup` untimed steps, then `steps` timed ones, every step bracketed by device
synchronisations; figures are medians over the timed steps:
- tokens/s and MFU (flops_per_token x tokens/s over the device's dense bf16 peak);
- peak device memory (torch.cuda.max_memory_allocated from the build on) against the planner's
  prediction for the same job (trainer.plan.plan(...).total with the device's memory);
- exposed communication: the engine's comm/exposed_ms (CUDA timing events around the compute
  stream's waits on collectives);
- the step time of ours over FSDP2's (below 1: we are faster), and its inverse as a tokens/s ratio.

World size 1: a process group of one rank, built in this process (NCCL on CUDA, gloo on the CPU).
At world size 1 the engine makes each unit's compute copy by a local cast and issues no
collective, so its exposed communication is 0 by construction: this measures compute efficiency
and the engine's own overhead against FSDP2's. The collective path at world size 2 to 4 on one
GPU is tested by tests/gpu/test_threaded_ranks.py, which `make gpu-check` runs first.

Prints one line per contestant as it finishes, a table, then one JSON line with the headline
figures. Exits 1 if a first-step loss disagrees with FSDP2's (bf16: 1e-2) or is not finite.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # the reference, here only

from trainer.config import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    ShardingConfig,
    TrainConfig,
    TrainerConfig,
    model_config,
)
from trainer.device import peak_flops
from trainer.fsdp import build_mesh, parallelize
from trainer.fsdp.parallelize import apply_activation_checkpointing
from trainer.model import build_model, flops_per_token, loss_sum
from trainer.optim import build_optimizer, implementation, lr_at, set_lr
from trainer.plan import plan

GiB = 2**30
SEED = 0
LOSS_TOLERANCE = (
    1e-2  # bf16 first-step loss, ours vs FSDP2 (tests/fsdp/test_parity.py's bf16 bound)
)
CUDA_HINT = (
    "needs torch with CUDA and a visible GPU; install the CUDA build with "
    'make setup TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128, '
    "or run a python that has one: make gpu-check PY=python3 (or --device cpu --quick here)"
)


@dataclass(frozen=True)
class Setup:
    """One model's runs: the batch every contestant trains on, and how many steps each."""

    model: str
    batch: int
    """Sequences per step (the whole global batch: world size 1)."""
    seq_len: int
    warmup: int
    steps: int


# Sized for MFU within make gpu-check's 6 minutes on one H200 (141 GB); planned peaks without / with
# activation checkpointing: 125m 51 / 27 GiB, 1b 75 / 48 GiB (the 1b's persistent state alone,
# bf16 compute over fp32 master weights, gradients and AdamW state, is 16 B/param = 24 GB).
FULL = (Setup("125m", 32, 2048, 5, 30), Setup("1b", 8, 2048, 5, 25))
QUICK = (Setup("tiny", 2, 32, 1, 2),)


@dataclass
class Measured:
    """One contestant's timed steps."""

    step_ms: float
    """Median over the timed steps."""
    first_loss: float
    """Mean token loss of the first (untimed) step: same weights and batch for every contestant."""
    peak_bytes: Optional[int]
    """torch.cuda.max_memory_allocated from the build on; None on the CPU."""
    exposed_ms: Optional[float]
    """Median engine comm/exposed_ms; None for FSDP2 (it has no such figure)."""


# ---- the contestants -------------------------------------------------------------------------
class Ours:
    """Our engine, built and stepped as trainer/loop.py does."""

    name = "ours"

    def __init__(
        self, mcfg: ModelConfig, sharding: ShardingConfig, optim: OptimConfig, device, init
    ):
        self.model = parallelize(
            build_model(mcfg, device="meta"),
            sharding,
            build_mesh(sharding, 0, 1),
            device,
            init_fn=copy_init(init),
        )
        self.optimizer = build_optimizer(self.model, optim)
        self.clip = optim.grad_clip

    def step(self, x: torch.Tensor, y: torch.Tensor, tokens: int) -> torch.Tensor:
        s, _ = loss_sum(self.model(x), y)
        (s / tokens).backward()
        self.model.clip_grad_norm_(self.clip)
        self.optimizer.step()
        self.model.zero_grad()
        return s.detach()

    def exposed_ms(self) -> Optional[float]:
        """This step's exposed communication (reading it waits for the step's last collective)."""
        return self.model.metrics()["comm/exposed_ms"]


class FSDP2:
    """torch FSDP2 with torchtitan's units on the same model, weights and optimizer settings."""

    name = "fsdp2"

    def __init__(
        self, mcfg: ModelConfig, sharding: ShardingConfig, optim: OptimConfig, device, init
    ):
        model = build_model(mcfg, device="meta")
        model.to_empty(device=device)
        model.load_state_dict(init)
        if sharding.activation_checkpointing:
            for block in model.layers:  # the engine's own wrapper: the same recomputation
                apply_activation_checkpointing(block)
        mesh = init_device_mesh(torch.device(device).type, (1,))
        mp = MixedPrecisionPolicy(
            param_dtype=sharding.param_dtype.torch, reduce_dtype=sharding.reduce_dtype.torch
        )
        fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=mp)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        # Backward starts with the head: keeping it gathered saves a re-gather (torchtitan).
        fully_shard(
            [model.norm, model.output], mesh=mesh, mp_policy=mp, reshard_after_forward=False
        )
        fully_shard(model, mesh=mesh, mp_policy=mp)
        self.model = model
        decay = [p for p in model.parameters() if p.ndim >= 2]  # build_optimizer's rule
        rest = [p for p in model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": optim.weight_decay},
                {"params": rest, "weight_decay": 0.0},
            ],
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            **implementation(device),
        )
        self.clip = optim.grad_clip

    def step(self, x: torch.Tensor, y: torch.Tensor, tokens: int) -> torch.Tensor:
        s, _ = loss_sum(self.model(x), y)
        (s / tokens).backward()  # FSDP2 averages over ranks: at world size 1 the same gradient
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return s.detach()

    def exposed_ms(self) -> Optional[float]:
        return None


def initial_state(mcfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every parameter as trainer.model.initializer(SEED) fills it, on the host. Drawn once per
    model: the 1b draws 1.5B numbers on one CPU core (seconds each time); every run copies."""
    model = build_model(mcfg, device="cpu", seed=SEED)
    return {k: p.detach() for k, p in model.named_parameters()}


def copy_init(state: dict[str, torch.Tensor]) -> Callable[[torch.nn.Module, str], None]:
    """init_fn for parallelize: the values initializer(SEED) would draw, copied from `state`."""

    def init(module: torch.nn.Module, prefix: str) -> None:
        with torch.no_grad():
            for name, p in module.named_parameters(recurse=False):
                p.copy_(state[prefix + name])

    return init


# ---- measuring -------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(contestant, setup: Setup, optim: OptimConfig, x, y, device) -> Measured:
    """Warm-up steps, then timed ones, each between two device synchronisations. The learning
    rate follows the loop's schedule (warmup, cosine) over the steps run."""
    tokens = x.numel()
    total = setup.warmup + setup.steps
    times, exposed, first = [], [], math.nan
    for i in range(total):
        set_lr(contestant.optimizer, lr_at(optim, total, i))
        sync(device)
        t0 = time.perf_counter()
        loss = contestant.step(x, y, tokens)
        sync(device)
        t1 = time.perf_counter()
        if i == 0:
            first = float(loss) / tokens
        if i >= setup.warmup:
            times.append(t1 - t0)
            e = contestant.exposed_ms()
            if e is not None:
                exposed.append(e)
    return Measured(
        step_ms=1000 * statistics.median(times),
        first_loss=first,
        peak_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        exposed_ms=statistics.median(exposed) if exposed else None,
    )


def contest(cls, setup: Setup, sharding: ShardingConfig, init, x, y, device) -> Measured:
    """Build one contestant from nothing (the peak counts from here), train it, free it."""
    optim = OptimConfig()
    free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    contestant = cls(model_config(setup.model), sharding, optim, device, init)
    try:
        return measure(contestant, setup, optim, x, y, device)
    finally:
        del contestant
        free(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fixed_batch(mcfg: ModelConfig, setup: Setup, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): random tokens, the same for every contestant and step."""
    g = torch.Generator().manual_seed(SEED)
    toks = torch.randint(0, mcfg.vocab_size, (setup.batch, setup.seq_len + 1), generator=g)
    return toks[:, :-1].contiguous().to(device), toks[:, 1:].contiguous().to(device)


def planned_peak(mcfg: ModelConfig, sharding: ShardingConfig, setup: Setup, memory: int) -> int:
    """The planner's peak bytes for this very job on one worker."""
    cfg = TrainerConfig(
        model=mcfg,
        sharding=sharding,
        train=TrainConfig(global_batch_size=setup.batch),
        data=DataConfig(seq_len=setup.seq_len),
    )
    return plan(cfg, world_size=1, device_memory_bytes=memory).total


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # the host's, for the plan


# ---- one model, one setting ------------------------------------------------------------------
def run(setup: Setup, checkpointing: bool, init, device) -> dict:
    """Ours and FSDP2 on one model and setting: the row of the table, as a dict."""
    mcfg = model_config(setup.model)
    sharding = ShardingConfig(
        strategy="FULL_SHARD", param_dtype="bfloat16", activation_checkpointing=checkpointing
    )
    x, y = fixed_batch(mcfg, setup, device)
    name = f"{setup.model}_bf16" + ("_ac" if checkpointing else "")
    ours = contest(Ours, setup, sharding, init, x, y, device)
    report(name, "ours", ours)
    ref = contest(FSDP2, setup, sharding, init, x, y, device)
    report(name, "fsdp2", ref)
    tokens_per_s = x.numel() / (ours.step_ms / 1000)
    peak = peak_flops(device, "bfloat16")
    mfu = flops_per_token(mcfg, setup.seq_len) * tokens_per_s / peak if peak else None
    return dict(
        run=name,
        model=setup.model,
        activation_checkpointing=checkpointing,
        batch=setup.batch,
        seq_len=setup.seq_len,
        timed_steps=setup.steps,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        fsdp2_mfu=None if mfu is None else mfu * ours.step_ms / ref.step_ms,
        step_ms=ours.step_ms,
        fsdp2_step_ms=ref.step_ms,
        step_time_ratio_vs_fsdp2=ours.step_ms / ref.step_ms,
        tokens_per_s_ratio_vs_fsdp2=ref.step_ms / ours.step_ms,
        peak_gib=gib(ours.peak_bytes),
        planned_peak_gib=gib(planned_peak(mcfg, sharding, setup, device_memory(device))),
        fsdp2_peak_gib=gib(ref.peak_bytes),
        exposed_comm_ms=ours.exposed_ms,
        loss=ours.first_loss,
        fsdp2_loss=ref.first_loss,
        loss_rel_diff_vs_fsdp2=abs(ours.first_loss - ref.first_loss) / abs(ref.first_loss),
    )


def gib(n: Optional[int]) -> Optional[float]:
    return None if n is None else n / GiB


def report(name: str, who: str, m: Measured) -> None:
    peak = "" if m.peak_bytes is None else f" | peak {m.peak_bytes / GiB:6.2f} GiB"
    print(
        f"{name:14s} {who:5s} | {m.step_ms:8.1f} ms/step | loss {m.first_loss:.4f}{peak}",
        flush=True,
    )


# ---- output ----------------------------------------------------------------------------------
COLUMNS = (
    ("run", "run", "{:14s}"),
    ("tok/s", "tokens_per_s", "{:>10,.0f}"),
    ("MFU", "mfu", "{:>6.1%}"),
    ("ms/step", "step_ms", "{:>8.1f}"),
    ("FSDP2 ms", "fsdp2_step_ms", "{:>8.1f}"),
    ("ours/FSDP2", "step_time_ratio_vs_fsdp2", "{:>10.3f}"),
    ("peak GiB", "peak_gib", "{:>8.2f}"),
    ("plan GiB", "planned_peak_gib", "{:>8.2f}"),
    ("FSDP2 GiB", "fsdp2_peak_gib", "{:>9.2f}"),
    ("exposed ms", "exposed_comm_ms", "{:>10.2f}"),
    ("loss diff", "loss_rel_diff_vs_fsdp2", "{:>9.1e}"),
)


def table(rows: list[dict]) -> str:
    def cell(fmt: str, value, width: int) -> str:
        return "-".rjust(width) if value is None else fmt.format(value)

    widths = [len(fmt.format(0 if key != "run" else "")) for _, key, fmt in COLUMNS]
    widths = [max(w, len(title)) for w, (title, _, _) in zip(widths, COLUMNS)]
    head = " | ".join(
        t.rjust(w) if i else t.ljust(w) for i, ((t, _, _), w) in enumerate(zip(COLUMNS, widths))
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [cell(fmt, r[key], w) for (_, key, fmt), w in zip(COLUMNS, widths)]
        lines.append(" | ".join(c.rjust(w) for c, w in zip(cells, widths)))
    return "\n".join(lines)


def headline(rows: list[dict], device: torch.device, seconds: float) -> dict:
    out = dict(
        benchmark="gpu_check",
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        world_size=1,
        strategy="FULL_SHARD",
        param_dtype="bfloat16",
    )
    for r in rows:
        out[f"mfu_{r['run']}"] = r["mfu"]
    for key in (
        "tokens_per_s",
        "tokens_per_s_ratio_vs_fsdp2",
        "step_time_ratio_vs_fsdp2",
        "exposed_comm_ms",
        "loss_rel_diff_vs_fsdp2",
    ):
        out[key] = {r["run"]: r[key] for r in rows}
    out["peak_gib"] = {
        r["run"]: dict(
            planned=r["planned_peak_gib"], measured=r["peak_gib"], fsdp2=r["fsdp2_peak_gib"]
        )
        for r in rows
    }
    out["runs"] = rows
    out["elapsed_s"] = seconds
    return out


def problems(rows: list[dict]) -> list[str]:
    """What makes the check fail: a first-step loss that is not finite or disagrees with FSDP2's
    (same weights, batch and bf16 compute)."""
    out = []
    for r in rows:
        if not (math.isfinite(r["loss"]) and r["loss_rel_diff_vs_fsdp2"] <= LOSS_TOLERANCE):
            out.append(
                f"{r['run']}: first-step loss {r['loss']:.5f} vs FSDP2 {r['fsdp2_loss']:.5f} "
                f"(rel diff {r['loss_rel_diff_vs_fsdp2']:.2e}; allowed {LOSS_TOLERANCE})"
            )
    return out


# ---- entry -----------------------------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    """cuda:0 (fails with how to get a CUDA build when there is none) or the CPU."""
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(
            f"benchmarks.gpu_check --device cuda: torch {torch.__version__} in {sys.executable} "
            f"sees no CUDA device (torch.version.cuda={torch.version.cuda}); {CUDA_HINT}"
        )
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def setups(args) -> tuple[Setup, ...]:
    if args.quick:
        return QUICK
    known = {s.model: s for s in FULL}
    wanted = [m for m in args.models.split(",") if m]
    unknown = [m for m in wanted if m not in known]
    if unknown or not wanted:
        raise SystemExit(
            f"--models {args.models!r}: valid are {', '.join(known)} (comma-separated)"
        )
    return tuple(known[m] for m in wanted)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--quick", action="store_true", help="the tiny model, a few steps (the CPU smoke test)"
    )
    p.add_argument("--models", default="125m,1b", help="of 125m,1b (ignored with --quick)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    todo = setups(args)
    t0 = time.perf_counter()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    rows = []
    try:
        for setup in todo:
            init = initial_state(model_config(setup.model))
            for checkpointing in (False, True):
                rows.append(run(setup, checkpointing, init, device))
            del init
    finally:
        dist.destroy_process_group()
    print(table(rows))
    failed = problems(rows)
    for line in failed:
        print(f"FAILED {line}", flush=True)
    print(json.dumps(headline(rows, device, time.perf_counter() - t0)), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
