"""The chunked loss (trainer/loss.py, train.loss_chunk_tokens) against the plain one.

- One forward and backward: the loss and the count equal the plain loss_sum's (1e-6) and every
  parameter's gradient is as close to the exact (float64) one as the plain fp32 path's is (each
  sums the same products in its own order), tied and untied, for no weight, a number
  weight (0.0: a placeholder micro-batch, whose backward still runs and gives zeros), per-token
  masks and ignored (-100) targets, at chunk sizes that do not divide the tokens; evaluation
  (no grad) too. bf16: the loss is fp32 and the gradients are as close to fp32's as the plain
  bf16 path's are.
- Training: our engine at world sizes 1, 2 and 3 (gloo), FULL_SHARD, tied and untied, masks,
  two micro-batches with a zero-weight placeholder on some rank, activation checkpointing:
  chunked equals unchunked to 1e-5 in every step's loss and gradient norm, and the loss falls;
  at world size 2 also fp16 under the grad scaler (to its rounding) and torch FSDP2 (the peer
  of benchmarks/peers.py, over the same units) stepped by trainer/step.py's TorchPeer.
- Auto resolves against the vocabulary; bad values name the key.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from trainer.config import ShardingConfig, model_config
from trainer.fsdp import build_mesh, parallelize
from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.loss import AUTO_MIN_VOCAB, loss_sum, resolve_chunk_tokens
from trainer.model import build_model, initializer
from trainer.step import TorchPeer, micro_batch_loss, train_step

SEED, SEQ, BATCH, STEPS = 7, 12, 4, 3
VOCAB = 263
MODEL = dict(dim=32, n_layers=2, n_heads=4, ffn_dim=64, vocab_size=VOCAB)
CHUNK = 7  # divides neither a rank's tokens nor the batch's


def cfg(tied: bool):
    return model_config("tiny", **MODEL, tie_embeddings=tied)


def data(step: int):
    """(inputs, targets, a loss mask with some zero tokens) of the global batch of `step`."""
    g = torch.Generator().manual_seed(SEED + step)
    toks = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.3).float()
    return toks[:, :-1], toks[:, 1:], mask


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
    """Largest difference relative to the reference's largest magnitude; asserted <= tol."""
    err = float((a.double() - b.double()).abs().max() / max(float(b.abs().max()), 1e-30))
    assert err <= tol, f"{err:.3g} > {tol}"
    return err


# ------------------------------------------------------------------------- one forward and backward


def loss_and_grads(model, x, y, weight, chunk: int):
    model.zero_grad(set_to_none=True)
    s, n = micro_batch_loss(model, x, y, weight, chunk=chunk)
    (s * 0.37).backward()  # the grad scaler and 1/global tokens arrive as grad_output
    return s.detach(), int(n), {k: p.grad for k, p in model.named_parameters()}


WEIGHTS = {
    "none": lambda mask: None,
    "number": lambda mask: 0.5,
    "placeholder": lambda mask: 0.0,
    "mask": lambda mask: mask,
}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("weight", list(WEIGHTS))
def test_chunked_loss_and_gradients_equal_the_plain_loss_in_fp32(tied, weight):
    model = build_model(cfg(tied), device="cpu", seed=SEED)
    x, y, mask = data(0)
    y = y.clone()
    y[0, :3] = -100  # ignored targets, as F.cross_entropy ignores them
    w = WEIGHTS[weight](mask)
    s0, n0, g0 = loss_and_grads(model, x, y, w, 0)
    # The exact gradient, to compare both fp32 paths with: each sums the same products in its
    # own order, so each carries its own fp32 rounding (~1e-7 x the terms' magnitude); they may
    # differ from each other by the sum of both. The chunked one must be as close to the exact
    # value as the plain one is (twice its error), or within 8 fp32 ulps of the largest value.
    exact = build_model(cfg(tied), device="cpu", seed=SEED).double()
    _, _, g64 = loss_and_grads(exact, x, y, w.double() if torch.is_tensor(w) else w, 0)
    ulp = torch.finfo(torch.float32).eps
    for chunk in (CHUNK, 1, 10_000):
        s, n, g = loss_and_grads(model, x, y, w, chunk)
        assert s.dtype == torch.float32 and n == n0
        if weight == "placeholder":  # adds nothing, but every gradient exists (backward ran)
            assert float(s) == 0.0 and all(float(t.abs().max()) == 0.0 for t in g.values())
            continue
        assert abs(float(s) - float(s0)) <= 1e-6 * abs(float(s0))
        for k in g0:
            plain_err = close(g0[k], g64[k], 1e-5)
            close(g[k], g64[k], max(2 * plain_err, 8 * ulp))


def test_evaluation_without_gradients_equals_the_plain_loss():
    model = build_model(cfg(False), device="cpu", seed=SEED)
    x, y, mask = data(1)
    with torch.no_grad():
        plain, n0 = loss_sum(model(x), y, mask)
        chunked, n = micro_batch_loss(model, x, y, mask, chunk=CHUNK)
    assert not chunked.requires_grad and int(n) == int(n0)
    assert abs(float(chunked) - float(plain)) <= 1e-6 * float(plain)


def test_bf16_chunked_loss_is_fp32_and_its_gradients_as_close_to_fp32_as_the_plain_ones():
    x, y, mask = data(2)
    ref = build_model(cfg(False), device="cpu", seed=SEED)
    _, _, g32 = loss_and_grads(ref, x, y, mask, 0)
    model = build_model(cfg(False), device="cpu", seed=SEED).to(torch.bfloat16)
    s_plain, _, g_plain = loss_and_grads(model, x, y, mask, 0)
    s, _, g = loss_and_grads(model, x, y, mask, CHUNK)
    assert s.dtype == torch.float32 and abs(float(s) - float(s_plain)) <= 1e-3 * float(s_plain)
    for k in g32:
        err_plain = close(g_plain[k].float(), g32[k], 0.05)
        err = close(g[k].float(), g32[k], 0.05)
        assert err <= 2 * err_plain + 1e-3, (k, err, err_plain)


def test_a_second_backward_through_the_chunked_loss_is_refused():
    model = build_model(cfg(False), device="cpu", seed=SEED)
    x, y, _ = data(0)
    s, _ = micro_batch_loss(model, x, y, None, chunk=CHUNK)
    s.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="loss_chunk_tokens"):
        s.backward()


def test_auto_chunking_turns_on_for_large_vocabularies_and_values_name_the_key():
    assert resolve_chunk_tokens(None, 256) == 0
    assert resolve_chunk_tokens(None, AUTO_MIN_VOCAB - 1) == 0 == resolve_chunk_tokens(None, 8192)
    assert resolve_chunk_tokens(None, 32000) == 2048  # Llama 2, the 125m preset
    assert resolve_chunk_tokens(None, 128_256) == 512  # 256 MiB of fp32 logits per chunk
    assert resolve_chunk_tokens(None, 151_936) == 384
    assert resolve_chunk_tokens(None, 10**7) == 128
    assert resolve_chunk_tokens(0, 128_256) == 0
    assert resolve_chunk_tokens(100, 256) == 100
    with pytest.raises(ValueError, match=r"train.loss_chunk_tokens: got -1"):
        resolve_chunk_tokens(-1, 256)


# ------------------------------------------------------------------------- training, world 1-3

JOBS = [
    # (name, tied, masked, micro-batches, sharding)
    ("untied", False, False, 1, {}),
    ("tied+mask", True, True, 1, {}),
    ("untied+mask+micro+checkpointing", False, True, 2, {"activation_checkpointing": True}),
    ("fp16", False, False, 1, {"param_dtype": "float16"}),
]


def micro_batches(x, y, mask, lo: int, hi: int, n: int, masked: bool) -> list:
    """This rank's rows in n micro-batches (np.array_split, as trainer.data's Batcher); a rank
    with fewer rows runs a zero-weight placeholder of one row (its collectives pair up)."""
    out = []
    for idx in np.array_split(np.arange(lo, hi), n):
        if len(idx) == 0:
            out.append((x[:1], y[:1], 0.0))
        else:
            out.append((x[idx], y[idx], mask[idx] if masked else 1.0))
    return out


def train_ours(rank, world, tied, masked, micro, sharding, chunk) -> dict:
    sh = ShardingConfig(strategy="FULL_SHARD", **sharding)
    fsdp = parallelize(
        build_model(cfg(tied), device="meta"),
        sh,
        build_mesh(sh, rank, world, local_world_size=world),
        "cpu",
        init_fn=initializer(SEED),
    )
    opt = torch.optim.AdamW(fsdp.param_groups(0.1), lr=1e-2, foreach=False)
    scaler = ShardedGradScaler(enabled=sh.param_dtype == "float16")
    return _train(fsdp, opt, scaler, rank, world, masked, micro, chunk)


def train_fsdp2(rank, world, chunk) -> dict:
    from benchmarks.peers import adamw, fsdp2

    model = build_model(cfg(False), device="cpu", seed=SEED)
    fsdp2(model)
    opt = adamw(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999))
    return _train(TorchPeer(model, opt), opt, None, rank, world, True, 1, chunk)


def _train(model, opt, scaler, rank, world, masked, micro, chunk) -> dict:
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    losses, norms = [], []
    x, y, mask = data(0)  # one batch, learnt step after step: the loss falls
    for _ in range(STEPS):
        out = train_step(
            model,
            opt,
            micro_batches(x, y, mask, lo, hi, micro, masked),
            global_tokens=int(mask.sum()) if masked else BATCH * SEQ,
            grad_clip=1.0,
            scaler=scaler or ShardedGradScaler(enabled=False),
            world=world,
            loss_chunk_tokens=chunk,
        )
        losses.append(float(out.loss))
        norms.append(float(out.norm))
    return dict(losses=losses, norms=norms)


def both(rank: int, world: int) -> dict:
    """Every job plain and chunked on this rank; fp16 and FSDP2 at world size 2 only (time)."""
    out = {}
    for name, tied, masked, micro, sharding in JOBS:
        if name == "fp16" and world != 2:
            continue
        for chunk in (0, CHUNK):
            out[name, chunk] = train_ours(rank, world, tied, masked, micro, sharding, chunk)
    if world == 2:
        for chunk in (0, CHUNK):
            out["fsdp2", chunk] = train_fsdp2(rank, world, chunk)
    return out


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def runs(request):
    world = request.param
    return world, (both(0, 1) if world == 1 else run_distributed(both, world)[0])


@pytest.mark.parametrize("name", [j[0] for j in JOBS] + ["fsdp2"])
def test_chunked_training_equals_unchunked_and_the_loss_falls_at_world_sizes_1_2_3(runs, name):
    world, out = runs
    if (name, 0) not in out:
        pytest.skip(f"{name} runs at world size 2 only")
    plain, chunked = out[name, 0], out[name, CHUNK]
    # fp16: the head's gradient is rounded before its scaling, not after (the math is the same);
    # AdamW's first steps amplify that rounding in the later steps' norms.
    tols = {"losses": 2e-3, "norms": 1e-2} if name == "fp16" else {"losses": 1e-5, "norms": 1e-5}
    for key, tol in tols.items():  # each step's loss and gradient norm: the updates agree
        for a, b in zip(chunked[key], plain[key]):
            assert abs(a - b) <= tol * abs(b), (key, chunked[key], plain[key])
    assert chunked["losses"][-1] < chunked["losses"][0] - 0.05, chunked["losses"]


def test_the_loop_trains_the_same_curve_with_the_loss_in_chunks(tmp_path, monkeypatch):
    """trainer/loop.py resolves train.loss_chunk_tokens and hands it to every step and to the
    evaluation: chunks of 16 tokens give the plain loss's curve (1e-5), which falls."""
    from trainer.config import TrainerConfig
    from trainer.data import prepare
    from trainer.loop import WorkerContext, run_training

    def run(chunk: int, name: str):
        c = TrainerConfig()
        c.model.dim, c.model.n_layers, c.model.n_heads, c.model.ffn_dim = 64, 2, 4, 160
        c.data.max_bytes, c.data.prepared_dir, c.data.seq_len = 100_000, str(tmp_path / "p"), 32
        c.data.eval_fraction, c.train.eval_every = 0.1, 3
        c.train.steps, c.train.global_batch_size, c.train.checkpoint_every = 6, 4, 0
        c.train.loss_chunk_tokens, c.optim.warmup_steps = chunk, 2
        c.validate()
        prepare(c.data)
        ctx = WorkerContext(rank=0, world_size=1, checkpoint_root=str(tmp_path / name))
        return run_training(c, ctx)

    import trainer.loss

    sizes = []  # the chunks the loss ran over: none with 0, 16-token ones with 16
    chunks = trainer.loss._chunks
    monkeypatch.setattr(
        trainer.loss, "_chunks", lambda n, chunk: sizes.append(chunk) or chunks(n, chunk)
    )
    plain = run(0, "plain")
    assert sizes == []
    chunked = run(16, "chunked")
    assert sizes and set(sizes) == {16}
    assert dict(chunked.losses) == pytest.approx(dict(plain.losses), rel=1e-5)
    assert dict(chunked.eval_losses) == pytest.approx(dict(plain.eval_losses), rel=1e-5)
    assert plain.losses[-1][1] < plain.losses[0][1]
