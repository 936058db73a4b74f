"""Our engine against a single-process reference (fp32: losses and norms to 1e-5) and torch FSDP2
(bf16: losses to 1e-3 and parameter updates to 0.2 of their size; a run that never updated fails).

The matrix: strategy x world size 1, 2, 3 (uneven shards: every unit is padded, the last rank's
shard ends in padding) and 4 (FULL_SHARD pads the embedding and the blocks; HYBRID_SHARD with two
shard groups of 2) x {fp32, bf16 param_dtype} x activation checkpointing x {1, 2} micro-batches,
10 steps each. One process group per world size runs every configuration, so the whole matrix
costs a few spawns.
"""

import itertools

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import (
    initial_parameters,
    matrix_run,
    reference,
    rel,
    unit_padding,
    update_error,
)

STEPS, BATCH = 10, 7  # 7 rows split 7 / 4+3 / 2+2+3 / 1+2+2+2 (a rank with an empty micro-batch)
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
HYBRID_GROUP = {1: 1, 2: 1, 3: 3, 4: 2}


# bf16 against FSDP2 bf16 (the fp32 reference at world size 1), measured over the 10 steps and
# the whole matrix: loss worst 2.2e-4, parameter update worst 0.061 (world 1; 0.053 at 3). Our
# engine with its optimizer cut off from the shards (no update at all): loss 5.9e-3 (what 10
# steps move it, inside the 1e-2 this test once had) and every update error 1.0.
BF16_LOSS_TOL, BF16_UPDATE_TOL = 1e-3, 0.2


@pytest.fixture(scope="module")
def ref():
    return dict(reference(STEPS, BATCH), p0=initial_parameters())


def configs(
    world: int,
    strategies=STRATEGIES,
    dtypes=("float32", "bfloat16"),
    ac=(False, True),
    micro=(1, 2),
):
    out = []
    for s, d, a, m in itertools.product(strategies, dtypes, ac, micro):
        out.append(
            dict(
                strategy=s,
                param_dtype=d,
                activation_checkpointing=a,
                micro_batches=m,
                hybrid_shard_group_size=HYBRID_GROUP[world],
            )
        )
    return out


def check(world: int, cfgs: list[dict], ref) -> None:
    peers = {
        d: dict(fsdp2=True, param_dtype=d) for d in {c["param_dtype"] for c in cfgs} if world > 1
    }
    results = run_distributed(matrix_run, world, cfgs + list(peers.values()), STEPS, BATCH)[0]
    fsdp2 = {d: r for d, r in zip(peers, results[len(cfgs) :])}
    failures = []
    for c, r in zip(cfgs, results):
        tag = f"world={world} {c}"
        if c["param_dtype"] == "float32":
            worst = max(rel(a, b) for a, b in zip(r["losses"], ref["losses"]))
            if worst > 1e-5:
                failures.append(f"{tag}: loss rel err {worst:.2e} vs single process")
            worst = max(rel(a, b) for a, b in zip(r["norms"], ref["norms"]))
            if worst > 1e-5:
                failures.append(f"{tag}: grad-norm rel err {worst:.2e} vs single process")
            for k, g in ref["grads0"].items():
                if not torch.allclose(
                    r["grads0"][k], g, rtol=1e-4, atol=1e-6 * float(g.abs().max())
                ):
                    failures.append(f"{tag}: step-0 gradient of {k} differs")
            if "float32" in fsdp2:
                worst = max(rel(a, b) for a, b in zip(r["losses"], fsdp2["float32"]["losses"]))
                if worst > 1e-5:
                    failures.append(f"{tag}: loss rel err {worst:.2e} vs FSDP2 fp32")
        else:
            base = fsdp2.get("bfloat16", ref)
            against = "FSDP2 bf16" if world > 1 else "fp32 ref"
            worst = max(rel(a, b) for a, b in zip(r["losses"], base["losses"]))
            if worst > BF16_LOSS_TOL:
                failures.append(f"{tag}: loss rel err {worst:.2e} vs {against}")
            # the losses alone barely move in 10 steps: the updates must match too
            err = update_error(r["params"], base["params"], ref["p0"])
            name = max(err, key=err.get)
            if err[name] > BF16_UPDATE_TOL:
                failures.append(f"{tag}: update of {name} off by {err[name]:.3f} vs {against}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_strategy_matches_single_process_fp32_at_world_size(world, ref):
    sharded_accumulation = [
        dict(c, sharded_grad_accumulation=True)
        for c in configs(world, ("FULL_SHARD", "HYBRID_SHARD"), ("float32",), (False,), (2,))
    ]
    check(
        world,
        configs(world, dtypes=("float32",), ac=(False,), micro=(1,))
        + configs(world, strategies=("FULL_SHARD",), dtypes=("float32",), ac=(True,), micro=(2,))
        + sharded_accumulation,
        ref,
    )


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_params_match_fsdp2_mixed_precision_at_world_size(world, ref):
    check(
        world,
        configs(
            world,
            strategies=("FULL_SHARD", "NO_SHARD"),
            dtypes=("bfloat16",),
            ac=(False,),
            micro=(1,),
        ),
        ref,
    )


def _padded(units: dict) -> set[str]:
    return {name for name, flats in units.items() if any(n < padded for n, padded, _ in flats)}


@pytest.mark.parametrize(
    "world,padded",
    [
        (3, {"tok_embeddings", "layers.0", "layers.1", "layers.2", "norm+output"}),
        (4, {"tok_embeddings", "layers.0", "layers.1", "layers.2"}),
    ],
)
def test_the_parity_model_has_uneven_shards_that_end_in_padding_at_world_size(world, padded):
    """The matrix above proves uneven shards only if the shards are uneven: padding exists, and
    the last rank holds fewer real elements than the others (so a rank that took the wrong
    elements would be caught). World size 2 cannot pad this decoder (scaffold.MODEL says why)."""
    ranks = run_distributed(unit_padding, world)
    assert _padded(ranks[-1]) == padded, ranks[-1]
    for name in padded:
        (numel, total, first), *_ = ranks[0][name]
        last = ranks[-1][name][0][2]
        assert first == total // world and last < first, (name, ranks[0][name], ranks[-1][name])
        assert sum(r[name][0][2] for r in ranks) == numel  # every real element, exactly once


def test_hybrid_shard_two_groups_of_two_matches_single_process(ref):
    check(
        4,
        configs(
            4, strategies=("HYBRID_SHARD",), dtypes=("float32",), ac=(False, True), micro=(1, 2)
        ),
        ref,
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_full_matrix_at_world_size(world, ref):
    """strategy x {fp32, bf16} x activation checkpointing x {1, 2} micro-batches."""
    check(world, configs(world), ref)
