"""`make gpu-check`: our engine on one GPU against torch FSDP2, with the figures asked first.

    python3 -m benchmarks.gpu_check --out gpu-check/      # the whole staged check (gpu_stages.py)
    python -m benchmarks.gpu_check                        # these rows only: 125m and 1b
    python -m benchmarks.gpu_check --models 125m          # one of them
    python -m benchmarks.gpu_check --models 1b --levers   # compiled, Float8, parameter offload
    python -m benchmarks.gpu_check --device cpu --quick   # the same code path: tiny model, gloo

For each model (125m: 32 x 2048 tokens a step, 1b: 8 x 2048), bf16 compute with fp32 master
weights and reductions, FULL_SHARD, without and with activation checkpointing:
- ours, built as trainer/loop.py builds it (parallelize, build_optimizer: fused AdamW on CUDA)
  and stepped by the loop's own recipe (trainer/step.py train_step);
- torch FSDP2 on the same model, weights and batch: fully_shard units as torchtitan makes them
  (the embedding, each block, [norm, output] kept gathered after forward, then the root),
  MixedPrecisionPolicy(bf16 params, fp32 reduce), the same AdamW and activation checkpointing,
  stepped by the same train_step (trainer.step.TorchPeer).
Each trains `warmup` untimed steps, then `steps` timed ones, every step bracketed by device
synchronisations; figures are medians over the timed steps:
- tokens/s and MFU (flops_per_token x tokens/s over the device's dense bf16 peak);
- peak memory from the build on, above what was allocated when the counter was reset (so a
  row's peak is its own, whatever ran before: on CUDA torch.cuda.max_memory_allocated minus the
  allocation at the reset, and the allocator's reserved peak beside it, which calibrates the
  planner's fragmentation margin; on the CPU the high-water of the torch allocator's live bytes
  from torch.profiler's memory events), against the planner's prediction for the same job
  (trainer.plan.plan(...).total);
- exposed communication: the engine's comm/exposed_ms (CUDA timing events around the compute
  stream's waits on collectives);
- the step time of ours over FSDP2's (below 1: we are faster), and its inverse as a tokens/s ratio.

--levers: the rows of the speed and memory levers instead, ours and FSDP2 given the same:
`_compile` (every block's forward compiled in place, trainer.speed; `compile s` is the first
step's extra time), `_compile_float8` (compiled with torchao's tensorwise Float8 linears in the
blocks, our gather still bf16; skipped with the reason where torchao is missing or the GPU is
below sm_89), `_offload_params` (sharding.offload=params; FSDP2 with CPUOffloadPolicy; CUDA
only). --quick runs both kinds on the tiny model, one compiled row (with Float8 through
torchao's CPU emulation where torchao is installed), compiled by aot_eager (inductor's C++ takes
minutes on 2 cores).

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
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine import allocation_high_water
from benchmarks.gpu_contestants import CONTESTANTS, SEED, Setup, initial_state
from benchmarks.gpu_stages import BUDGET_S, MIN_STAGE_S, resolve_device, run_all
from trainer.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ShardingConfig,
    TrainConfig,
    TrainerConfig,
    model_config,
)
from trainer.device import peak_flops
from trainer.model import flops_per_token
from trainer.optim import lr_at, set_lr
from trainer.plan import MemoryPlan, plan
from trainer.speed import check_float8

GiB = 2**30
LOSS_TOLERANCE = (
    1e-2  # bf16 first-step loss, ours vs FSDP2 (tests/fsdp/test_parity.py's bf16 bound)
)


# Sized for MFU within make gpu-check's 6 minutes on one H200 (141 GB); planned peaks without / with
# activation checkpointing: 125m 51 / 27 GiB, 1b 75 / 48 GiB (the 1b's persistent state alone,
# bf16 compute over fp32 master weights, gradients and AdamW state, is 16 B/param = 24 GB).
FULL = (Setup("125m", 32, 2048, 5, 30), Setup("1b", 8, 2048, 5, 25))
QUICK = (Setup("tiny", 2, 32, 1, 2),)


@dataclass(frozen=True)
class Lever:
    """One row's setting beyond bf16 FULL_SHARD, given to ours and FSDP2 alike."""

    suffix: str
    """Of the row's name: <model>_bf16<suffix>."""
    checkpointing: bool = False
    train: TrainConfig = field(default_factory=TrainConfig)
    """compile / float8: trainer.speed.apply_speed_levers on both (FSDP2's blocks compiled and
    converted the same way, before fully_shard)."""
    offload: str = "none"
    """sharding.offload for ours; FSDP2 gets CPUOffloadPolicy(pin_memory=True) for "params"."""
    warmup: Optional[int] = None
    steps: Optional[int] = None
    """None: the setup's. Compiling happens in the first step (untimed); an offloaded 1b steps
    AdamW on the host (seconds a step), so it times fewer."""


PLAIN = (Lever(""), Lever("_ac", checkpointing=True))
"""The rows of every model: bf16 FULL_SHARD without and with activation checkpointing."""
LEVERS = (
    Lever("_compile", train=TrainConfig(compile=True), warmup=3, steps=12),
    Lever(
        "_compile_float8",
        train=TrainConfig(compile=True, float8=True, float8_recipe="tensorwise"),
        warmup=3,
        steps=12,
    ),
    Lever("_offload_params", offload="params", warmup=1, steps=3),
)
"""--levers (1b on the GPU; the CPU dry run takes one compiled row, by aot_eager): the
compiled and the Float8 rows of issue 27, and issue 28's parameter offload."""


@dataclass
class Measured:
    """One contestant's timed steps."""

    step_ms: float
    """Median over the timed steps."""
    first_loss: float
    """Mean token loss of the first (untimed) step: same weights and batch for every contestant."""
    peak_bytes: Optional[int] = None
    """Allocated-memory high-water from the build on, above what was allocated at its start."""
    reserved_bytes: Optional[int] = None
    """CUDA: the caching allocator's reserved high-water above its start (None on the CPU)."""
    exposed_ms: Optional[float] = None
    """Median engine comm/exposed_ms; None for FSDP2 (it has no such figure)."""
    compile_s: Optional[float] = None
    """The first step's time over the median step's: with compile, the compiling (seconds)."""


class MemoryWatch:
    """A contestant's own memory: the high-water above what was allocated when it starts.

    CUDA: max_memory_allocated after a reset, minus memory_allocated at that reset (a model left
    behind by an earlier row, or anything else alive, is not counted), and the same for reserved.
    CPU: the torch allocator's live-bytes high-water from torch.profiler's memory events."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak: Optional[int] = None
        self.reserved: Optional[int] = None

    def __enter__(self) -> "MemoryWatch":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self._base_reserved = torch.cuda.memory_reserved(self.device)
        else:
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            self.reserved = torch.cuda.max_memory_reserved(self.device) - self._base_reserved
        else:
            self._prof.__exit__(*exc)
            if exc[0] is None:
                self.peak = allocation_high_water(self._prof)


# ---- measuring -------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(contestant, setup: Setup, optim: OptimConfig, x, y, device) -> Measured:
    """Warm-up steps, then timed ones, each between two device synchronisations. The learning
    rate follows the loop's schedule (warmup, cosine) over the steps run."""
    tokens = x.numel()
    total = setup.warmup + setup.steps
    times, exposed, first, first_s = [], [], math.nan, 0.0
    for i in range(total):
        set_lr(contestant.optimizer, lr_at(optim, total, i))
        sync(device)
        t0 = time.perf_counter()
        loss = contestant.step(x, y, tokens)
        sync(device)
        t1 = time.perf_counter()
        if i == 0:
            first, first_s = float(loss), t1 - t0
        if i >= setup.warmup:
            times.append(t1 - t0)
            e = contestant.exposed_ms()
            if e is not None:
                exposed.append(e)
    return Measured(
        step_ms=1000 * statistics.median(times),
        first_loss=first,
        exposed_ms=statistics.median(exposed) if exposed else None,
        compile_s=first_s - statistics.median(times),
    )


def contest(cls, setup: Setup, sharding: ShardingConfig, init, x, y, device, **levers) -> Measured:
    """Build one contestant from nothing (the peak counts from here, above what is allocated
    already), train it, free it: the engine frees a dropped model (tests/fsdp/test_no_leak.py),
    so the next contestant starts from the same memory."""
    optim = OptimConfig()
    free(device)
    with MemoryWatch(device) as mem:
        contestant = cls(model_config(setup.model), sharding, optim, device, init, **levers)
        try:
            m = measure(contestant, setup, optim, x, y, device)
        finally:
            del contestant
    free(device)
    m.peak_bytes, m.reserved_bytes = mem.peak, mem.reserved
    return m


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fixed_batch(mcfg: ModelConfig, setup: Setup, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): random tokens, the same for every contestant and step."""
    g = torch.Generator().manual_seed(SEED)
    toks = torch.randint(0, mcfg.vocab_size, (setup.batch, setup.seq_len + 1), generator=g)
    return toks[:, :-1].contiguous().to(device), toks[:, 1:].contiguous().to(device)


def job_plan(mcfg: ModelConfig, sharding: ShardingConfig, setup: Setup, memory: int) -> MemoryPlan:
    """The planner's plan for this very job on one worker (its CUDA headroom included)."""
    cfg = TrainerConfig(
        model=mcfg,
        sharding=sharding,
        train=TrainConfig(global_batch_size=setup.batch),
        data=DataConfig(seq_len=setup.seq_len),
    )
    return plan(cfg, world_size=1, device_memory_bytes=memory)


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # the host's, for the plan


# ---- one model, one setting ------------------------------------------------------------------
ORDERS = ("ours,fsdp2", "fsdp2,ours")


def run(
    setup: Setup, lever: Lever, init, device, order: str = ORDERS[0], backend: str = "inductor"
) -> dict:
    """Ours and FSDP2 on one model and setting, in `order`: the row of the table, as a dict."""
    mcfg = model_config(setup.model)
    sharding = ShardingConfig(
        strategy="FULL_SHARD",
        param_dtype="bfloat16",
        activation_checkpointing=lever.checkpointing,
        offload=lever.offload,
    )
    setup = replace(
        setup,
        warmup=setup.warmup if lever.warmup is None else lever.warmup,
        steps=setup.steps if lever.steps is None else lever.steps,
    )
    x, y = fixed_batch(mcfg, setup, device)
    name = f"{setup.model}_bf16{lever.suffix}"
    measured = {}
    for who in order.split(","):
        measured[who] = contest(
            CONTESTANTS[who],
            setup,
            sharding,
            init,
            x,
            y,
            device,
            train=lever.train,
            backend=backend,
        )
        report(name, who, measured[who])
    ours, ref = measured["ours"], measured["fsdp2"]
    planned = job_plan(mcfg, sharding, setup, device_memory(device))
    tokens_per_s = x.numel() / (ours.step_ms / 1000)
    peak = peak_flops(device, "bfloat16")
    mfu = flops_per_token(mcfg, setup.seq_len) * tokens_per_s / peak if peak else None
    return dict(
        run=name,
        model=setup.model,
        activation_checkpointing=lever.checkpointing,
        compile=lever.train.compile,
        float8=lever.train.float8_recipe if lever.train.float8 else None,
        offload=lever.offload,
        compile_s=ours.compile_s,
        fsdp2_compile_s=ref.compile_s,
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
        planned_peak_gib=gib(planned.total),
        planned_fragmentation_gib=gib(planned.headroom.fragmentation),
        fsdp2_peak_gib=gib(ref.peak_bytes),
        reserved_gib=gib(ours.reserved_bytes),
        fsdp2_reserved_gib=gib(ref.reserved_bytes),
        exposed_comm_ms=ours.exposed_ms,
        loss=ours.first_loss,
        fsdp2_loss=ref.first_loss,
        loss_rel_diff_vs_fsdp2=abs(ours.first_loss - ref.first_loss) / abs(ref.first_loss),
    )


def gib(n: Optional[int]) -> Optional[float]:
    return None if n is None else n / GiB


def report(name: str, who: str, m: Measured) -> None:
    peak = "" if m.peak_bytes is None else f" | peak {m.peak_bytes / GiB:6.3f} GiB"
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
    ("reserved", "reserved_gib", "{:>8.2f}"),
    ("exposed ms", "exposed_comm_ms", "{:>10.2f}"),
    ("compile s", "compile_s", "{:>9.1f}"),
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


def headline(
    rows: list[dict], device: torch.device, seconds: float, skipped: Optional[dict] = None
) -> dict:
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
            planned=r["planned_peak_gib"],
            measured=r["peak_gib"],
            fsdp2=r["fsdp2_peak_gib"],
            reserved=r["reserved_gib"],
            planned_fragmentation=r["planned_fragmentation_gib"],
        )
        for r in rows
    }
    out["compile_s"] = {r["run"]: r["compile_s"] for r in rows if r["compile"]}
    out["skipped"] = skipped or {}
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
    p.add_argument(
        "--out",
        type=Path,
        help="run the whole staged check (benchmarks/gpu_stages.py), its result files in OUT",
    )
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="with --out: the whole run")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--quick", action="store_true", help="the tiny model, a few steps (the CPU smoke test)"
    )
    p.add_argument("--models", default="125m,1b", help="of 125m,1b (ignored with --quick)")
    p.add_argument(
        "--levers",
        action="store_true",
        help="the compiled, Float8 and parameter-offload rows instead of bf16 and bf16 + AC",
    )
    p.add_argument("--order", choices=ORDERS, default=ORDERS[0], help="who runs first in a row")
    p.add_argument(
        "--rows-file", type=Path, help="rewrite this JSON file with the rows after each row"
    )
    args = p.parse_args(argv)
    if args.budget_s < MIN_STAGE_S:  # every stage would be skipped: a check that checks nothing
        p.error(
            f"--budget-s {args.budget_s:g}: valid is at least {MIN_STAGE_S:g} (a stage "
            f"needs that much; the default {BUDGET_S:g} fits the whole check)"
        )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out is not None:
        return run_all(args.out, tuple(m.model for m in setups(args)), args.budget_s)
    device = resolve_device(args.device)
    todo = setups(args)
    t0 = time.perf_counter()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    rows, skipped = [], {}
    # The CPU dry run compiles with aot_eager (inductor's C++ would take minutes on 2 cores).
    compiler = "aot_eager" if args.quick else "inductor"
    try:
        for setup in todo:
            init = initial_state(model_config(setup.model))
            for lever in levers(args):
                why = unavailable(lever, device)
                if why:
                    skipped[f"{setup.model}_bf16{lever.suffix}"] = why
                    print(f"{setup.model}_bf16{lever.suffix}: skipped: {why}", flush=True)
                    continue
                rows.append(run(setup, lever, init, device, args.order, compiler))
                if args.rows_file:  # a stage killed later keeps the rows done
                    write_rows(args.rows_file, rows, device, time.perf_counter() - t0, skipped)
            del init
    finally:
        dist.destroy_process_group()
    print(table(rows))
    failed = problems(rows)
    for line in failed:
        print(f"FAILED {line}", flush=True)
    head = headline(rows, device, time.perf_counter() - t0, skipped)
    if args.rows_file:
        write_rows(args.rows_file, rows, device, head["elapsed_s"], skipped, failed)
    print(json.dumps(head), flush=True)
    return 1 if failed else 0


def levers(args) -> tuple[Lever, ...]:
    """The rows to run per model: --levers the LEVERS, else PLAIN; --quick both kinds, with one
    compiled row (compiled + Float8 where torchao is installed, else compiled alone) to keep the
    CPU dry run short."""
    if args.quick:
        f8 = importlib.util.find_spec("torchao") is not None
        return PLAIN + tuple(x for x in LEVERS if x.offload != "none" or x.train.float8 == f8)
    return LEVERS if args.levers else PLAIN


def unavailable(lever: Lever, device: torch.device) -> Optional[str]:
    """Why this machine cannot run the row (a skip, not a failure), or None."""
    if lever.offload == "params" and device.type != "cuda":
        return "parameter offload is measured on CUDA (pinned host memory, the copy stream)"
    if lever.train.float8:
        try:
            check_float8(lever.train, device)
        except ConfigError as e:  # torchao missing (the float8 extra), or a GPU below sm_89
            return str(e)
    return None


def write_rows(path: Path, rows: list, device, seconds: float, skipped: dict, failed=None) -> None:
    """The headline so far; `failed` (None until the end) says whether the run finished."""
    out = headline(rows, device, seconds, skipped)
    out["finished"] = failed is not None
    out["failed"] = failed or []
    path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
