"""Per-module strategies (sharding.modules): units placed on the mesh by their own strategy train
exactly as the single-process reference, save what each element is once, and a pattern that
names no unit is refused with the unit names there are.

Two mixes at world sizes 1, 2 and 3 (3: every sharded unit is padded): a FULL_SHARD mesh whose
embedding is NO_SHARD and whose head is SHARD_GRAD_OP, and a NO_SHARD mesh whose blocks are
FULL_SHARD. fp32, 6 steps: losses and gradient norms to 1e-5, every parameter's update to 1e-4
of its size (an update lost or doubled on one unit fails: with lr=0 every error is 1.0).
"""

import pytest
import torch
import torch.distributed as dist

from tests.checkpoint.test_engine_reshard import _step
from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import (
    WD,
    initial_parameters,
    matrix_run,
    optimizer,
    reference,
    rel,
    tiny,
    update_error,
    wrap,
)
from trainer.checkpoint import CheckpointReader, CheckpointWriter
from trainer.checkpoint.checkpointer import load_state, state_chunks
from trainer.config import ConfigError, ShardingConfig
from trainer.fsdp import build_mesh, parallelize
from trainer.fsdp.state import full_parameters, optim_pieces
from trainer.model import build_model

STEPS, BATCH = 6, 7
MIXES = {
    "full_shard_embedding_replicated": dict(
        strategy="FULL_SHARD", modules={"tok_embeddings": "no_shard", "output": "SHARD_GRAD_OP"}
    ),
    "no_shard_blocks_sharded": dict(strategy="NO_SHARD", modules={"layers.*": "full_shard"}),
}
# What each unit's one flat parameter is under each mix: sharded over all ranks or whole.
SHARDED = {
    "full_shard_embedding_replicated": [False, True, True, True, True],
    "no_shard_blocks_sharded": [False, True, True, True, False],
}


@pytest.fixture(scope="module")
def ref():
    return dict(reference(STEPS, BATCH), p0=initial_parameters())


@pytest.mark.parametrize("world", [1, 2, 3])
def test_per_module_strategies_match_the_single_process_reference_at_world_size(world, ref):
    results = run_distributed(matrix_run, world, list(MIXES.values()), STEPS, BATCH)[0]
    for name, r in zip(MIXES, results):
        losses = max(rel(a, b) for a, b in zip(r["losses"], ref["losses"]))
        norms = max(rel(a, b) for a, b in zip(r["norms"], ref["norms"]))
        assert losses <= 1e-5 and norms <= 1e-5, (name, world, losses, norms)
        err = update_error(r["params"], ref["params"], ref["p0"])
        worst = max(err, key=err.get)
        assert err[worst] <= 1e-4, (name, world, worst, err[worst])
        # the placement: a replicated unit keeps its whole flat; a sharded one 1/world of it
        for (padded, shard, _), sharded in zip(r["flats"], SHARDED[name]):
            assert shard == (padded // world if sharded else padded), (name, r["flats"])


def _save_mixed(rank, world, root):
    fsdp = wrap(rank, world, **MIXES["full_shard_embedding_replicated"])
    opt = optimizer(fsdp.param_groups(WD))
    for step in range(2):
        _step(fsdp, opt, step, rank, world)
    writer = CheckpointWriter(root, keep=2, group=dist.group.WORLD if world > 1 else None)
    chunks = state_chunks(fsdp, opt)
    writer.save(2, rank, world, chunks, {"optim_step": 2.0})
    path = writer.wait()
    writer.close()
    written = sum(c.data.numel() for c in chunks)
    state = everything(fsdp, opt)
    return dict(path=path, state=state, next=_step(fsdp, opt, 2, rank, world), written=written)


def everything(fsdp, opt) -> dict:
    """Every parameter and AdamW state element, whole, on every rank: each element lies in
    exactly one first replica's shard, so a SUM over all ranks of the primary pieces, zero
    elsewhere, reassembles it bit for bit (replicas would count twice)."""
    params = full_parameters(fsdp)
    out = dict(params)
    pieces = {(k, n): torch.zeros(v.numel()) for k, v in params.items() for n in ("a", "b")}
    names = {"exp_avg": "a", "exp_avg_sq": "b"}
    for fqn, name, _, start, t in optim_pieces(fsdp, opt, primary=True):
        pieces[fqn, names[name]][start : start + t.numel()] = t
    for fqn, n in sorted(pieces):
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(pieces[fqn, n])
        out[f"{fqn}/{n}"] = pieces[fqn, n]
    return out


def _load_uniform(rank, world, path):
    fsdp = wrap(rank, world, strategy="FULL_SHARD")
    opt = optimizer(fsdp.param_groups(WD))
    reader = CheckpointReader(path)
    load_state(fsdp, opt, reader, reader.state["optim_step"], torch.device("cpu"))
    return dict(state=everything(fsdp, opt), next=_step(fsdp, opt, 2, rank, world))


def test_a_mixed_checkpoint_writes_each_element_once_and_loads_bitwise_at_another_size(tmp_path):
    saved = run_distributed(_save_mixed, 3, str(tmp_path / "ckpt"))
    # the replicated embedding is written by rank 0 alone: the ranks write the model once
    numel = sum(p.numel() for p in initial_parameters().values())
    assert sum(s["written"] for s in saved) == 3 * numel  # params + exp_avg + exp_avg_sq
    loaded = run_distributed(_load_uniform, 2, saved[0]["path"])[0]
    want = saved[0]
    assert sorted(loaded["state"]) == sorted(want["state"])
    for key, value in want["state"].items():
        assert torch.equal(loaded["state"][key], value), key
    assert loaded["next"] == pytest.approx(want["next"], rel=1e-6)


def test_a_pattern_that_names_no_unit_is_refused_naming_the_units():
    cfg = ShardingConfig(modules={"layers.1.attention": "no_shard"})
    with pytest.raises(ConfigError) as e:
        parallelize(build_model(tiny(), device="meta"), cfg, build_mesh(cfg, 0, 1), "cpu", None)
    message = str(e.value)
    assert "'layers.1.attention' names no unit" in message
    assert "tok_embeddings, layers.0 .. layers.2 (layers.*), norm, output" in message


def test_module_strategy_values_are_case_blind_and_bad_ones_name_the_key():
    assert ShardingConfig(modules={"x": "no_shard"}).modules == {"x": "NO_SHARD"}
    with pytest.raises(ConfigError, match=r"sharding.modules\['x'\]='sharded'"):
        ShardingConfig(modules={"x": "sharded"})
    with pytest.raises(ConfigError, match="needs sharding.strategy=HYBRID_SHARD"):
        ShardingConfig(modules={"output": "hybrid_shard"}).validate()


def test_a_unit_without_a_pattern_keeps_the_mesh_strategy_and_the_planner_prices_each_unit():
    from trainer.plan.layout import layout

    mixed = ShardingConfig(strategy="FULL_SHARD", modules={"tok_embeddings": "NO_SHARD"})
    lay = layout(tiny(), mixed, world_size=4, local_world_size=4)
    sizes = {u.name: (u.shard_size, u.replicate_size, u.reshard_after_forward) for u in lay.units}
    assert sizes["tok_embeddings"] == (1, 4, False)
    assert sizes["layers.0"] == (4, 1, True) and sizes["norm+output"] == (4, 1, True)
    plain = layout(tiny(), ShardingConfig(strategy="FULL_SHARD"), world_size=4, local_world_size=4)
    # the replicated embedding (259 x 50) keeps all of its fp32 master instead of 1/4 of its
    # padded 12,952 elements
    assert lay.sharded_params - plain.sharded_params == (12950 - 12952 // 4) * 4
