"""How much of a step one worker computes: the sequences of its largest micro-batch, the tokens
of each under context parallelism, the patches its vision tower sees, what a mixture's routers
keep. The memory planner (planner.py) and the step-time model (steptime.py) count with these.
"""

from __future__ import annotations

import math
from typing import Optional

from trainer.data import rank_range


def router_bytes(model, tokens: int, param_bytes: int) -> int:
    """What a mixture's routers keep for backward over `tokens` tokens, every sparse layer: the
    logits (compute dtype) and the fp32 probabilities of every expert, and the top-k indices
    (int64) and weights (fp32) of each token (trainer/model/moe.py). Without checkpointing all
    layers' at once; with it, one block's during its recomputation."""
    per_token = model.moe_experts * (param_bytes + 4) + model.moe_top_k * (8 + 4)
    return tokens * per_token * len(model.sparse_layers)


def context_tokens(seq_len: int, context: int) -> int:
    """Tokens of each sequence one worker computes at train.context_parallel=`context`: two
    chunks of ceil(seq_len / 2N) (the sequence padded to 2N chunks), all of them at 1."""
    return seq_len if context <= 1 else 2 * -(-seq_len // (2 * context))


def rows_per_micro_batch(
    global_batch: int, world_size: int, micro_batches: int, rank: int = 0
) -> int:
    """Sequences in `rank`'s largest micro-batch, as trainer.data.Batcher splits a step: the rank's
    share (rank 0 takes one more when uneven) by np.array_split; an empty split runs one
    sequence."""
    lo, hi = rank_range(global_batch, world_size, rank)
    return max(1, math.ceil((hi - lo) / micro_batches))


def image_patches(model, rows: int, seq_len: int, image_tokens: Optional[int]) -> int:
    """Patches a worker's micro-batch of `rows` sequences sends through the tower: image_tokens
    per sequence (None: all seq_len), merge**2 patches each; 0 without a tower."""
    if getattr(model, "vision", None) is None:
        return 0
    tokens = seq_len if image_tokens is None else min(int(image_tokens), seq_len)
    return rows * tokens * model.vision.merge_tokens
