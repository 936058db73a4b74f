"""Whether a preparation holds what a run reads: a sample of data.seq_len + 1 tokens in every
split it reads, and token ids the model has rows for. Asked from the manifest alone (no shard is
read), so the driver answers before any worker starts; the workers' Batches say the same.

    check_prepared(cfg, PreparedData.open(uri))      # cluster/preflight.py: ConfigError or None
    too_small(data, source, split, seq_len)          # the message, where a split has no sample

A text preparation (layout stream) is sliced into windows at any data.seq_len; a chat one
(layout windows) holds whole conversations packed into windows of the data.seq_len it was
prepared at, one window at least for each split that holds a conversation. So a text split too
small is a matter of tokens, a chat split of conversations, and the advice differs: a train
split grows with a lower data.eval_fraction, an eval split with a higher one.
"""

from __future__ import annotations

import math

from trainer.config import ConfigError, TrainerConfig

from .dataset import PreparedData
from .preparation import check_vocab

HOLD_OUT_MARGIN = 2.0
"""A suggested data.eval_fraction holds about this many times what one sample needs: documents
are held out by a hash of their content, so a split is only about its fraction of the corpus."""


def samples(data: PreparedData, source: int, split: str, seq_len: int) -> int:
    """The samples of data.seq_len (+ 1) tokens in a (source, split), from the manifest."""
    tokens = data.manifest.sources[source].splits[split].tokens
    if data.width is not None:
        return tokens // data.width
    return max(tokens - 1, 0) // seq_len


def check_prepared(cfg: TrainerConfig, data: PreparedData) -> None:
    """ConfigError, naming the key, the value and what is valid, when `cfg` cannot train on
    `data`: the model lacks rows for its token ids, its windows are of another data.seq_len, or a
    split the run reads (train; eval with train.eval_every) holds no sample."""
    check_vocab(cfg, data.vocab_size, data.manifest.tokenizer["name"])
    seq_len = cfg.data.seq_len
    if data.width is not None and data.width != seq_len + 1:
        raise ConfigError(window_mismatch(data, seq_len))
    splits = ("train", "eval") if cfg.train.eval_every else ("train",)
    for split in splits:
        for source in range(data.num_sources):
            if samples(data, source, split, seq_len) <= 0:
                raise ConfigError(too_small(data, source, split, seq_len))


def window_mismatch(data: PreparedData, seq_len: int) -> str:
    return (
        f"invalid config: data.seq_len={seq_len}; valid: {data.width - 1} (the windows of "
        f"{data.root} are {data.width} tokens: prepared at that seq_len)"
    )


def too_small(data: PreparedData, source: int, split: str, seq_len: int) -> str:
    """Why the (source, split) holds no sample of data.seq_len, and what would give it one."""
    if data.width is not None:
        return _no_window(data, source, split)
    return _too_few_tokens(data, source, split, seq_len)


def _where(data: PreparedData, source: int) -> str:
    return f"source {source} ({data.manifest.sources[source].name})"


def _fraction(data: PreparedData) -> float:
    return float(data.manifest.settings.get("eval_fraction", 0.0))


def _suggested_fraction(needed: float, total: float, now: float) -> str:
    """A data.eval_fraction holding `needed` of `total` (tokens or documents) with margin."""
    want = min(max(HOLD_OUT_MARGIN * needed / max(total, 1), now * 2), 0.5)
    digits = max(0, -math.floor(math.log10(want)) + 1)
    return f"{math.ceil(want * 10**digits) / 10**digits:g}"


def _too_few_tokens(data: PreparedData, source: int, split: str, seq_len: int) -> str:
    s = data.manifest.sources[source]
    tokens, docs = s.splits[split].tokens, s.splits[split].documents
    total = sum(sp.tokens for sp in s.splits.values())
    all_docs = sum(sp.documents for sp in s.splits.values())
    width, fraction = seq_len + 1, _fraction(data)
    longest = f"data.seq_len <= {tokens - 1}" if tokens > 1 else "more documents"
    held = f"{tokens:,} tokens ({docs:,} of {all_docs:,} documents)"
    if split == "eval":
        suggest = _suggested_fraction(width, total, fraction)
        return (
            f"invalid config: data.eval_fraction={fraction:g} holds out too little of "
            f"{_where(data, source)} to evaluate at data.seq_len={seq_len}: its eval split "
            f"holds {held}, less than one sequence of data.seq_len + 1 = {width:,} tokens; "
            f"valid: data.eval_fraction={suggest} or more (about {HOLD_OUT_MARGIN:g} sequences "
            f"of its {total:,} tokens: documents are held out by a hash of their content, so "
            f"the split is only about that size), {longest}, or train.eval_every=0 (no "
            "evaluation)"
        )
    more = "add documents"
    max_bytes = int(data.manifest.settings.get("max_bytes", 0) or 0)
    if max_bytes:
        more += f", raise data.max_bytes={max_bytes:,} (it caps each source's input) or set it to 0"
    if fraction:
        more += f", or lower data.eval_fraction={fraction:g} (the eval split holds the rest)"
    return (
        f"invalid config: data.seq_len={seq_len} is longer than the train split of "
        f"{_where(data, source)}: it holds {held}, and a training sequence is data.seq_len + 1 "
        f"tokens; valid: {longest}, or {more}"
    )


def _no_window(data: PreparedData, source: int, split: str) -> str:
    s = data.manifest.sources[source]
    conversations = sum(sp.documents for sp in s.splits.values())
    fraction = _fraction(data)
    where = f"{_where(data, source)}, {conversations:,} conversations in windows of {data.width:,}"
    if split == "eval":
        suggest = _suggested_fraction(1, conversations, fraction)
        return (
            f"invalid config: data.eval_fraction={fraction:g} holds out no conversation of "
            f"{where} tokens, so there is no eval window; valid: data.eval_fraction={suggest} "
            f"or more (about {HOLD_OUT_MARGIN:g} conversations: they are held out by a hash of "
            "their content, so the split is only about that size), or train.eval_every=0 (no "
            "evaluation)"
        )
    dropped = int(s.skipped.get("overlong_dropped", 0))
    why = [f"{s.splits['eval'].documents:,} held out at data.eval_fraction={fraction:g}"]
    valid = ["more conversations", "a lower data.eval_fraction"]
    if dropped:
        why.append(f"{dropped:,} dropped as longer than a window (data.overlong=drop)")
        valid += ["data.overlong=truncate", "a longer data.seq_len"]
    return (
        f"invalid config: the train split of {where} tokens holds no window "
        f"({'; '.join(why)}); valid: {', '.join(valid)}"
    )
