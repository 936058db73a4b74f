"""The schedule (from the event trace), the memory formulas and the bytes on the wire.

Trace: the gather of unit i+1 is issued before unit i's forward starts; the reduce-scatter of unit
i is issued before unit i-1's backward starts; never more gathers in flight than the bound.
Memory: persistent bytes for fp32 AdamW are 16 B x params / N plus padding, exactly.
Communication: FULL_SHARD ~3x params x (N-1)/N, SHARD_GRAD_OP and NO_SHARD ~2x, bf16 gathers half.
"""

import pytest

from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import engine_run, matrix_run

BATCH = 6


def _run_traced(rank, world, sharding):
    return engine_run(rank, world, 2, BATCH, dict(sharding, trace=True), keep_trace=True)


def second_step(events):
    """Events of the second step: the first step records the execution order, prefetch starts
    after."""
    starts = [i for i, e in enumerate(events) if e == ("compute_start", "forward", "root")]
    return events[starts[1] :]


def index(events, kind, op, unit):
    return events.index((kind, op, unit))


@pytest.fixture(scope="module")
def traced():
    return run_distributed(_run_traced, 2, dict(strategy="FULL_SHARD", max_gathers_in_flight=2))[0]


def test_forward_prefetch_issues_next_gather_before_current_unit_computes(traced):
    ev, order = second_step(traced["events"]), traced["order"]
    assert order == ["layers.0", "layers.1", "layers.2"]
    for cur, nxt in zip(order, order[1:]):
        assert index(ev, "issue", "all_gather", nxt) < index(ev, "compute_start", "forward", cur), (
            cur,
            nxt,
        )


def test_backward_prefetch_and_reduce_scatter_issued_before_previous_unit_backward(traced):
    ev, order = second_step(traced["events"]), traced["order"]
    bwd = ev[index(ev, "compute_end", "forward", "root") :]
    for prev, cur in zip(order, order[1:]):
        start_prev = index(bwd, "compute_start", "backward", prev)
        assert index(bwd, "issue", "reduce_scatter", cur) < start_prev, (cur, prev)
        assert index(bwd, "issue", "all_gather", prev) < index(
            bwd, "compute_start", "backward", cur
        ), (prev, cur)


def test_gathers_in_flight_never_exceed_the_bound_and_memory_follows(traced):
    for bound in (1, 2):
        r = (
            run_distributed(
                _run_traced, 2, dict(strategy="FULL_SHARD", max_gathers_in_flight=bound)
            )[0]
            if bound != 2
            else traced
        )
        in_flight = peak = 0
        for kind, op, unit in r["events"]:
            if op == "all_gather":
                in_flight += 1 if kind == "issue" else -1
                peak = max(peak, in_flight)
        assert peak <= bound
        gathered_peak = max(a["peak"].get("gathered_params", 0) for a in r["acct"])
        assert 0 < gathered_peak <= (1 + bound) * r["largest_unit"]


ACCT_CONFIGS = [dict(strategy=s) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")] + [
    dict(strategy="FULL_SHARD", param_dtype="bfloat16"),
    dict(strategy="HYBRID_SHARD", hybrid_shard_group_size=1),
]


@pytest.fixture(scope="module", params=[2, 3])
def accounted(request):
    world = request.param
    return world, run_distributed(matrix_run, world, ACCT_CONFIGS, 2, BATCH)[0]


def _flat_sizes(r):
    padded = sum(p for p, _, _ in r["flats"])
    shard = sum(s for _, s, _ in r["flats"])
    valid = sum(v for _, _, v in r["flats"])
    return padded, shard, valid


def test_persistent_bytes_are_16_per_param_over_n_plus_padding(accounted):
    world, results = accounted
    for cfg, r in zip(ACCT_CONFIGS, results):
        padded, shard, valid = _flat_sizes(r)
        P = r["num_params"]
        persistent = r["acct"][-1]["persistent"]
        # fp32 shard + fp32 grad shard over the padded slice; exp_avg + exp_avg_sq over real
        # elements.
        assert persistent == 8 * shard + 8 * valid, cfg
        n = 1 if cfg["strategy"] in ("NO_SHARD", "HYBRID_SHARD") else world
        units = len(r["flats"])
        assert abs(persistent - 16 * P / n) <= 16 * n * units, (cfg, persistent, 16 * P / n)


def test_bytes_per_step_follow_the_strategy_formulas(accounted):
    world, results = accounted
    by = {
        (c["strategy"], c.get("param_dtype", "float32")): r for c, r in zip(ACCT_CONFIGS, results)
    }
    frac = (world - 1) / world
    full = by[("FULL_SHARD", "float32")]
    padded, _, _ = _flat_sizes(full)
    root_padded = full["flats"][0][0]  # the root unit's flat comes first
    comm = full["acct"][-1]["comm"]
    # every unit gathered in forward, blocks again in backward (the root stays gathered), one
    # reduce-scatter
    assert comm["all_gather"] == pytest.approx(4 * (2 * padded - root_padded) * frac, rel=1e-6)
    assert comm["reduce_scatter"] == pytest.approx(4 * padded * frac, rel=1e-6)
    total = sum(comm.values())
    assert 2.4 <= total / (4 * padded * frac) <= 3.0  # "about 3x"; the root is gathered once
    sgo = by[("SHARD_GRAD_OP", "float32")]["acct"][-1]["comm"]
    assert sum(sgo.values()) == pytest.approx(2 * 4 * padded * frac, rel=1e-6)
    nos = by[("NO_SHARD", "float32")]
    assert sum(nos["acct"][-1]["comm"].values()) == pytest.approx(
        2 * 4 * _flat_sizes(nos)[0] * frac, rel=1e-6
    )
    bf16 = by[("FULL_SHARD", "bfloat16")]["acct"][-1]["comm"]
    assert bf16["all_gather"] == pytest.approx(comm["all_gather"] / 2, rel=1e-6)


def test_unsharded_gradients_never_pile_up_past_the_reduction_bound():
    r = run_distributed(_run_traced, 2, dict(strategy="FULL_SHARD", max_reductions_in_flight=1))[0]
    padded, _, _ = _flat_sizes(r)
    peak = max(a["peak"].get("unsharded_grads", 0) for a in r["acct"])
    # one pending plus the one being issued, in fp32; never the whole model's gradient
    assert 0 < peak <= 2 * r["largest_unit"] < 4 * padded
