"""Low precision against the fp32 reference (parameters after several steps, at a tolerance a
run with lr=0 fails), fp16 loss scaling agreed across ranks, frozen parameters, and meta-device
wrapping."""

import resource

import pytest
import torch

from tests.dist_utils import fresh_ranks, run_distributed
from tests.fsdp.scaffold import engine_run, fsdp2_run, initial_parameters, reference, update_error
from trainer.config import ShardingConfig, model_config
from trainer.fsdp import build_mesh, parallelize
from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.fsdp.state import full_gradients
from trainer.model import build_model, initializer


def _overflow_on_one_rank(rank, world):
    scaler = ShardedGradScaler(enabled=True, init_scale=1024.0)
    grads = [torch.ones(4) * 1024.0]
    if rank == 1:
        grads[0][2] = float("inf")
    found = scaler.unscale_and_check(grads, world)
    scaler.update(found)
    return dict(found=found, scale=scaler.scale, grad0=float(grads[0][0]))


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    for r in run_distributed(_overflow_on_one_rank, 2):
        assert r["found"] is True
        assert r["scale"] == 512.0
        assert r["grad0"] == 1.0  # unscaled in place


def _low_precision_runs(rank, world, steps, overflow_rank):
    runs = dict(
        bf16=dict(sharding=dict(param_dtype="bfloat16")),
        bf16_reduced_in_bf16=dict(sharding=dict(param_dtype="bfloat16", reduce_dtype="bfloat16")),
        bf16_lr0=dict(sharding=dict(param_dtype="bfloat16"), lr=0.0),
        fp16=dict(sharding=dict(param_dtype="float16"), overflow_at=(OVERFLOW_STEP, overflow_rank)),
    )
    out = {}
    for name, kw in runs.items():
        r = engine_run(rank, world, steps, BATCH, kw.pop("sharding"), **kw)
        out[name] = dict(params=r["params"], skipped=r["skipped"], scale=r["scale"])
    out["fsdp2_bf16"] = fsdp2_run(rank, world, steps, BATCH, "bfloat16")
    return out


STEPS, BATCH, OVERFLOW_STEP = 8, 7, 3
# Measured at world sizes 2 and 3 (8 steps, lr 3e-3): bf16 worst parameter 0.054 to 0.063 (torch
# FSDP2 bf16 0.060), fp16 0.030 (0.41 against the run that took the skipped step); lr=0 gives 1.0
# for every parameter.
BF16_TOL, FP16_TOL = 0.25, 0.1


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_and_fp16_updates_match_the_fp32_reference_at_world_size(world):
    p0 = initial_parameters()
    ref = reference(STEPS, BATCH)["params"]
    ref_skip = reference(STEPS, BATCH, skip=(OVERFLOW_STEP,))["params"]
    ranks = run_distributed(_low_precision_runs, world, STEPS, world - 1)
    r = ranks[0]
    for name in ("bf16", "bf16_reduced_in_bf16"):
        err = update_error(r[name]["params"], ref, p0)
        worst = max(err, key=err.get)
        assert err[worst] < BF16_TOL, (name, worst, err[worst])
    # torch FSDP2 in bf16, same model and data, lands in the same band
    fsdp2 = update_error(r["fsdp2_bf16"]["params"], ref, p0)
    assert max(fsdp2.values()) < BF16_TOL
    # the tolerance can fail: a run that never updated is far outside it
    assert min(update_error(r["bf16_lr0"]["params"], ref, p0).values()) > 3 * BF16_TOL
    # fp16: the overflow on the last rank skipped that step on every rank, and only that step
    for rank_result in ranks:
        assert rank_result["fp16"]["skipped"] == [OVERFLOW_STEP]
        assert rank_result["fp16"]["scale"] == 2.0**15  # backed off once from 2**16
    err = update_error(r["fp16"]["params"], ref_skip, p0)
    worst = max(err, key=err.get)
    assert err[worst] < FP16_TOL, (worst, err[worst])
    # ...and skipping it mattered: against the run that took the step, the updates differ
    assert max(update_error(r["fp16"]["params"], ref, p0).values()) > FP16_TOL


def _frozen(rank, world):
    cfg = ShardingConfig(strategy="FULL_SHARD")
    model = build_model(
        model_config("tiny", dim=32, n_layers=2, n_heads=2, ffn_dim=64), device="meta"
    )
    for p in model.tok_embeddings.parameters():
        p.requires_grad_(False)
    mesh = build_mesh(cfg, rank, world, local_world_size=world)
    fsdp = parallelize(model, cfg, mesh, "cpu", init_fn=initializer(0))
    x = torch.randint(0, 256, (2, 8))
    fsdp(x).float().pow(2).mean().backward()
    grads = full_gradients(fsdp)
    embedding_flats = [(f.requires_grad, [i.fqn for i in f.infos]) for f in fsdp.units[0].flats]
    return dict(
        grads=sorted(grads),
        embedding_flats=embedding_flats,
        grad_bytes=fsdp.acct.live["sharded_grads"],
        trainable_shard=sum(f.shard_numel for f in fsdp.flats() if f.requires_grad),
    )


def test_frozen_parameters_take_no_gradient_memory():
    r = run_distributed(_frozen, 2)[0]
    assert "tok_embeddings.weight" not in r["grads"] and "output.weight" in r["grads"]
    assert r["embedding_flats"] == [(False, ["tok_embeddings.weight"])]
    assert r["grad_bytes"] == 4 * r["trainable_shard"]  # no gradient shard for the frozen flat


def _wrap_big(rank, world, cfg):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sharding = ShardingConfig()
    mesh = build_mesh(sharding, rank, world, local_world_size=world)
    fsdp = parallelize(
        build_model(cfg, device="meta"), sharding, mesh, "cpu", init_fn=initializer(0)
    )
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(
        growth=after - before,
        shard_bytes=fsdp.acct.live["sharded_params"],
        largest=max(sum(f.padded_numel for f in u.flats) * 4 for u in fsdp.all_units()),
    )


def test_a_model_larger_than_one_rank_holds_is_built_shard_by_shard():
    """~160M parameters (650 MB fp32) over 4 ranks: no rank's peak memory comes near the whole."""
    cfg = model_config("tiny", dim=768, n_layers=16, n_heads=8, ffn_dim=2048, vocab_size=32000)
    full_bytes = 4 * sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    assert full_bytes > 6e8
    fresh_ranks(4)  # peak RSS of a process only grows: measure in processes that did nothing else
    for r in run_distributed(_wrap_big, 4, cfg):
        # the shard, plus one unit materialised at a time (and its flat copy), plus allocator slack
        assert r["growth"] < r["shard_bytes"] + 3 * r["largest"] + 200e6
        assert r["growth"] < 0.6 * full_bytes, (r["growth"], full_bytes)
        print(
            f"peak RSS growth {r['growth'] / 1e6:.0f} MB for a {full_bytes / 1e6:.0f} MB model "
            f"(shard {r['shard_bytes'] / 1e6:.0f} MB)"
        )
