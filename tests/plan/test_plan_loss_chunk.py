"""The planner's activations (trainer/plan/activations.py) with the chunked loss.

- Chunked, the root's profile holds one chunk's logits and their gradient, not the whole
  [tokens, vocab] fp32 logits: its peak falls by more than the whole logits, and what it keeps
  for backward is the head's gradient and the hidden states', not the log-probabilities.
- What the profile says chunking saves is what a real forward and backward saves, counted by
  the same allocation tracker on real tensors (within 5%).
- profile's loss_chunk_tokens is train.loss_chunk_tokens, resolved as the loop resolves it
  (None: auto for the vocabulary; 0: the plain loss).
"""

from __future__ import annotations

import torch

from trainer.config import model_config
from trainer.loss import resolve_chunk_tokens
from trainer.model import build_model
from trainer.plan import profile
from trainer.plan.activations import AllocationTracker
from trainer.step import micro_batch_loss

MiB = 2**20
VOCAB, DIM, ROWS, SEQ, CHUNK = 32768, 64, 2, 512, 256
MODEL = model_config("tiny", vocab_size=VOCAB, dim=DIM, n_layers=1, n_heads=1, ffn_dim=128)
LOGITS = ROWS * SEQ * VOCAB * 4  # the whole fp32 logits: 128 MiB


def root_peak(chunk) -> int:
    r = profile(MODEL, ROWS, SEQ, "float32", False, chunk).root
    return max(r.forward_peak, r.head_backward_peak, r.embedding_backward_peak)


def test_chunked_root_holds_one_chunk_of_logits_not_the_whole_logits():
    plain = profile(MODEL, ROWS, SEQ, "float32", False, 0).root
    chunked = profile(MODEL, ROWS, SEQ, "float32", False, CHUNK).root
    assert root_peak(0) - root_peak(CHUNK) >= LOGITS
    head_grad, hidden = VOCAB * DIM * 4, ROWS * SEQ * DIM * 4
    chunk_logits = CHUNK * VOCAB * 4
    assert plain.retained >= LOGITS  # the fp32 log-probabilities wait for backward
    assert chunked.retained <= head_grad + 2 * hidden + MiB
    assert chunked.forward_peak <= chunk_logits + head_grad + 2 * hidden + MiB


def _measured_peak(model, x, y, chunk: int) -> int:
    """Peak bytes that torch's ops allocate in a forward and backward of the real model (the
    parameters' gradients already exist: a second step)."""
    for _ in range(2):
        model.zero_grad(set_to_none=False)
        tracker = AllocationTracker()
        with tracker:
            s, _ = micro_batch_loss(model, x, y, None, chunk=chunk)
            (s / (ROWS * SEQ)).backward()
            del s
    return tracker.peak


def test_what_the_profile_says_chunking_saves_is_what_a_real_step_saves():
    model = build_model(MODEL, device="cpu", seed=0)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(2))
    measured = _measured_peak(model, x, y, 0) - _measured_peak(model, x, y, CHUNK)
    planned = root_peak(0) - root_peak(CHUNK)
    assert measured >= LOGITS
    assert abs(measured - planned) <= 0.05 * measured, (measured / MiB, planned / MiB)


def test_the_profile_resolves_the_setting_as_the_loop_does():
    auto = resolve_chunk_tokens(None, VOCAB)
    assert auto > 0  # this vocabulary is large enough for auto
    assert profile(MODEL, ROWS, SEQ, "float32", False) == profile(
        MODEL, ROWS, SEQ, "float32", False, auto
    )
    small = model_config("tiny")
    assert resolve_chunk_tokens(None, small.vocab_size) == 0
    assert profile(small, 2, 16, "float32", False) == profile(small, 2, 16, "float32", False, 0)
