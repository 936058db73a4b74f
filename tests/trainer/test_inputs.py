"""trainer/inputs.py: the real tokens a mixture's routing counts, on windows packing builds."""

import numpy as np
import torch

from trainer.data.packing import build_windows
from trainer.inputs import real_tokens

PAD = 0


def _windows(docs, width):
    masks = [np.ones(len(d), np.uint8) for d in docs]
    return build_windows([np.array(d) for d in docs], masks, [list(range(len(docs)))], width, PAD)


def test_padding_after_the_last_document_is_not_real():
    w = _windows([[5, 6, 7, PAD], [8, 9]], width=10)  # eod-terminated docs, then 4 pads
    inputs = torch.from_numpy(w.tokens[:, :-1])
    positions = torch.from_numpy(w.positions[:, :-1])
    real = real_tokens(inputs, positions, PAD)
    assert real.tolist() == [[True] * 6 + [False] * 3]
    assert int(real.sum()) == 6


def test_a_document_ending_in_the_pad_id_stays_real():
    w = _windows([[5, 6, PAD], [7, 8, 9, PAD, PAD]], width=8)  # full window, no padding
    inputs = torch.from_numpy(w.tokens[:, :-1])
    positions = torch.from_numpy(w.positions[:, :-1])
    assert bool(real_tokens(inputs, positions, PAD).all())


def test_plain_windows_are_all_real():
    assert real_tokens(torch.zeros(2, 5, dtype=torch.long), None, PAD) is None


def test_a_placeholder_micro_batch_counts_no_token():
    from trainer.data.loader import MicroBatch
    from trainer.inputs import model_inputs

    w = _windows([[5, 6, 7]], width=6)
    mask = torch.ones(1, 6, dtype=torch.uint8)
    mb = MicroBatch(torch.from_numpy(w.tokens), 0.0, np.array([0]), np.array([0]), mask,
                    torch.from_numpy(w.positions))  # fmt: skip
    *_, real = model_inputs(mb, PAD)
    assert not bool(real.any())  # weight 0 everywhere: the routing statistics skip it too
    assert float(model_inputs(mb, PAD)[2].sum()) == 0.0
