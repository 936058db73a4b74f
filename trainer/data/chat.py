"""Chat templates and conversations: records -> messages -> rendered text -> ids and a loss mask.

    template = load_chat_template(cfg.data)           # data.chat_template, or the tokenizer's own
    text = template.render(messages, add_generation_prompt=True)   # as transformers renders it
    enc = encode_conversation(template, tokenizer.model, messages, "assistant", "<|im_end|>")
    enc.ids, enc.mask                                 # or a str: the reason it is skipped

Rendering equals `transformers.AutoTokenizer.apply_chat_template(messages, tokenize=False)`: the
same sandboxed Jinja environment (trim_blocks, lstrip_blocks, loopcontrols), the same globals
(raise_exception, strftime_now, dict, namespace), the same `tojson` filter and the tokenizer's
named special tokens as variables. The ids are the tokenizer's encoding of the whole rendered
text without added special tokens, which is what apply_chat_template(tokenize=True) returns.

Loss spans: for assistant message i, P_i = render(messages[:i], add_generation_prompt=True);
when the full rendering T starts with P_i, the turn starts at len(P_i) (exact for Llama 3,
Qwen2.5/3 and Mistral templates), else at its (stripped) content found in T after the previous
turn; it ends after the first end-of-turn text at or after its content. A token is a loss
token when its characters overlap a loss span.

A message's content is a string, or a list of parts in the Hugging Face format ({"type":
"text", "text": ...}, {"type": "image", "image": ...}), which the template renders (Qwen2-VL's
writes <|vision_start|><|image_pad|><|vision_end|> for an image); chat_images.py finds the
images and expands their placeholders.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Optional, Union

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trainer import storage
from trainer.config import ConfigError, DataConfig

from .template_files import (
    CHAT_TEMPLATE_JINJA,
    CHAT_TEMPLATE_JSON,
    TOKENIZER_CONFIG,
    beside,
    find_template,
    read_tokenizer_config,
)

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens transformers passes to a template (its special_tokens_map)."""
ROLES = ("system", "user", "assistant", "tool", "ipython", "function", "developer")
"""Roles passed to the template; any other is skipped as unknown_role."""
SAMPLE_CONVERSATION = [
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hi there."},
]
"""What the driver renders to check that the end-of-turn token closes an assistant turn."""


# ----------------------------------------------------------------------------- the template


def token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(config: Optional[dict]) -> dict[str, str]:
    """The named special tokens of a tokenizer_config (bos_token, eos_token, ...) as strings."""
    config = config or {}
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = token_text(config.get(key))
        if text is not None:
            out[key] = text
    return out


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): the body
    renders as it is; our masks come from the turns themselves."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateDict:
    """`dict(...)` in a template, without attribute access to the type (as transformers)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore names (no reach into CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} not allowed")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; transformers' (and so ours) does not
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=8)
def _compile(text: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(text)


class ChatTemplate:
    """A chat template and the special tokens it sees; renders as transformers does."""

    def __init__(
        self, text: str, tokens: Optional[dict[str, str]] = None, origin: str = "", note: str = ""
    ):
        self.text, self.tokens, self.origin = text, dict(tokens or {}), origin
        self.note = note  # another file beside the tokenizer holds a different one: which is used
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        try:
            self._template = _compile(text)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(
                f"invalid config: the chat template from {origin or 'data.chat_template'} does not "
                f"parse (line {e.lineno}: {e.message}); valid: a Jinja chat template"
            ) from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **kw) -> str:
        """The conversation as text; jinja2 errors (raise_exception too) propagate."""
        variables = {**self.tokens, **kw}  # keyword arguments win over special tokens
        return self._template.render(
            messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
            tools=variables.pop("tools", None),
            documents=variables.pop("documents", None),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


def load_chat_template(cfg: DataConfig, config: Optional[dict] = None) -> ChatTemplate:
    """data.chat_template (a file or URI when one exists there, else the template itself), or
    the one saved beside data.tokenizer (template_files.find_template: chat_template.jinja,
    tokenizer_config.json's, chat_template.json's). ConfigError saying where it looked when
    there is none."""
    if config is None:
        config = read_tokenizer_config(cfg.tokenizer)
    tokens = special_tokens(config)
    spec = cfg.chat_template
    if spec:
        text = _read_if_file(spec)
        if text is not None:
            return ChatTemplate(text, tokens, spec)
        return ChatTemplate(spec, tokens, "data.chat_template")
    found = find_template(cfg.tokenizer, config)
    if found is None:
        where = beside(cfg.tokenizer, TOKENIZER_CONFIG)
        state = "has no chat_template" if config is not None else "does not exist"
        raise ConfigError(
            f"invalid config: data.chat_template=None and {where} {state}, nor is there a "
            f"{CHAT_TEMPLATE_JINJA} or {CHAT_TEMPLATE_JSON} beside it; valid: "
            "data.chat_template=<a Jinja template, or the file or URI holding one>, or the "
            "model's own chat_template.jinja or tokenizer_config.json beside data.tokenizer"
        )
    return ChatTemplate(found.text, tokens, found.origin, found.note)


def _read_if_file(spec: str) -> Optional[str]:
    if "{" in spec or "\n" in spec:  # a template, not a path
        return None
    try:
        return storage.read_bytes(storage.resolve(spec)).decode("utf-8")
    except (FileNotFoundError, storage.StorageError, OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- records


def record_messages(
    record: dict, messages_column: str, prompt_column: str, completion_column: str
) -> Union[tuple[list[dict], bool], str]:
    """(messages, is_prompt_completion) of a record, or the reason it is skipped
    (malformed_messages, unknown_role). A content list's parts lose their empty fields."""
    messages = record.get(messages_column)
    if messages is None:
        prompt, completion = record.get(prompt_column), record.get(completion_column)
        if not isinstance(prompt, str) or not isinstance(completion, str):
            return "malformed_messages"
        return [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ], True
    if not isinstance(messages, (list, tuple)) or not messages:
        return "malformed_messages"
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return "malformed_messages"
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            content = content_parts(content)
            if content is None:
                return "malformed_messages"
        elif not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            return "malformed_messages"
        if m["role"] not in ROLES:
            return "unknown_role"
        out.append({k: v for k, v in {**m, "content": content}.items() if v is not None})
    return out, False


def content_parts(parts) -> Optional[list[dict]]:
    """A content list in the Hugging Face message format ({"type": "text", "text": ...},
    {"type": "image", "image": ...}) with its empty fields left out (a Parquet struct has every
    field in every part: a text part's image is null, and a template that asks `'image' in
    part` must not see it); None when a part is not a dict with a string type."""
    out = []
    for part in parts:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            return None
        out.append({k: v for k, v in part.items() if v is not None})
    return out


def content_text(content) -> str:
    """The text of a message's content: itself, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p.get("text"), str))
    return ""


# ----------------------------------------------------------------------------- encoding


@dataclass
class Encoded:
    ids: np.ndarray
    """int64 token ids of the rendered conversation."""
    mask: np.ndarray
    """uint8, 1 = a loss target; 0 at the first token (nothing in its document predicts it)."""
    text: str
    images: list = field(default_factory=list)
    """The conversation's images in the order of their <|image_pad|> runs (chat_images.py)."""


def loss_spans(
    template: ChatTemplate, messages: list[dict], text: str, train_on: str, eot: str
) -> list[tuple[int, int]]:
    """Character spans [start, end) of `text` (the rendering of `messages`) that are trained on."""
    if train_on == "all":
        return [(0, len(text))]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last_assistant" or train_on == "completion":
        turns = turns[-1:]
    spans, after = [], 0
    for i in turns:
        start = None
        try:
            prefix = template.render(messages[:i], add_generation_prompt=True)
            if text.startswith(prefix) and len(prefix) >= after:
                start = len(prefix)
        except Exception:  # noqa: BLE001 -- a template may refuse a prefix; use the fallback
            pass
        content = content_text(messages[i].get("content")).strip()
        at = text.find(content, start if start is not None else after) if content else -1
        if start is None:
            if at < 0:
                continue  # the template does not render this turn's content
            start = at
        content_end = at + len(content) if at >= 0 else start
        close = text.find(eot, content_end) if eot else -1
        end = close + len(eot) if close >= 0 else max(content_end, start)
        if end > start:
            spans.append((start, end))
            after = end
    return spans


def mask_of(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose character span overlaps one of `spans` (both in order)."""
    mask = np.zeros(len(offsets), np.uint8)
    k = 0
    for t, (lo, hi) in enumerate(offsets):
        while k < len(spans) and lo >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if hi > spans[k][0] and hi > lo:
            mask[t] = 1
    return mask


def render_spans(
    template: ChatTemplate, messages: list[dict], train_on: str, eot: str
) -> Union[tuple[str, list[tuple[int, int]]], str]:
    """(rendered text, loss spans), or 'template_error' when the template raises."""
    try:
        text = template.render(messages)
        return text, loss_spans(template, messages, text, train_on, eot)
    except Exception:  # noqa: BLE001 -- any template failure skips the record (counted)
        return "template_error"


def encode_conversation(
    template: ChatTemplate, model, messages: list[dict], train_on: str, eot: str
) -> Union[Encoded, str]:
    """Ids and loss mask of one conversation with a `tokenizers.Tokenizer` model, or the
    reason it is skipped (template_error, no_loss_tokens)."""
    rendered = render_spans(template, messages, train_on, eot)
    if isinstance(rendered, str):
        return rendered
    text, spans = rendered
    return encoded(text, spans, model.encode(text, add_special_tokens=False))


def encoded(text: str, spans: list[tuple[int, int]], enc) -> Union[Encoded, str]:
    """Encoded from a tokenizers Encoding of `text`, or 'no_loss_tokens' (the first token
    never counts: nothing in its document predicts it)."""
    mask = mask_of(enc.offsets, spans)
    mask[:1] = 0
    if not mask.any():
        return "no_loss_tokens"
    return Encoded(np.asarray(enc.ids, np.int64), mask, text)
