"""The memory planner against the engine, the ZeRO paper and a real CPU training step.

- State terms (parameter, gradient and optimizer shards) equal the engine's accounting exactly, on
  every rank, at world sizes 1, 2, 3 for each strategy; so do the bytes sent per step.
- The ZeRO formulas give the paper's 120 / 31.4 / 16.6 / 1.9 GB, and our strategies' state maps
  onto them (stage 3 exactly, stage 0 exactly, stage 2 up to our fp32 gradient shards).
- The planned peak is within 15% (+ 4 MiB of CPU kernel scratch) of the measured peak of a real
  step (world size 2, gloo), for the tiny model and a mid-size one (dim 512, 8 layers). Measured =
  the engine's persistent bytes (exact, its own accounting) + the larger rise of the rank's
  resident memory over the second and third steps, from just before each to its high-water mark
  during it (VmHWM, cleared first; with glibc's mmap threshold fixed at
  64 KiB every larger tensor is its own mapping, returned to the OS when freed, so resident memory
  follows the live tensors). That rise covers everything the step allocates: activations, autograd
  temporaries, gathered parameters, unsharded gradients, optimizer temporaries, gloo's buffers.
  The plan models NCCL, and gloo differs in one place: its reduce-scatter clones the input
  (ProcessGroupGloo implements it as clone + all-reduce) and keeps the clone as long as the work
  object, which the engine holds until backward ends, while the output's pages are first written
  at the wait. That is why the plan reads up to ~10% low on the mid-size model at world size 2
  (by hand it measured within 3% at world size 1, where nothing is communicated).
- An 8B job that cannot fit on 8 x 80 GiB fails in seconds, with the breakdown and what would fit.
- A plan fits in the device's memory less a CUDA worker's headroom (the CUDA context, NCCL's
  buffers per communicator build_mesh gives a rank, a fragmentation margin), each term as
  trainer/plan/headroom.py documents it; headroom=False plans against the whole device.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import resource
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cluster.config import ClusterConfig, JobConfig
from cluster.plan import main as plan_main
from cluster.tracking import job as tracking
from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import MODEL
from trainer.config import (
    ConfigError,
    DataConfig,
    OptimConfig,
    ShardingConfig,
    TrainConfig,
    model_config,
)
from trainer.data import rank_range
from trainer.fsdp import build_mesh, parallelize
from trainer.fsdp import mesh as fsdp_mesh
from trainer.model import build_model, count_params, initializer, loss_sum
from trainer.optim import build_optimizer
from trainer.plan import (
    Headroom,
    check_fits,
    format_recommendation,
    nccl_communicators,
    plan,
    profile,
    recommend,
    zero_stage_bytes,
)

GiB = 2**30
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
BIG = 2**50  # device memory for plans that only compare numbers
# The parity model of tests/fsdp (scaffold.MODEL): no unit divides by 3, so every unit pads at
# world size 3 (none can pad at 2: every unit is a multiple of the even dim).
UNEVEN = model_config("tiny", **MODEL)
MID = model_config("tiny", dim=512, n_layers=8, n_heads=8, ffn_dim=1376)


def job(model=UNEVEN, global_batch=6, seq_len=16, micro_batches=1, **sharding) -> JobConfig:
    return JobConfig(
        model=model,
        sharding=ShardingConfig(**sharding),
        train=TrainConfig(global_batch_size=global_batch, micro_batches=micro_batches),
        data=DataConfig(seq_len=seq_len),
    )


# ------------------------------------------------------------------------- one real step per rank


def _resident(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _train_two_steps(rank: int, world: int, cfg: JobConfig) -> dict:
    """Three steps of the engine as trainer/loop.py runs them; figures of the steady steps (the
    first also allocates the optimizer state): the larger resident rise of the two, as a step's
    own memory can only be missed (by pages reused from the allocator's free lists), never
    added by anything else in this process."""
    mesh = build_mesh(cfg.sharding, rank, world, local_world_size=world)
    fsdp = parallelize(
        build_model(cfg.model, device="meta"), cfg.sharding, mesh, "cpu", init_fn=initializer(0)
    )
    if cfg.optim.state_dtype != "float32" or cfg.sharding.master_dtype.value != "float32":
        opt = build_optimizer(fsdp, cfg.optim)  # the levers' own AdamW (trainer/optim.py)
    else:
        opt = torch.optim.AdamW(fsdp.param_groups(0.1), lr=1e-3, foreach=False)
    b, t, micro = cfg.train.global_batch_size, cfg.data.seq_len, cfg.train.micro_batches
    lo, hi = rank_range(b, world, rank)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(0)
    )
    rises = []
    for _ in range(3):
        gc.collect()
        before = _resident("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # restart the high-water mark from the current resident set
        for k, rows in enumerate(np.array_split(np.arange(lo, hi), micro)):
            weight = 1.0
            if len(rows) == 0:  # as trainer.data.Batcher: a padding micro-batch of one sequence
                rows, weight = np.array([0]), 0.0
            with fsdp.no_sync() if k < micro - 1 else contextlib.nullcontext():
                s, _ = loss_sum(fsdp(tokens[rows, :-1]), tokens[rows, 1:], weight)
                (s / (b * t)).backward()
            del s
        fsdp.clip_grad_norm_(1.0)
        opt.step()
        fsdp.zero_grad()
        fsdp.metrics(opt)  # counts the optimizer state in the accounting
        rises.append(_resident("VmHWM") - before)
    return dict(
        live=dict(fsdp.acct.live),
        peak=dict(fsdp.acct.peak),
        comm=dict(fsdp.acct.comm_bytes),
        persistent=fsdp.acct.persistent_bytes(),
        rss_rise=max(rises[1:]),
        rss_rises=rises,
    )


def _train_jobs(rank: int, world: int, jobs: list[JobConfig]) -> list[dict]:
    """In a spawned rank: every tensor above 64 KiB gets its own mapping, returned to the OS when
    freed (glibc's M_MMAP_THRESHOLD, fixed), so the resident set follows the live tensors."""
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    out = []
    for cfg in jobs:
        out.append(_train_two_steps(rank, world, cfg))
        if world > 1:
            dist.barrier()  # the next job's baseline: after every rank has finished this one
    return out


# ------------------------------------------------------------------------- exact state and traffic


def state_jobs(world: int) -> list[JobConfig]:
    hybrid = 1 if world > 1 else 0  # world > 1: one rank per shard group, shards all-reduced across
    return [
        job(strategy="FULL_SHARD"),
        job(strategy="SHARD_GRAD_OP"),
        job(strategy="NO_SHARD"),
        job(strategy="HYBRID_SHARD", hybrid_shard_group_size=hybrid),
        job(
            strategy="FULL_SHARD", param_dtype="bfloat16", reduce_dtype="bfloat16", micro_batches=2
        ),
    ]


@pytest.fixture(scope="module")
def world2():
    """One process group of 2 runs the state jobs and the jobs measured against the plan."""
    results = run_distributed(_train_jobs, 2, state_jobs(2) + TOTAL_JOBS)
    n = len(state_jobs(2))
    return [r[:n] for r in results], results[0][n:]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def engine_state(request):
    world = request.param
    if world == 1:  # no collectives at all: run here, without spawning
        ranks = [[_train_two_steps(0, 1, cfg) for cfg in state_jobs(1)]]
    elif world == 2:
        ranks = request.getfixturevalue("world2")[0]
    else:
        ranks = run_distributed(_train_jobs, world, state_jobs(world))
    return world, state_jobs(world), ranks


def test_state_terms_equal_the_engine_accounting_on_every_rank(engine_state):
    world, jobs, ranks = engine_state
    for cfg in jobs:
        for rank, results in enumerate(ranks):
            r = results[jobs.index(cfg)]
            p = plan(cfg, world, BIG, local_world_size=world, rank=rank)
            tag = f"world={world} rank={rank} {cfg.sharding.strategy}"
            assert p.sharded_params == r["live"]["sharded_params"], tag
            assert p.sharded_grads == r["peak"]["sharded_grads"], tag  # zero_grad freed them
            assert r["live"]["sharded_grads"] == 0 or p.offload, tag
            assert p.optim_state == r["live"]["optim_state"], tag
            assert p.persistent == r["persistent"], tag


def test_bytes_sent_per_step_equal_the_engine_accounting(engine_state):
    world, jobs, ranks = engine_state
    for cfg, r in zip(jobs, ranks[0]):
        p = plan(cfg, world, BIG, local_world_size=world)
        sent = {op: n for op, n in p.bytes_moved.items() if n}
        assert sent == r["comm"], (
            f"world={world} {cfg.sharding.strategy} micro={cfg.train.micro_batches}"
        )


def test_engine_buffers_stay_within_the_planned_schedule(engine_state):
    """Unsharded gradients peak at a hand-off to the reducer (the newest max_reductions_in_flight
    + 1 alive): the plan says exactly that much; gathered parameters never exceed the plan's
    bound."""
    world, jobs, ranks = engine_state
    for cfg, r in zip(jobs, ranks[0]):
        p = plan(cfg, world, BIG, local_world_size=world)
        tag = f"world={world} {cfg.sharding.strategy}"
        if cfg.train.micro_batches == 1:
            assert p.timeline.hand_off_peak == r["peak"]["unsharded_grads"], tag
        else:  # the plan adds the no_sync accumulators, which the engine does not account
            assert p.timeline.max_of("unsharded_grads") >= r["peak"]["unsharded_grads"], tag
        assert r["peak"]["gathered_params"] <= p.timeline.max_of("gathered_params"), tag


# ----------------------------------------------------------------------------- ZeRO


def test_zero_formula_gives_the_papers_figures_for_7_5b_on_64_devices():
    figures = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in figures.items():
        assert zero_stage_bytes(7_500_000_000, 64, stage) / 1e9 == pytest.approx(gb, abs=0.05), (
            stage
        )


def test_our_strategies_state_maps_onto_the_zero_stages():
    """A ~7.5B model (8B shapes, 30 layers), bf16 compute, fp32 master and AdamW, 64 workers."""
    model = model_config("8b", n_layers=30)
    psi, n = count_params(model), 64
    cfg = job(model=model, global_batch=64, seq_len=128, param_dtype="bfloat16")

    def state(strategy, **kw):
        sh = dataclasses.replace(cfg.sharding, strategy=strategy, **kw)
        return plan(dataclasses.replace(cfg, sharding=sh), n, BIG)

    padding = 16 * n * (model.n_layers + 1)  # < n elements per unit, 16 bytes each
    assert state("NO_SHARD").model_state == zero_stage_bytes(psi, n, 0)  # 16 psi, no padding
    assert abs(state("FULL_SHARD").model_state - zero_stage_bytes(psi, n, 3)) <= padding
    assert (
        abs(state("HYBRID_SHARD").model_state - zero_stage_bytes(psi, 8, 3)) <= padding
    )  # 8 per node
    sgo = state("SHARD_GRAD_OP")
    during_backward = sgo.model_state + sgo.timeline.max_of("gathered_params")
    assert (
        abs(during_backward - zero_stage_bytes(psi, n, 2) - 2 * psi / n) <= padding
    )  # fp32 grad shards


# ----------------------------------------------------------------------------- against a real step

TOTAL_JOBS = [
    job(model=model_config("tiny"), global_batch=8, seq_len=128, strategy="FULL_SHARD"),
    job(model=model_config("tiny"), global_batch=8, seq_len=128, strategy="SHARD_GRAD_OP"),
    job(model=model_config("tiny"), global_batch=8, seq_len=128, strategy="NO_SHARD"),
    job(
        model=model_config("tiny"),
        global_batch=8,
        seq_len=128,
        strategy="FULL_SHARD",
        param_dtype="bfloat16",
        activation_checkpointing=True,
    ),
    job(
        model=model_config("tiny"),
        global_batch=8,
        seq_len=128,
        strategy="FULL_SHARD",
        micro_batches=2,
    ),
    job(model=MID, global_batch=2, seq_len=128, strategy="FULL_SHARD"),
    dataclasses.replace(  # the memory levers of issue 28: bf16 moments and a bf16 master
        job(model=MID, global_batch=2, seq_len=128, strategy="FULL_SHARD", master_dtype="bfloat16"),
        optim=OptimConfig(state_dtype="bfloat16"),
    ),
    job(
        model=MID,
        global_batch=2,
        seq_len=128,
        strategy="SHARD_GRAD_OP",
        param_dtype="bfloat16",
        activation_checkpointing=True,
    ),
]


SCRATCH = 4 * 2**20
"""CPU kernels' own scratch memory, which the plan does not model and which differs between
machines (another CPU, other kernels): the tiny jobs measured 5-7 MiB less in CI than here, the
small bf16 one out of 15% alone (1.166 and 1.168 there, 1.10 here)."""


def test_planned_peak_is_within_15_percent_of_a_real_cpu_step(world2):
    results = world2[1]
    report, failures = [], []
    for cfg, r in zip(TOTAL_JOBS, results):
        p = plan(cfg, 2, BIG, local_world_size=2)
        measured = r["persistent"] + r["rss_rise"]
        ratio = p.total / measured
        line = (
            f"{cfg.model.dim}x{cfg.model.n_layers} {cfg.sharding.strategy} "
            f"{cfg.sharding.param_dtype} ckpt={cfg.sharding.activation_checkpointing} "
            f"micro={cfg.train.micro_batches} master={cfg.sharding.master_dtype} "
            f"moments={cfg.optim.state_dtype}: planned "
            f"{p.total / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, ratio {ratio:.3f}"
            f" (rises {[round(x / 2**20, 1) for x in r['rss_rises']]} MiB)"
        )
        report.append(line)
        if abs(p.total - measured) > 0.15 * measured + SCRATCH:
            failures.append(line)
    print("\n".join(report))
    assert not failures, "\n".join(failures)


def test_checkpointing_keeps_only_each_blocks_input():
    without = profile(MID, 2, 128, "float32", False).block
    with_ckpt = profile(MID, 2, 128, "float32", True).block
    assert with_ckpt.retained == pytest.approx(without.io_bytes, rel=0.05)
    assert without.retained > 8 * without.io_bytes  # attention, FFN and norm inputs per block
    assert with_ckpt.backward_peak > without.retained  # the recompute happens in backward


# ----------------------------------------------------------------------------- fail fast, recommend

EIGHT_B = job(
    model=model_config("8b"),
    global_batch=64,
    seq_len=4096,
    strategy="FULL_SHARD",
    param_dtype="bfloat16",
)


def test_8b_that_cannot_fit_on_8_gpus_fails_fast_with_the_breakdown():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        check_fits(EIGHT_B, 8, 80 * GiB)
    elapsed = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    msg = str(err.value)
    assert msg.startswith("invalid config: sharding.strategy=FULL_SHARD")
    for row in (
        "sharded parameters",
        "optimizer state",
        "gathered parameters",
        "unsharded gradients",
        "activations: blocks",
        "activations: embedding, logits, loss",
        "DOES NOT FIT",
        "usable for tensors",
    ):
        assert row in msg, row
    # SHARD_GRAD_OP or FULL_SHARD (both fit once the chunked loss keeps no full logits)
    assert "with activation checkpointing" in msg.split("recommended: ")[1].splitlines()[0]
    assert "Memory levers that make it fit" in msg  # and the levers, cheapest first
    assert elapsed < 60 and grown < 2 * GiB, (
        elapsed,
        grown,
    )  # planned, never allocated (8B is 128 GB)


def test_recommendations_fit_and_come_fewest_bytes_first():
    cfg = dataclasses.replace(EIGHT_B, train=TrainConfig(global_batch_size=64, micro_batches=8))
    options = recommend(cfg, 64, 80 * GiB)
    assert options and all(o.fits for o in options)
    on_device = [o for o in options if not o.offload]
    assert options[: len(on_device)] == on_device  # offloading the optimizer comes last
    moved = [o.total_bytes_moved for o in on_device]
    assert moved == sorted(moved)
    assert options[0].strategy == "SHARD_GRAD_OP"  # ~2x params on the wire against FULL_SHARD's ~3x
    # 8 micro-batches of unsharded fp32 gradients (30 GiB at 8B / 64) against reducing each one
    assert any(o.sharded_grad_accumulation for o in options)


def test_sharded_accumulation_is_chosen_when_unsharded_micro_batch_gradients_do_not_fit():
    cfg = dataclasses.replace(
        EIGHT_B,
        sharding=ShardingConfig(param_dtype="bfloat16", activation_checkpointing=True),
        train=TrainConfig(global_batch_size=512, micro_batches=8),
        data=DataConfig(seq_len=4096),
    )
    kept = plan(cfg, 64, 36 * GiB)
    assert not kept.fits  # 8 micro-batches keep ~30 GiB of unsharded fp32 gradients
    chosen = check_fits(cfg, 64, 36 * GiB)
    assert chosen.fits and chosen.sharded_grad_accumulation
    assert chosen.total < kept.total - 25 * GiB
    assert chosen.bytes_moved["reduce_scatter"] == 8 * kept.bytes_moved["reduce_scatter"]


def test_offloading_the_optimizer_leaves_the_compute_copy_on_the_device():
    cfg = dataclasses.replace(EIGHT_B, sharding=ShardingConfig(param_dtype="bfloat16"))
    on = plan(cfg, 8, 80 * GiB)
    off = plan(
        dataclasses.replace(
            cfg, sharding=ShardingConfig(param_dtype="bfloat16", offload="optimizer")
        ),
        8,
        80 * GiB,
    )
    assert off.sharded_params * 2 == on.sharded_params  # bf16 copy of the fp32 shard
    assert off.sharded_grads == off.optim_state == 0
    assert off.host_state == on.model_state  # the 16 B / param / N moved to the host
    on_device_state = on.persistent + on.peak_phase.sharded_grads  # at the peak
    assert off.total == pytest.approx(on.total - on_device_state + off.sharded_params, rel=0.01)


def test_cli_prints_the_plan_and_exits_by_whether_it_fits(capsys):
    args = ["model=tiny", "sharding=full_shard", "cluster.num_workers=4"]
    assert plan_main(args + ["device_memory_gb=80"]) == 0
    out = capsys.readouterr().out
    assert "FULL_SHARD on 4 workers" in out and "fits" in out and "recommended: " in out
    assert plan_main(args + ["device_memory_gb=0.01"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert plan_main(args + ["sharding.strategy=ZERO9"]) == 2
    assert "sharding.strategy" in capsys.readouterr().err


def test_snapshots_cost_host_memory_five_shard_states_per_worker_and_the_plan_says_so():
    """A staging copy in the worker and its share of the keepers' 2 copies x 2 generations."""
    cfg = dataclasses.replace(EIGHT_B, sharding=ShardingConfig(param_dtype="bfloat16"))
    on = plan(cfg, 64, 80 * GiB)
    assert on.snapshot_host == 5 * (on.sharded_params + on.optim_state)  # 12 B/param/N x 5
    assert on.snapshot_host == pytest.approx(5 * 12 * on.num_params / 64, rel=0.01)
    assert "host memory for in-memory snapshots" in on.table()
    off = plan(dataclasses.replace(cfg, train=TrainConfig(snapshot_every=0)), 64, 80 * GiB)
    assert off.snapshot_host == 0 and "in-memory snapshots" not in off.table()
    assert off.total == on.total  # on the host, never on the device


# ----------------------------------------------------------------------------- headroom


def _mesh_groups(monkeypatch, strategy: str, world: int, local: int, hybrid: int = 0) -> int:
    """Distinct groups of more than one rank that build_mesh gives rank 0, the world group
    counted as the loop uses it (its loss all-reduce): with stand-ins for torch.distributed, so
    the engine's own mesh code decides which group is the world's and which its own."""
    fake = types.SimpleNamespace(
        new_group=lambda ranks: tuple(ranks), group=types.SimpleNamespace(WORLD="WORLD")
    )
    monkeypatch.setattr(fsdp_mesh, "dist", fake)
    sh = ShardingConfig(strategy=strategy, hybrid_shard_group_size=hybrid)
    m = build_mesh(sh, 0, world, local_world_size=local)
    groups = {m.shard_group, m.replicate_group, "WORLD" if world > 1 else None} - {None}
    return len(groups)


@pytest.mark.parametrize(
    "strategy, world, local, hybrid, expected",
    [
        ("FULL_SHARD", 1, 1, 0, 0),
        ("SHARD_GRAD_OP", 1, 1, 0, 0),
        ("NO_SHARD", 1, 1, 0, 0),
        ("HYBRID_SHARD", 1, 1, 0, 0),
        ("FULL_SHARD", 2, 2, 0, 1),
        ("FULL_SHARD", 64, 8, 0, 1),
        ("SHARD_GRAD_OP", 64, 8, 0, 1),
        ("NO_SHARD", 64, 8, 0, 1),
        ("HYBRID_SHARD", 64, 8, 0, 3),  # 8 per node x 8 nodes: world, shard and replicate groups
        ("HYBRID_SHARD", 4, 2, 0, 3),  # 2 groups of 2
        ("HYBRID_SHARD", 8, 8, 0, 1),  # one node: the shard group is the world
        ("HYBRID_SHARD", 8, 8, 1, 1),  # groups of 1: the replicate group is the world
        ("HYBRID_SHARD", 8, 8, 4, 3),
    ],
)
def test_nccl_communicators_are_the_groups_build_mesh_gives_a_rank(
    monkeypatch, strategy, world, local, hybrid, expected
):
    cfg = job(global_batch=64, strategy=strategy, hybrid_shard_group_size=hybrid)
    p = plan(cfg, world, BIG, local_world_size=local)
    assert nccl_communicators(world, p.shard_size, p.replicate_size) == expected
    assert p.headroom.nccl_communicators == expected
    assert p.headroom.nccl_buffers == expected * 3 * GiB // 4  # 0.75 GiB per communicator
    assert _mesh_groups(monkeypatch, strategy, world, local, hybrid) == expected


def test_headroom_is_the_cuda_context_nccl_buffers_and_10_percent_of_the_peak():
    cfg = dataclasses.replace(EIGHT_B, sharding=ShardingConfig(param_dtype="bfloat16"))
    p = plan(cfg, 64, 80 * GiB)  # FULL_SHARD: one communicator, a 7.6 GiB peak
    h = p.headroom
    assert h.cuda_context == 1 * GiB
    assert (h.nccl_communicators, h.nccl_buffers) == (1, 3 * GiB // 4)
    assert h.fragmentation == round(0.10 * p.total) > GiB // 2
    assert h.total == h.cuda_context + h.nccl_buffers + h.fragmentation
    assert p.usable == 80 * GiB - h.total
    small = plan(job(), 1, BIG)  # a tiny step: the margin's floor, no collectives
    assert small.headroom == Headroom(1 * GiB, 0, 0, GiB // 2)


def test_fits_flips_exactly_at_the_memory_usable_for_tensors():
    cfg = job(global_batch=8, strategy="HYBRID_SHARD")
    p = plan(cfg, 4, BIG, local_world_size=2)
    need = p.total + p.headroom.total
    at = plan(cfg, 4, need, local_world_size=2)
    below = plan(cfg, 4, need - 1, local_world_size=2)
    assert at.total == below.total == p.total  # the step's peak does not depend on the device
    assert at.fits and at.usable == p.total
    assert not below.fits
    # a device just above the peak: enough for the tensors alone, not for the headroom
    assert plan(cfg, 4, p.total + 1, local_world_size=2, headroom=False).fits
    assert not plan(cfg, 4, p.total + 1, local_world_size=2).fits


def test_headroom_none_reproduces_the_fit_against_the_whole_device():
    assert Headroom.none() == Headroom(0, 0, 0, 0) and Headroom.none().total == 0
    cfg = dataclasses.replace(EIGHT_B, sharding=ShardingConfig(param_dtype="bfloat16"))
    on = plan(cfg, 64, 80 * GiB)
    off = plan(cfg, 64, 80 * GiB, headroom=False)
    assert off.headroom == Headroom.none() and off.usable == 80 * GiB
    assert off.total == on.total  # the allocator's peak either way
    for device in (on.total - 1, on.total, on.total + 1, on.total + on.headroom.total):
        p = plan(cfg, 64, device, headroom=False)
        assert p.fits == (p.total <= device), device
    assert "usable for tensors" not in off.table()
    assert f"of 80.00 GiB: fits ({(80 * GiB - off.total) / GiB:.2f} GiB free)" in off.table()


def test_the_table_shows_each_reserved_term_and_the_verdict_against_what_is_left():
    cfg = dataclasses.replace(
        EIGHT_B, sharding=ShardingConfig(strategy="HYBRID_SHARD", param_dtype="bfloat16")
    )
    p = plan(cfg, 64, 80 * GiB)
    lines = p.table().splitlines()

    def row(label: str) -> str:
        (line,) = [x for x in lines if x.strip().startswith(label)]
        return line

    h = p.headroom
    assert row("device memory").split()[-1] == "80.00"
    assert row("- CUDA context and kernels").split()[-1] == "1.00"
    assert row("- NCCL buffers (3 communicators)").split()[-1] == f"{h.nccl_buffers / GiB:.2f}"
    fragmentation = row("- allocator fragmentation margin (10% of peak)")
    assert fragmentation.split()[-1] == f"{h.fragmentation / GiB:.2f}"
    usable = row("= usable for tensors")
    assert f"{p.usable / GiB:.2f}   fits ({(p.usable - p.total) / GiB:.2f} GiB free)" in usable
    tight = plan(cfg, 64, p.total + GiB)  # the whole device would fit, the usable part does not
    short = (tight.total - tight.usable) / GiB
    assert f"DOES NOT FIT (short by {short:.2f} GiB)" in tight.table()
    small = plan(job(), 1, 80 * GiB).table()
    assert "NCCL buffers (0 communicators)" in small
    assert "allocator fragmentation margin (floor 0.5 GiB)" in small


def test_recommend_and_check_fits_use_the_headroom_and_can_turn_it_off():
    cfg = dataclasses.replace(EIGHT_B, sharding=ShardingConfig(param_dtype="bfloat16"))
    p = plan(cfg, 64, BIG)
    device = p.total + 1  # the configured job fits the whole device, not what is usable
    assert check_fits(cfg, 64, device, headroom=False).total == p.total
    with pytest.raises(ConfigError, match="usable for tensors of the device's"):
        check_fits(cfg, 64, device)
    options = recommend(cfg, 64, 80 * GiB)
    assert options and all(o.fits and o.total <= o.usable < 80 * GiB for o in options)
    assert all(o.headroom == Headroom.none() for o in recommend(cfg, 64, 80 * GiB, headroom=False))
    assert "GiB usable" in format_recommendation(options, plan(cfg, 64, 80 * GiB))


@pytest.mark.parametrize("use_gpu", [True, False])
def test_the_logged_memory_plan_reserves_headroom_for_gpu_workers_only(
    monkeypatch, tmp_path, use_gpu
):
    cfg = dataclasses.replace(job(), cluster=ClusterConfig(num_workers=2, use_gpu=use_gpu))
    monkeypatch.setattr(tracking, "device_memory", lambda cfg: (80 * GiB, "a test's 80 GiB"))
    text = Path(tracking.write_memory_plan(cfg, tmp_path / "memory_plan.txt")).read_text()
    for label in (
        "CUDA context and kernels",
        "NCCL buffers (1 communicator)",
        "usable for tensors",
    ):
        assert (label in text) == use_gpu, label
    assert "fits" in text


def test_mixture_presets_have_their_published_totals_and_the_planner_prices_the_expert_axis():
    """Qwen3-30B-A3B (30.5B, 3.3B active) and Mixtral-8x7B (46.7B, 12.9B active); with
    sharding.expert_parallel a worker holds its share of the experts, gathers and reduces them
    over the ranks holding the same ones, and sends the token exchange."""
    from trainer.model import count_params
    from trainer.model.config import PRESETS

    assert count_params(PRESETS["qwen3-30b-a3b"]) == 30_532_122_624
    assert count_params(PRESETS["qwen3-30b-a3b"], active=True) == 3_353_032_704
    assert count_params(PRESETS["mixtral-8x7b"]) == 46_702_792_704
    assert count_params(PRESETS["mixtral-8x7b"], active=True) == 12_879_925_248
    small = model_config("tiny", moe_experts=8, moe_top_k=2, moe_ffn_dim=64, moe_layers=[1, 3])
    dense = job(model=small, global_batch=8, seq_len=64, strategy="FULL_SHARD")
    spread = job(model=small, global_batch=8, seq_len=64, strategy="FULL_SHARD", expert_parallel=4)
    a, b = plan(dense, 8, BIG, 8), plan(spread, 8, BIG, 8)
    assert (a.experts_per_rank, b.experts_per_rank) == (8, 2)
    assert a.num_params == b.num_params == count_params(small)
    assert "all_to_all" not in a.bytes_moved and b.bytes_moved["all_to_all"] == (
        2 * 4 * 64 * 2 * 3 // 4 * small.dim * 4  # layers x passes x tokens x k x 3/4 x D x fp32
    )
    # the experts are gathered over 2 ranks instead of 8: fewer all-gather bytes
    assert b.bytes_moved["all_gather"] < a.bytes_moved["all_gather"]
    # the routers' saved activations: per token E x (fp32 logits + probabilities) + k x (index,
    # weight), 2 sparse layers, rank 0's micro-batch of 1 x 64 tokens
    assert a.router_activations == 64 * (8 * 8 + 2 * 12) * 2
    from trainer.plan.report import format_plan

    line = next(x for x in format_plan(b).splitlines() if "mixture of experts:" in x)
    assert "2 experts of every sparse layer on each worker" in line and "; routers " in line
    # a world the degree does not divide re-plans it (as a resize does): 4 does not divide 6
    assert plan(spread, 6, BIG, 6).experts_per_rank == 4
