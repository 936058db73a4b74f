"""docs/finetuning.md's load-and-generate snippet (step 5) runs as written with the pinned
transformers, on a tiny model and tokenizer that transformers itself saved (its chat template in
chat_template.jinja, as transformers 5 saves it): in transformers 5 `apply_chat_template(...,
return_tensors='pt')` is a BatchEncoding, which `generate` cannot take as the ids."""

from __future__ import annotations

import re
from pathlib import Path

from tests.data.chat_templates import save_with_transformers
from tests.hf.tiny import hf_model

DOC = Path(__file__).resolve().parents[2] / "docs" / "finetuning.md"
SNIPPET = re.compile(r'^\.venv/bin/python -c "(from transformers import .*?)"$', re.M | re.S)


def snippet_code() -> str:
    """The Python of the doc's `python -c "..."` command, its shell line continuations joined."""
    (command,) = SNIPPET.findall(DOC.read_text())
    return re.sub(r"\\\n\s*", "", command)


def save_transformers_model(out: Path) -> None:
    """A tiny Qwen2 and a chat tokenizer (Qwen2.5's template), both saved by transformers."""
    hf_model("qwen2_untied", vocab_size=448).save_pretrained(out)
    save_with_transformers(out, "qwen2.5")


def test_the_load_and_generate_snippet_runs_on_a_model_transformers_saved(
    tmp_path, monkeypatch, capsys
):
    save_transformers_model(tmp_path / "out")
    assert (tmp_path / "out" / "chat_template.jinja").is_file()  # transformers 5's layout
    monkeypatch.chdir(tmp_path)  # the snippet loads 'out', as after `trainer.hf export ... out/`
    exec(snippet_code(), {})  # noqa: S102 -- the documented code itself is what is tested
    printed = capsys.readouterr().out
    assert printed.strip(), "the snippet printed no generated text"
