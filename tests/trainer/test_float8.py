"""train.float8: torchao's Float8Linear inside the blocks (trainer/speed.py), on the CPU through
torchao's emulation (fp8 casts and scales, products in fp32), through our engine.

Float8 scales by the amax of what each rank computes on (its batch rows), so the reference is
the data-parallel computation itself in one process: each rank's rows forward and backward in
turn, gradients summed, one clip and one AdamW step. Skipped without torchao (the `float8`
extra, which `make setup` installs).
"""

import importlib.util

import pytest
import torch

from tests.dist_utils import run_distributed
from trainer.config import ConfigError, ShardingConfig, TrainConfig, model_config
from trainer.fsdp import build_mesh, parallelize
from trainer.fsdp.state import full_gradients, full_parameters
from trainer.model import build_model, initializer, loss_sum
from trainer.speed import apply_speed_levers, check_float8
from trainer.step import train_step

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402 -- after the skip

MODEL = dict(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=128)
SEQ, GLOBAL_BATCH, STEPS, SEED, CLIP, LR = 16, 4, 4, 3, 0.5, 3e-3


def batch(step: int):
    g = torch.Generator().manual_seed(SEED + step)
    toks = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def adamw(groups):
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), foreach=False)


def float8_model(recipe: str, device: str):
    model = build_model(model_config("tiny", **MODEL), device=device, seed=SEED)
    info = apply_speed_levers(model, TrainConfig(float8=True, float8_recipe=recipe), "cpu")
    return model, info


def reference(world: int, recipe: str) -> dict:
    """Data parallelism in one process: rank r's rows forward and backward, r = 0..world-1."""
    model, _ = float8_model(recipe, "cpu")
    params = list(model.parameters())
    opt = adamw(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    )
    p0 = {k: p.detach().clone() for k, p in model.named_parameters()}
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        total = 0.0
        for r in range(world):
            lo, hi = r * GLOBAL_BATCH // world, (r + 1) * GLOBAL_BATCH // world
            s, _ = loss_sum(model(x[lo:hi]), y[lo:hi])
            (s / (GLOBAL_BATCH * SEQ)).backward()
            total += float(s)
        if step == 0:
            grads0 = {k: p.grad.clone() for k, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total / (GLOBAL_BATCH * SEQ))
    params = {k: p.detach() for k, p in model.named_parameters()}
    return dict(losses=losses, params=params, p0=p0, grads0=grads0)


def engine(rank: int, world: int, recipe: str) -> dict:
    model, info = float8_model(recipe, "meta")
    cfg = ShardingConfig()
    fsdp = parallelize(
        model, cfg, build_mesh(cfg, rank, world, world), "cpu", init_fn=initializer(SEED)
    )
    opt = adamw(fsdp.param_groups(0.1))
    lo, hi = rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world
    losses, grads0 = [], {}
    for step in range(STEPS):
        x, y = batch(step)
        out = train_step(
            fsdp,
            opt,
            [(x[lo:hi], y[lo:hi], 1.0)],
            global_tokens=GLOBAL_BATCH * SEQ,
            grad_clip=CLIP,
            world=world,
            on_gradients=(lambda: grads0.update(full_gradients(fsdp))) if step == 0 else None,
        )
        losses.append(float(out.loss))
    params = full_parameters(fsdp)
    if rank != 0:
        return None
    plain = build_model(model_config("tiny", **MODEL), device="cpu", seed=SEED)
    x, y = batch(0)
    plain_loss = float(loss_sum(plain(x), y)[0].detach()) / (GLOBAL_BATCH * SEQ)
    return dict(
        losses=losses,
        params=params,
        grads0=grads0,
        ref=reference(world, recipe),
        plain_loss=plain_loss,
        info=(len(info.float8_linears), info.float8_emulated, info.describe()),
    )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_through_the_engine_equals_data_parallel_float8_at_world_2(recipe):
    out = run_distributed(engine, 2, recipe, timeout=240)[0]
    ref = out["ref"]
    # The first step starts from the same weights: the same fp8 casts, the same loss and the
    # same gradient as data parallelism computes them.
    a, b = out["losses"][0], ref["losses"][0]
    assert abs(a - b) <= 1e-6 * abs(b), (a, b)
    for name, want in ref["grads0"].items():
        err = (out["grads0"][name] - want).norm() / want.norm()
        assert err <= 1e-5, (name, float(err))
    # Later the engine's summation order moves a weight by an ulp, and an fp8 rounding may flip
    # with it (tensorwise: one scale for the whole tensor): fp8-sized differences, far below
    # what a lost or doubled update makes (lr=0 or a lost update: an update error of 1).
    for a, b in zip(out["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-3 * abs(b), (out["losses"], ref["losses"])
    for name, want in ref["params"].items():
        update = want - ref["p0"][name]
        err = (out["params"][name] - want).norm() / update.norm()
        assert err <= 0.2, (name, float(err))
    # fp8 really ran: the first loss moved off the plain model's by fp8 rounding
    assert abs(out["losses"][0] - out["plain_loss"]) > 1e-5 * out["plain_loss"]
    n, emulated, line = out["info"]
    assert n == 2 * 7 and emulated and "emulated on the CPU" in line, line


def test_float8_converts_the_block_linears_only_keeping_their_init():
    model, info = float8_model("tensorwise", "cpu")
    linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, Float8Linear) for m in linears)
    inside = {id(m) for m in model.layers.modules()}
    outside = [m for m in model.modules() if id(m) not in inside]  # the embedding, the head
    assert outside and not any(isinstance(m, Float8Linear) for m in outside)
    assert type(model.tok_embeddings) is torch.nn.Embedding
    assert all(hasattr(m, "init_std") for m in linears)  # init_parameters still knows them
    assert info.float8_skipped == []


def test_float8_leaves_out_linears_whose_dimensions_do_not_divide_by_16():
    cfg = model_config("tiny", dim=64, n_layers=1, n_heads=4, ffn_dim=72, vocab_size=128)
    model = build_model(cfg, device="meta")
    info = apply_speed_levers(model, TrainConfig(float8=True), "cpu")
    ffn = {f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")}
    assert set(info.float8_skipped) == ffn and len(info.float8_linears) == 4
    assert "3 left out" in info.describe()


def test_float8_is_refused_on_a_gpu_below_sm89_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError) as e:
        check_float8(TrainConfig(float8=True), torch.device("cuda", 0))
    msg = str(e.value)
    assert "train.float8=True" in msg and "sm_80" in msg and "sm_89" in msg and "A100" in msg


def test_float8_without_torchao_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"elastic-fsdp\[float8\].*torchao==0\.18\.0"):
        check_float8(TrainConfig(float8=True))
