"""sharding.offload=params against on-device training: the same parameters and losses (1e-6) at
world sizes 1, 2 and 3, fp32 and bf16 compute, with micro-batches, the loss falling on a repeated
batch; and the device holds no copy of the shard between gathers (its shard is copied in for a
gather and freed after it), while the master, gradient and AdamW state are accounted on the host.
FULL_SHARD, SHARD_GRAD_OP (bf16), a bf16 master, and NO_SHARD (whose units copy the host shard in
directly, as every unit at world size 1 does).

On this CPU-only machine the host IS the device (see test_offload.py): what is proven is the
bookkeeping (a fresh copy of the current master read at every gather, forward and backward, and
nothing kept); pinned memory and the gather stream run on a GPU (make gpu-check).
"""

import pytest

from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import engine_run

STEPS, BATCH = 5, 6
CASES = [
    dict(strategy="FULL_SHARD"),
    dict(strategy="FULL_SHARD", param_dtype="bfloat16", micro_batches=2),
    dict(strategy="SHARD_GRAD_OP", param_dtype="bfloat16"),
    dict(strategy="FULL_SHARD", master_dtype="bfloat16", param_dtype="bfloat16"),
    dict(strategy="NO_SHARD"),  # no gather: each unit's copy in is a local one
]


def _pairs(rank, world, cases):
    out = []
    for case in cases:
        case = dict(case)
        micro = case.pop("micro_batches", 1)
        pair = {}
        for offload in ("none", "params"):
            r = engine_run(
                rank, world, STEPS, BATCH, dict(case, offload=offload), micro, data_step=0
            )
            last = r["acct"][-1]
            pair[offload] = dict(
                params=r["params"], losses=r["losses"], live=last["live"], peak=last["peak"]
            )
        out.append(pair)
    return out


def worst_param_diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offloaded_parameters_train_as_on_device_at_world_size(world):
    results = run_distributed(_pairs, world, CASES)
    for case, pair in zip(CASES, results[0]):
        on, off = pair["none"], pair["params"]
        assert worst_param_diff(off["params"], on["params"]) <= 1e-6, case
        assert off["losses"] == pytest.approx(on["losses"], rel=1e-6), case
        assert off["losses"][-1] < off["losses"][0] - 0.05, case  # it trains
    for rank_results in results:  # memory, on every rank
        for case, pair in zip(CASES, rank_results):
            on, off = pair["none"], pair["params"]
            master = on["live"]["sharded_params"]  # on the device without offload
            assert off["live"]["sharded_params"] == 0, case  # no copy kept between gathers
            assert off["live"]["gathered_params"] == 0, case
            assert off["live"]["host_params"] == master, case
            assert off["live"]["host_grads"] == master, case  # gradient shard: master dtype
            assert off["live"]["host_optim_state"] == on["live"]["optim_state"], case
            assert off["live"]["sharded_grads"] == off["live"]["optim_state"] == 0, case
            # The copies in live only while their gathers do: at most one unit's shard more at
            # the peak than the gathered parameters of the run on the device.
            extra = off["peak"]["gathered_params"] - on["peak"]["gathered_params"]
            assert 0 <= extra <= master, case
            if world > 1 and case["strategy"] != "NO_SHARD":
                assert extra > 0, case
