"""fp16 loss scaling agreed across ranks, frozen parameters, and meta-device wrapping."""

import resource

import torch

from tests.dist_utils import fresh_ranks, run_distributed
from tests.fsdp.scaffold import engine_run, reference, rel
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


def _fp16_and_frozen(rank, world):
    out = engine_run(rank, world, 4, 6, dict(strategy="FULL_SHARD", param_dtype="float16"))
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
    root_flats = [(f.requires_grad, [i.fqn for i in f.infos]) for f in fsdp.root.flats]
    return dict(
        fp16_losses=out["losses"],
        grads=sorted(grads),
        root_flats=root_flats,
        grad_bytes=fsdp.acct.live["sharded_grads"],
        trainable_shard=sum(f.shard_numel for f in fsdp.flats() if f.requires_grad),
    )


def test_fp16_params_and_frozen_parameters_take_no_gradient_memory():
    ref = reference(4, 6)
    r = run_distributed(_fp16_and_frozen, 2)[0]
    assert max(rel(a, b) for a, b in zip(r["fp16_losses"], ref["losses"])) < 1e-2
    assert "tok_embeddings.weight" not in r["grads"] and "output.weight" in r["grads"]
    assert (False, ["tok_embeddings.weight"]) in r["root_flats"]
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
