"""What the model says at each evaluation: a few fixed eval prompts, generated on every rank of
the engine together and returned as one text block for rank 0 to log (samples/step_N.txt).

    prompts = eval_prompts(eval_batches, cfg.train.sample_prompts)   # the same on every rank
    text = sample_text(fsdp, data.tokenizer_info(), prompts, cfg.train.sample_tokens,
                       world=world, step=step)                                  # ALL ranks
    logger.log_text(text, f"samples/step_{step}.txt")                           # rank 0 logs

A prompt is the start of a window's first document: up to its first loss token (chat data: the
first conversation's prompt, its generation header included), or without a loss mask its first
`max_prompt` tokens.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch
from torch import nn

from trainer.generate.decode import generate_ids
from trainer.generate.text import Text, text_of_info

DEFAULT_PROMPT_TOKENS = 32
"""Prompt length taken from a window without a loss mask (text data)."""


def eval_prompt(
    tokens, loss_mask=None, positions=None, max_prompt: int = DEFAULT_PROMPT_TOKENS
) -> list[int]:
    """The prompt of one window (1-D tokens [T+1] as ids, its loss_mask and positions as in
    MicroBatch, or None): the first document's tokens before its first loss target; a first
    document without one (or no mask) gives its first `max_prompt` tokens (at least one)."""
    ids = np.asarray(_numpy(tokens), dtype=np.int64)
    end = len(ids)
    if positions is not None:
        starts = np.flatnonzero(_numpy(positions)[1:] == 0)  # where the next document begins
        end = int(starts[0]) + 1 if len(starts) else end
    if loss_mask is not None:
        targets = np.flatnonzero(_numpy(loss_mask)[:end])
        if len(targets) and targets[0] > 0:
            return ids[: int(targets[0])].tolist()
    return ids[: max(1, min(end, max_prompt))].tolist()


def batch_prompts(mb, count: int, max_prompt: int = DEFAULT_PROMPT_TOKENS) -> list[list[int]]:
    """The prompts of a MicroBatch's first `count` windows (eval_prompt of each)."""
    windows = mb.windows
    rows = min(count, windows.shape[0])
    return [
        eval_prompt(
            windows[i],
            None if mb.loss_mask is None else mb.loss_mask[i],
            None if mb.positions is None else mb.positions[i],
            max_prompt,
        )
        for i in range(rows)
    ]


def eval_prompts(batches, count: int, max_prompt: int = DEFAULT_PROMPT_TOKENS) -> list[list[int]]:
    """The prompts of the eval split's first `count` windows (a trainer.data Batches). Every
    rank reads the same windows (as rank 0 of a world of one): they must feed the same tokens."""
    if count <= 0:
        return []
    return batch_prompts(batches.fixed_micro_batches(count, 0, 1, count)[0], count, max_prompt)


def sample_text(
    model: nn.Module,
    tokenizer: Union[dict, Text],
    prompts: list[list[int]],
    max_new_tokens: int = 48,
    *,
    world: int = 1,
    step: Optional[int] = None,
    stop_ids: Optional[list[int]] = None,
) -> str:
    """Greedy generations for `prompts`, as a text block: per prompt, its text, then the
    generation's. Every rank of the engine must call it with the same prompts (each forward
    is collective); each returns the same text. `tokenizer`: the run's tokenizer dict
    (PreparedData.tokenizer_info()) or a Text; its stop ids unless `stop_ids` is given."""
    text = tokenizer if isinstance(tokenizer, Text) else text_of_info(tokenizer)
    stops = text.stop_ids if stop_ids is None else list(stop_ids)
    title = f"step {step}: " if step is not None else ""
    lines = [f"# {title}{len(prompts)} prompts, greedy, up to {max_new_tokens} new tokens"]
    for n, prompt in enumerate(prompts, 1):
        ids = generate_ids(model, prompt, max_new_tokens, stops, world=world)
        ended = "ended its turn" if ids and ids[-1] in stops else "did not end its turn"
        lines += [
            "",
            f"## sample {n}",
            f"### prompt ({len(prompt)} tokens)",
            _shown(text, prompt, keep_stop=True),
            f"### generated ({len(ids)} tokens, {ended})",
            _shown(text, ids),
        ]
    return "\n".join(lines) + "\n"


def _shown(text: Text, ids: list[int], keep_stop: bool = False) -> str:
    """The text of ids (ids themselves without a readable tokenizer)."""
    if text.codec is None:
        return " ".join(map(str, ids))
    return text.codec.decode(ids) if keep_stop else text.decode(ids)


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)
