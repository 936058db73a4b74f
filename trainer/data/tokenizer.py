"""Tokenizers: byte-level (the default, no file needed) or a Hugging Face `tokenizer.json`.

    tok = load_tokenizer("s3://bucket/tokenizers/llama3/tokenizer.json")   # or "byte"
    ids = tok.encode_batch(["a document", "another"])    # lists of token ids, no special tokens
    tok.eod_id, tok.vocab_size, tok.dtype                 # end-of-document id, ids < vocab_size

Every document is followed by the end-of-document token in the token stream, so a sequence that
crosses two documents sees where one ended. `train_tokenizer` makes a byte-level BPE
tokenizer.json from any source, for users without access to a model hub.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Optional, Union

import numpy as np
from tokenizers import Tokenizer as HFTokenizerModel
from tokenizers import decoders, models, pre_tokenizers, trainers

from trainer import storage
from trainer.config import ConfigError

BYTE = "byte"
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
"""End-of-document tokens by their usual names, in the order they are looked for."""
TRAINED_EOD = "<|endoftext|>"

Document = Union[str, bytes]


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id: uint16 up to 65,536 tokens, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ByteTokenizer:
    """Tokens are the document's bytes (UTF-8 for text); 0 (NUL, absent from text) ends each
    document."""

    name = BYTE
    vocab_size = 256
    eod_id = 0
    digest = "byte"
    decodes_bytes = True  # raw file bytes need no UTF-8 decoding

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    def encode_batch(self, docs: list[Document]) -> list[np.ndarray]:
        return [np.frombuffer(d if isinstance(d, bytes) else d.encode(), np.uint8) for d in docs]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer, loaded from the bytes of its tokenizer.json."""

    decodes_bytes = False

    def __init__(self, json_bytes: bytes, source: str, eod_token: Optional[str] = None):
        try:
            self.model = HFTokenizerModel.from_str(json_bytes.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for a corrupt file
            raise ConfigError(
                f"invalid config: data.tokenizer={source!r} is not a readable tokenizer.json "
                f"({e}); valid: a Hugging Face tokenizer.json, or 'byte'"
            ) from None
        self.name = source
        self.digest = hashlib.sha256(json_bytes).hexdigest()
        self.json_bytes = json_bytes
        self.vocab_size = self.model.get_vocab_size(with_added_tokens=True)
        self.eod_token = eod_token or self._find_eod(source)
        eod = self.model.token_to_id(self.eod_token)
        if eod is None:
            raise ConfigError(
                f"invalid config: data.eod_token={self.eod_token!r} is not a token of "
                f"{source}; valid: one of its special tokens "
                f"({', '.join(self._special_tokens()) or 'it has none'})"
            )
        self.eod_id = eod

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    def _special_tokens(self) -> list[str]:
        return [t.content for t in self.model.get_added_tokens_decoder().values()]

    def _find_eod(self, source: str) -> str:
        for name in EOD_NAMES:
            if self.model.token_to_id(name) is not None:
                return name
        raise ConfigError(
            f"invalid config: data.eod_token=None and {source} has none of the usual "
            f"end-of-document tokens ({', '.join(EOD_NAMES)}); valid: data.eod_token=<one of "
            f"its special tokens: {', '.join(self._special_tokens()) or 'it has none'}>"
        )

    def encode_batch(self, docs: list[Document]) -> list[list[int]]:
        texts = [d.decode("utf-8") if isinstance(d, bytes) else d for d in docs]
        return [e.ids for e in self.model.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.model.decode([int(i) for i in ids], skip_special_tokens=False)


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def load_tokenizer(spec: str, eod_token: Optional[str] = None) -> Tokenizer:
    """'byte', or the tokenizer.json at a path or pyarrow.fs URI. ConfigError (naming the key and
    what to do) when it is missing or not a tokenizer."""
    if spec == BYTE:
        return ByteTokenizer()
    try:
        data = storage.read_bytes(storage.resolve(spec))
    except (FileNotFoundError, storage.StorageError, OSError) as e:
        raise ConfigError(
            f"invalid config: data.tokenizer={spec!r} cannot be read ({e}); valid: 'byte', or "
            "the path or URI of a tokenizer.json (python -m trainer.data train-tokenizer makes one)"
        ) from None
    return HFTokenizer(data, spec, eod_token)


def train_tokenizer(docs: Iterable[Document], vocab_size: int, show_progress: bool = False):
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenization, no unknown tokens) with
    <|endoftext|> as its end-of-document token, trained on `docs`; returns the tokenizers model."""
    if vocab_size < 257:
        raise ConfigError(
            f"invalid config: --vocab-size={vocab_size}; valid: at least 257 "
            "(256 byte symbols and the end-of-document token)"
        )
    model = HFTokenizerModel(models.BPE(unk_token=None))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    texts = (d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs)
    model.train_from_iterator(texts, trainer=trainer)
    return model
