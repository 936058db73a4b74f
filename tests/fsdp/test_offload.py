"""sharding.offload=optimizer against the on-device optimizer: same parameters after several steps
(1e-6), at world sizes 1, 2, 3 and HYBRID_SHARD, in fp32 and bf16, with micro-batches; and the
device keeps only the compute-dtype copy of its shard while the master, the gradient shard and
AdamW's state are accounted on the host.

On this CPU-only machine the host IS the device, so the copies are CPU to CPU: what is proven
here is the bookkeeping (which copy is read when, refreshed after each optimizer step, gradients
folded once, the norm and clip over host shards); pinned memory, the copy stream and its overlap
with backward run only on a GPU (tests/gpu).
"""

import pytest

from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import engine_run

STEPS, BATCH = 6, 7
CASES = [
    dict(strategy="FULL_SHARD"),
    dict(strategy="FULL_SHARD", param_dtype="bfloat16"),
    dict(strategy="SHARD_GRAD_OP", param_dtype="bfloat16", micro_batches=2),
    dict(strategy="FULL_SHARD", micro_batches=2, sharded_grad_accumulation=True),
    dict(strategy="NO_SHARD"),
]


def _pairs(rank, world, cases):
    out = []
    for case in cases:
        case = dict(case)
        micro = case.pop("micro_batches", 1)
        pair = {}
        for offload in ("none", "optimizer"):
            r = engine_run(rank, world, STEPS, BATCH, dict(case, offload=offload), micro)
            pair[offload] = dict(
                params=r["params"],
                losses=r["losses"],
                live=r["acct"][-1]["live"],
                persistent=r["acct"][-1]["persistent"],
            )
        out.append(pair)
    return out


def worst_param_diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offloaded_optimizer_matches_the_on_device_one_at_world_size(world):
    cases = CASES + (
        [dict(strategy="HYBRID_SHARD", hybrid_shard_group_size=1)] if world > 1 else []
    )
    results = run_distributed(_pairs, world, cases)
    for case, pair in zip(cases, results[0]):
        on, off = pair["none"], pair["optimizer"]
        assert worst_param_diff(off["params"], on["params"]) <= 1e-6, case
        assert off["losses"] == pytest.approx(on["losses"], rel=1e-6), case
        assert off["params"].keys() == on["params"].keys()
    for rank_results in results:  # memory, on every rank
        for case, pair in zip(cases, rank_results):
            on, off = pair["none"]["live"], pair["optimizer"]["live"]
            itemsize = 2 if case.get("param_dtype") == "bfloat16" else 4
            shard_bytes = on["sharded_params"]  # fp32
            assert off["sharded_params"] == shard_bytes * itemsize // 4, case
            assert off["sharded_grads"] == 0 and off["optim_state"] == 0, case
            assert off["host_params"] == shard_bytes, case
            # On the device the gradient shards are freed between steps (zero_grad sets them to
            # None); the pinned host ones stay, fp32, one per parameter shard.
            assert on["sharded_grads"] == 0 and off["host_grads"] == shard_bytes, case
            assert off["host_optim_state"] == on["optim_state"], case
