"""trainer/data/chat.py: templates render as transformers renders them (text and ids), for the
Llama 3.1, Qwen2.5 and Mistral (v0.3, v0.1) templates, and the loss masks cover exactly the
assistant turns and the end-of-turn token that closes each."""

from __future__ import annotations

import numpy as np
import pytest

from tests.data.chat_templates import (
    CONVERSATIONS,
    FAMILIES,
    hf_ids,
    hf_tokenizer,
    write_tokenizer,
)
from trainer.config import ConfigError, DataConfig
from trainer.data.chat import (
    encode_conversation,
    load_chat_template,
    read_tokenizer_config,
    record_messages,
)
from trainer.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, our template, our tokenizer, transformers' tokenizer) of one family."""
    name = request.param
    path = write_tokenizer(tmp_path_factory.mktemp(name), name)
    template = load_chat_template(DataConfig(tokenizer=str(path), kind="chat"))
    return name, template, load_tokenizer(str(path)), hf_tokenizer(path, name)


def renderable(name: str) -> list[list[dict]]:
    # Mistral v0.1 refuses a system message (raise_exception): the skip test covers that
    return [c for c in CONVERSATIONS if name != "mistral_v1" or c[0]["role"] != "system"]


def test_rendering_equals_transformers_text_and_ids(family):
    name, template, tok, hf = family
    for conv in renderable(name):
        for prompt in (False, True):
            want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=prompt)
            assert template.render(conv, add_generation_prompt=prompt) == want
        enc = encode_conversation(template, tok.model, conv, "assistant", FAMILIES[name][2])
        assert enc.ids.tolist() == hf_ids(hf, conv)
        for i in range(1, len(conv)):  # every prefix too (the masks are built from them)
            prefix = conv[:i]
            if name.startswith("mistral") and prefix[-1]["role"] == "system":
                continue
            assert template.render(prefix, add_generation_prompt=True) == hf.apply_chat_template(
                prefix, tokenize=False, add_generation_prompt=True
            )


def test_llama3_renders_the_knowledge_date_block_and_tool_turns_as_transformers(family):
    name, template, tok, hf = family
    if name != "llama3":
        pytest.skip("llama3 only")
    conv = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Köln"}}}
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    text = template.render(conv)
    assert "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024" in text
    assert '"Köln"' in text  # tojson keeps non-ASCII, as transformers' does
    assert text == hf.apply_chat_template(conv, tokenize=False)
    for kw in ({"date_string": "01 Jan 2025"}, {"tools": [{"name": "weather"}]}):
        assert template.render(conv, **kw) == hf.apply_chat_template(conv, tokenize=False, **kw)


def loss_runs(tok, enc) -> list[str]:
    """The decoded runs of consecutive loss tokens, stripped."""
    runs, current = [], []
    for i, m in zip(enc.ids.tolist(), enc.mask.tolist()):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r).strip() for r in runs]


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant"])
def test_the_mask_is_exactly_the_assistant_contents_and_their_end_of_turn(family, train_on):
    name, template, tok, _ = family
    eot = FAMILIES[name][2]
    for conv in renderable(name):
        enc = encode_conversation(template, tok.model, conv, train_on, eot)
        replies = [m["content"] + eot for m in conv if m["role"] == "assistant"]
        want = replies if train_on == "assistant" else replies[-1:]
        assert loss_runs(tok, enc) == want, (name, enc.text)


def test_train_on_all_is_every_token_but_the_first(family):
    name, template, tok, _ = family
    enc = encode_conversation(template, tok.model, CONVERSATIONS[0], "all", FAMILIES[name][2])
    assert enc.mask[0] == 0 and enc.mask[1:].all()


def test_a_prompt_completion_record_is_a_user_and_an_assistant_turn(family):
    name, template, tok, hf = family
    eot = FAMILIES[name][2]
    record = {"prompt": "Two plus two?", "completion": "Four."}
    messages, pair = record_messages(record, "messages", "prompt", "completion")
    assert pair and [m["role"] for m in messages] == ["user", "assistant"]
    enc = encode_conversation(template, tok.model, messages, "completion", eot)
    assert enc.ids.tolist() == hf_ids(hf, messages)
    assert loss_runs(tok, enc) == ["Four." + eot]


def test_records_that_are_not_conversations_give_their_skip_reason():
    cols = ("messages", "prompt", "completion")
    assert record_messages({"messages": "hi"}, *cols) == "malformed_messages"
    assert record_messages({"messages": []}, *cols) == "malformed_messages"
    assert record_messages({"messages": [{"role": "user"}]}, *cols) == "malformed_messages"
    assert record_messages({"prompt": "p"}, *cols) == "malformed_messages"
    bad_role = {"messages": [{"role": "narrator", "content": "x"}]}
    assert record_messages(bad_role, *cols) == "unknown_role"
    ok = {"messages": [{"role": "user", "content": "x", "name": None}]}
    assert record_messages(ok, *cols) == ([{"role": "user", "content": "x"}], False)


def test_no_assistant_turn_and_a_raising_template_are_skip_reasons(family):
    name, template, tok, _ = family
    eot = FAMILIES[name][2]
    only_user = [{"role": "user", "content": "Hello?"}]
    assert encode_conversation(template, tok.model, only_user, "assistant", eot) == (
        "no_loss_tokens"
    )
    if name.startswith("mistral"):  # roles must alternate: raise_exception
        twice = only_user * 2 + [{"role": "assistant", "content": "Hi."}]
        assert encode_conversation(template, tok.model, twice, "assistant", eot) == (
            "template_error"
        )


def test_the_template_comes_from_the_setting_a_file_or_the_tokenizer_config(tmp_path):
    path = write_tokenizer(tmp_path / "tok", "qwen2.5")
    literal = "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    cfg = DataConfig(tokenizer=str(path), kind="chat", chat_template=literal)
    assert load_chat_template(cfg).render([{"role": "user", "content": "a"}]) == "a<|im_end|>"
    (tmp_path / "t.jinja").write_text("X{{ messages | length }}")
    cfg.chat_template = str(tmp_path / "t.jinja")
    assert load_chat_template(cfg).render([{"role": "user", "content": "a"}]) == "X1"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    write_tokenizer(tmp_path / "named", "qwen2.5", {"chat_template": named})
    cfg = DataConfig(tokenizer=str(tmp_path / "named" / "tokenizer.json"), kind="chat")
    assert load_chat_template(cfg).text == "D"
    config = read_tokenizer_config(str(path))
    assert config["eos_token"]["content"] == "<|im_end|>"


def test_no_template_anywhere_is_a_config_error_naming_where_it_looked(tmp_path):
    path = write_tokenizer(tmp_path / "tok", "qwen2.5")
    (tmp_path / "tok" / "tokenizer_config.json").unlink()
    cfg = DataConfig(tokenizer=str(path), kind="chat")
    with pytest.raises(
        ConfigError,
        match=r"data\.chat_template=None.*tokenizer_config\.json "
        r"does not exist.*valid: data\.chat_template=",
    ):
        load_chat_template(cfg)


def test_masks_are_uint8_and_ids_int64(family):
    name, template, tok, _ = family
    enc = encode_conversation(template, tok.model, CONVERSATIONS[0], "assistant", FAMILIES[name][2])
    assert enc.ids.dtype == np.int64 and enc.mask.dtype == np.uint8
    assert len(enc.ids) == len(enc.mask)
