"""The text side of generation: the tokenizer, the chat template and the ids that end a turn.

    text = text_of_checkpoint(reader.state, path)   # the run's tokenizer (state["tokenizer"])
    text = text_of_hf_dir("/models/Qwen2.5-0.5B-Instruct")
    ids = text.chat_ids("Summarise FSDP in one line.", system=None)
    text.stop_ids, text.decode(ids)

A checkpoint carries its run's tokenizer dict (PreparedData.tokenizer_info(): "name" is the
tokenizer.json or 'byte', plus chat_template, special tokens and stop_ids when they are known);
an imported checkpoint whose state has none uses the Hugging Face folder it was imported from
(or, where that is not readable, only the eos ids the import recorded).
A Hugging Face folder has tokenizer.json, tokenizer_config.json (special tokens), its chat
template (chat_template.jinja, or tokenizer_config.json's: trainer/data/template_files.py) and
generation_config.json (eos ids). A tokenizer that cannot be read is not an error until
text is needed: generation from ids still works and prints ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Protocol

from tokenizers import Tokenizer as HFTokenizerModel

from trainer import storage
from trainer.config import ConfigError
from trainer.data.chat import ChatTemplate, special_tokens
from trainer.data.template_files import (
    CHAT_TEMPLATE_JINJA,
    TOKENIZER_CONFIG,
    beside,
    find_template,
    read_tokenizer_config,
)
from trainer.data.tokenizer import BYTE, ByteTokenizer
from trainer.hf import CONFIG, GENERATION_CONFIG

TOKENIZER_JSON = "tokenizer.json"


class Codec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_id(self, token: str) -> Optional[int]: ...


class JsonCodec:
    """A tokenizer.json: text is encoded without added special tokens (the data pipeline's and
    apply_chat_template's encoding) and decoded with them."""

    def __init__(self, data: bytes, source: str):
        try:
            self.model = HFTokenizerModel.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for a corrupt file
            raise ConfigError(
                f"invalid config: tokenizer {source!r} is not a readable tokenizer.json ({e}); "
                "valid: a Hugging Face tokenizer.json"
            ) from None

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.model.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> Optional[int]:
        return self.model.token_to_id(token)


class ByteCodec:
    """The byte-level tokenizer: ids are UTF-8 bytes."""

    def encode(self, text: str) -> list[int]:
        return ByteTokenizer().encode_batch([text])[0].tolist()

    def decode(self, ids: list[int]) -> str:
        return ByteTokenizer().decode(ids)

    def token_id(self, token: str) -> Optional[int]:
        return None


@dataclass
class Text:
    """What generation needs of the tokenizer side. `codec` None: no readable tokenizer
    (`missing` says why); ids in and out still work."""

    codec: Optional[Codec]
    template: Optional[str] = None
    special: dict[str, str] = field(default_factory=dict)
    """The named special tokens a chat template sees (bos_token, eos_token, ...)."""
    stop_ids: list[int] = field(default_factory=list)
    where: str = ""
    """Where the tokenizer and template were looked for (for error messages)."""
    missing: str = ""
    tokenizer: Optional[str] = None
    """The tokenizer.json it was read from ('byte', None): a vision-language model's
    preprocessor_config.json is beside it (trainer/generate/images.py)."""

    def encode(self, text: str, key: str = "--prompt") -> list[int]:
        if self.codec is None:
            raise ConfigError(
                f"invalid config: {key} needs a tokenizer, and {self.missing}; valid: "
                "--tokenizer PATH (a tokenizer.json), or --prompt-ids"
            )
        return self.codec.encode(text)

    def decode(self, ids: list[int]) -> Optional[str]:
        """The text of `ids`, without a final stop token; None without a tokenizer."""
        if self.codec is None:
            return None
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.codec.decode(ids)

    def chat_ids(self, user: str, system: Optional[str] = None, images: int = 0) -> list[int]:
        """[system,] user rendered by the chat template with the generation prompt, encoded.
        With `images`, the user turn is that many {"type": "image"} parts, then the text (the
        Hugging Face message format; the template renders each image's placeholder)."""
        if self.template is None:
            raise ConfigError(
                f"invalid config: --chat needs a chat template and {self.where} has none; "
                "valid: a checkpoint of a run whose data had a chat template, a Hugging Face "
                f"folder with one ({CHAT_TEMPLATE_JINJA}, or tokenizer_config.json's "
                "chat_template), or --tokenizer PATH with one of those beside it"
            )
        content = user
        if images:
            content = [{"type": "image"}] * images + [{"type": "text", "text": user}]
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": content}
        ]
        rendered = ChatTemplate(self.template, self.special, self.where).render(
            messages, add_generation_prompt=True
        )
        return self.encode(rendered, "--chat")


# ----------------------------------------------------------------------------- where it comes from


def text_of_checkpoint(state: dict, path: str) -> Text:
    """The run's tokenizer side from a checkpoint's trainer state; an imported checkpoint's
    (no tokenizer in its state) is that of the folder it was imported from, or, when that is
    not readable here, only the eos ids the import recorded."""
    info = state.get("tokenizer")
    if info:
        return text_of_info(info, f"the tokenizer of {path}")
    source = state.get("imported_from")
    if source and _readable(storage.resolve(source).child(CONFIG)):
        return text_of_hf_dir(source)
    stops: list[int] = []
    _add_ids(stops, (state.get("hf_special_ids") or {}).get("eos_token_id"))
    return Text(
        None,
        stop_ids=stops,
        where=f"{path} (its state names no tokenizer)",
        missing=f"the checkpoint {path} names none",
    )


def text_of_info(info: dict, where: str = "the run's tokenizer") -> Text:
    """From a tokenizer dict (PreparedData.tokenizer_info(), the trainer state's "tokenizer")."""
    name = info.get("name")
    codec, missing = _codec(name)
    special = special_tokens(info.get("tokenizer_config"))
    for key in ("bos_token", "eos_token"):
        if info.get(key):
            special[key] = info[key]
    stops = list(info.get("stop_ids") or [])
    if not stops and info.get("eod_id") is not None:
        stops = [int(info["eod_id"])]
    where = f"{where} ({name})"
    return Text(codec, info.get("chat_template"), special, stops, where, missing, name)


def text_of_hf_dir(path: str) -> Text:
    """From a Hugging Face folder: tokenizer.json, tokenizer_config.json, generation_config.json
    and config.json (every eos id any of them names stops)."""
    loc = storage.resolve(path)
    tokenizer = str(loc.child(TOKENIZER_JSON))
    codec, missing = _codec(tokenizer)
    config = read_tokenizer_config(tokenizer)
    special = special_tokens(config)
    stops: list[int] = []
    for source in (_json(loc.child(GENERATION_CONFIG)), _json(loc.child(CONFIG))):
        _add_ids(stops, (source or {}).get("eos_token_id"))
    if codec is not None and special.get("eos_token"):
        _add_ids(stops, codec.token_id(special["eos_token"]))
    found = find_template(tokenizer, config)
    where = found.origin if found else str(loc.child(TOKENIZER_CONFIG))
    return Text(codec, found.text if found else None, special, stops, where, missing, tokenizer)


def with_tokenizer(text: Text, path: str) -> Text:
    """`text` with the tokenizer at `path` (--tokenizer: a tokenizer.json, or a folder holding
    one), and the chat template and special tokens saved beside it if any.
    The model's stop ids stay (they are ids of its vocabulary); without any, the new eos."""
    if storage.exists(storage.resolve(path).child(TOKENIZER_JSON)):
        path = str(storage.resolve(path).child(TOKENIZER_JSON))
    codec, missing = _codec(path)
    if codec is None:
        raise ConfigError(
            f"invalid config: --tokenizer={path!r}: {missing}; valid: a tokenizer.json, or a "
            "folder holding one"
        )
    config = read_tokenizer_config(path)
    found = find_template(path, config)
    if config is None and found is None:
        return Text(codec, text.template, text.special, text.stop_ids, text.where, tokenizer=path)
    special = special_tokens(config) if config is not None else text.special
    stops = list(text.stop_ids)
    if not stops and special.get("eos_token"):
        _add_ids(stops, codec.token_id(special["eos_token"]))
    template = found.text if found else text.template
    where = found.origin if found else beside(path, TOKENIZER_CONFIG)
    return Text(codec, template, special, stops, where, tokenizer=path)


def _codec(name: Optional[str]) -> tuple[Optional[Codec], str]:
    if name == BYTE:
        return ByteCodec(), ""
    if not name:
        return None, "none is named"
    try:
        data = storage.read_bytes(storage.resolve(name))
    except (FileNotFoundError, storage.StorageError, OSError, ValueError) as e:
        return None, f"{name} cannot be read ({e})"
    return JsonCodec(data, name), ""


def _add_ids(out: list[int], value) -> None:
    for i in value if isinstance(value, list) else [value]:
        if isinstance(i, int) and i not in out:
            out.append(i)


def _readable(loc: storage.Location) -> bool:
    try:
        return storage.exists(loc)
    except (OSError, ValueError):
        return False


def _json(loc: storage.Location) -> Optional[dict]:
    try:
        value = json.loads(storage.read_bytes(loc))
    except (FileNotFoundError, storage.StorageError, OSError):
        return None
    except ValueError as e:
        raise ConfigError(f"invalid config: {loc} is not JSON ({e})") from None
    return value if isinstance(value, dict) else None
