"""trainer/data/packing.py and the loader's windows: best-fit-decreasing packs whole documents
deterministically, and a step's loss-token count is the same whatever the world size and
micro-batches (the sum of every rank's loss weights); text gets document positions on demand."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from tests.data.chat_templates import write_tokenizer
from trainer.config import DataConfig
from trainer.data import Batches, PreparedData, prepare
from trainer.data.loader import document_positions
from trainer.data.packing import best_fit_decreasing, build_windows, efficiency


def test_best_fit_decreasing_places_each_document_in_the_tightest_window():
    # longest first: 7 opens w0 (room 3), 6 opens w1 (room 4), 4 -> w1 (tightest that fits),
    # 3 -> w0, 2 opens w2 (no room left elsewhere), 2 -> w2 (ties in document order)
    lengths = [3, 7, 2, 6, 4, 2]
    assert best_fit_decreasing(lengths, 10) == [[0, 1], [3, 4], [2, 5]]
    with pytest.raises(ValueError, match="does not fit"):
        best_fit_decreasing([11], 10)


def test_packing_never_splits_a_document_and_is_deterministic():
    rng = random.Random(0)
    lengths = [rng.randint(1, 64) for _ in range(500)]
    bins = best_fit_decreasing(lengths, 64)
    assert bins == best_fit_decreasing(list(lengths), 64)
    assert sorted(i for b in bins for i in b) == list(range(500))  # each document once
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 64) * 1.03 + 1  # BFD: within a few % of the bound


def test_windows_restart_positions_mask_document_starts_and_pad_the_rest():
    docs = [np.array([5, 6, 7]), np.array([8, 9])]
    masks = [np.array([1, 1, 1], np.uint8), np.array([0, 1], np.uint8)]
    w = build_windows(docs, masks, [[0, 1]], 8, pad=0)
    assert w.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert w.mask.tolist() == [[0, 1, 1, 0, 1, 0, 0, 0]]
    assert w.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert w.counts.tolist() == [3] and w.real == 5 and efficiency(w.real, 8) == 5 / 8


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """A packed chat preparation (with an eval split) whose assistant turns vary a lot."""
    root = tmp_path_factory.mktemp("chat")
    tok = write_tokenizer(root / "tok", "qwen2.5")
    rng = random.Random(1)
    with open(root / "c.jsonl", "w") as f:
        for i in range(120):
            reply = " ".join(["mu"] * rng.choice([1, 2, 40, 90]))
            conv = [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": reply}]
            f.write(json.dumps({"messages": conv}) + "\n")
    cfg = DataConfig(
        source=str(root / "c.jsonl"),
        tokenizer=str(tok),
        kind="chat",
        seq_len=255,
        eval_fraction=0.2,
        prepared_dir=str(root / "prep"),
    )
    return PreparedData.open(prepare(cfg).uri)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n_micro", [1, 2])
def test_loss_tokens_is_the_sum_of_every_ranks_loss_weights(chat_data, world, n_micro):
    batches = Batches(chat_data, 255, seed=0, global_batch=5)
    for step in range(4):
        total, rows = 0.0, []
        for rank in range(world):
            for mb in batches.micro_batches(step, rank, world, n_micro):
                assert mb.loss_weights.shape == (len(mb.sample_ids), 255)
                total += float(mb.loss_weights.sum())
                if mb.weight:
                    rows += mb.sample_ids.tolist()
                else:
                    assert float(mb.loss_weights.abs().sum()) == 0.0  # padding adds nothing
        assert total == batches.loss_tokens(step) > 0
        assert len(rows) == 5


def test_window_samples_carry_their_mask_and_positions_to_the_device(chat_data):
    batches = Batches(chat_data, 255, seed=0, global_batch=4)
    mb = batches.micro_batches(0, 0, 1, 1)[0]
    width = chat_data.width
    i = int(mb.sample_ids[0])
    tokens = chat_data.stream(0).read(i * width, width).astype(np.int64)
    positions = chat_data.extra_stream("positions", 0).read(i * width, width).astype(np.int64)
    moved = mb.to("cpu")
    assert torch.equal(moved.windows[0], torch.from_numpy(tokens))
    assert moved.positions.dtype == torch.int64 and moved.loss_mask.dtype == torch.uint8
    assert torch.equal(mb.input_positions[0], torch.from_numpy(positions[:-1]))
    assert mb.input_positions.dtype == torch.int64 and mb.loss_weights.dtype == torch.float32
    assert torch.equal(moved.loss_weights, mb.loss_weights)


def test_eval_windows_work_the_same_way(chat_data):
    assert chat_data.documents("eval") > 0
    batches = Batches(chat_data, 255, seed=0, global_batch=2, split="eval", tag=1)
    mbs = batches.fixed_micro_batches(2, 0, 1, 2)
    assert sum(float(mb.loss_weights.sum()) for mb in mbs) == batches.loss_tokens(0)


def test_a_seq_len_other_than_the_prepared_windows_is_a_config_error(chat_data):
    from trainer.config import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match=r"data\.seq_len=127; valid: 255"):
        Batches(chat_data, 127, seed=0, global_batch=2)


def test_text_with_document_mask_gets_positions_restarting_after_each_end_of_document(tmp_path, dh):
    tokens = np.array([3, 4, 0, 5, 6, 7, 0, 8, 9, 1, 2, 0, 3, 4, 5, 6, 7], np.uint16)
    data = PreparedData.open(dh.make_dataset(tmp_path / "t", [tokens]))
    plain = Batches(data, 8, seed=0, global_batch=2).micro_batches(0, 0, 1, 1)[0]
    assert plain.positions is None and plain.loss_weights is None and plain.loss_mask is None
    batches = Batches(data, 8, seed=0, global_batch=2, document_mask=True)
    mb = batches.micro_batches(0, 0, 1, 1)[0]
    for row, i in enumerate(mb.sample_ids.tolist()):
        window = tokens[i * 8 : i * 8 + 9]
        want, pos = [], 0
        for j in range(9):
            want.append(pos)
            pos = 0 if window[j] == 0 else pos + 1
        assert mb.positions[row].tolist() == want
    assert batches.loss_tokens(3) == 16
    assert document_positions(np.array([[0, 0, 1]]), 0).tolist() == [[0, 0, 0]]
