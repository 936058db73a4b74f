"""The engine's collective path at world size 2, 3 and 4 on ONE device, against the single-process
reference: rank threads joined by torch's threaded process group (threaded_ranks.py says why not
NCCL or gloo, and what makes the threaded group order collectives on CUDA streams as NCCL does).

Each test runs twice: on the CPU (always: it proves the harness in CI, where there is no GPU) and
on CUDA (skipped without a GPU; `make gpu-check` runs it), where every rank drives its own compute
stream and the engine's three collective streams, events and buffer lifetimes on the one GPU.

The paths, each stepped as trainer/loop.py steps it (threaded_ranks.train_tiny): FULL_SHARD,
HYBRID_SHARD, SHARD_GRAD_OP two gathers and two reductions deep, NO_SHARD's all-reduce, the
optimizer offloaded to (pinned) host memory with micro-batches, bf16 with activation
checkpointing, bf16 reduced in bf16, fp16 under the loss scaler with an overflow on one rank.
"""

import pytest
import torch
import torch.distributed as dist

from tests.fsdp.scaffold import initial_parameters, reference, rel, update_error
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
# The loss moves little in STEPS steps: a run that never updates misses the reference's losses
# by at most 2.4e-3 (relative, at the last step), inside BF16_TOL, so low precision is judged by
# its updates (update_error: 1.0 for a parameter that did not move). Measured on the CPU, worst
# parameter after STEPS steps: bf16 0.065 (fp32 or bf16 reduction alike, offloaded or not), fp16
# 0.026, fp16 with the overflow step skipped 0.042; fp32 runs 5e-6. The bounds leave CUDA's
# reduced-precision GEMM reductions room (3.5x-6x) and stay far below a lost update's 1.0.
BF16_UPDATE_TOL, FP16_UPDATE_TOL = 0.25, 0.15
# Their gradient norms: bf16 off by up to 4e-3 (step 1's, after one bf16 update), fp16 8e-5. The
# bound is for gross errors: a gradient left scaled by the loss scale is off 65536x.
NORM_TOL = 5e-2


@pytest.fixture(scope="module")
def ref():
    return reference(STEPS, BATCH)


@pytest.fixture(scope="module")
def p0():
    return initial_parameters()


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


def check_tracks_reference(r: dict, ref: dict, p0: dict, update_tol: float) -> None:
    """Low precision: the losses and gradient norms near the fp32 reference's (the norms catch a
    gradient left scaled: clipping and AdamW would hide it from the update), and every
    parameter's update too."""
    worst = max(rel(a, b) for a, b in zip(r["losses"], ref["losses"]))
    assert worst < BF16_TOL, f"loss rel err {worst:.2e} vs the fp32 reference"
    worst = max(rel(a, b) for a, b in zip(r["norms"], ref["norms"]))
    assert worst < NORM_TOL, f"grad-norm rel err {worst:.2e} vs the fp32 reference"
    err = update_error(r["params"], ref["params"], p0)
    worst = max(err, key=err.get)
    assert err[worst] < update_tol, f"update of {worst} off the reference's by {err[worst]:.3f}"


def ring_bytes(numels: list[int], itemsize: int, world: int, factor: int = 1) -> float:
    """What accounting.py counts for one collective per flat over `world` ranks (factor 2: an
    all-reduce)."""
    return float(sum(factor * n * itemsize * (world - 1) // world for n in numels))


def most_in_flight(events: list, op: str) -> int:
    """The most collectives of `op` issued and not yet waited for, over the trace."""
    n = most = 0
    for kind, o in events:
        if o == op and kind in ("issue", "wait"):
            n += 1 if kind == "issue" else -1
            most = max(most, n)
    return most


def check_offloaded(r: dict, device: str) -> None:
    """Every flat's master shard on the host (pinned on CUDA), and AdamW's state there too."""
    assert r["host_master_pinned"] == [device == "cuda"] * len(r["reduced_numels"]), r
    assert r["optim_state_on"] == ["cpu"], r["optim_state_on"]


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
def test_bf16_full_shard_with_checkpointing_tracks_fp32_at_world_size_2(ref, p0, device):
    sharding = dict(strategy="FULL_SHARD", param_dtype="bfloat16", activation_checkpointing=True)
    results = run_threaded(train_tiny, 2, device, STEPS, BATCH, sharding)
    check_communicated(results, device)
    check_tracks_reference(results[0], ref, p0, BF16_UPDATE_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_offloaded_optimizer_with_micro_batches_matches_single_process_at_world_size_3(ref, device):
    """sharding.offload=optimizer: the master shards (pinned on CUDA), the gradient shards and
    AdamW's state on the host, each reduced shard copied there on the copy stream as backward
    goes on; two micro-batches (one row each), the first under no_sync."""
    sharding = dict(strategy="FULL_SHARD", offload="optimizer")
    results = run_threaded(train_tiny, 3, device, STEPS, BATCH, sharding, micro_batches=2)
    check_communicated(results, device)
    for r in results:
        check_offloaded(r, device)
        check_matches_reference(r, ref, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_offloaded_optimizer_tracks_fp32_at_world_size_2(ref, p0, device):
    sharding = dict(strategy="FULL_SHARD", param_dtype="bfloat16", offload="optimizer")
    results = run_threaded(train_tiny, 2, device, STEPS, BATCH, sharding)
    check_communicated(results, device)
    for r in results:
        check_offloaded(r, device)
        check_tracks_reference(r, ref, p0, BF16_UPDATE_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_no_shard_all_reduce_matches_single_process_at_world_size_3(ref, device):
    results = run_threaded(train_tiny, 3, device, STEPS, BATCH, dict(strategy="NO_SHARD"))
    check_communicated(results, device)
    for r in results:  # one fp32 all-reduce of every flat gradient a step, nothing else
        moved = ring_bytes(r["reduced_numels"], 4, 3, factor=2)
        assert all(
            c == dict(all_gather=0, reduce_scatter=0, all_reduce=moved) for c in r["comm_by_op"]
        )
        check_matches_reference(r, ref, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_reduce_dtype_tracks_fp32_at_world_size_3(ref, p0, device):
    """Gradients reduce-scattered in bf16 (half the bytes of fp32; the sum of 3 ranks' bf16
    gradients rounded to bf16, then accumulated into the fp32 shards). At this size it lands
    where the fp32 reduction does (0.063 against 0.062 worst update error), so the bytes prove
    that the reduction ran in bf16."""
    sharding = dict(strategy="FULL_SHARD", param_dtype="bfloat16", reduce_dtype="bfloat16")
    results = run_threaded(train_tiny, 3, device, STEPS, BATCH, sharding)
    check_communicated(results, device)
    for r in results:
        moved = ring_bytes(r["reduced_numels"], 2, 3)
        assert [c["reduce_scatter"] for c in r["comm_by_op"]] == [moved] * STEPS
        check_tracks_reference(r, ref, p0, BF16_UPDATE_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_with_loss_scaler_tracks_fp32_at_world_size_2(ref, p0, device):
    results = run_threaded(train_tiny, 2, device, STEPS, BATCH, dict(param_dtype="float16"))
    check_communicated(results, device)
    for r in results:  # the scaler ran (its initial scale, not the disabled one's 1.0), no skip
        assert r["skipped"] == [] and r["scale"] == 2.0**16, (r["skipped"], r["scale"])
        check_tracks_reference(r, ref, p0, FP16_UPDATE_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_overflow_on_one_rank_skips_that_step_on_every_rank_at_world_size_3(ref, p0, device):
    """Rank 2's loss is blown up at step 1: only its gradients overflow, and every rank skips
    that update (the scaler's flag is all-reduced) and halves its scale."""
    step = 1
    results = run_threaded(
        train_tiny, 3, device, STEPS, BATCH, dict(param_dtype="float16"), overflow_at=(step, 2)
    )
    check_communicated(results, device)
    skipped = reference(STEPS, BATCH, skip=(step,))
    for r in results:
        assert r["skipped"] == [step] and r["scale"] == 2.0**15, (r["skipped"], r["scale"])
        check_tracks_reference(r, skipped, p0, FP16_UPDATE_TOL)
    # ...and skipping it mattered: the run that took step 1's update lands elsewhere
    assert max(update_error(results[0]["params"], ref["params"], p0).values()) > FP16_UPDATE_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_shard_grad_op_with_two_gathers_and_two_reductions_in_flight_matches_at_world_size_3(
    ref, device
):
    sharding = dict(
        strategy="SHARD_GRAD_OP", max_gathers_in_flight=2, max_reductions_in_flight=2, trace=True
    )
    results = run_threaded(train_tiny, 3, device, STEPS, BATCH, sharding)
    check_communicated(results, device)
    for r in results:
        assert most_in_flight(r["events"], "all_gather") == 2
        assert most_in_flight(r["events"], "reduce_scatter") == 2
        check_matches_reference(r, ref, TOL[device])


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
