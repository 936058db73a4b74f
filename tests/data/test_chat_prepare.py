"""Chat preparation (data.kind=chat): every kept conversation lands whole in one window with its
mask and positions, the bytes are deterministic, overlong and unusable records are counted,
the digest names the chat settings (text digests unchanged), and the driver's checks refuse
bad input before any worker starts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import trainer.data.preparation as prep
from tests.data.chat_templates import CONVERSATIONS, write_tokenizer
from trainer.config import ConfigError, DataConfig, ModelConfig, TrainerConfig
from trainer.data import PreparedData, load_tokenizer, plan_and_check, prepare
from trainer.data.__main__ import main as data_main
from trainer.data.chat import encode_conversation, load_chat_template

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
EOT = "<|im_end|>"


def conversations(n: int, seed: int = 0, most: int = 12) -> list[list[dict]]:
    """n conversations of 1-3 turns and very different lengths."""
    rng = random.Random(seed)

    def text(k):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, k)))

    out = []
    for i in range(n):
        conv = [{"role": "system", "content": f"System {i}."}] if i % 4 == 0 else []
        for _ in range(rng.randint(1, 3)):
            conv += [
                {"role": "user", "content": text(most // 2)},
                {"role": "assistant", "content": text(most)},
            ]
        out.append(conv)
    return out


def write_records(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("qwen"), "qwen2.5")


def chat_cfg(tmp_path, source, tok_path, **kw) -> DataConfig:
    base = dict(
        source=str(source),
        tokenizer=str(tok_path),
        kind="chat",
        seq_len=511,
        eval_fraction=0.0,
        prepared_dir=str(tmp_path / "prep"),
    )
    return DataConfig(**{**base, **kw})


def windows_of(data: PreparedData, split: str = "train"):
    """(tokens, mask, positions, counts) of a split, as [n, W] arrays."""
    width = data.width
    out = []
    for stream in (
        data.stream(0, split),
        data.extra_stream("mask", 0, split),
        data.extra_stream("positions", 0, split),
    ):
        out.append(stream.read(0, len(stream)).astype(np.int64).reshape(-1, width))
    return (*out, data.window_counts(0, split))


def documents_in(tokens, mask, positions, pad) -> list[tuple]:
    """Every document of every window as (ids, mask) tuples; all-padding runs left out."""
    docs = []
    for t, m, p in zip(tokens, mask, positions):
        starts = np.flatnonzero(p == 0).tolist() + [len(p)]
        for a, b in zip(starts, starts[1:]):
            if not (t[a:b] == pad).all():
                docs.append((tuple(t[a:b].tolist()), tuple(m[a:b].tolist())))
    return docs


def expected(convs, cfg, width=None):
    tok = load_tokenizer(cfg.tokenizer)
    template = load_chat_template(cfg)
    out = []
    for c in convs:
        enc = encode_conversation(template, tok.model, c, cfg.train_on, EOT)
        if width:
            enc.ids, enc.mask = enc.ids[:width], enc.mask[:width]
        out.append((tuple(enc.ids.tolist()), tuple(enc.mask.tolist())))
    return out


def test_packed_windows_hold_every_conversation_whole_with_mask_and_positions(tmp_path, tok_path):
    convs = conversations(60)
    src = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    cfg = chat_cfg(tmp_path, src, tok_path)
    data = PreparedData.open(prepare(cfg).uri)
    tokens, mask, positions, counts = windows_of(data)
    pad = load_tokenizer(str(tok_path)).model.token_to_id(EOT)
    assert tokens.shape[1] == 512 and data.manifest.layout["kind"] == "windows"
    assert Counter(documents_in(tokens, mask, positions, pad)) == Counter(expected(convs, cfg))
    np.testing.assert_array_equal(counts, mask[:, 1:].sum(axis=1))
    assert (positions[:, 0] == 0).all() and (mask[positions == 0] == 0).all()
    shard = data.manifest.sources[0].splits["train"].shards[0]
    real = sum(len(d[0]) for d in expected(convs, cfg))
    assert shard.real_tokens == real and shard.documents == 60
    # best-fit-decreasing packs tightly: fewer windows than one per conversation, near the bound
    assert info_skipped(data) == {} and len(tokens) <= -(-real // 512) + 1 < 60
    assert data.verify() == []


def info_skipped(data):
    return data.skipped()


def test_two_preparations_write_the_same_bytes(tmp_path, tok_path):
    src = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in conversations(40)])
    a = prepare(chat_cfg(tmp_path, src, tok_path, prepared_dir=str(tmp_path / "a")))
    b = prepare(chat_cfg(tmp_path, src, tok_path, prepared_dir=str(tmp_path / "b")))
    files_a = sorted(p for p in Path(a.uri).iterdir() if p.suffix == ".bin")
    assert len(files_a) == 4  # tokens, mask, positions, counts
    for f in files_a:
        assert f.read_bytes() == (Path(b.uri) / f.name).read_bytes(), f.name


def test_pack_false_is_one_conversation_per_window_padded(tmp_path, tok_path):
    convs = conversations(12)
    src = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    cfg = chat_cfg(tmp_path, src, tok_path, pack=False)
    data = PreparedData.open(prepare(cfg).uri)
    tokens, mask, positions, counts = windows_of(data)
    pad = load_tokenizer(str(tok_path)).model.token_to_id(EOT)
    want = expected(convs, cfg)
    assert len(tokens) == len(convs)
    for row, (ids, m) in enumerate(want):  # in document order, each padded to the window
        n = len(ids)
        assert tuple(tokens[row, :n]) == ids and tuple(mask[row, :n]) == m
        assert (tokens[row, n:] == pad).all() and (mask[row, n:] == 0).all()
        np.testing.assert_array_equal(positions[row, n:], np.arange(512 - n))


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_conversations_longer_than_the_window_are_truncated_or_dropped_and_counted(
    tmp_path, tok_path, overlong
):
    convs = conversations(30, seed=3, most=30)
    src = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    cfg = chat_cfg(tmp_path, src, tok_path, seq_len=255, overlong=overlong)
    info = prepare(cfg)
    lengths = [len(ids) for ids, _ in expected(convs, cfg)]
    long = sum(n > 256 for n in lengths)
    assert 5 <= long <= 25
    data = PreparedData.open(info.uri)
    tokens, mask, positions, _ = windows_of(data)
    pad = load_tokenizer(str(tok_path)).model.token_to_id(EOT)
    docs = Counter(documents_in(tokens, mask, positions, pad))
    if overlong == "drop":
        assert info.skipped == {"overlong_dropped": long}
        kept = [e for e, n in zip(expected(convs, cfg), lengths) if n <= 256]
    else:
        kept = [e for e in expected(convs, cfg, width=256) if any(e[1])]
        lost = len(convs) - len(kept)  # nothing to learn in the first 256 tokens
        want = {"overlong_truncated": long - lost, "no_loss_tokens": lost}
        assert info.skipped == {k: v for k, v in want.items() if v}
    assert docs == Counter(kept) and len(kept) >= 10


def test_unusable_records_are_skipped_and_counted_by_reason(tmp_path, tok_path):
    good = {"messages": CONVERSATIONS[0]}
    records = [
        good,
        {"messages": "not a list"},
        {"messages": [{"role": "narrator", "content": "Once."}]},
        {"messages": [{"role": "user", "content": "No reply?"}]},
        {"prompt": "Two plus two?", "completion": "Four."},
        {"other": 1},
    ]
    src = write_records(tmp_path / "c.jsonl", records)
    path = tmp_path / "c.jsonl"
    path.write_text(path.read_text() + "not json\n")
    info = prepare(chat_cfg(tmp_path, src, tok_path))
    assert info.skipped == {
        "malformed_messages": 2,
        "unknown_role": 1,
        "no_loss_tokens": 1,
        "unreadable": 1,
    }
    assert info.num_documents == 2
    raising = (
        "{{ raise_exception('too long') if messages | length > 2 }}"
        "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"
    )
    long_conv = {"messages": CONVERSATIONS[1]}
    src2 = write_records(tmp_path / "d.jsonl", [good, long_conv])
    info = prepare(chat_cfg(tmp_path, src2, tok_path, chat_template=raising, train_on="all"))
    assert info.skipped == {"template_error": 1}


def test_parquet_message_structs_prepare_as_the_same_windows_as_jsonl(tmp_path, tok_path):
    convs = conversations(20, seed=5)
    src = write_records(tmp_path / "j" / "c.jsonl", [{"messages": c} for c in convs])
    table = pa.table({"id": list(range(20)), "messages": convs})
    assert pa.types.is_list(table.schema.field("messages").type)
    pq.write_table(table, tmp_path / "c.parquet")
    a = PreparedData.open(prepare(chat_cfg(tmp_path, src, tok_path)).uri)
    b = PreparedData.open(prepare(chat_cfg(tmp_path, tmp_path / "c.parquet", tok_path)).uri)
    for x, y in zip(windows_of(a), windows_of(b)):
        np.testing.assert_array_equal(x, y)


def test_the_digest_names_the_chat_settings_and_text_digests_are_unchanged(tmp_path, tok_path):
    src = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in conversations(5)])
    cfg = chat_cfg(tmp_path, src, tok_path)
    digests = {prep.plan_preparation(cfg).digest}
    for change in (
        dict(train_on="last_assistant"),
        dict(pack=False),
        dict(overlong="drop"),
        dict(seq_len=255),
        dict(messages_column="conv"),
        dict(chat_template="{{ messages[0].content }}<|im_end|>"),
        dict(eot_token="<|im_start|>"),
    ):
        digests.add(prep.plan_preparation(dataclasses.replace(cfg, **change)).digest)
    assert len(digests) == 8
    text = DataConfig(source=str(src), tokenizer=str(tok_path), text_column="messages")
    plan = prep.plan_preparation(text)
    tok = plan.tokenizer
    f = plan.files[0][0]
    old_key = [
        2,
        tok.digest,
        tok.eod_id,
        0,
        0.0,
        prep.UNIT_BYTES,
        [[str(src), "auto", "messages", [[f.uri, f.size, f.mtime_ns]]]],
    ]
    assert plan.digest == hashlib.sha256(json.dumps(old_key).encode()).hexdigest()
    # and text data now records the tokenizer_config beside its tokenizer (not in the digest)
    info = prep.tokenizer_info(plan)
    assert info["eos_token"] == EOT and info["stop_ids"][0] == tok.model.token_to_id(EOT)
    assert info["chat_template"].startswith("{%- if tools %}")


def trainer_cfg(data: DataConfig) -> TrainerConfig:
    return TrainerConfig(model=ModelConfig(vocab_size=512), data=data)


def test_the_driver_refuses_bad_chat_input_before_workers_start(tmp_path, tok_path):
    msgs = write_records(tmp_path / "m.jsonl", [{"messages": CONVERSATIONS[0]}])
    plan_and_check(trainer_cfg(chat_cfg(tmp_path, msgs, tok_path)))  # fine
    with pytest.raises(ConfigError, match=r"data\.eot_token='<\|nope\|>' is not a token"):
        plan_and_check(trainer_cfg(chat_cfg(tmp_path, msgs, tok_path, eot_token="<|nope|>")))
    with pytest.raises(
        ConfigError,
        match=r"data\.eot_token='<\|im_start\|>' is never rendered.*"
        r"after an assistant turn",
    ):
        plan_and_check(
            trainer_cfg(
                chat_cfg(
                    tmp_path,
                    msgs,
                    tok_path,
                    eot_token="<|im_start|>",
                    chat_template="{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}",
                )
            )
        )
    with pytest.raises(
        ConfigError,
        match=r"data\.train_on='completion' with message records"
        r".*valid: last_assistant",
    ):
        plan_and_check(trainer_cfg(chat_cfg(tmp_path, msgs, tok_path, train_on="completion")))
    other = write_records(tmp_path / "o.jsonl", [{"text": "x", "id": 1}])
    with pytest.raises(
        ConfigError,
        match=r"data\.messages_column='messages'.*has none of them"
        r".*valid: one of 'id', 'text'",
    ):
        plan_and_check(trainer_cfg(chat_cfg(tmp_path, other, tok_path)))
    (tok_path.parent / "tokenizer_config.json").rename(tok_path.parent / "saved.json")
    try:
        with pytest.raises(ConfigError, match=r"data\.chat_template=None and .*tokenizer_config"):
            plan_and_check(trainer_cfg(chat_cfg(tmp_path, msgs, tok_path)))
    finally:
        (tok_path.parent / "saved.json").rename(tok_path.parent / "tokenizer_config.json")


def test_inspect_shows_a_window_with_its_loss_tokens_marked_and_the_packing_efficiency(
    tmp_path, tok_path, capsys
):
    src = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in conversations(20)])
    info = prepare(chat_cfg(tmp_path, src, tok_path))
    capsys.readouterr()
    assert data_main(["inspect", info.uri]) == 0
    out = capsys.readouterr().out
    assert "windows of 512 tokens" in out and "packing efficiency" in out
    assert "<|im_start|>assistant\n[[" in out and EOT + "]]" in out


def test_the_manifest_records_what_generation_and_the_export_need(tmp_path):
    tok_path = write_tokenizer(tmp_path / "llama", "llama3")
    src = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    data = PreparedData.open(prepare(chat_cfg(tmp_path, src, tok_path)).uri)
    info = data.tokenizer_info()
    model = load_tokenizer(str(tok_path)).model
    assert info["chat_template"].startswith("{{- bos_token }}")
    assert info["tokenizer_config"]["bos_token"] == "<|begin_of_text|>"
    assert info["bos_token"] == "<|begin_of_text|>"
    assert info["bos_id"] == model.token_to_id("<|begin_of_text|>")
    assert info["eos_token"] == info["eot_token"] == "<|eot_id|>"
    eot, eod = model.token_to_id("<|eot_id|>"), model.token_to_id("<|endoftext|>")
    assert info["stop_ids"] == [eot, eod] and info["eod_id"] == eod
