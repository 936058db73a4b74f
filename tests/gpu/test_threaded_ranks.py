"""The engine's collective path at world size 2, 3 and 4 on ONE device, against the single-process
reference: rank threads joined by torch's threaded process group (threaded_ranks.py says why not
NCCL or gloo, and what makes the threaded group order collectives on CUDA streams as NCCL does).

Each test runs twice: on the CPU (always: it proves the harness in CI, where there is no GPU) and
on CUDA (skipped without a GPU; `make gpu-check` runs it), where every rank drives its own compute
stream and the engine's three collective streams, events and buffer lifetimes on the one GPU.
"""

import pytest
import torch
import torch.distributed as dist

from tests.fsdp.scaffold import reference, rel
from tests.gpu.threaded_ranks import rank_stream, run_threaded, train_tiny
from trainer.fsdp.collectives import _all_gather, _reduce_scatter  # torch 2.13's names, or older

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)
DEVICES = ["cpu", CUDA]
STEPS, BATCH = 4, 6  # 6 rows: 3+3 at world 2, 2+2+2 at 3, 1+2+1+2 at 4
# fp32 against the CPU reference: on the CPU as tight as tests/fsdp/test_parity.py. CUDA kernels
# sum in another order than the CPU's, so 10x that; a collective racing its stream hands a unit
# stale or half-written parameters and misses by orders of magnitude more.
TOL = {"cpu": 1e-5, "cuda": 1e-4}
BF16_TOL = 1e-2  # bf16 against the fp32 reference, as test_parity.py allows


@pytest.fixture(scope="module")
def ref():
    return reference(STEPS, BATCH)


def check_matches_reference(r: dict, ref: dict, tol: float) -> None:
    worst = max(rel(a, b) for a, b in zip(r["losses"], ref["losses"]))
    assert worst < tol, f"loss rel err {worst:.2e} (losses {r['losses']} vs {ref['losses']})"
    worst = max(rel(a, b) for a, b in zip(r["norms"], ref["norms"]))
    assert worst < tol, f"grad-norm rel err {worst:.2e}"
    for k, g in ref["grads0"].items():
        atol = 0.1 * tol * float(g.abs().max())
        assert torch.allclose(r["grads0"][k], g, rtol=10 * tol, atol=atol), f"step-0 grad of {k}"
    for k, p in ref["params"].items():
        err = float((r["params"][k] - p).abs().max())
        assert err < tol, f"{k} after {STEPS} steps: max abs err {err:.2e}"


def check_communicated(results: list, device: str) -> None:
    """Every rank moved bytes every step and measured how long its compute waited for them."""
    for rank, r in enumerate(results):
        assert all(b > 0 for b in r["comm_bytes"]), f"rank {rank}: a step moved no bytes"
        assert all(0 <= ms < 60_000 for ms in r["exposed_ms"]), (rank, r["exposed_ms"])
        assert r["collective_streams"] == (3 if device == "cuda" else 0), (rank, r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [2, 3])
def test_full_shard_matches_single_process_on_one_device(ref, device, world):
    results = run_threaded(train_tiny, world, device, STEPS, BATCH, dict(strategy="FULL_SHARD"))
    check_communicated(results, device)
    for r in results:  # every rank saw the same all-reduced losses and gathered the same params
        check_matches_reference(r, ref, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_shard_two_groups_of_two_matches_single_process_at_world_size_4(ref, device):
    sharding = dict(strategy="HYBRID_SHARD", hybrid_shard_group_size=2)
    results = run_threaded(train_tiny, 4, device, STEPS, BATCH, sharding)
    check_communicated(results, device)
    check_matches_reference(results[0], ref, TOL[device])
    check_matches_reference(results[3], ref, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_full_shard_with_checkpointing_tracks_fp32_at_world_size_2(ref, device):
    sharding = dict(strategy="FULL_SHARD", param_dtype="bfloat16", activation_checkpointing=True)
    results = run_threaded(train_tiny, 2, device, STEPS, BATCH, sharding)
    check_communicated(results, device)
    worst = max(rel(a, b) for a, b in zip(results[0]["losses"], ref["losses"]))
    assert worst < BF16_TOL, f"bf16 loss rel err {worst:.2e} vs the fp32 reference"


def _late_inputs(rank: int, world: int, device: str) -> tuple:
    """Each rank writes its input only after its stream sleeps (rank 0, whose thread queues the
    copies, not at all; rank r ~10r ms), then gathers and reduce-scatters it on that stream."""
    dev = torch.device(device)
    with rank_stream(dev):
        inp = torch.zeros(world * 4096, device=dev)
        if dev.type == "cuda" and rank:
            torch.cuda._sleep(20_000_000 * rank)  # cycles: ~10 ms a rank at ~2 GHz
        inp.fill_(rank + 1)
        gathered = torch.empty(world * inp.numel(), device=dev)
        _all_gather(gathered, inp)
        reduced = torch.empty(inp.numel() // world, device=dev)
        _reduce_scatter(reduced, inp, op=dist.ReduceOp.SUM)
        return gathered.view(world, -1)[:, 0].tolist(), reduced.unique().tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_threaded_collectives_wait_for_and_precede_each_ranks_stream(device):
    """The harness itself: a collective reads each rank's input only after the work that rank
    queued before it (here a sleep, then the write), and its result is what that rank's stream
    reads next. Upstream's threaded group would copy at once on rank 0's idle stream and gather
    the other ranks' zeros."""
    world = 3
    for gathered, reduced in run_threaded(_late_inputs, world, device):
        assert gathered == [1.0, 2.0, 3.0]
        assert reduced == [6.0]
