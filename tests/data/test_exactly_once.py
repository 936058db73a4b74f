"""Exactly once across resizes, on a tokenized Parquet corpus: a run that stops at world size 2,
resumes at 3, then at 1, trains the same multiset of sequences as a run that never stopped (none
repeated, none skipped), with the same losses and the same held-out evaluation.

Runs the real loop (trainer/loop.py) on gloo ranks under torch.multiprocessing; the tokenizer is
a BPE trained in the test on the corpus itself."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io

import pytest

from tests.dist_utils import run_distributed
from trainer.config import ConfigError, TrainerConfig
from trainer.data import plan_and_check, prepare

STEPS = 9


def _train(rank, world, cfg, root, stop_at):
    from trainer.loop import WorkerContext, run_training

    step = [0]

    def before(s):
        step[0] = s + 1  # should_stop is polled before the next step

    stop = (lambda: step[0] >= stop_at) if stop_at is not None else None
    with contextlib.redirect_stdout(io.StringIO()) as out:
        r = run_training(
            cfg,
            WorkerContext(
                rank=rank,
                world_size=world,
                checkpoint_root=root,
                should_stop=stop,
                before_step=before,
                record_samples=True,
            ),
        )
    return dict(
        losses=r.losses,
        samples=r.samples,
        evals=r.eval_losses,
        start=r.start_step,
        steps=r.steps_done,
        printed=out.getvalue(),
    )


@pytest.fixture(scope="module")
def cfg(tmp_path_factory, parquet_corpus, tokenizer_json):
    c = TrainerConfig()
    c.model.dim, c.model.n_layers, c.model.n_heads, c.model.ffn_dim = 64, 2, 4, 160
    c.model.vocab_size = 512
    c.data.source, c.data.tokenizer = f"{parquet_corpus}/*.parquet", str(tokenizer_json)
    c.data.prepared_dir = str(tmp_path_factory.mktemp("prep"))
    c.data.seq_len, c.data.eval_fraction, c.data.eval_sequences = 32, 0.15, 10
    c.train.steps, c.train.global_batch_size, c.train.checkpoint_every = STEPS, 6, 3
    c.train.eval_every = 3
    c.optim.warmup_steps = 2
    c.validate()
    plan_and_check(c)
    prepare(c.data)
    return c


@pytest.fixture(scope="module")
def uninterrupted(cfg, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ref") / "ckpt")
    return run_distributed(_train, 2, cfg, root, None)


def consumed(results) -> collections.Counter:
    return collections.Counter((step, src, sid) for r in results for step, src, sid in r["samples"])


def test_resizes_2_3_1_consume_the_same_sequences_once_with_the_same_losses(
    cfg, uninterrupted, tmp_path
):
    root = str(tmp_path / "ckpt")
    first = run_distributed(_train, 2, cfg, root, 4)
    second = run_distributed(_train, 3, cfg, root, 7)
    third = run_distributed(_train, 1, cfg, root, None)
    assert (first[0]["steps"], second[0]["start"], second[0]["steps"], third[0]["start"]) == (
        4,
        4,
        7,
        7,
    )
    resized = consumed(first) + consumed(second) + consumed(third)
    reference = consumed(uninterrupted)
    assert resized == reference  # the same (step, source, sample) multiset
    assert max(resized.values()) == 1 and len(resized) == STEPS * cfg.train.global_batch_size
    per_step = collections.Counter(step for step, _, _ in resized)
    assert set(per_step.values()) == {cfg.train.global_batch_size}  # no step short or doubled
    ref = dict(uninterrupted[0]["losses"])
    trained = first[0]["losses"] + second[0]["losses"] + third[0]["losses"]
    assert [s for s, _ in trained] == list(range(STEPS))
    for step, loss in trained:
        assert loss == pytest.approx(ref[step], rel=1e-5), step
    evals = first[0]["evals"] + second[0]["evals"] + third[0]["evals"]
    assert [s for s, _ in evals] == [2, 5, 8] == [s for s, _ in uninterrupted[0]["evals"]]
    for (_, got), (_, want) in zip(evals, uninterrupted[0]["evals"]):
        assert got == pytest.approx(want, rel=1e-5)
    assert ref[STEPS - 1] < ref[0] and "| eval " in third[0]["printed"]


def test_a_run_refuses_to_resume_on_data_prepared_differently(cfg, tmp_path):
    root = str(tmp_path / "ckpt")
    _train(
        0, 1, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=3)), root, None
    )
    other = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seed=1))
    with pytest.raises(ConfigError, match=r"trained on other data \(seed: 0 then, 1 now\)"):
        _train(0, 1, other, root, None)
