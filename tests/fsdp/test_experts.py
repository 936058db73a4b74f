"""A mixture of experts on the expert axis trains exactly as one process does, and its
checkpoints resume at any expert degree.

The reference: the plain model, the whole global batch in one forward, transformers'
load_balancing_loss_func on the router logits (padding masked out) added with the coefficient,
torch's clip and AdamW. Ours: the engine at world 1, 2 and 3 with sharding.expert_parallel 1,
2 and 3 (6 experts; world 3 with 2 re-plans to 1, the degree a resize to 3 gets), one and two
micro-batches. The batch of 7 rows splits unevenly over the ranks; two rows end in padding
that the routing statistics leave out; in step 2 every token is the same one, so every token
of a layer goes to the same two experts and the other four get none (asserted on the
reference's routing): ranks send and receive empty slices in the all-to-all.

fp32, 4 steps: losses (with the aux loss) and gradient norms to 1e-5, every parameter's update
to 1e-4 of its size (lr=0 or a lost expert update makes that error 1.0; an aux loss left out
moves the router's update by far more than 1e-4).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from benchmarks.peers import adamw
from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import rel, update_error
from trainer.checkpoint import CheckpointReader, CheckpointWriter
from trainer.checkpoint.checkpointer import load_state, state_chunks
from trainer.config import ConfigError, ShardingConfig, model_config
from trainer.fsdp import build_mesh, mesh_shape, parallelize
from trainer.fsdp.state import full_parameters, optim_pieces
from trainer.model import build_model, initializer, loss_sum
from trainer.optim import AdamW
from trainer.step import train_step

SEED, STEPS, BATCH, SEQ, VOCAB, PAD = 7, 4, 7, 12, 64, 0
E, K, COEF = 6, 2, 0.5
LR, WD, CLIP = 3e-3, 0.1, 1.0
PADDED = {1: 4, 4: 7}  # row -> padding tokens at its end
SAME_TOKEN_STEP = 2


def moe():
    return model_config(
        "tiny", dim=32, n_layers=3, n_heads=4, vocab_size=VOCAB, ffn_dim=48, max_seq_len=32,
        moe_experts=E, moe_top_k=K, moe_ffn_dim=16, moe_layers=[0, 2], router_aux_loss_coef=COEF,
    )  # fmt: skip


def batch(step: int):
    """(inputs, targets, real, loss weights) of the global batch of `step`."""
    g = torch.Generator().manual_seed(SEED + step)
    toks = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=g)
    if step == SAME_TOKEN_STEP:
        toks[:] = 5
    real = torch.ones(BATCH, SEQ, dtype=torch.bool)
    for row, n in PADDED.items():
        toks[row, SEQ + 1 - n :] = PAD
        real[row, SEQ - n :] = False  # inputs that are padding
    return toks[:, :-1], toks[:, 1:], real, real.to(torch.float32)


def reference():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = build_model(moe(), device="cpu", seed=SEED)
    p0 = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = adamw(model, lr=LR, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8)
    routers = [layer.moe.router for layer in model.layers if hasattr(layer, "moe")]
    losses, norms, used = [], [], []
    for step in range(STEPS):
        x, y, real, w = batch(step)
        logits = []
        hooks = [r.register_forward_hook(lambda m, a, out: logits.append(out)) for r in routers]
        s, _ = loss_sum(model(x), y, w)
        for h in hooks:
            h.remove()
        aux = load_balancing_loss_func(tuple(logits), E, K, attention_mask=real.long())
        loss = s / w.sum() + COEF * aux
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        chosen = [lg.detach().reshape(BATCH, SEQ, E)[real].topk(K).indices for lg in logits]
        used.append([sorted(set(c.flatten().tolist())) for c in chosen])
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return dict(losses=losses, norms=norms, params=params, p0=p0, used=used)


def wrap(rank: int, world: int, ep: int, master: str = "float32"):
    cfg = ShardingConfig(strategy="FULL_SHARD", expert_parallel=ep, master_dtype=master)
    mesh = build_mesh(cfg, rank, world, local_world_size=world, experts=E)
    fsdp = parallelize(
        build_model(moe(), device="meta"), cfg, mesh, "cpu", init_fn=initializer(SEED)
    )
    if master == "float32":
        opt = adamw(fsdp.param_groups(WD), lr=LR, betas=(0.9, 0.95), eps=1e-8)
    else:  # ours: the bf16 master's stochastic rounding, keyed by each element's index
        opt = AdamW(
            fsdp.param_groups(WD), lr=LR, betas=(0.9, 0.95), eps=1e-8,
            rounding=fsdp.master_rounding, seed=SEED, index=fsdp.element_index(),
        )  # fmt: skip
    return fsdp, opt


def micro_batches(step: int, rank: int, world: int, n: int) -> tuple[list, float]:
    x, y, real, w = batch(step)
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    out = []
    for idx in np.array_split(np.arange(lo, hi), n):
        out.append((x[idx], y[idx], w[idx], None, real[idx]))
    return out, float(w.sum())


def train(fsdp, opt, rank, world, steps, micro=1):
    losses, norms = [], []
    for step in steps:
        mbs, tokens = micro_batches(step, rank, world, micro)
        out = train_step(fsdp, opt, mbs, global_tokens=tokens, grad_clip=CLIP, world=world)
        losses.append(float(out.loss))
        norms.append(float(out.norm))
    return losses, norms


def _run(rank, world, ep, micro):
    fsdp, opt = wrap(rank, world, ep)
    losses, norms = train(fsdp, opt, rank, world, range(STEPS), micro)
    return dict(
        losses=losses,
        norms=norms,
        params=full_parameters(fsdp),
        expert_axis=fsdp.mesh.size("expert"),
        local_experts=fsdp.module.layers[0].moe.experts.w1.shape[0],
    )


@pytest.fixture(scope="module")
def ref():
    return reference()


def test_the_data_has_uneven_expert_loads_and_padding(ref):
    # step 2: every real token of a layer picks the same two experts; the other four get none
    assert all(len(layer) == K for layer in ref["used"][SAME_TOKEN_STEP])
    assert all(len(layer) > K for layer in ref["used"][0])


@pytest.mark.parametrize(
    "world,ep,micro,axis",
    [(1, 1, 1, 1), (2, 1, 2, 1), (2, 2, 1, 2), (3, 3, 1, 3), (3, 2, 2, 1)],
    ids=["w1", "w2-ep1-micro2", "w2-ep2", "w3-ep3", "w3-ep2-replanned-micro2"],
)
def test_expert_parallel_training_matches_the_single_process_reference(world, ep, micro, axis, ref):
    r = run_distributed(_run, world, ep, micro)[0]
    assert r["expert_axis"] == axis and r["local_experts"] == E // axis
    losses = max(rel(a, b) for a, b in zip(r["losses"], ref["losses"]))
    norms = max(rel(a, b) for a, b in zip(r["norms"], ref["norms"]))
    assert losses <= 1e-5 and norms <= 1e-5, (losses, norms, r["losses"], ref["losses"])
    assert sorted(r["params"]) == sorted(ref["params"])
    err = update_error(r["params"], ref["params"], ref["p0"])
    worst = max(err, key=err.get)
    assert err[worst] <= 1e-4, (worst, err[worst])


def _bf16_master(rank, world, ep):
    fsdp, opt = wrap(rank, world, ep, master="bfloat16")
    train(fsdp, opt, rank, world, range(2))
    return {k: v for k, v in full_parameters(fsdp).items() if ".experts." in k}


def test_a_bf16_master_rounds_each_expert_element_alike_at_any_expert_degree():
    """Stochastic rounding keys its noise by the element's index in the whole parameter: the
    same expert rounds alike at degree 1 and 2 (only where the fp32 updates, summed in another
    order, straddle a rounding boundary may they differ); keyed by the index in this rank's
    flat, ranks would share noise and about half of the experts' elements would differ."""
    one = run_distributed(_bf16_master, 1, 1)[0]
    two = run_distributed(_bf16_master, 2, 2)[0]
    differ = sum(int((one[k] != two[k]).sum()) for k in one)
    total = sum(v.numel() for v in one.values())
    assert differ <= 0.01 * total, (differ, total)


# ---- checkpoints across expert degrees ---------------------------------------------------------


def everything(fsdp, opt) -> dict:
    """Every parameter and AdamW moment, whole, on every rank: each element lies in exactly one
    first replica's shard (an expert's rows on the ranks of its expert coordinate), so a SUM of
    the primary pieces, zero elsewhere, reassembles it bit for bit."""
    params = full_parameters(fsdp)
    out = dict(params)
    pieces = {(k, n): torch.zeros(v.numel()) for k, v in params.items() for n in ("a", "b")}
    names = {"exp_avg": "a", "exp_avg_sq": "b"}
    for fqn, name, _, start, t in optim_pieces(fsdp, opt, primary=True):
        pieces[fqn, names[name]][start : start + t.numel()] = t
    for key in sorted(pieces):
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(pieces[key])
        out[f"{key[0]}/{key[1]}"] = pieces[key]
    return out


def _save(rank, world, ep, root):
    fsdp, opt = wrap(rank, world, ep)
    train(fsdp, opt, rank, world, range(2))
    writer = CheckpointWriter(root, keep=2, group=dist.group.WORLD if world > 1 else None)
    writer.save(2, rank, world, state_chunks(fsdp, opt), {"optim_step": 2.0})
    path = writer.wait()
    writer.close()
    return dict(path=path, state=everything(fsdp, opt), next=train(fsdp, opt, rank, world, [2, 3]))


def _load(rank, world, ep, path):
    fsdp, opt = wrap(rank, world, ep)
    reader = CheckpointReader(path)
    load_state(fsdp, opt, reader, reader.state["optim_step"], torch.device("cpu"))
    return dict(
        state=everything(fsdp, opt),
        next=train(fsdp, opt, rank, world, [2, 3]),
        axis=fsdp.mesh.size("expert"),
    )


@pytest.mark.parametrize("saved,loaded", [((2, 2), (3, 3)), ((3, 3), (2, 1)), ((2, 2), (1, 1))])
def test_a_checkpoint_resumes_bitwise_at_another_expert_degree(saved, loaded, tmp_path):
    want = run_distributed(_save, *saved, str(tmp_path / "ckpt"))[0]
    got = run_distributed(_load, *loaded, want["path"])[0]
    assert got["axis"] == loaded[1]
    assert sorted(got["state"]) == sorted(want["state"])
    for key, value in want["state"].items():
        assert torch.equal(got["state"][key], value), key
    # the next steps as the uninterrupted run's (another split of the batch: fp32 rounding)
    for a, b in zip(got["next"][0], want["next"][0]):
        assert rel(a, b) <= 1e-5, (got["next"], want["next"])


# ---- the expert degree at a world size ---------------------------------------------------------


def test_the_expert_degree_is_re_planned_at_a_world_it_does_not_divide():
    from trainer.fsdp.mesh import mesh_plan

    sh = ShardingConfig(strategy="FULL_SHARD", expert_parallel=4)
    assert mesh_shape(sh, 8, experts=8) == {"replicate": 1, "shard": 2, "expert": 4, "context": 1}
    shape, why = mesh_plan(sh, 6, experts=8)  # 4 does not divide 6: 2 divides 6 and 8
    assert shape == {"replicate": 1, "shard": 3, "expert": 2, "context": 1}
    assert "sharding.expert_parallel=4 does not divide the 6 ranks" in why
    assert "2 is the largest degree below it dividing both them and the 8 experts" in why
    assert mesh_shape(sh, 3, experts=8)["expert"] == 1
    # NO_SHARD cuts the expert axis from the replicas; HYBRID from the node's shard group
    no = ShardingConfig(strategy="NO_SHARD", expert_parallel=2)
    assert mesh_shape(no, 4, experts=8) == {"replicate": 2, "shard": 1, "expert": 2, "context": 1}
    hy = ShardingConfig(strategy="HYBRID_SHARD", expert_parallel=2, hybrid_shard_group_size=4)
    assert mesh_shape(hy, 8, experts=8) == {"replicate": 2, "shard": 2, "expert": 2, "context": 1}
    with pytest.raises(ConfigError, match=r"expert_parallel=4 does not divide the model's 6 "
                       r"experts; valid: 1, 2, 3, 6"):  # fmt: skip
        mesh_shape(sh, 8, experts=6)


def test_bad_expert_degrees_are_refused_before_workers_start_naming_the_valid_values():
    from cluster.config import ClusterConfig, JobConfig

    def job(ep, workers, **model):
        lo, hi = (workers, workers) if isinstance(workers, int) else workers
        cluster = (
            ClusterConfig(num_workers=lo, min_workers=lo, max_workers=hi)
            if lo != hi
            else (ClusterConfig(num_workers=lo))
        )
        cfg = JobConfig(model=moe(), cluster=cluster)
        cfg.sharding.expert_parallel = ep
        for k, v in model.items():
            setattr(cfg.model, k, v)
        cfg.train.global_batch_size, cfg.data.seq_len = 8, 16
        return cfg

    with pytest.raises(ConfigError, match=r"sharding.expert_parallel=4; valid: a divisor of the "
                       r"model's 6 experts \(1, 2, 3, 6\)"):  # fmt: skip
        job(4, 4).validate()
    with pytest.raises(ConfigError, match=r"sharding.expert_parallel=3; valid: a divisor of both "
                       r"the 6 experts and the 4 ranks .* at 4 workers \(1, 2\)"):  # fmt: skip
        job(3, 4).validate()
    with pytest.raises(ConfigError, match=r"expert_parallel=2; valid: 1 \(a dense model"):
        job(2, 2, moe_experts=0).validate()
    job(2, 4).validate()  # divides both
    job(3, [2, 4]).validate()  # elastic: re-planned at each size (logged), not refused
