"""The files Hugging Face saves beside a tokenizer.json, and the chat template among them.

    config = read_tokenizer_config("/models/Qwen2.5-0.5B-Instruct/tokenizer.json")  # or None
    found = find_template("/models/Qwen2.5-0.5B-Instruct/tokenizer.json", config)
    found.text, found.origin, found.note          # None when no file beside it holds one

Where a chat template is saved has moved: transformers 4 wrote it into tokenizer_config.json's
"chat_template"; transformers 5 writes chat_template.jinja beside tokenizer.json and leaves it
out of tokenizer_config.json; some multimodal processors write chat_template.json. All three are
read, in the order transformers' tokenizer takes them (chat_template.jinja replaces the
tokenizer_config's), and when two hold different templates the note says which one is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from trainer import storage
from trainer.config import ConfigError

TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
"""transformers 5's file of a tokenizer's (default) chat template."""
CHAT_TEMPLATE_JSON = "chat_template.json"
"""A processor's {"chat_template": ...} (some vision-language models save only this one)."""


def beside(spec: str, name: str) -> str:
    """The path or URI of file `name` in the folder of `spec` (query string kept)."""
    path, _, query = spec.partition("?")
    folder = path.rsplit("/", 1)[0] if "/" in path else "."
    return f"{folder}/{name}" + (f"?{query}" if query else "")


def read_tokenizer_config(tokenizer: str) -> Optional[dict]:
    """The tokenizer_config.json beside `tokenizer` (a tokenizer.json path or URI), as read;
    None when there is none (or the tokenizer is 'byte')."""
    if tokenizer == "byte":
        return None
    return _read_json(tokenizer, TOKENIZER_CONFIG)


def config_template(config: Optional[dict]) -> Optional[str]:
    """The chat_template of a tokenizer_config: a string, or the "default" of a named list."""
    value = (config or {}).get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


@dataclass
class FoundTemplate:
    text: str
    origin: str
    """The file it was read from."""
    note: str = ""
    """When another file beside it holds a different template: which one is used, and why."""


def find_template(tokenizer: str, config: Optional[dict]) -> Optional[FoundTemplate]:
    """The chat template saved beside `tokenizer` (`config`: its tokenizer_config.json as read):
    chat_template.jinja, else tokenizer_config.json's, else chat_template.json's; None when none
    of them holds one (or the tokenizer is 'byte')."""
    if tokenizer == "byte":
        return None
    processor = _read_json(tokenizer, CHAT_TEMPLATE_JSON)
    candidates = [
        (beside(tokenizer, CHAT_TEMPLATE_JINJA), _read_text(tokenizer, CHAT_TEMPLATE_JINJA)),
        (beside(tokenizer, TOKENIZER_CONFIG), config_template(config)),
        (beside(tokenizer, CHAT_TEMPLATE_JSON), config_template(processor)),
    ]
    found = [(where, text) for where, text in candidates if text is not None]
    if not found:
        return None
    (origin, text), others = found[0], found[1:]
    differ = [where for where, other in others if other != text]
    note = ""
    if differ:
        note = (
            f"the chat template of {origin} is used; {' and '.join(differ)} "
            f"{'holds' if len(differ) == 1 else 'hold'} another ({CHAT_TEMPLATE_JINJA} first, "
            "as transformers reads it; data.chat_template=<file> chooses another)"
        )
    return FoundTemplate(text, origin, note)


def _read_text(tokenizer: str, name: str) -> Optional[str]:
    try:
        return storage.read_bytes(storage.resolve(beside(tokenizer, name))).decode("utf-8")
    except (FileNotFoundError, storage.StorageError, OSError):
        return None
    except ValueError as e:
        raise ConfigError(
            f"invalid config: data.tokenizer={tokenizer!r}: {beside(tokenizer, name)} is not "
            f"UTF-8 text ({e}); valid: a Jinja chat template as Hugging Face writes it, or none"
        ) from None


def _read_json(tokenizer: str, name: str) -> Optional[dict]:
    loc = storage.resolve(beside(tokenizer, name))
    try:
        data = storage.read_bytes(loc)
    except (FileNotFoundError, storage.StorageError, OSError):
        return None
    try:
        value = json.loads(data)
    except ValueError as e:
        raise ConfigError(
            f"invalid config: data.tokenizer={tokenizer!r}: {loc} is not JSON ({e}); valid: a "
            f"{name} as Hugging Face writes it, or none"
        ) from None
    return value if isinstance(value, dict) else None
