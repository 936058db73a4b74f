"""The divergence guard: nothing non-finite is applied, saved, or left as the newest checkpoint.

A step whose loss or gradient norm is not finite is skipped on every rank (the parameters and
AdamW's state do not move, with the foreach and the fused AdamW alike); train.max_bad_steps of them
in a row stop the run with DivergenceError; non-finite parameters found before a save refuse the
save, so the newest checkpoint stays the last good state. Config numbers must be finite.
"""

import contextlib
import copy
import io
import re

import pytest
import torch

from tests.dist_utils import run_distributed
from trainer.checkpoint.catalog import list_checkpoints
from trainer.checkpoint.verify import verify
from trainer.config import ConfigError, TrainerConfig
from trainer.data import prepare


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    c = TrainerConfig()
    c.model.dim, c.model.n_layers, c.model.n_heads, c.model.ffn_dim = 64, 2, 4, 160
    c.data.max_bytes, c.data.prepared_dir, c.data.seq_len = 200_000, str(d / "prep"), 32
    c.train.steps, c.train.global_batch_size, c.train.checkpoint_every = 8, 4, 2
    c.optim.warmup_steps = 1
    c.validate()
    prepare(c.data)
    return c


def _state(trainer) -> dict:
    """This rank's parameter shards and AdamW state, copied."""
    out = {f"p{i}": f.shard.detach().clone() for i, f in enumerate(trainer.model.flats())}
    for i, st in enumerate(trainer.optimizer.state.values()):
        for k, v in st.items():
            out[f"s{i}.{k}"] = v.detach().clone().float()
    return out


def _run(rank, world, cfg, root, poison, fused=False):
    """Train with `poison`: {"loss": steps whose loss is NaN} or {"param": (from, to), "flat": i}:
    the first element of rank 0's shard of flat i is NaN from step `from` until before step `to`
    (None: for good). Returns the result, the error, what was printed and the state around step
    3."""
    import trainer.step as recipe
    from trainer.loop import DivergenceError, Trainer, WorkerContext

    bad_loss = set(poison.get("loss", ()))
    real_loss_sum = recipe.loss_sum  # the train step's (evaluation's stays finite)
    seen, trainer, saved = {}, [None], {}

    def loss_sum(*a, **kw):
        s, n = real_loss_sum(*a, **kw)
        if trainer[0].step in bad_loss:
            s = s * float("nan")
        return s, n

    def before_step(step):
        t = trainer[0]
        seen[step] = _state(t)
        lo, hi = poison.get("param", (None, None))
        shard = list(t.model.flats())[poison.get("flat", 0)].shard
        if lo is not None and step == lo and rank == 0:
            saved["value"] = shard[0].item()
            shard.data[0] = float("nan")
        if hi is not None and step == hi and rank == 0:
            shard.data[0] = saved["value"]
            seen[step] = _state(t)  # as restored

    recipe.loss_sum = loss_sum
    import trainer.optim as optim  # fused: found_inf on the device; foreach: read on the host

    real_impl = optim.implementation
    optim.implementation = lambda device: {"fused": True} if fused else {"foreach": True}
    out, error = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out):
            ctx = WorkerContext(rank=rank, world_size=world, checkpoint_root=root)
            ctx.before_step = before_step
            trainer[0] = Trainer(cfg, ctx)
            assert bool(trainer[0].optimizer.defaults.get("fused")) == fused
            result = trainer[0].run()
    except DivergenceError as e:
        result, error = trainer[0].result, str(e)
    finally:
        recipe.loss_sum = real_loss_sum
        optim.implementation = real_impl
    return dict(
        losses=result.losses,
        bad=result.bad_steps,
        error=error,
        printed=out.getvalue(),
        steps=trainer[0].step,
        before3=seen.get(3),
        before4=seen.get(4),
    )


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world,fused", [(1, False), (1, True), (2, False)])
def test_a_non_finite_step_is_skipped_on_every_rank_and_training_goes_on(
    cfg, tmp_path, world, fused
):
    root = str(tmp_path / "ckpt")
    if world == 1:
        ranks = [_run(0, 1, cfg, root, {"loss": [3]}, fused)]
    else:
        ranks = run_distributed(_run, world, cfg, root, {"loss": [3]}, fused)
    for r in ranks:
        assert r["error"] is None and r["steps"] == cfg.train.steps
        assert r["bad"] == [3], r["printed"]
        # Step 3 moved nothing: the state before step 4 is the state before step 3 ...
        assert _same(r["before3"], r["before4"])
        # ... and every other step trained (a broken guard that skips everything fails here).
        assert all(loss == loss for s, loss in r["losses"] if s != 3)
    assert "update not applied (1 of train.max_bad_steps=3 in a row)" in ranks[0]["printed"]
    assert all(c.problem is None for c in list_checkpoints(root))


def test_max_bad_steps_in_a_row_stop_the_run_and_the_checkpoints_stay_finite(cfg, tmp_path):
    root = str(tmp_path / "ckpt")
    ranks = run_distributed(_run, 2, cfg, root, {"loss": [3, 4, 5, 6, 7]})
    for r in ranks:
        assert r["bad"] == [3, 4, 5] and r["steps"] == 6
        assert "training diverged: 3 steps in a row (steps 4 to 6)" in r["error"]  # steps done
    # Saved: step 2 and step 4 (whose updates since step 2 were skipped: still finite); nothing
    # after the stop. Every tensor of every checkpoint is finite and checks out.
    found = {c.step: c for c in list_checkpoints(root)}
    assert sorted(found) == [2, 4] and all(c.problem is None for c in found.values())
    for c in found.values():
        assert verify(c.path, check_finite=True) == [], c.path


def test_bad_steps_with_good_ones_between_do_not_stop_the_run(cfg, tmp_path):
    """Five bad steps of eight, never train.max_bad_steps=3 of them in a row: each good step ends
    the streak, so the run trains to the end (a streak that never reset would stop it at step 4)."""
    assert cfg.train.max_bad_steps == 3
    r = _run(0, 1, cfg, str(tmp_path / "ckpt"), {"loss": [1, 2, 4, 5, 7]})
    assert r["error"] is None and r["steps"] == cfg.train.steps, r["printed"]
    assert r["bad"] == [1, 2, 4, 5, 7]
    streaks = re.findall(r"\((\d) of train.max_bad_steps=3 in a row\)", r["printed"])
    assert streaks == ["1", "2", "1", "2", "1"], r["printed"]
    assert not _same(r["before3"], r["before4"])  # step 3, between bad steps, was applied


@pytest.mark.parametrize(
    "flat,bad",
    [
        (-1, [3]),  # the output projection: every logit, so the loss of step 3 is NaN
        (0, []),  # the embedding row of byte 0, which no text holds: every loss stays finite
    ],
)
def test_non_finite_parameters_refuse_the_save_and_the_last_good_checkpoint_survives(
    cfg, tmp_path, flat, bad
):
    c = copy.deepcopy(cfg)
    c.train.keep_checkpoints = 1  # retention would delete step 2 the moment step 4 committed
    c.train.max_bad_steps = 10
    root = str(tmp_path / "ckpt")
    ranks = run_distributed(_run, 2, c, root, {"param": (3, None), "flat": flat})
    for r in ranks:
        assert r["bad"] == bad and r["steps"] == 4
        assert "not saving step 4: the parameters or optimizer state are not finite" in r["error"]
        assert "Nothing after step 2 was saved" in r["error"]
    found = list_checkpoints(root)
    assert [x.step for x in found] == [2] and found[0].problem is None
    assert verify(found[0].path, check_finite=True) == []


@pytest.mark.parametrize(
    "section,key,value",
    [
        ("optim", "lr", float("inf")),
        ("optim", "lr", float("nan")),
        ("optim", "weight_decay", float("nan")),
        ("optim", "grad_clip", float("nan")),
        ("optim", "grad_clip", float("inf")),
        ("optim", "eps", 0.0),
        ("optim", "eps", float("nan")),
        ("optim", "beta2", float("nan")),
        ("optim", "min_lr_ratio", float("nan")),
        ("model", "norm_eps", float("nan")),
        ("model", "rope_theta", float("inf")),
        ("data", "eval_fraction", float("nan")),
        ("train", "max_bad_steps", 0),
    ],
)
def test_config_numbers_must_be_finite(section, key, value):
    c = TrainerConfig()
    setattr(getattr(c, section), key, value)
    with pytest.raises(ConfigError, match=rf"{section}\.{key}="):
        c.validate()
