"""Loss masks under a template whose rendering of an assistant turn depends on the turns after it
(Qwen3's rule, tests/data/chat_templates.py THINKING): a reasoning trace is rendered only for
the turns after the last user turn, an empty think block for those without one, and earlier
turns lose theirs. The text and ids equal transformers'; the mask is exactly what the model
says in each trained turn as rendered, its end-of-turn token included."""

from __future__ import annotations

import pytest

from tests.data.chat_templates import THINKING_FAMILIES, hf_ids, hf_tokenizer, write_tokenizer
from tests.data.test_chat_template import loss_runs
from trainer.config import DataConfig
from trainer.data.chat import encode_conversation, load_chat_template
from trainer.data.tokenizer import load_tokenizer

NAME = "qwen3-style"
EOT = THINKING_FAMILIES[NAME][2]

REASONED = [
    {"role": "system", "content": "Think, then answer briefly."},
    {"role": "user", "content": "Name a prime number."},
    {
        "role": "assistant",
        "content": "<think>\nSmall ones: two, three.\n</think>\n\nSeven is prime.",
    },
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "<think>\nOnly two.\n</think>\n\nTwo is the only even prime."},
]
PLAIN = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Greece?"},
    {"role": "assistant", "content": "Athens."},
]
"""Reasoning in every assistant turn; none (non-thinking data: the last turn renders an empty
think block all the same)."""


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    path = write_tokenizer(tmp_path_factory.mktemp("thinking"), NAME)
    template = load_chat_template(DataConfig(tokenizer=str(path), kind="chat"))
    return template, load_tokenizer(str(path)), hf_tokenizer(path, NAME)


@pytest.mark.parametrize("conv", [REASONED, PLAIN], ids=["reasoned", "plain"])
def test_the_rendering_drops_earlier_reasoning_as_transformers_does(thinking, conv):
    template, tok, hf = thinking
    text = template.render(conv)
    assert text == hf.apply_chat_template(conv, tokenize=False)
    assert text.count("<think>") == 1, "only the turn after the last user turn keeps a block"
    for i in range(1, len(conv)):
        want = hf.apply_chat_template(conv[:i], tokenize=False, add_generation_prompt=True)
        assert template.render(conv[:i], add_generation_prompt=True) == want
    enc = encode_conversation(template, tok.model, conv, "assistant", EOT)
    assert enc.ids.tolist() == hf_ids(hf, conv)


def test_every_assistant_turn_is_trained_as_rendered_with_the_last_one_s_reasoning(thinking):
    template, tok, _ = thinking
    enc = encode_conversation(template, tok.model, REASONED, "assistant", EOT)
    assert loss_runs(tok, enc) == [
        "Seven is prime." + EOT,  # its trace is not in the text: never a target
        "<think>\nOnly two.\n</think>\n\nTwo is the only even prime." + EOT,
    ]
    last = encode_conversation(template, tok.model, REASONED, "last_assistant", EOT)
    assert loss_runs(tok, last) == loss_runs(tok, enc)[-1:]


def test_non_thinking_data_trains_the_empty_block_the_template_renders(thinking):
    template, tok, _ = thinking
    enc = encode_conversation(template, tok.model, PLAIN, "assistant", EOT)
    assert loss_runs(tok, enc) == [
        "Paris is the capital of France." + EOT,
        "<think>\n\n</think>\n\nAthens." + EOT,
    ]
    prompt_tokens = [t for t, m in zip(enc.ids.tolist(), enc.mask.tolist()) if not m]
    assert "capital of France?" in tok.decode(prompt_tokens), "the prompts are never targets"
