"""trainer/data/template_files.py: the chat template is found where Hugging Face saves it today.
transformers 5 writes chat_template.jinja beside tokenizer.json (and none into
tokenizer_config.json), older ones tokenizer_config.json's "chat_template", some processors
chat_template.json; a freshly saved model needs no data.chat_template, and when two files
disagree the one used (chat_template.jinja first, as transformers reads it) is said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.data.chat_templates import (
    CONVERSATIONS,
    hf_tokenizer,
    save_with_transformers,
    write_tokenizer,
)
from trainer.config import ConfigError, DataConfig
from trainer.data import prepare
from trainer.data.chat import load_chat_template
from trainer.data.template_files import find_template

OTHER = "{% for m in messages %}[{{ m.content }}]{% endfor %}"


@pytest.fixture
def saved(tmp_path) -> Path:
    """A tokenizer saved by transformers itself (Qwen2.5's template): its tokenizer.json."""
    return save_with_transformers(tmp_path / "model", "qwen2.5")


def chat(tokenizer: Path, **kw) -> DataConfig:
    return DataConfig(tokenizer=str(tokenizer), kind="chat", **kw)


def test_a_tokenizer_saved_by_transformers_gives_its_template_as_transformers_renders_it(saved):
    folder = saved.parent
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (folder / "chat_template.jinja").is_file() and "chat_template" not in config
    template = load_chat_template(chat(saved))
    assert template.origin == str(folder / "chat_template.jinja") and not template.note
    reference = hf_tokenizer(saved, "qwen2.5")
    for messages in CONVERSATIONS:
        assert template.render(messages) == reference.apply_chat_template(messages, tokenize=False)


def test_a_processors_chat_template_json_is_read(tmp_path):
    path = write_tokenizer(tmp_path, "qwen2.5")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": OTHER}))
    template = load_chat_template(chat(path))
    assert template.text == OTHER and template.origin.endswith("chat_template.json")


def test_two_files_that_disagree_say_which_template_is_used(saved, tmp_path):
    config_path = saved.parent / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": OTHER}))
    found = find_template(str(saved), json.loads(config_path.read_text()))
    assert found.origin.endswith("chat_template.jinja") and found.text != OTHER
    assert f"the chat template of {saved.parent}/chat_template.jinja is used" in found.note
    assert f"{config_path} holds another" in found.note
    agree = find_template(str(saved), {**config, "chat_template": found.text})
    assert agree.note == ""  # the same template twice is nothing to say


def test_preparing_says_which_template_is_used_when_two_disagree(saved, tmp_path):
    config_path = saved.parent / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": OTHER}))
    records = tmp_path / "sft.jsonl"
    records.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 4))
    lines: list[str] = []
    cfg = chat(saved, source=str(records), prepared_dir=str(tmp_path / "prepared"), seq_len=256)
    prepare(cfg, log=lines.append)
    assert any("chat_template.jinja is used" in line for line in lines), lines


def test_no_template_in_any_of_the_three_files_names_them_and_data_chat_template(tmp_path):
    path = write_tokenizer(tmp_path, "qwen2.5", {"chat_template": None})
    with pytest.raises(ConfigError) as e:
        load_chat_template(chat(path))
    message = str(e.value)
    assert f"{tmp_path}/tokenizer_config.json has no chat_template" in message
    assert "chat_template.jinja or chat_template.json beside it" in message
    assert "valid: data.chat_template=" in message
