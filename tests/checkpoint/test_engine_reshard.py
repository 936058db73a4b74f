"""Save the engine's shards at N ranks, load at M, under another strategy: nothing changes.

Weights and AdamW state after loading are bitwise equal to the consolidated originals, and the
next step's loss equals the loss of the run that continued without a reload. N, M in 1..4, and
the strategy changes on load (FULL_SHARD -> NO_SHARD -> HYBRID_SHARD -> SHARD_GRAD_OP).
"""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import BATCH_SEQ, WD, batch, optimizer, wrap
from trainer.checkpoint import CheckpointReader, CheckpointWriter
from trainer.checkpoint.checkpointer import load_state, state_chunks
from trainer.checkpoint.keys import optim_key, param_key
from trainer.fsdp.state import full_parameters, optim_pieces
from trainer.model import loss_sum

B = 6
SAVE = {1: "FULL_SHARD", 2: "NO_SHARD", 3: "FULL_SHARD", 4: "HYBRID_SHARD"}
LOAD = {1: "SHARD_GRAD_OP", 2: "HYBRID_SHARD", 3: "NO_SHARD", 4: "FULL_SHARD"}


def _step(fsdp, opt, step, rank, world):
    lo, hi = rank * B // world, (rank + 1) * B // world
    x, y = batch(step, B)
    s, _ = loss_sum(fsdp(x[lo:hi]), y[lo:hi])
    (s / (B * BATCH_SEQ)).backward()
    fsdp.clip_grad_norm_(0.5)
    opt.step()
    fsdp.zero_grad()
    total = s.detach()
    if world > 1:
        dist.all_reduce(total)
    return float(total) / (B * BATCH_SEQ)


def consolidated(fsdp, opt):
    """Every parameter and AdamW state tensor, whole. Each element lives in exactly one shard of a
    shard group, so a SUM over the group of zero-filled tensors reassembles it bit for bit."""
    params = full_parameters(fsdp)
    out = {param_key(k): v for k, v in params.items()}
    # every key on every rank (a rank may hold no element of some parameter): same collectives
    pieces = {
        (k, n): torch.zeros(v.numel()) for k, v in params.items() for n in ("exp_avg", "exp_avg_sq")
    }
    for fqn, name, shape, start, t in optim_pieces(fsdp, opt):
        pieces[fqn, name][start : start + t.numel()] = t
    group = fsdp.mesh.shard_group
    for key in sorted(pieces) if fsdp.mesh.shard_size > 1 else []:
        dist.all_reduce(pieces[key], group=group)
    for fqn, name in sorted(pieces):
        out[optim_key(fqn, name)] = pieces[fqn, name].reshape(params[fqn].shape)
    return out


def _save(rank, world, root):
    fsdp = wrap(rank, world, strategy=SAVE[world], hybrid_shard_group_size=2 if world == 4 else 0)
    opt = optimizer(fsdp.param_groups(WD))
    for step in range(2):
        _step(fsdp, opt, step, rank, world)
    writer = CheckpointWriter(
        root, keep=5, async_save=True, group=dist.group.WORLD if world > 1 else None
    )
    writer.save(2, rank, world, state_chunks(fsdp, opt), {"optim_step": 2.0})
    path = writer.wait()
    writer.close()
    state = consolidated(fsdp, opt)
    next_loss = _step(fsdp, opt, 2, rank, world)
    return dict(path=path, state=state, next_loss=next_loss) if rank == 0 else None


def _load(rank, world, paths):
    out = []
    for path in paths:
        fsdp = wrap(
            rank, world, strategy=LOAD[world], hybrid_shard_group_size=2 if world == 4 else 0
        )
        opt = optimizer(fsdp.param_groups(WD))
        reader = CheckpointReader(path)
        load_state(fsdp, opt, reader, reader.state["optim_step"], torch.device("cpu"))
        state = consolidated(fsdp, opt)
        out.append(dict(state=state, next_loss=_step(fsdp, opt, 2, rank, world)))
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {n: run_distributed(_save, n, str(root / f"saved_at_{n}"))[0] for n in (1, 2, 3, 4)}


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_save_at_n_load_at_m_is_bitwise_and_the_next_step_matches(saved, m):
    ns = sorted(saved)
    loaded = run_distributed(_load, m, [saved[n]["path"] for n in ns])[0]
    for n, got in zip(ns, loaded):
        want = saved[n]
        assert sorted(got["state"]) == sorted(want["state"])
        for key, value in want["state"].items():
            assert torch.equal(got["state"][key], value), (
                f"{key}: saved at {n} ({SAVE[n]}), loaded at {m} ({LOAD[m]})"
            )
        assert got["next_loss"] == pytest.approx(want["next_loss"], rel=1e-6), (n, m)


def attention_and_ffn_units(model):
    """Another wrap policy: two units per block (attention, feed-forward); norms go to the root."""
    return [m for block in model.layers for m in (block.attention, block.feed_forward)]


def _load_other_policy(rank, world, path):
    fsdp = wrap(
        rank, world, policy=attention_and_ffn_units, strategy="FULL_SHARD", param_dtype="bfloat16"
    )
    opt = optimizer(fsdp.param_groups(WD))
    reader = CheckpointReader(path)
    load_state(fsdp, opt, reader, reader.state["optim_step"], torch.device("cpu"))
    state = consolidated(fsdp, opt)  # collective: every rank takes part
    return dict(state=state, units=len(fsdp.units)) if rank == 0 else None


def test_a_checkpoint_loads_under_another_wrap_policy_and_mixed_precision(saved):
    """Saved with one unit per block in fp32 at 3 ranks; loaded with attention and feed-forward as
    separate units and bf16 compute at 2 ranks: the fp32 master state is the same, bit for bit."""
    got = run_distributed(_load_other_policy, 2, saved[3]["path"])[0]
    assert got["units"] == 2 * 3
    for key, value in saved[3]["state"].items():
        assert torch.equal(got["state"][key], value), key
