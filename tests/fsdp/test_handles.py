"""What a user holds of a wrapped model: parameters() for the optimizer, the sharded and the full
state dict by the unwrapped model's names, and a forward without gradients (evaluation,
generation) that matches the plain model."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import SEED, initial_parameters, tiny, wrap
from trainer.model import build_model


def _handles(rank, world, sharding):
    fsdp = wrap(rank, world, **sharding)
    named = list(fsdp.named_parameters())
    in_groups = [p for g in fsdp.param_groups(0.1) for p in g["params"]]
    shards = {k: (v.shape, v.start, v.values.clone()) for k, v in fsdp.sharded_state_dict().items()}
    full = fsdp.full_state_dict()
    bf16 = fsdp.full_state_dict(torch.bfloat16)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        logits = fsdp(x)
    # a write through the sharded state dict is a write to the model
    for piece in fsdp.sharded_state_dict().values():
        piece.values.fill_(0.5)
    after = fsdp.full_state_dict()
    return dict(
        names=[n for n, _ in named],
        same_as_groups=sorted(map(id, (p for _, p in named))) == sorted(map(id, in_groups)),
        numel=sum(p.numel() for _, p in named),
        valid=sum(f.valid_numel for f in fsdp.flats() if f.requires_grad),
        shards=shards,
        full=full,
        bf16_dtypes=sorted({str(t.dtype) for t in bf16.values()}),
        x=x,
        logits=logits,
        all_half=all(bool((t == 0.5).all()) for t in after.values()),
    )


@pytest.mark.parametrize(
    "world,sharding",
    [
        (1, dict(strategy="FULL_SHARD")),
        (2, dict(strategy="FULL_SHARD")),
        (3, dict(strategy="FULL_SHARD")),
        (3, dict(strategy="NO_SHARD")),
        (4, dict(strategy="HYBRID_SHARD", hybrid_shard_group_size=2)),
    ],
)
def test_parameters_and_state_dicts_name_what_the_unwrapped_model_has(world, sharding):
    ranks = run_distributed(_handles, world, sharding)
    reference = initial_parameters()
    plain = build_model(tiny(), device="cpu", seed=SEED)
    # full_state_dict: every parameter whole, exact, on rank 0 only
    assert ranks[0]["full"].keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(ranks[0]["full"][k], v), k
    assert ranks[0]["bf16_dtypes"] == ["torch.bfloat16"]
    assert all(r["full"] == {} for r in ranks[1:])
    # sharded_state_dict: the pieces of the first replica tile every parameter exactly
    replica = ranks if sharding["strategy"] != "HYBRID_SHARD" else ranks[:2]
    if sharding["strategy"] == "NO_SHARD":
        replica = ranks[:1]
    for k, v in reference.items():
        covered = torch.zeros(v.numel(), dtype=torch.int64)
        for r in replica:
            if k in r["shards"]:
                shape, start, values = r["shards"][k]
                assert tuple(shape) == tuple(v.shape)
                assert torch.equal(values, v.reshape(-1)[start : start + values.numel()])
                covered[start : start + values.numel()] += 1
        assert bool((covered == 1).all()), k
    for r in ranks:
        # parameters(): exactly what the optimizer groups hold, every real element once
        assert r["same_as_groups"] and r["numel"] == r["valid"]
        assert len(set(r["names"])) == len(r["names"])
        # a forward under no_grad is the plain model's
        with torch.no_grad():
            expected = plain(r["x"])
        torch.testing.assert_close(r["logits"], expected, rtol=1e-5, atol=1e-5)
    assert ranks[0]["all_half"]
