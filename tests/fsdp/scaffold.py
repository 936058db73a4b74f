"""A single-process reference and the same training under our engine, for parity tests."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.peers import adamw, fsdp2
from trainer.config import ShardingConfig, model_config
from trainer.fsdp import FSDPModel, build_mesh, parallelize
from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.fsdp.state import full_gradients, full_parameters
from trainer.model import build_model, initializer, loss_sum
from trainer.optim import AdamW
from trainer.step import train_step

SEED = 1234
SEQ = 16
BATCH_SEQ = SEQ
# Units of 12,950 (embedding), 25,250 (each of 3 blocks) and 13,000 (norm + head) elements: none
# divides by 3 (every unit pads at world size 3) and the embedding and blocks are 2 mod 4 (they
# pad at world size 4 too). No unit of this decoder can be odd, so world size 2 never pads:
# every parameter's numel is a multiple of dim = n_heads x head_dim, and rotary needs an even
# head_dim. tests/fsdp/test_parity.py asserts the padding.
MODEL = dict(dim=50, n_layers=3, n_heads=5, ffn_dim=101, vocab_size=259)
LR, WD, CLIP = 3e-3, 0.1, 0.5


def tiny():
    return model_config("tiny", **MODEL)


def batch(step: int, global_batch: int):
    g = torch.Generator().manual_seed(SEED + step)
    toks = torch.randint(0, 256, (global_batch, SEQ + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def optimizer(groups, lr: float = LR):
    """torch's AdamW (benchmarks/peers.py), the plain single-tensor loop, over `groups`."""
    return adamw(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lever_optimizer(fsdp: FSDPModel, lr: float = LR, state_dtype: str = "float32", seed: int = 0):
    """Ours (trainer/optim.py AdamW), the reference's hyperparameters: moments in `state_dtype`,
    the engine's master dtype and rounding, the rounding keyed by `seed`."""
    return AdamW(
        fsdp.param_groups(WD),
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        state_dtype=getattr(torch, state_dtype),
        rounding=fsdp.master_rounding,
        seed=seed,
        index=fsdp.element_index(),
    )


def initial_parameters() -> dict[str, torch.Tensor]:
    """Every parameter before the first step (the same init every run and rank uses)."""
    model = build_model(tiny(), device="cpu", seed=SEED)
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def reference(steps: int, global_batch: int, skip: tuple[int, ...] = ()):
    """Single process, whole batch, plain model: per-step (loss, grad norm) and step-0 grads.
    The steps in `skip` compute their loss and take no optimizer step (an fp16 overflow step)."""
    model = build_model(tiny(), device="cpu", seed=SEED)
    opt = adamw(model, lr=LR, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8)
    losses, norms, grads0 = [], [], None
    for step in range(steps):
        x, y = batch(step, global_batch)
        s, n = loss_sum(model(x), y)
        (s / (global_batch * SEQ)).backward()
        if step == 0:
            grads0 = {k: p.grad.clone() for k, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        if step not in skip:
            opt.step()
        opt.zero_grad()
        losses.append(float(s.detach()) / (global_batch * SEQ))
    return dict(
        losses=losses,
        norms=norms,
        grads0=grads0,
        params={k: p.detach().clone() for k, p in model.named_parameters()},
    )


def wrap(rank: int, world: int, policy=None, device="cpu", **sharding) -> FSDPModel:
    """policy(model) -> the unit modules; None is the default (one unit per block)."""
    cfg = ShardingConfig(**sharding)
    mesh = build_mesh(cfg, rank, world, local_world_size=world)
    return parallelize(
        build_model(tiny(), device="meta"),
        cfg,
        mesh,
        device,
        init_fn=initializer(SEED),
        **({"wrap_policy": policy} if policy else {}),
    )


def engine_run(
    rank: int,
    world: int,
    steps: int,
    global_batch: int,
    sharding: dict,
    micro_batches: int = 1,
    keep_trace: bool = False,
    lr: float = LR,
    overflow_at: Optional[tuple[int, int]] = None,
    state_dtype: Optional[str] = None,
    seed: int = 0,
    data_step: Optional[int] = None,
):
    """Our engine on this rank: same data split by rank_range, losses all-reduced.

    `state_dtype` (or a bf16 master in `sharding`): our AdamW (lever_optimizer) instead of
    torch's, its rounding keyed by `seed`. `data_step`: every step trains on that step's batch
    (the loss then falls step by step).

    fp16 runs under the ShardedGradScaler as trainer/loop.py does. overflow_at=(step, rank): that
    rank's loss is multiplied by 2**30 in that step, so its fp16 backward overflows (on that rank
    only) and every rank must skip the step."""
    fsdp = wrap(rank, world, **sharding)
    if state_dtype is not None or sharding.get("master_dtype", "float32") != "float32":
        opt = lever_optimizer(fsdp, lr, state_dtype or "float32", seed)
    else:
        opt = optimizer(fsdp.param_groups(WD), lr)
    scaler = ShardedGradScaler(enabled=fsdp.param_dtype == torch.float16)
    lo = rank * global_batch // world
    hi = (rank + 1) * global_batch // world
    losses, norms, grads0, acct, skipped = [], [], {}, [], []
    for step in range(steps):
        x, y = batch(step if data_step is None else data_step, global_batch)
        out = train_step(
            fsdp,
            opt,
            micro_batch_split(x[lo:hi], y[lo:hi], micro_batches),
            global_tokens=global_batch * SEQ,
            grad_clip=CLIP,
            scaler=scaler,
            world=world,
            grad_scale=2.0**30 if overflow_at == (step, rank) else 1.0,
            on_gradients=(lambda: grads0.update(full_gradients(fsdp))) if step == 0 else None,
        )
        norms.append(float(out.norm))
        if out.overflow:
            skipped.append(step)
        fsdp.metrics(opt)  # counts the optimizer state in the accounting
        losses.append(float(out.loss))
        acct.append(
            dict(
                comm=dict(fsdp.acct.comm_bytes),
                peak=dict(fsdp.acct.peak),
                persistent=fsdp.acct.persistent_bytes(),
                live=dict(fsdp.acct.live),
            )
        )
    out = dict(
        losses=losses,
        norms=norms,
        grads0=grads0,
        params=full_parameters(fsdp),
        skipped=skipped,
        scale=scaler.scale,
        acct=acct,
        largest_unit=fsdp.largest_unit_bytes(),
        root_bytes=fsdp.root.gathered_bytes,
        num_params=fsdp.num_params(),
        flats=[(f.padded_numel, f.shard_numel, f.valid_numel) for f in fsdp.flats()],
    )
    if keep_trace:
        out["events"] = [(e.kind, e.op, e.unit) for e in fsdp.acct.events]
        out["order"] = [u.name for u in fsdp.scheduler.order]
        out["backward_order"] = [u.name for u in fsdp.scheduler.backward_order]
    return out


def micro_batch_split(x, y, n: int) -> list:
    """(inputs, targets, weight) of n micro-batches of these rows, split as np.array_split splits
    (as trainer.data's Batcher does); a rank with fewer rows than micro-batches runs zero-weight
    ones (every rank runs as many forwards and backwards: their collectives pair up)."""
    out = []
    for idx in np.array_split(np.arange(len(x)), n):
        weight = 1.0
        if len(idx) == 0:
            idx, weight = np.array([0]), 0.0
        out.append((x[idx], y[idx], weight))
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def update_error(params: dict, ref: dict, p0: dict) -> dict[str, float]:
    """Per parameter: |update - reference update| / |reference update| after the run. 1.0 for a
    parameter that did not move (lr=0, a unit whose update was lost)."""
    return {
        k: float(((params[k] - p0[k]) - (ref[k] - p0[k])).norm() / (ref[k] - p0[k]).norm())
        for k in ref
    }


def fsdp2_run(rank: int, world: int, steps: int, global_batch: int, param_dtype: str):
    """torch FSDP2 as the peer reference (benchmarks/peers.py): same model, data split and
    optimizer."""
    model = build_model(tiny(), device="cpu", seed=SEED)
    fsdp2(model, param_dtype=getattr(torch, param_dtype))
    opt = adamw(model, lr=LR, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8)
    lo, hi = rank * global_batch // world, (rank + 1) * global_batch // world
    losses = []
    names = [k for k, _ in model.named_parameters()]
    for step in range(steps):
        x, y = batch(step, global_batch)
        s, _ = loss_sum(model(x[lo:hi]), y[lo:hi])
        # FSDP2 averages gradients over ranks; our loss is a sum over the global batch, so undo it.
        (s * world / (global_batch * SEQ)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        total = s.detach().float()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / (global_batch * SEQ))
    params = {k: p.full_tensor().detach().clone() for k, p in zip(names, model.parameters())}
    return dict(losses=losses, params=params)


def matrix_run(rank: int, world: int, configs: list[dict], steps: int, global_batch: int):
    """Many engine configurations in one process group (spawning costs seconds; steps are ms)."""
    out = []
    for c in configs:
        c = dict(c)
        micro = c.pop("micro_batches", 1)
        if c.pop("fsdp2", False):
            r = fsdp2_run(rank, world, steps, global_batch, c["param_dtype"])
            out.append(r if rank == 0 else None)
        else:
            r = engine_run(rank, world, steps, global_batch, c, micro_batches=micro)
            out.append(r if rank == 0 else None)
    return out


def unit_padding(rank: int, world: int, **sharding) -> dict[str, list[tuple[int, int, int]]]:
    """Per unit that holds parameters: (numel, padded_numel, real elements of this rank's shard)
    of each of its flat parameters, as the engine lays them out on this rank."""
    fsdp = wrap(rank, world, **sharding)
    return {
        u.name: [(f.numel, f.padded_numel, f.valid_numel) for f in u.flats]
        for u in fsdp.all_units()
        if u.flats
    }
