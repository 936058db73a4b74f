"""Context parallelism (train.context_parallel): each sequence split over the mesh's context axis
trains exactly as one process training the whole sequences.

The reference is a plain model in one process: whole batch, whole sequences, the loss sum over
the global loss-token count, torch's AdamW. Our engine runs at world 2 to 4 with context 2 or 3
(context 3 makes 6 chunks of a 26-token sequence: padded to 30, the padding no loss token), with
and without packed documents (positions restarting: attention stays inside each, rotary at each
document's positions), with activation checkpointing, with per-token loss weights. fp32, 3 steps:
losses and gradient norms to 1e-5, every parameter's update to 1e-4 of its size (with lr=0, or
a chunk's gradient lost, every error is 1.0 or far above).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from benchmarks.peers import adamw as peer_adamw
from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import rel, update_error
from trainer.config import ConfigError, ShardingConfig, TrainerConfig, model_config
from trainer.fsdp import build_mesh, parallelize
from trainer.fsdp.mesh import mesh_shape
from trainer.fsdp.state import full_gradients, full_parameters
from trainer.model import build_model, initializer, loss_sum
from trainer.model.context import ContextSplit, chunk_layout, sequence_order
from trainer.step import train_step

SEED, SEQ, BATCH, STEPS = 99, 26, 4, 3
LR, WD, CLIP = 3e-3, 0.1, 1.0


def cfg():
    # grouped-query attention (4 heads over 2 kv heads): the gathered K/V are the kv heads'
    return model_config("tiny", dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                        vocab_size=259, max_seq_len=64)  # fmt: skip


def data(step: int, documents: bool):
    """(inputs, targets, per-token weights or 1.0, positions or None) of the global batch."""
    g = torch.Generator().manual_seed(SEED + step)
    toks = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    if not documents:
        return toks[:, :-1], toks[:, 1:], 1.0, None
    positions = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for b in range(BATCH):  # 1-4 packed documents per row, boundaries at random places
        cuts = sorted(torch.randperm(SEQ - 1, generator=g)[: b + 0].add(1).tolist())
        start = 0
        for t in range(SEQ):
            if t in cuts:
                start = t
            positions[b, t] = t - start
    weights = (torch.rand(BATCH, SEQ, generator=g) > 0.3).float()  # a loss mask
    return toks[:, :-1], toks[:, 1:], weights, positions


def adamw(params):
    """torch's AdamW, decay on matrices only (the engine's param_groups and a module alike)."""
    return peer_adamw(params, lr=LR, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8)


def reference(documents: bool) -> dict:
    model = build_model(cfg(), device="cpu", seed=SEED)
    p0 = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = adamw(model)
    losses, norms = [], []
    for step in range(STEPS):
        x, y, w, pos = data(step, documents)
        tokens = float(w.sum()) if torch.is_tensor(w) else BATCH * SEQ
        s, _ = loss_sum(model(x, pos), y, w)
        (s / tokens).backward()
        if step == 0:
            grads0 = {k: p.grad.clone() for k, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(s.detach()) / tokens)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return dict(losses=losses, norms=norms, params=params, p0=p0, grads0=grads0)


def context_run(rank, world, context, documents, checkpointing, strategy="FULL_SHARD"):
    sharding = ShardingConfig(strategy=strategy, activation_checkpointing=checkpointing)
    if strategy == "HYBRID_SHARD":
        sharding.hybrid_shard_group_size = 2
    mesh = build_mesh(sharding, rank, world, world, context=context)
    model = build_model(cfg(), device="meta")
    fsdp = parallelize(model, sharding, mesh, "cpu", init_fn=initializer(SEED))
    opt = adamw(fsdp.param_groups(WD))
    lo = mesh.data_rank * BATCH // mesh.data_size
    hi = (mesh.data_rank + 1) * BATCH // mesh.data_size
    losses, norms, grads0 = [], [], {}
    for step in range(STEPS):
        x, y, w, pos = data(step, documents)
        tokens = int(w.sum()) if torch.is_tensor(w) else BATCH * SEQ
        w = w[lo:hi] if torch.is_tensor(w) else w
        mb = (x[lo:hi], y[lo:hi], w, None if pos is None else pos[lo:hi])
        keep = (lambda: grads0.update(full_gradients(fsdp))) if step == 0 else None
        out = train_step(fsdp, opt, [mb], global_tokens=tokens, grad_clip=CLIP, world=world,
                         on_gradients=keep)  # fmt: skip
        losses.append(float(out.loss))
        norms.append(float(out.norm))
    sent = fsdp.acct.comm_bytes.get("context", 0)
    return dict(losses=losses, norms=norms, params=full_parameters(fsdp), context_bytes=sent,
                shape=dict(mesh.shape), grads0=grads0)  # fmt: skip


@pytest.fixture(scope="module")
def refs():
    return {documents: reference(documents) for documents in (False, True)}


@pytest.mark.parametrize(
    "world,context,documents,checkpointing",
    [(2, 2, False, False), (3, 3, True, True), (4, 2, True, False), (4, 2, False, True)],
    ids=["w2-cp2", "w3-cp3-documents-ac", "w4-cp2-documents", "w4-cp2-ac"],
)
def test_context_parallel_trains_as_the_single_process_reference(
    world, context, documents, checkpointing, refs
):
    ref = refs[documents]
    results = run_distributed(context_run, world, context, documents, checkpointing)
    r = results[0]
    assert r["shape"]["context"] == context and r["shape"]["shard"] == world // context
    losses = max(rel(a, b) for a, b in zip(r["losses"], ref["losses"]))
    norms = max(rel(a, b) for a, b in zip(r["norms"], ref["norms"]))
    assert losses <= 1e-5 and norms <= 1e-5, (r["losses"], ref["losses"], r["norms"], ref["norms"])
    # every parameter's gradient of the first step, to 1e-5 of its norm
    grads = {k: float((r["grads0"][k] - g).norm() / g.norm()) for k, g in ref["grads0"].items()}
    assert max(grads.values()) <= 1e-5, grads
    # the updates after 3 steps: AdamW divides by the gradients' root mean square, so the
    # last-bit differences of the attention kernels' sums grow there (1.3e-4 measured at most);
    # a lost or doubled update is an error of 1.0 or more
    err = update_error(r["params"], ref["params"], ref["p0"])
    worst = max(err, key=err.get)
    assert err[worst] <= 1e-3, (worst, err[worst])
    assert all(x["context_bytes"] > 0 for x in results)  # K/V did travel


def test_hybrid_shard_places_context_groups_inside_the_shard_group(refs):
    """HYBRID_SHARD with groups of 2 at world 4 and context 2: the context axis is the whole
    shard group (each node's two ranks split every sequence); replicas across "nodes"."""
    r = run_distributed(context_run, 4, 2, True, False, "HYBRID_SHARD")[0]
    assert r["shape"] == {"replicate": 2, "shard": 1, "expert": 1, "context": 2}
    ref = refs[True]
    assert max(rel(a, b) for a, b in zip(r["losses"], ref["losses"])) <= 1e-5


def test_the_split_is_balanced_global_and_skips_what_the_masks_empty():
    # 2N chunks, rank i holds i and 2N-1-i; the padding goes at the end
    padded, c, idx = chunk_layout(3, 1, 26)
    assert (padded, c) == (30, 5)
    assert idx.tolist() == list(range(5, 10)) + list(range(20, 25))
    assert sequence_order(2) == [0, 2, 3, 1]
    # a chunk inside a document that starts after the chunk before: keys before it never read
    positions = torch.cat([torch.arange(10), torch.arange(6)])[None]  # documents of 10 and 6
    tokens = torch.zeros(1, 16, dtype=torch.long)
    split = ContextSplit(2, 1, gather=None)  # chunks 1 and 2 of 4: tokens 4..7 and 8..11
    toks, pos, tgt, w, real, attn = split.shard(tokens, positions, tokens, 1.0, None, block=False)
    assert pos.tolist() == [[4, 5, 6, 7, 8, 9, 0, 1]]  # positions inside each document
    first, second = attn.chunks
    assert (first.lo, first.hi) == (0, 8)  # the first document starts at 0
    assert (second.lo, second.hi) == (0, 12)  # token 8 is still in the first document
    split0 = ContextSplit(2, 0, gather=None)  # chunks 0 and 3: tokens 0..3 and 12..15
    *_, attn0 = split0.shard(tokens, positions, tokens, 1.0, None, block=False)
    assert (attn0.chunks[1].lo, attn0.chunks[1].hi) == (10, 16)  # the second document only
    # the padding (26 tokens to 30) is no loss token: rank 0 holds chunks 0 and 5 (25..29)
    row = torch.zeros(2, 26, dtype=torch.long)
    _, _, _, w, _, _ = ContextSplit(3, 0, gather=None).shard(row, None, row, 1.0, None)
    assert w.tolist() == [[1.0] * 6 + [0.0] * 4] * 2


def test_the_context_axis_is_cut_from_the_shard_axis_and_bad_degrees_are_refused():
    sh = ShardingConfig()
    assert mesh_shape(sh, 4, context=2) == {"replicate": 1, "shard": 2, "expert": 1, "context": 2}
    no = ShardingConfig(strategy="NO_SHARD")
    assert mesh_shape(no, 4, context=2) == {"replicate": 2, "shard": 1, "expert": 1, "context": 2}
    with pytest.raises(ConfigError, match=r"train.context_parallel=3 does not divide the world "
                       r"size 4; valid: 1, 2, 4"):  # fmt: skip
        mesh_shape(sh, 4, context=3)
    hy = ShardingConfig(strategy="HYBRID_SHARD", hybrid_shard_group_size=2)
    with pytest.raises(ConfigError, match="HYBRID_SHARD shard group of 2 ranks; valid: 1, 2"):
        mesh_shape(hy, 8, context=4)
    moe = TrainerConfig()
    moe.model = model_config("tiny", moe_experts=4, moe_top_k=2, moe_ffn_dim=32)
    moe.train.context_parallel = 2
    with pytest.raises(ConfigError, match="context parallelism and expert routing"):
        moe.validate()
    short = TrainerConfig()
    short.data.seq_len = 6
    short.train.context_parallel = 4
    with pytest.raises(ConfigError, match="at most data.seq_len / 2 = 3"):
        short.validate()


def _logits_without_targets(rank, world):
    """A forward without targets (generation, logits) computes the whole sequence on every rank."""
    sharding = ShardingConfig()
    mesh = build_mesh(sharding, rank, world, world, context=world)
    fsdp = parallelize(build_model(cfg(), device="meta"), sharding, mesh, "cpu",
                       init_fn=initializer(SEED))  # fmt: skip
    x, *_ = data(0, False)
    with torch.no_grad():
        out = fsdp(x)
    dist.barrier()
    return out


def test_a_forward_without_targets_gives_the_whole_sequences_logits():
    want = build_model(cfg(), device="cpu", seed=SEED)(data(0, False)[0])
    got = run_distributed(_logits_without_targets, 2)
    for out in got:
        assert torch.allclose(out, want, atol=1e-5)
