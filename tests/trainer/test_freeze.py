"""train.freeze: frozen modules train as the single-process reference does, hold no gradient and
no optimizer state, stay bitwise, checkpoint, resume and export, and the planner prices what the
engine holds and sends.

The engine is built by trainer/build.py (the one build: freezing, then sharding) with units
of their own strategies (sharding.modules) at world sizes 1, 2 and 3 (3: every sharded unit is
padded). The reference is the plain model in one process, the same parameters frozen by name
(written here, not by trainer/freeze.py's matching), torch's AdamW over the rest. fp32, 4 steps:
losses to 1e-5, every trainable parameter's update to 1e-4 of its size (with lr=0 every error is
1.0), every frozen parameter bitwise equal to its initial value.

A vision-language model (tiny-vl) with its tower's blocks frozen and replicated, its merger
trained and kept gathered, the decoder FULL_SHARD, on images: the same at world sizes 1 to 3.

A resume may change the frozen set (trainer/checkpoint/optim_state.py): the run continues as a
reference that starts from the checkpoint's weights and AdamW state, a newly trainable parameter
from no state (as in a new run), or, where it shares an optimizer view with parameters that have
state, from zero moments under the view's step count. Each rule is told apart from the other by
more than the tolerance.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
import torch
import torch.distributed as dist

from benchmarks.peers import adamw
from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import CLIP, LR, SEED, SEQ, WD, batch, micro_batch_split, rel, tiny
from trainer.build import build, check_freeze
from trainer.checkpoint import CheckpointReader, CheckpointWriter
from trainer.checkpoint.checkpointer import load_state, state_chunks
from trainer.checkpoint.export import export, load_exported
from trainer.checkpoint.keys import optim_key, param_key
from trainer.config import ConfigError, OptimConfig, ShardingConfig, TrainerConfig, model_config
from trainer.data import rank_range
from trainer.fsdp import build_mesh
from trainer.fsdp.state import full_parameters, optim_pieces
from trainer.fsdp.wrap import NO_INIT
from trainer.model import build_model, initializer, loss_sum
from trainer.optim import set_lr
from trainer.plan.layout import layout
from trainer.plan.traffic import bytes_per_step
from trainer.step import train_step

STEPS, BATCH, SAVED_AT = 4, 7, 2
FULL = dict(strategy="FULL_SHARD")
JOBS = {  # name: (train.freeze, sharding)
    # the embedding replicated and the first block kept gathered, both frozen; the head
    # SHARD_GRAD_OP and trained
    "leading_units": (
        ["tok_embeddings", "layers.0.*"],
        dict(
            strategy="FULL_SHARD",
            modules={"tok_embeddings": "NO_SHARD", "layers.0": "SHARD_GRAD_OP", "output": "sgo"},
        ),
    ),
    # parameters inside units: a unit with a trainable flat and a frozen one
    "inside_units": (
        ["layers.1.attention.*", "norm.weight"],
        dict(strategy="NO_SHARD", modules={"layers.*": "FULL_SHARD", "output": "SHARD_GRAD_OP"}),
    ),
    # resumed from leading_units: the first block trains now / the second block is frozen too
    "unfrozen_block": (["tok_embeddings"], FULL),
    "frozen_more": (["tok_embeddings", "layers.0", "layers.1"], FULL),
    "attention_0": (["layers.0.attention.*"], FULL),
    "nothing": ([], FULL),
}
FROZEN = {  # the same sets, by name
    "leading_units": lambda n: n.startswith(("tok_embeddings.", "layers.0.")),
    "inside_units": lambda n: n.startswith("layers.1.attention.") or n == "norm.weight",
    "unfrozen_block": lambda n: n.startswith("tok_embeddings."),
    "frozen_more": lambda n: n.startswith(("tok_embeddings.", "layers.0.", "layers.1.")),
    "attention_0": lambda n: n.startswith("layers.0.attention."),
    "nothing": lambda n: False,
}


def job(name: str) -> TrainerConfig:
    freeze, sharding = JOBS[name]
    sharding = dict(sharding, modules={k: _s(v) for k, v in sharding.get("modules", {}).items()})
    cfg = TrainerConfig(model=tiny(), sharding=ShardingConfig(**sharding))
    cfg.train.freeze = list(freeze)
    cfg.optim = OptimConfig(lr=LR, weight_decay=WD, beta1=0.9, beta2=0.95, eps=1e-8)
    return cfg.validate()


def _s(value: str) -> str:
    return "SHARD_GRAD_OP" if value == "sgo" else value


def _build(rank, world, name, lr=LR, init=True):
    cfg = job(name)
    mesh = build_mesh(cfg.sharding, rank, world, local_world_size=world)
    built = build(cfg, mesh, "cpu", initializer(SEED) if init else NO_INIT)
    set_lr(built.optimizer, lr)  # optim.lr must be positive: the lr=0 control sets it here
    return built


def _train(rank, world, built, steps: range) -> list[float]:
    lo, hi = rank_range(BATCH, world, rank)
    losses = []
    for step in steps:
        x, y = batch(step, BATCH)
        out = train_step(
            built.model,
            built.optimizer,
            micro_batch_split(x[lo:hi], y[lo:hi], 1),
            global_tokens=BATCH * SEQ,
            grad_clip=CLIP,
            world=world,
        )
        losses.append(float(out.loss))
    return losses


def _held(built) -> dict:
    """What this rank holds for training: optimizer state (bytes, names), gradient shards."""
    fsdp, opt = built.model, built.optimizer
    trainable = [f for f in fsdp.flats() if f.requires_grad]
    return dict(
        optim_bytes=sum(
            v.numel() * v.element_size()
            for st in opt.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.dim() > 0
        ),
        optim_fqns=sorted({fqn for fqn, *_ in optim_pieces(fsdp, opt)}),
        trainable_valid=sum(f.valid_numel for f in trainable),
        trainable_shard=sum(f.shard_numel for f in trainable),
        grad_peak=fsdp.acct.peak["sharded_grads"],
        comm=dict(fsdp.acct.comm_bytes),  # the last step's
        backward=sorted(u.name for u in fsdp.scheduler.backward_order if u is not fsdp.root),
    )


def _runs(rank, world, runs):
    out = []
    for name, lr in runs:
        built = _build(rank, world, name, lr)
        losses = _train(rank, world, built, range(STEPS))
        frozen = built.frozen
        out.append(
            dict(
                losses=losses,
                params=full_parameters(built.model),
                frozen=(frozen.tensors, frozen.params, frozen.total_params),
                **_held(built),
            )
        )
    return out


@lru_cache(maxsize=None)
def runs_at(world: int):
    return run_distributed(_runs, world, [(n, LR) for n in RUNS] + [("leading_units", 0.0)])


RUNS = ("leading_units", "inside_units")


@lru_cache(maxsize=None)
def initial() -> dict[str, torch.Tensor]:
    model = build_model(tiny(), device="cpu", seed=SEED)
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def reference(name: str, model=None, state=None, steps=range(STEPS)) -> dict:
    """The plain model in one process, FROZEN[name] frozen, torch's AdamW (decay on matrices)
    over the rest; `model`, `state` (param name -> AdamW state): where it starts from."""
    model = model or build_model(tiny(), device="cpu", seed=SEED)
    for n, p in model.named_parameters():
        p.requires_grad_(not FROZEN[name](n))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = adamw([p for _, p in named], lr=LR, weight_decay=WD)
    for n, p in named:
        if state and n in state:
            opt.state[p] = state[n]
    losses = []
    for step in steps:
        x, y = batch(step, BATCH)
        s, _ = loss_sum(model(x), y)
        (s / (BATCH * SEQ)).backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(s.detach()) / (BATCH * SEQ))
    return dict(losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


def update_errors(params: dict, ref: dict, start: dict, names) -> dict[str, float]:
    """|update - reference update| / |reference update| for each of `names` (1.0: no move)."""
    return {
        n: float(((params[n] - start[n]) - (ref[n] - start[n])).norm() / (ref[n] - start[n]).norm())
        for n in names
    }


@pytest.mark.parametrize("world", [1, 2, 3])
def test_frozen_modules_under_mixed_strategies_match_the_single_process_reference(world):
    p0 = initial()
    *results, lr0 = runs_at(world)[0]
    for name, r in zip(RUNS, results):
        ref = reference(name)
        losses = max(rel(a, b) for a, b in zip(r["losses"], ref["losses"]))
        assert losses <= 1e-5, (name, world, r["losses"], ref["losses"])
        frozen = [n for n in p0 if FROZEN[name](n)]
        trainable = [n for n in p0 if not FROZEN[name](n)]
        err = update_errors(r["params"], ref["params"], p0, trainable)
        worst = max(err, key=err.get)
        assert err[worst] <= 1e-4, (name, world, worst, err[worst])
        for n in frozen:  # never touched: no update, no weight decay
            assert torch.equal(r["params"][n], p0[n]), (name, n)
        assert r["frozen"] == (len(frozen), sum(p0[n].numel() for n in frozen), _numel(p0))
    # the tolerance can fail: a run whose trainable part never moved is far outside it
    err = update_errors(lr0["params"], reference("leading_units")["params"], p0, p0)
    assert min(v for n, v in err.items() if not FROZEN["leading_units"](n)) > 0.5


def _numel(params: dict) -> int:
    return sum(p.numel() for p in params.values())


@pytest.mark.parametrize("world", [2, 3])
def test_frozen_parameters_hold_no_gradient_and_no_optimizer_state_on_any_rank(world):
    p0 = initial()
    for i, name in enumerate(RUNS):
        held = [ranks[i] for ranks in runs_at(world)]
        trainable = {n for n in p0 if not FROZEN[name](n)}
        # AdamW's two fp32 moments for exactly the trainable elements this rank holds
        for h in held:
            assert h["optim_bytes"] == 8 * h["trainable_valid"], (name, h)
            assert h["grad_peak"] == 4 * h["trainable_shard"], (name, h)
            assert not set(h["optim_fqns"]) - trainable, (name, h["optim_fqns"])
        assert set().union(*(h["optim_fqns"] for h in held)) == trainable


@pytest.mark.parametrize("world", [2, 3])
def test_the_planner_prices_what_the_engine_holds_and_sends_with_frozen_units(world):
    """Each rank's gradient shards, AdamW state and gradient traffic as trainer.plan's layout
    and traffic say (a frozen flat: none of each), and the units whose backward runs; its
    gathers too (a leading frozen FULL_SHARD unit is not gathered again: no backward runs)."""
    for i, name in enumerate(RUNS):
        freeze, sharding = JOBS[name]
        sh = job(name).sharding
        for rank, h in enumerate(r[i] for r in runs_at(world)):
            lay = layout(tiny(), sh, world, world, rank, freeze=freeze)
            assert lay.sharded_grads == h["grad_peak"], (name, rank)
            assert lay.optim_state == h["optim_bytes"], (name, rank)
            sent = bytes_per_step(lay, sh, 1)
            for op in ("reduce_scatter", "all_reduce"):
                assert sent[op] == h["comm"].get(op, 0), (name, rank, op, sent, h["comm"])
            assert sent["all_gather"] == h["comm"].get("all_gather", 0), (name, rank)
            # the units whose backward runs, as the layout says (a leading frozen unit: none)
            assert sorted(u.name for u in lay.units if u.backward) == h["backward"], name
    unfrozen = layout(tiny(), job("leading_units").sharding, world, world)
    frozen = layout(tiny(), job("leading_units").sharding, world, world, freeze=JOBS[RUNS[0]][0])
    assert frozen.frozen_elements == sum(
        v.numel() for k, v in initial().items() if FROZEN[RUNS[0]](k)
    )
    assert frozen.sharded_params == unfrozen.sharded_params  # the weights are still held
    assert (
        frozen.optim_state < unfrozen.optim_state and frozen.sharded_grads < unfrozen.sharded_grads
    )


# ---- checkpoints ---------------------------------------------------------------------------


def _save(rank, world, root, name):
    built = _build(rank, world, name)
    _train(rank, world, built, range(SAVED_AT))
    writer = CheckpointWriter(root, keep=2, group=dist.group.WORLD if world > 1 else None)
    state = {"model_config": dataclasses.asdict(tiny())}  # what the export writes as config.json
    writer.save(SAVED_AT, rank, world, state_chunks(built.model, built.optimizer), state)
    path = writer.wait()
    writer.close()
    continued = _train(rank, world, built, range(SAVED_AT, STEPS))
    return dict(path=path, continued=continued, params=full_parameters(built.model))


def _resume(rank, world, path, name):
    built = _build(rank, world, name, init=False)
    notes = load_state(built.model, built.optimizer, CheckpointReader(path), 2.0, "cpu")
    fresh = sorted(  # parameters whose optimizer views start with no state
        i.fqn
        for f in built.model.flats()
        if f.requires_grad
        for p, _, base in f.opt_params
        if p not in built.optimizer.state
        for i, _, n, off in f.local_pieces()
        if base <= off < base + p.numel()
    )
    losses = _train(rank, world, built, range(SAVED_AT, STEPS))
    return dict(notes=notes, fresh=fresh, losses=losses, params=full_parameters(built.model))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen")
    return {
        name: run_distributed(_save, 2, str(root / name), name)[0]
        for name in ("leading_units", "attention_0")
    }


def test_a_run_with_frozen_modules_resumes_at_another_world_size_as_it_would_have_continued(
    saved,
):
    s = saved["leading_units"]
    p0 = initial()
    keys = set(CheckpointReader(s["path"]).keys())
    for n in p0:  # every weight saved; AdamW state for the trainable ones only
        assert param_key(n) in keys
        assert (optim_key(n, "exp_avg") in keys) is not FROZEN["leading_units"](n), n
    for world in (3, 1):
        r = run_distributed(_resume, world, s["path"], "leading_units")[0]
        assert r["notes"] == [] and r["fresh"] == []
        assert max(rel(a, b) for a, b in zip(r["losses"], s["continued"])) <= 1e-5, world
        for n in p0:
            if FROZEN["leading_units"](n):
                assert torch.equal(r["params"][n], p0[n]), n
            else:
                torch.testing.assert_close(r["params"][n], s["params"][n], rtol=1e-4, atol=1e-6)


def test_the_export_keeps_frozen_weights_bitwise(saved, tmp_path):
    export(saved["leading_units"]["path"], str(tmp_path / "out"))
    cfg, tensors = load_exported(str(tmp_path / "out"))
    p0 = initial()
    assert sorted(tensors) == sorted(p0)
    moved = [n for n in p0 if not torch.equal(tensors[n], p0[n])]
    assert moved == [n for n in p0 if not FROZEN["leading_units"](n)]


def from_checkpoint(path: str, zero_moments: tuple[str, ...] = ()):
    """The plain model holding the checkpoint's weights, and each saved AdamW state (step 2);
    the parameters in `zero_moments` get zero moments under step 2."""
    reader = CheckpointReader(path)
    model = build_model(tiny(), device="cpu", seed=SEED)
    state = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(reader.read_full(param_key(n)))
            if optim_key(n, "exp_avg") in reader.keys():
                moments = {
                    m: reader.read_full(optim_key(n, m)).clone() for m in ("exp_avg", "exp_avg_sq")
                }
                state[n] = dict(step=torch.tensor(2.0), **moments)
            elif n in zero_moments:
                state[n] = dict(
                    step=torch.tensor(2.0),
                    exp_avg=torch.zeros_like(p),
                    exp_avg_sq=torch.zeros_like(p),
                )
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, state, start


def _continues_as(r, path, name, zero_moments=(), other=None):
    """r (a resumed run) follows the reference from `path` with `zero_moments`, and parts from
    the one with `other` instead (the other rule) by more than the tolerance."""
    model, state, start = from_checkpoint(path, zero_moments)
    ref = reference(name, model, state, range(SAVED_AT, STEPS))
    assert max(rel(a, b) for a, b in zip(r["losses"], ref["losses"])) <= 1e-5, name
    trainable = [n for n in start if not FROZEN[name](n)]
    err = update_errors(r["params"], ref["params"], start, trainable)
    assert max(err.values()) <= 1e-4, (name, max(err, key=err.get))
    for n in start:
        if FROZEN[name](n):
            assert torch.equal(r["params"][n], start[n]), n
    if other is None:
        return
    model, state, start = from_checkpoint(path, other)
    ref = reference(name, model, state, range(SAVED_AT, STEPS))
    err = update_errors(r["params"], ref["params"], start, trainable)
    assert max(err.values()) > 1e-2, name


def test_a_module_unfrozen_at_resume_starts_its_adamw_state_as_a_new_run_does(saved):
    path = saved["leading_units"]["path"]
    ranks = run_distributed(_resume, 3, path, "unfrozen_block")
    r = ranks[0]
    block0 = [n for n in initial() if n.startswith("layers.0.")]
    assert len(r["notes"]) == 1 and "9 parameters (layers.0." in r["notes"][0], r["notes"]
    assert "zero moments" in r["notes"][0]
    fresh = set().union(*(x["fresh"] for x in ranks))  # its own flat: no state until its step
    assert sorted(fresh) == sorted(block0)
    _continues_as(r, path, "unfrozen_block", other=tuple(block0))


def test_a_module_frozen_at_resume_drops_its_state_and_keeps_its_saved_weights(saved):
    path = saved["leading_units"]["path"]
    r = run_distributed(_resume, 2, path, "frozen_more")[0]
    assert len(r["notes"]) == 1 and "(layers.1." in r["notes"][0], r["notes"]
    assert "not loaded" in r["notes"][0]
    _continues_as(r, path, "frozen_more")


def test_a_parameter_unfrozen_beside_trained_ones_starts_from_zero_moments_at_their_step(saved):
    """layers.0's attention was frozen, its feed-forward trained: unfrozen, the attention shares
    the block's weight-decay view (one step count) with the feed-forward's saved state."""
    path = saved["attention_0"]["path"]
    attention = tuple(n for n in initial() if n.startswith("layers.0.attention."))
    for world in (2, 3):  # at 3, rank 0's slice of the block's flat is all attention
        ranks = run_distributed(_resume, world, path, "nothing")
        assert all(x["fresh"] == [] for x in ranks) and "zero moments" in ranks[0]["notes"][0]
        _continues_as(ranks[0], path, "nothing", zero_moments=attention, other=())


def test_a_freeze_pattern_that_names_no_parameter_is_refused_naming_the_top_level_modules():
    cfg = job("leading_units")
    cfg.train.freeze = ["tok_embeddings", "visual.*"]
    with pytest.raises(ConfigError) as e:
        check_freeze(cfg)
    message = str(e.value)
    assert "train.freeze pattern 'visual.*' names no parameter" in message
    assert "tok_embeddings, layers (layers.0 .. layers.2), norm, output" in message
    with pytest.raises(ConfigError):  # the build refuses it too, on every worker
        build(cfg, build_mesh(cfg.sharding, 0, 1), "meta", None, optimizer=False)
    cfg.train.freeze = ["*"]
    with pytest.raises(ConfigError, match="freezes every parameter of this model"):
        check_freeze(cfg)
    cfg.train.freeze = "visual.*"
    with pytest.raises(ConfigError, match=r"train.freeze='visual.\*'; valid: a list"):
        cfg.validate()


def test_patterns_name_parameters_or_the_modules_holding_them():
    cfg = job("nothing")
    frozen = {
        tuple(p): check_freeze(_with(cfg, p))
        for p in (["layers.0"], ["layers.0.*"], ["layers.*.attention"], ["*_norm.weight"])
    }
    blocks = {n: p.numel() for n, p in initial().items()}
    block0 = sum(v for n, v in blocks.items() if n.startswith("layers.0."))
    assert frozen[("layers.0",)].params == frozen[("layers.0.*",)].params == block0
    attention = sum(v for n, v in blocks.items() if ".attention." in n)
    assert frozen[("layers.*.attention",)].params == attention
    assert frozen[("*_norm.weight",)].tensors == 2 * 3  # each block's two norms (not `norm`)
    assert "12 of 30 tensors frozen" in frozen[("layers.*.attention",)].describe()


def _with(cfg, patterns):
    cfg.train.freeze = list(patterns)
    return cfg


# ---- a vision-language model ---------------------------------------------------------------

VL_ROWS, VL_SEQ, VL_STEPS, IMAGE_GRID = 6, 24, 3, (1, 4, 4)  # an image: 16 patches, 4 tokens
# the tower frozen but its merger (the projector), which trains with the decoder; the frozen
# blocks replicated, the merger kept gathered, the decoder FULL_SHARD
VL_FREEZE = ["visual.patch_embed", "visual.blocks.*"]
VL_SHARDING = dict(
    strategy="FULL_SHARD", modules={"visual.merger": "SHARD_GRAD_OP", "visual.*": "NO_SHARD"}
)


def vl_frozen(name: str, merger: bool = False) -> bool:
    tower = ("visual.patch_embed.", "visual.blocks.") + (("visual.merger.",) if merger else ())
    return name.startswith(tower)


def vl_batch(step: int, rows: range):
    """Token rows of the step, each with one image (its run of image tokens at column 3), the
    targets, and the images' pixels and grids, for `rows` of them."""
    g = torch.Generator().manual_seed(SEED + step)
    toks = torch.randint(0, 250, (VL_ROWS, VL_SEQ + 1), generator=g)
    toks[:, 3:7] = model_config("tiny-vl").vision.image_token_id
    patches = IMAGE_GRID[1] * IMAGE_GRID[2]
    pixels = torch.randn(VL_ROWS, patches, 3 * 2 * 14 * 14, generator=g)
    x, y = toks[rows, :-1], toks[rows, 1:]
    grid = torch.tensor([IMAGE_GRID] * len(rows))
    images = dict(pixels=pixels[rows].flatten(0, 1), image_grid=grid)
    return x, y, images


def _vl_run(rank, world):
    cfg = TrainerConfig(model=model_config("tiny-vl"), sharding=ShardingConfig(**VL_SHARDING))
    cfg.train.freeze = VL_FREEZE
    cfg.optim = OptimConfig(lr=LR, weight_decay=WD, beta1=0.9, beta2=0.95, eps=1e-8)
    mesh = build_mesh(cfg.validate().sharding, rank, world, local_world_size=world)
    built = build(cfg, mesh, "cpu", initializer(SEED))
    rows = range(*rank_range(VL_ROWS, world, rank))
    losses = []
    for step in range(VL_STEPS):
        x, y, images = vl_batch(step, rows)
        out = train_step(
            built.model,
            built.optimizer,
            [(x, y, 1.0, None, None, images)],
            global_tokens=VL_ROWS * VL_SEQ,
            grad_clip=CLIP,
            world=world,
        )
        losses.append(float(out.loss))
    return dict(losses=losses, params=full_parameters(built.model), **_held(built))


@lru_cache(maxsize=None)
def vl_reference(merger_frozen: bool = False) -> dict:
    model = build_model(model_config("tiny-vl"), device="cpu", seed=SEED)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(not vl_frozen(n, merger_frozen))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(trainable, lr=LR, weight_decay=WD)
    losses = []
    for step in range(VL_STEPS):
        x, y, images = vl_batch(step, range(VL_ROWS))
        s, _ = loss_sum(model(x, **images), y)
        (s / (VL_ROWS * VL_SEQ)).backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(s.detach()) / (VL_ROWS * VL_SEQ))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(losses=losses, params=params, start=start)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_frozen_vision_tower_stays_bitwise_while_its_merger_and_the_decoder_train(world):
    ranks = run_distributed(_vl_run, world)
    r, ref = ranks[0], vl_reference()
    assert max(rel(a, b) for a, b in zip(r["losses"], ref["losses"])) <= 1e-5, world
    start = ref["start"]
    trainable = [n for n in start if not vl_frozen(n)]
    # A key bias's gradient is zero but for rounding (softmax ignores what adds to every
    # score of a query: q.(k + b)), and AdamW scales that noise to lr-sized steps. The token
    # embedding's rows seen once in these steps take AdamW's sign-like first steps on gradients
    # whose rank partial sums cancel in places: measured 2.0e-5, 3.8e-4 and 4.4e-4 at world
    # sizes 1, 2 and 3 (every other parameter within 4.5e-5); a lost update is 1.0.
    compared = [n for n in trainable if not (".wk." in n and n.endswith("bias"))]
    err = update_errors(r["params"], ref["params"], start, compared)
    tolerance = {"tok_embeddings.weight": 2e-3}
    bad = {n: e for n, e in err.items() if e > tolerance.get(n, 1e-4)}
    assert not bad, (world, bad)
    assert any(n.startswith("visual.merger.") for n in trainable)
    for n in start:
        if vl_frozen(n):
            assert torch.equal(r["params"][n], start[n]), n
    for h in ranks:  # no gradient and no AdamW state for the tower's blocks, on any rank
        assert h["optim_bytes"] == 8 * h["trainable_valid"]
        assert h["grad_peak"] == 4 * h["trainable_shard"]
        assert not [n for n in h["optim_fqns"] if vl_frozen(n)]
    # the tolerance can fail: against the reference whose merger stays, the merger is far off
    merger = [n for n in trainable if n.startswith("visual.merger.") and n.endswith("weight")]
    still = vl_reference(merger_frozen=True)
    off = update_errors(r["params"], still["params"], start, merger)
    assert min(off.values()) > 0.5, off
