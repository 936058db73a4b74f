"""trainer/data/preparation.py and the CLI: what a preparation writes (exactly the tokenized
documents, each followed by end-of-document), that it is idempotent, resumable and never mixed
with another, and the held-out split."""

from __future__ import annotations

import os
import threading
import zlib

import numpy as np
import pytest

import trainer.data.preparation as prep
from trainer.config import ConfigError, DataConfig, SourceConfig
from trainer.data import PreparedData, list_files, load_tokenizer, prepare
from trainer.data.__main__ import main as data_main
from trainer.data.dataset import MANIFEST


def stream_of(data: PreparedData, source: int = 0, split: str = "train") -> np.ndarray:
    s = data.stream(source, split)
    return s.read(0, len(s))


def expected(docs, tok, keep=lambda d: True) -> np.ndarray:
    """Each kept document's ids followed by the end-of-document id, in order."""
    ids = [
        np.append(np.asarray(i, np.int64), tok.eod_id)
        for d, i in zip(docs, tok.encode_batch(docs))
        if keep(d)
    ]
    return np.concatenate(ids)


def held_out(doc, fraction):
    data = doc if isinstance(doc, bytes) else doc.encode()
    return zlib.crc32(data) < fraction * 2**32


def test_parquet_with_a_bpe_tokenizer_is_every_document_tokenized_then_end_of_document(
    parquet_corpus, tokenizer_json, tmp_path, dh
):
    cfg = DataConfig(
        source=f"{parquet_corpus}/*.parquet",
        tokenizer=str(tokenizer_json),
        prepared_dir=str(tmp_path / "prep"),
        eval_fraction=0.2,
    )
    info = prepare(cfg)
    data = PreparedData.open(info.uri)
    tok = load_tokenizer(str(tokenizer_json))
    docs = [d for k in range(3) for d in dh.documents(120, seed=k)]
    np.testing.assert_array_equal(
        stream_of(data), expected(docs, tok, lambda d: not held_out(d, 0.2))
    )
    np.testing.assert_array_equal(
        stream_of(data, split="eval"), expected(docs, tok, lambda d: held_out(d, 0.2))
    )
    evals = sum(held_out(d, 0.2) for d in docs)
    assert 40 < evals < 110  # about a fifth, chosen by content
    assert (data.documents("train"), data.documents("eval")) == (360 - evals, evals)
    assert info.num_files == 3 and info.num_shards == 6 and data.dtype == np.uint16
    assert data.manifest.tokenizer["vocab_size"] == tok.vocab_size and data.eod_id == tok.eod_id
    assert info.uri == os.path.join(cfg.prepared_dir, info.digest[:16])
    assert data.verify() == []


def test_text_files_are_capped_at_max_bytes_and_keep_their_bytes(tmp_path):
    root = tmp_path / "texts"
    root.mkdir()
    contents = [b"first file\n" * 30, "second: caf\xe9 \u2713\n".encode() * 20, b"third\n" * 50]
    for i, c in enumerate(contents):
        (root / f"{i}.txt").write_bytes(c)
    info = prepare(DataConfig(source=str(root), prepared_dir=str(tmp_path / "p"), max_bytes=500))
    stream = stream_of(PreparedData.open(info.uri))
    capped = contents[0] + b"\0" + contents[1][: 500 - len(contents[0])] + b"\0"
    np.testing.assert_array_equal(stream, np.frombuffer(capped, np.uint8).astype(np.uint16))


def test_prepare_is_idempotent_and_a_change_of_input_is_another_preparation(
    tmp_path, dh, monkeypatch
):
    src = dh.write_jsonl(tmp_path / "docs" / "a.jsonl", dh.documents(50))
    cfg = DataConfig(source=str(src.parent), prepared_dir=str(tmp_path / "prep"))
    first = prepare(cfg)
    with monkeypatch.context() as m:
        m.setattr(prep, "process_unit", lambda *a, **k: pytest.fail("prepared twice"))
        again = prepare(cfg)
    assert first.created and not again.created and again.uri == first.uri
    dh.write_jsonl(src, dh.documents(50, seed=1))  # new content: another digest, another folder
    os.utime(src, ns=(1, 10**18))
    changed = prepare(cfg)
    assert changed.created and changed.digest != first.digest
    assert sorted(os.listdir(tmp_path / "prep")) == sorted([first.digest[:16], changed.digest[:16]])
    assert PreparedData.open(first.uri).verify() == []  # the old one is untouched


def test_a_preparation_that_died_resumes_at_the_first_unfinished_unit(tmp_path, dh, monkeypatch):
    for k in range(4):
        dh.write_jsonl(tmp_path / "docs" / f"{k}.jsonl", dh.documents(30, seed=k))
    cfg = DataConfig(source=str(tmp_path / "docs"), prepared_dir=str(tmp_path / "prep"))
    real, calls = prep.process_unit, []

    def dies_on_the_third(unit, args, tokenizer=None):
        calls.append(unit.index)
        if len(calls) == 3:
            raise OSError("simulated crash")
        return real(unit, args, tokenizer)

    with monkeypatch.context() as m:
        m.setattr(prep, "process_unit", dies_on_the_third)
        with pytest.raises(OSError, match="simulated crash"):
            prepare(cfg)
    plan = prep.plan_preparation(cfg)
    assert not (tmp_path / "prep" / plan.digest[:16] / MANIFEST).exists()  # nothing committed
    calls.clear()

    def counting(unit, args, tokenizer=None):
        calls.append(unit.index)
        return real(unit, args, tokenizer)

    with monkeypatch.context() as m:
        m.setattr(prep, "process_unit", counting)
        info = prepare(cfg)
    assert calls == [2, 3]  # units 0 and 1 were committed before the crash
    clean = prepare(DataConfig(source=cfg.source, prepared_dir=str(tmp_path / "clean")))
    np.testing.assert_array_equal(
        stream_of(PreparedData.open(info.uri)), stream_of(PreparedData.open(clean.uri))
    )


def test_concurrent_preparations_of_the_same_data_all_succeed(tmp_path, dh):
    for k in range(3):
        dh.write_jsonl(tmp_path / "docs" / f"{k}.jsonl", dh.documents(40, seed=k))
    cfg = DataConfig(source=str(tmp_path / "docs"), prepared_dir=str(tmp_path / "prep"))
    errors, infos, barrier = [], [], threading.Barrier(3)

    def run():
        barrier.wait()
        try:
            infos.append(prepare(cfg, log=lambda *_: None))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len({i.uri for i in infos}) == 1
    assert PreparedData.open(infos[0].uri).verify() == []


def test_prepare_accepts_a_pyarrow_uri_and_a_mix_of_formats(tmp_path, dh):
    dh.write_jsonl(tmp_path / "a.jsonl", dh.documents(20))
    dh.write_parquet(tmp_path / "b.parquet", dh.documents(20, seed=5))
    cfg = DataConfig(
        mix=[
            SourceConfig(str(tmp_path / "a.jsonl"), 3.0),
            SourceConfig(str(tmp_path / "b.parquet"), 1.0),
        ],
        prepared_dir=(tmp_path / "viauri").as_uri(),
    )
    info = prepare(cfg)
    assert info.uri.startswith("file://") and info.num_documents == 40
    data = PreparedData.open(info.uri)
    assert [s.format for s in data.manifest.sources] == ["auto", "auto"]
    assert [len(list_files(s)) for s in cfg.mix] == [1, 1] and data.num_sources == 2


def test_a_source_without_usable_documents_is_a_config_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": 1}\n{"text": null}\n')
    with pytest.raises(
        ConfigError, match=r"data\.source=.*bad\.jsonl.*no usable document.*not_text"
    ):
        prepare(DataConfig(source=str(path), prepared_dir=str(tmp_path / "p")))


def test_the_cli_trains_a_tokenizer_prepares_and_inspects(tmp_path, dh, capsys):
    dh.write_jsonl(tmp_path / "docs" / "a.jsonl", dh.documents(200))
    tok = tmp_path / "tok.json"
    assert (
        data_main(
            [
                "train-tokenizer",
                f"data.source={tmp_path / 'docs'}",
                "--vocab-size",
                "300",
                "--out",
                str(tok),
            ]
        )
        == 0
    )
    assert load_tokenizer(str(tok)).vocab_size == 300
    prepared = tmp_path / "prep"
    assert (
        data_main(
            [
                "prepare",
                f"data.source={tmp_path / 'docs'}",
                f"data.tokenizer={tok}",
                f"data.prepared_dir={prepared}",
                "data.eval_fraction=0.1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert data_main(["inspect", str(prepared), "--verify"]) == 0
    out = capsys.readouterr().out
    for text in (
        "vocabulary 300",
        "train",
        "eval",
        "documents",
        "decoded: 'Document 0:",
        "every shard's crc32 matches",
    ):
        assert text in out, out
    shard = next(p for p in (prepared).rglob("*-train.bin"))
    shard.write_bytes(b"\1" + shard.read_bytes()[1:])
    assert data_main(["inspect", str(prepared), "--verify"]) == 1
    assert "crc32" in capsys.readouterr().out
    assert data_main(["prepare", "data.sauce=x"]) == 2
    assert "valid: data.<key>=<value>" in capsys.readouterr().err
