"""Fine-tuning in the loop: the loss of a step is the mean over the loss tokens of the whole global
batch, whatever the world size, the micro-batches and how conversations fall on ranks.

The chat corpus's assistant turns range from one word to a few hundred, so the ranks of a step
hold very different numbers of loss tokens: a rank-local mean, or a normaliser of sequences x
seq_len, would make world sizes disagree or the loss differ from the independent reference below.
"""

import contextlib
import copy
import io
import json
import random

import pytest
import torch

from benchmarks.packing import write_chat_tokenizer
from tests.dist_utils import run_distributed
from trainer.config import TrainerConfig
from trainer.data import Batches, PreparedData, prepare
from trainer.model import build_model, loss_sum

STEPS = 6


def _train(rank, world, cfg, root):
    from trainer.loop import WorkerContext, run_training

    with contextlib.redirect_stdout(io.StringIO()):
        r = run_training(cfg, WorkerContext(rank=rank, world_size=world, checkpoint_root=root))
    return dict(losses=r.losses)


def write_conversations(path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "one", "two", "three", "red", "blue", "is"]
    with open(path, "w") as f:
        for i in range(n):
            reply = " ".join(rng.choice(words) for _ in range(rng.choice([1, 2, 5, 40, 90])))
            messages = [
                {"role": "user", "content": " ".join(rng.choice(words) for _ in range(6))},
                {"role": "assistant", "content": reply},
            ]
            if i % 3 == 0:
                messages = [{"role": "system", "content": "Be brief."}] + messages
            f.write(json.dumps({"messages": messages}) + "\n")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    write_conversations(d / "chat.jsonl", 160)
    tokenizer = write_chat_tokenizer(str(d), str(d / "chat.jsonl"), 300)
    c = TrainerConfig()
    c.model.dim, c.model.n_layers, c.model.n_heads, c.model.ffn_dim = 64, 2, 4, 160
    c.model.vocab_size = 300
    c.data.kind, c.data.source, c.data.tokenizer = "chat", str(d / "chat.jsonl"), tokenizer
    c.data.prepared_dir, c.data.seq_len = str(d / "prep"), 96
    c.train.steps, c.train.global_batch_size, c.train.checkpoint_every = STEPS, 6, 0
    c.optim.warmup_steps, c.optim.lr = 1, 3e-3
    c.validate()
    prepare(c.data, log=lambda *a: None)
    return c


@pytest.fixture(scope="module")
def reference(cfg, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ref") / "ckpt")
    return [loss for _, loss in run_distributed(_train, 1, cfg, root)[0]["losses"]]


def test_first_step_loss_is_the_mean_over_the_global_batchs_loss_tokens(cfg, reference):
    """Independent of the loop: the initial model's summed cross-entropy over the loss tokens of
    step 0's windows, divided by their count (padding and prompts excluded)."""
    from trainer.data import find_dataset

    data = PreparedData.open(find_dataset(cfg.data.prepared_dir))
    batches = Batches(data, cfg.data.seq_len, cfg.data.seed, cfg.train.global_batch_size)
    (mb,) = batches.micro_batches(0, 0, 1, 1)
    model = build_model(cfg.model, "cpu", seed=cfg.train.seed)
    with torch.no_grad():
        s, n = loss_sum(model(mb.inputs, mb.input_positions), mb.targets, mb.loss_weights)
    assert int(n) == batches.loss_tokens(0) < mb.targets.numel() // 2  # prompts are not trained
    assert reference[0] == pytest.approx(float(s) / int(n), rel=1e-5)


@pytest.mark.parametrize("world,micro", [(2, 1), (3, 1), (2, 2)])
def test_per_step_losses_do_not_depend_on_world_size_or_micro_batches(
    cfg, reference, tmp_path, world, micro
):
    c = copy.deepcopy(cfg)
    c.train.micro_batches = micro
    losses = [
        loss for _, loss in run_distributed(_train, world, c, str(tmp_path / "c"))[0]["losses"]
    ]
    assert losses == pytest.approx(reference, rel=1e-5)
    # Training moves the loss (an update that did nothing would pass the comparison above).
    assert reference[-1] < reference[0] - 0.05, reference
