"""The prepare progress line and `inspect` show the real input size: a chat corpus of a few
hundred conversations (10 KiB) was '0.0 of 0.0 MiB of input', a fixed MiB figure rounded to
nothing; sizes now come in the unit that shows them."""

from __future__ import annotations

import json

from tests.data.chat_templates import CONVERSATIONS, write_tokenizer
from trainer.config import DataConfig
from trainer.data import prepare
from trainer.data.__main__ import main as data_main
from trainer.data.preparation import size_text


def test_size_text_picks_the_unit_that_shows_the_size():
    assert size_text(0) == "0 bytes" and size_text(1023) == "1,023 bytes"
    assert size_text(10_550) == "10.3 KiB"
    assert size_text(5 * 2**20) == "5.0 MiB" and size_text(3 * 2**30) == "3.0 GiB"
    assert size_text(2048 * 2**30) == "2,048.0 GiB"


def test_a_small_chat_corpus_prepares_with_its_real_input_size(tmp_path, capsys):
    records = tmp_path / "sft.jsonl"
    records.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 30))
    size = size_text(records.stat().st_size)
    assert size.endswith("KiB")
    cfg = DataConfig(
        source=str(records),
        tokenizer=str(write_tokenizer(tmp_path / "tok", "qwen2.5")),
        kind="chat",
        seq_len=256,
        prepared_dir=str(tmp_path / "prepared"),
    )
    lines: list[str] = []
    info = prepare(cfg, log=lines.append)
    assert f"prepare: 1/1 units, {size} of {size} of input (" in lines[0], lines
    assert data_main(["inspect", info.uri]) == 0
    assert f"(auto, 1 files, {size} in)" in capsys.readouterr().out
