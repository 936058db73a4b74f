"""The one train step (trainer/step.py) with the loop's optimizer and schedule (trainer/optim.py)
against a hand-written single-process reference, at world sizes 1, 2 and 3.

The reference writes out, in plain tensor arithmetic, what the job promises: the mean token loss
of the global batch, the global-norm clip (active: the test model's norms are ~1.5x the bound),
AdamW with bias correction and decoupled weight decay on matrices only (the no-decay group still
learns), and the learning rate of a linear warmup then cosine decay to lr x min_lr_ratio. Our
side is the loop's own: build_optimizer over the engine's shards, lr_at, train_step. A run with
the no-decay group's lr at 0, no warmup, no cosine, weight decay on every parameter or the clip
ignored misses the reference by orders of magnitude more than the tolerance.
"""

import math

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import SEED, SEQ, batch, tiny, wrap
from trainer.config import OptimConfig
from trainer.model import build_model, loss_sum
from trainer.optim import build_optimizer, lr_at
from trainer.step import train_step

STEPS, BATCH = 6, 6
OPTIM = OptimConfig(
    lr=2e-3, warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.1, beta1=0.9, beta2=0.95,
    eps=1e-8, grad_clip=0.5,
)  # fmt: skip
TOL = 1e-5  # fp32, world sizes 1-3 against one process: summation order only (measured ~1e-7)


def scheduled_lr(step: int) -> float:
    """Warmup over OPTIM.warmup_steps to lr, then cosine to lr * min_lr_ratio at STEPS."""
    o = OPTIM
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    t = (step - o.warmup_steps) / (STEPS - o.warmup_steps)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * (1 + math.cos(math.pi * t)) / 2)


def reference() -> dict:
    """Plain model, whole batch, every update written out by hand."""
    model = build_model(tiny(), device="cpu", seed=SEED)
    params = dict(model.named_parameters())
    m = {k: torch.zeros_like(p) for k, p in params.items()}
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    losses, norms, clipped = [], [], 0
    for step in range(STEPS):
        x, y = batch(step, BATCH)
        s, _ = loss_sum(model(x), y)
        model.zero_grad()
        (s / (BATCH * SEQ)).backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params.values()))
        coef = min(1.0, OPTIM.grad_clip / (float(norm) + 1e-6))
        clipped += coef < 1.0
        lr, t = scheduled_lr(step), step + 1
        with torch.no_grad():
            for k, p in params.items():
                g = p.grad * coef
                m[k].mul_(OPTIM.beta1).add_(g, alpha=1 - OPTIM.beta1)
                v[k].mul_(OPTIM.beta2).addcmul_(g, g, value=1 - OPTIM.beta2)
                m_hat = m[k] / (1 - OPTIM.beta1**t)
                v_hat = v[k] / (1 - OPTIM.beta2**t)
                if p.ndim >= 2:  # decoupled weight decay, matrices only
                    p.mul_(1 - lr * OPTIM.weight_decay)
                p.sub_(lr * m_hat / (v_hat.sqrt() + OPTIM.eps))
        losses.append(float(s.detach()) / (BATCH * SEQ))
        norms.append(float(norm))
    assert clipped == STEPS, "the clip must be active for the test to see it"
    return dict(losses=losses, norms=norms, params={k: p.detach() for k, p in params.items()})


def ours(rank: int, world: int) -> dict:
    """The loop's recipe on this rank: build_optimizer, lr_at, train_step on its rows."""
    from trainer.fsdp.state import full_parameters

    fsdp = wrap(rank, world, strategy="FULL_SHARD")
    opt = build_optimizer(fsdp, OPTIM)
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step, BATCH)
        out = train_step(
            fsdp,
            opt,
            [(x[lo:hi], y[lo:hi], 1.0)],
            global_tokens=BATCH * SEQ,
            grad_clip=OPTIM.grad_clip,
            world=world,
            lr=lr_at(OPTIM, STEPS, step),
        )
        losses.append(float(out.loss))
        norms.append(float(out.norm))
    return dict(losses=losses, norms=norms, params=full_parameters(fsdp))


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_step_matches_a_hand_written_adamw_schedule_and_clip(ref, world):
    got = run_distributed(ours, world)[0] if world > 1 else ours(0, 1)  # 1: no process group
    for name in ("losses", "norms"):
        worst = max(abs(a - b) / abs(b) for a, b in zip(got[name], ref[name]))
        assert worst < TOL, (name, worst, got[name], ref[name])
    for k, p in ref["params"].items():
        err = float((got["params"][k] - p).abs().max())
        assert err < TOL, f"{k}: max abs err {err:.2e} after {STEPS} steps"


def test_the_reference_moves_far_more_than_the_tolerance(ref):
    """Would a broken update pass? The parameters move ~1e-3 per step: a run with any of the
    bugs in the module docstring misses by far more than TOL (checked: the no-decay group at lr 0
    misses by its whole update)."""
    start = {
        k: p.detach() for k, p in build_model(tiny(), device="cpu", seed=SEED).named_parameters()
    }
    moved = {k: float((p - start[k]).abs().max()) for k, p in ref["params"].items()}
    assert min(moved.values()) > 100 * TOL, moved
