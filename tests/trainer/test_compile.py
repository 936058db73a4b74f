"""train.compile: each block's forward compiled in place (trainer/speed.py), through our engine.

Compiled training equals eager training over 10 steps at world sizes 2 and 3, with activation
checkpointing on and off; no graph break inside a block; after the first steps (and the first
evaluation) nothing compiles again: not the uneven micro-batches of a rank, not the smaller last
evaluation batch, not the document-mask path (torch._dynamo.config.error_on_recompile turns any
recompilation into an error). Parity and recompilation use the aot_eager backend (dynamo's
capture and AOT autograd, what meets the engine's hooks and parameter views; seconds on 2 cores);
a slow test runs inductor itself, with its own cold cache under tmp_path so its time and its
result never depend on an earlier run.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from tests.dist_utils import run_distributed
from trainer.config import ShardingConfig, TrainConfig, model_config
from trainer.fsdp import build_mesh, parallelize
from trainer.fsdp.state import full_parameters
from trainer.model import build_model, initializer, loss_sum
from trainer.speed import apply_speed_levers, compile_blocks, compile_stats
from trainer.step import train_step

MODEL = dict(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=128)
SEQ, GLOBAL_BATCH, STEPS, SEED = 16, 6, 10, 7
LOSS_TOL = 1e-5  # relative, every step
UPDATE_TOL = 1e-4  # |compiled - eager update| / |eager update| per parameter after 10 steps


def batch(step: int, rank: int, world: int, documents: bool = False):
    """This rank's rows of the step's global batch (6 rows: 3 or 2 a rank); with `documents`,
    each row holds two packed documents (positions restart at 0 halfway)."""
    g = torch.Generator().manual_seed(SEED + step)
    toks = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)
    lo, hi = rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world
    x, y = toks[lo:hi, :-1], toks[lo:hi, 1:]
    if not documents:
        return x, y, None
    pos = torch.arange(SEQ) % (SEQ // 2)
    return x, y, pos.expand(hi - lo, SEQ).contiguous()


def micro_batches(x, y, positions, n: int) -> list:
    """n micro-batches as np.array_split splits the rows (3 rows in 2: 2 and 1, a partial one)."""
    out = []
    for idx in np.array_split(np.arange(len(x)), n):
        extra = () if positions is None else (positions[idx],)
        out.append((x[idx], y[idx], 1.0, *extra))
    return out


def build(rank: int, world: int, checkpointing: bool, backend):
    torch._dynamo.reset()  # the pool's ranks outlive a test: start from no compiled code
    counters.clear()
    model = build_model(model_config("tiny", **MODEL), device="meta")
    if backend:
        compile_blocks(model, backend)
    cfg = ShardingConfig(activation_checkpointing=checkpointing)
    fsdp = parallelize(
        model, cfg, build_mesh(cfg, rank, world, world), "cpu", init_fn=initializer(SEED)
    )
    opt = torch.optim.AdamW(fsdp.param_groups(0.1), lr=3e-3, betas=(0.9, 0.95), foreach=False)
    return fsdp, opt


def step(fsdp, opt, s: int, rank: int, world: int, micro: int = 1, documents: bool = False):
    x, y, pos = batch(s, rank, world, documents)
    out = train_step(
        fsdp,
        opt,
        micro_batches(x, y, pos, micro),
        global_tokens=GLOBAL_BATCH * SEQ,
        grad_clip=0.5,
        world=world,
    )
    return float(out.loss)


def train(rank: int, world: int, checkpointing: bool, backend, cache_dir=None) -> dict:
    """10 steps of our engine, blocks compiled with `backend` (None: eager)."""
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    fsdp, opt = build(rank, world, checkpointing, backend)
    losses = [step(fsdp, opt, s, rank, world) for s in range(STEPS)]
    return dict(losses=losses, params=full_parameters(fsdp), stats=compile_stats())


def eager_and_compiled(rank, world, backend, cache_dir=None):
    """Per activation-checkpointing setting: (start parameters, eager run, compiled run)."""
    out = {}
    for checkpointing in (False, True):
        p0 = full_parameters(build(rank, world, checkpointing, None)[0])
        eager = train(rank, world, checkpointing, None)
        out[checkpointing] = (p0, eager, train(rank, world, checkpointing, backend, cache_dir))
    return out if rank == 0 else None


def assert_same_training(p0, eager, compiled):
    for s, (a, b) in enumerate(zip(compiled["losses"], eager["losses"])):
        assert abs(a - b) <= LOSS_TOL * abs(b), (s, a, b)
    for name, ref in eager["params"].items():
        update = ref - p0[name]
        err = (compiled["params"][name] - ref).norm() / update.norm()
        assert err <= UPDATE_TOL, (name, float(err))  # lr=0 or a lost update: err = 1
    assert compiled["stats"]["graphs"] >= 1 and compiled["stats"]["graph_breaks"] == 0


@pytest.mark.parametrize("world", [2, 3])
def test_compiled_blocks_train_as_eager_with_and_without_checkpointing(world):
    runs = run_distributed(eager_and_compiled, world, "aot_eager", timeout=300)[0]
    for checkpointing, (p0, eager, compiled) in runs.items():
        assert_same_training(p0, eager, compiled)
        # The two blocks share one graph: dynamo takes the block's parameters as inputs. With
        # checkpointing the recomputation runs that graph again.
        assert compiled["stats"]["graphs"] == 1, (checkpointing, compiled["stats"])


@pytest.mark.slow
def test_inductor_compiled_training_equals_eager_at_world_2(tmp_path):
    """Inductor's generated code, from a cold cache of this test's own (the checkpointed run
    finds the plain run's graph in it: the same block graph). Slow: two ranks compile the block
    in C++ on 2 cores (67 s with the machine loaded; the aot_eager tests above are its fast
    siblings, and tests/benchmarks/test_engine.py's slow twin runs the benchmark on inductor)."""
    runs = run_distributed(eager_and_compiled, 2, "inductor", str(tmp_path), timeout=400)[0]
    for checkpointing, (p0, eager, compiled) in runs.items():
        assert_same_training(p0, eager, compiled)


# ----------------------------------------------------------------------------- recompilation


def evaluate(fsdp, rank: int, world: int, documents: bool) -> float:
    """The loop's evaluation shape: no_grad, the training micro-batch's rows (2), the last
    batch partial (1 row)."""
    x, y, pos = batch(99, rank, world, documents)
    total = torch.zeros(())
    with torch.no_grad():
        for mb in micro_batches(x, y, pos, 2):
            s, _ = loss_sum(fsdp(mb[0]) if pos is None else fsdp(mb[0], mb[3]), mb[1])
            total += s
    return float(total)


def graphs_after_warmup(rank: int, world: int, documents: bool, checkpointing: bool) -> dict:
    """Two steps and an evaluation meet every shape; then eight more steps and evaluations run
    with any recompilation an error."""
    fsdp, opt = build(rank, world, checkpointing, "aot_eager")
    for s in range(2):
        step(fsdp, opt, s, rank, world, micro=2, documents=documents)
    evaluate(fsdp, rank, world, documents)
    warm = compile_stats()
    torch._dynamo.config.error_on_recompile = True
    try:
        for s in range(2, STEPS):
            step(fsdp, opt, s, rank, world, micro=2, documents=documents)
            if s % 3 == 0:
                evaluate(fsdp, rank, world, documents)
    finally:
        torch._dynamo.config.error_on_recompile = False
    dist.barrier()
    return dict(warm=warm, end=compile_stats())


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "document_mask"])
def test_nothing_recompiles_after_step_2_partial_batches_eval_and_documents(documents):
    for rank_out in run_distributed(graphs_after_warmup, 2, documents, True, timeout=240):
        warm, end = rank_out["warm"], rank_out["end"]
        assert end == {**warm, "seconds": end["seconds"]}, (warm, end)
        assert end["graph_breaks"] == 0
        # one graph per (grad mode, rows): training's 2- and 1-row micro-batches, evaluation's
        assert 1 <= end["graphs"] <= 4, end


def test_generation_with_a_kv_cache_runs_the_block_eagerly():
    """A KV cache changes the length every token: the compiled forward steps aside for it."""
    from trainer.model import KVCache

    torch._dynamo.reset()
    counters.clear()
    cfg = model_config("tiny", **MODEL)
    model = build_model(cfg, device="cpu", seed=SEED)
    apply_speed_levers(model, TrainConfig(compile=True), "cpu")
    before = compile_stats()["graphs"]
    cache = KVCache(cfg, batch=1, max_len=8, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for t in range(4):
            model(torch.tensor([[t]]), cache=cache)
    assert compile_stats()["graphs"] == before and cache.length == 4
