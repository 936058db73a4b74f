"""Generation from a Hugging Face folder that transformers 5 saved: its chat template is in
chat_template.jinja (none in tokenizer_config.json), and --chat renders it as transformers
does."""

from __future__ import annotations

from tests.data.chat_templates import hf_tokenizer, save_with_transformers
from trainer.generate.text import text_of_hf_dir, with_tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_from_a_folder_transformers_saved_renders_its_chat_template_jinja(tmp_path):
    saved = save_with_transformers(tmp_path / "model", "qwen2.5")
    text = text_of_hf_dir(str(tmp_path / "model"))
    assert text.template == (tmp_path / "model" / "chat_template.jinja").read_text()
    reference = hf_tokenizer(saved, "qwen2.5").apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True
    )
    assert text.codec.decode(text.chat_ids(QUESTION[0]["content"])) == reference


def test_a_tokenizer_folder_given_with_tokenizer_brings_its_chat_template_jinja(tmp_path):
    save_with_transformers(tmp_path / "model", "qwen2.5")
    (tmp_path / "bare").mkdir()
    text = with_tokenizer(text_of_hf_dir(str(tmp_path / "bare")), str(tmp_path / "model"))
    assert text.template == (tmp_path / "model" / "chat_template.jinja").read_text()
    assert text.where.endswith("chat_template.jinja")
