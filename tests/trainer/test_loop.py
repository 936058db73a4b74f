"""The loop under plain torch.multiprocessing + gloo: resume at another world size loses nothing.

A run that stops at step 4 at world size 2 and resumes at world size 3 (then 1) must train the
same steps with the same losses (1e-5 relative, fp32) as a run that never stopped: the global batch
is constant, the data position is the step, and the checkpoint reshards. Evaluation reads the
held-out split: letters that only held-out documents hold make its loss rise while training's falls.
"""

import contextlib
import copy
import io
import json
import math
import random
import re

import pytest

from tests.dist_utils import run_distributed
from trainer.config import ConfigError, TrainerConfig
from trainer.data import PreparedData, find_dataset, prepare
from trainer.data.preparation import _held_out

STEPS = 8


def _train(rank, world, cfg, root, stop_at):
    from trainer.loop import WorkerContext, run_training

    stop = (lambda: trainer_step[0] >= stop_at) if stop_at is not None else None
    trainer_step = [0]

    def fault(step):
        trainer_step[0] = step + 1  # should_stop is polled before the next step

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        r = run_training(
            cfg,
            WorkerContext(
                rank=rank,
                world_size=world,
                checkpoint_root=root,
                should_stop=stop,
                before_step=fault,
            ),
        )
    print(out.getvalue(), end="")
    return dict(
        losses=r.losses,
        start=r.start_step,
        steps=r.steps_done,
        last=r.last_checkpoint,
        evals=r.eval_losses,
        printed=out.getvalue(),
    )


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    c = TrainerConfig()
    c.model.dim, c.model.n_layers, c.model.n_heads, c.model.ffn_dim = 64, 2, 4, 160
    c.data.max_bytes, c.data.prepared_dir, c.data.seq_len = 300_000, str(d / "prep"), 32
    c.train.steps, c.train.global_batch_size, c.train.checkpoint_every = STEPS, 6, 3
    c.optim.warmup_steps = 2
    c.validate()
    prepare(c.data)
    return c


@pytest.fixture(scope="module")
def uninterrupted(cfg, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ref") / "ckpt")
    return dict(run_distributed(_train, 2, cfg, root, None)[0]["losses"])


def test_resume_at_another_world_size_continues_the_same_loss_curve(cfg, uninterrupted, tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_distributed(_train, 2, cfg, root, 4)[0]
    assert first["steps"] == 4 and first["last"].endswith("step_000000004")
    second = run_distributed(_train, 3, cfg, root, 6)[0]
    assert second["start"] == 4 and second["steps"] == 6
    third = run_distributed(_train, 1, cfg, root, None)[0]
    assert third["start"] == 6 and third["steps"] == STEPS
    trained = first["losses"] + second["losses"] + third["losses"]
    assert [s for s, _ in trained] == list(range(STEPS)), "a step was skipped or trained twice"
    for step, loss in trained:
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5), step
    assert uninterrupted[STEPS - 1] < uninterrupted[0]


def test_checkpoint_of_another_model_is_refused_with_a_clear_error(cfg, tmp_path):
    """World size 1 needs no process group: this runs in the test process itself."""
    root = str(tmp_path / "ckpt")
    _train(0, 1, cfg, root, 1)
    other = copy.deepcopy(cfg)
    other.model.n_layers = 3
    with pytest.raises(ConfigError, match="is of another model .model.n_layers: 2 there, 3 here"):
        _train(0, 1, other, root, None)


def _flip_a_byte(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_a_corrupt_shard_on_one_rank_makes_every_rank_fall_back_to_the_previous_checkpoint(
    cfg, uninterrupted, tmp_path
):
    root = tmp_path / "ckpt"
    first = run_distributed(_train, 2, cfg, str(root), 6)[0]  # checkpoints at steps 3 and 6
    assert first["last"].endswith("step_000000006")
    _flip_a_byte(root / "step_000000006" / "rank-00001-of-00002.bin")
    rank0, rank1 = run_distributed(_train, 2, cfg, str(root), None)
    second = rank0
    assert second["start"] == 3, "rank 0 could read step 6 alone; all ranks must fall back together"
    assert (
        "step_000000006 is unusable" in rank1["printed"] and "checksum mismatch" in rank1["printed"]
    )
    assert "falling back to an older one" in rank0["printed"]
    for step, loss in second["losses"]:
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5), step


STEP_LINE = re.compile(
    r"^step +(?P<done>\d+)/(?P<total>\d+) \| loss (?P<loss>[\d.]+) \| lr [\d.e+-]+ \| "
    r"gnorm [\d.]+ \| (?P<tps>[\d,]+) tok/s \| [\d.]+ ms \| [\d.e+-]+ TFLOPs/worker \| "
    r"mem (?P<mem>[\d.]+) GiB RSS peak \| \d+:\d\d:\d\d elapsed, ETA \d+:\d\d:\d\d \| "
    r"world 1$"
)


def test_the_per_step_line_has_every_figure_and_counts_steps_done(cfg, tmp_path):
    """ "step N" is N optimizer steps done: the first line says step 1, the last step STEPS, as
    the checkpoint directory step_{STEPS:09d} does."""
    r = _train(0, 1, cfg, str(tmp_path / "ckpt"), None)
    lines = [line for line in r["printed"].splitlines() if line.startswith("step ")]
    matches = [STEP_LINE.match(line) for line in lines]
    assert lines and all(matches), lines
    assert [int(m["done"]) for m in matches] == list(range(1, STEPS + 1))
    assert all(int(m["total"]) == STEPS and float(m["mem"]) > 0 for m in matches)
    assert [float(m["loss"]) for m in matches] == pytest.approx(
        [loss for _, loss in r["losses"]], abs=1e-4
    )
    assert r["last"].endswith(f"step_{STEPS:09d}")


TRAIN_LETTERS, EVAL_LETTERS = "abcdefghijklm ", "NOPQRSTUVWXYZ"  # no byte in common


def _split_corpus(path, fraction: float, train_docs: int = 200, eval_docs: int = 60) -> None:
    """JSONL documents of TRAIN_LETTERS that the preparation's held-out hash sends to train and
    documents of EVAL_LETTERS that it sends to eval."""
    rng, docs, want = random.Random(0), [], {False: train_docs, True: eval_docs}
    while any(want.values()):
        held_out = rng.random() < 0.5
        text = "".join(rng.choice(EVAL_LETTERS if held_out else TRAIN_LETTERS) for _ in range(200))
        if want[held_out] and _held_out(text, fraction) == held_out:
            docs.append(text)
            want[held_out] -= 1
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))


def test_evaluation_reads_the_held_out_split(cfg, tmp_path):
    """Held-out documents hold letters that no training document holds. Training on its split
    lowers the loss below the uniform model's ln(256) and lowers the probability of every letter
    it never sees, so the eval loss rises above ln(256): evaluation reading the training split
    (or anything but the held-out one) would fall with the training loss instead."""
    c = copy.deepcopy(cfg)
    _split_corpus(tmp_path / "docs.jsonl", fraction=0.5)
    c.data.source, c.data.prepared_dir = str(tmp_path / "docs.jsonl"), str(tmp_path / "prep")
    c.data.max_bytes, c.data.eval_fraction, c.data.eval_sequences = 0, 0.5, 8
    c.train.eval_every, c.train.checkpoint_every = 4, 0
    c.validate()
    prepare(c.data)
    data = PreparedData.open(find_dataset(c.data.prepared_dir))
    for split, letters in (("train", TRAIN_LETTERS), ("eval", EVAL_LETTERS)):  # the premise
        stream = data.stream(0, split)
        held = set(stream.read(0, len(stream)).tolist()) - {data.eod_id}
        assert held == set(letters.encode()), (split, sorted(held))
    r = run_distributed(_train, 2, c, str(tmp_path / "ckpt"), None)[0]
    uniform = math.log(256)
    assert [s for s, _ in r["evals"]] == [3, 7]
    assert r["losses"][-1][1] < uniform - 1.0 < uniform < r["evals"][0][1] < r["evals"][-1][1], (
        r["losses"],
        r["evals"],
    )
