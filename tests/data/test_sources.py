"""trainer/data/sources.py and tokenizer.py: which files a source names, what documents they
hold, what is skipped and counted, and the errors that name the key, the value and what is valid."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from trainer.config import ConfigError, SourceConfig
from trainer.data import ByteTokenizer, detect_format, list_files, load_tokenizer, token_dtype
from trainer.data.sources import Counts, check_text_column, read_documents


@pytest.fixture
def folder(tmp_path):
    """Text files in two levels, a binary file, a hidden folder and a cache folder."""
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "__pycache__").mkdir()
    (root / "b" / "z.txt").write_bytes(b"zzz\n" * 50)
    (root / "a.md").write_bytes(b"# title\nsome text\n")
    (root / "b" / "c.py").write_bytes(b"print('hi')\n" * 40)
    (root / "blob.bin").write_bytes(bytes(range(256)))
    (root / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    (root / "__pycache__" / "c.pyc").write_bytes(b"\0\1")
    return root


def names(files, root) -> list[str]:
    return [os.path.relpath(f.uri, root) for f in files]


def test_a_folder_lists_its_text_files_sorted_without_binary_hidden_or_cache_files(folder):
    files = list_files(SourceConfig(str(folder)))
    assert names(files, folder) == ["a.md", "b/c.py", "b/z.txt"]
    assert {f.format for f in files} == {"text"} and files[0].size == 18
    assert names(list_files(SourceConfig(str(folder / "a.md"))), folder) == ["a.md"]


def test_globs_match_in_one_folder_or_across_folders_with_double_star(folder):
    assert names(list_files(SourceConfig(f"{folder}/*.md")), folder) == ["a.md"]
    assert names(list_files(SourceConfig(f"{folder}/b/*.txt")), folder) == ["b/z.txt"]
    assert names(list_files(SourceConfig(f"{folder}/**/*.py")), folder) == ["b/c.py"]
    with pytest.raises(ConfigError, match=r"data\.source=.*\*\.csv.*found no files matching"):
        list_files(SourceConfig(f"{folder}/*.csv"))


def test_stdlib_is_the_sorted_py_files_of_the_standard_library_without_site_packages():
    files = list_files(SourceConfig("stdlib"))
    assert len(files) > 100 and all(f.uri.endswith(".py") for f in files)
    assert not any("site-packages" in f.uri for f in files)
    assert [f.uri for f in files] == sorted(f.uri for f in files) or files == list_files(
        SourceConfig("stdlib")
    )


def test_a_missing_or_empty_source_is_a_config_error_naming_key_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.source=.*nope.*no such file or folder"):
        list_files(SourceConfig(str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"data\.mix\[1\]\.path=.*empty.*found no files"):
        list_files(SourceConfig(str(tmp_path / "empty")), "data.mix[1].path")


@pytest.mark.parametrize(
    "name,fmt",
    [
        ("a.parquet", "parquet"),
        ("a.pq", "parquet"),
        ("a.jsonl", "jsonl"),
        ("a.json.gz", "jsonl"),
        ("a.ndjson.zst", "jsonl"),
        ("a.txt", "text"),
        ("a", "text"),
        ("s3://b/x.parquet?endpoint_override=h:1", "parquet"),
    ],
)
def test_formats_are_detected_by_extension(name, fmt):
    assert detect_format(name) == fmt


def test_jsonl_skips_and_counts_unreadable_non_utf8_and_non_text_records(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [
        json.dumps({"text": "first"}).encode(),
        b"{not json",
        b'{"text": "caf\xe9"}',
        json.dumps({"text": 42}).encode(),
        json.dumps({"other": "x"}).encode(),
        b"",
        json.dumps({"text": "last"}).encode(),
    ]
    path.write_bytes(b"\n".join(lines))
    counts = Counts()
    (f,) = list_files(SourceConfig(str(path)))
    assert list(read_documents(f, "text", counts)) == ["first", "last"]
    assert counts == {
        "documents": 2,
        "unreadable": 1,
        "non_utf8": 1,
        "not_text": 1,
        "missing_text": 1,
    }


def test_compressed_jsonl_is_read_through(tmp_path):
    path = tmp_path / "docs.jsonl.gz"
    path.write_bytes(
        gzip.compress(b"\n".join(json.dumps({"body": f"d{i}"}).encode() for i in range(3)))
    )
    (f,) = list_files(SourceConfig(str(path)))
    assert f.compression == "gzip"
    assert list(read_documents(f, "body", Counts())) == ["d0", "d1", "d2"]


def test_a_missing_field_or_column_names_it_and_lists_those_present(tmp_path, dh):
    jsonl = dh.write_jsonl(tmp_path / "a.jsonl", ["x", "y"], field="content")
    (f,) = list_files(SourceConfig(str(jsonl)))
    with pytest.raises(
        ConfigError, match=r"data\.text_column='text'.*a\.jsonl has no such field.*'content', 'id'"
    ):
        check_text_column(f, "text")
    parquet = dh.write_parquet(tmp_path / "a.parquet", ["x", "y"], column="body")
    (f,) = list_files(SourceConfig(str(parquet)))
    with pytest.raises(
        ConfigError, match=r"data\.text_column='text'.*no such column.*'id', 'body'"
    ):
        check_text_column(f, "text")
    assert list(read_documents(f, "body", Counts())) == ["x", "y"]


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    (f,) = list_files(SourceConfig(str(bad)))
    with pytest.raises(ConfigError, match=r"bad\.parquet is not a readable Parquet file"):
        list(read_documents(f, "text", Counts()))


# ----------------------------------------------------------------------------- tokenizers


def test_the_byte_tokenizer_is_the_utf8_bytes_with_nul_ending_a_document():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod_id, tok.dtype) == (256, 0, np.dtype(np.uint16))
    ids = tok.encode_batch(["hé", b"\x00\xff"])
    assert ids[0].tolist() == [104, 195, 169] and ids[1].tolist() == [0, 255]
    assert tok.decode(ids[0]) == "hé"


def test_a_tokenizer_json_loads_from_a_path_and_finds_its_end_of_document_token(tokenizer_json):
    tok = load_tokenizer(str(tokenizer_json))
    assert 257 <= tok.vocab_size <= 512 and tok.eod_token == "<|endoftext|>" and tok.eod_id == 0
    ids = tok.encode_batch(["alpha beta gamma"])[0]
    assert tok.decode(ids) == "alpha beta gamma" and len(ids) < len("alpha beta gamma")


def test_a_missing_or_corrupt_tokenizer_is_a_config_error_saying_what_to_do(
    tmp_path, tokenizer_json
):
    with pytest.raises(
        ConfigError, match=r"data\.tokenizer=.*nope\.json.*cannot be read.*train-tokenizer"
    ):
        load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(tokenizer_json.read_text()[:500])
    with pytest.raises(
        ConfigError, match=r"data\.tokenizer=.*bad\.json.*not a readable tokenizer\.json"
    ):
        load_tokenizer(str(bad))
    with pytest.raises(
        ConfigError, match=r"data\.eod_token='<eos>' is not a token.*<\|endoftext\|>"
    ):
        load_tokenizer(str(tokenizer_json), eod_token="<eos>")


def test_the_token_dtype_follows_the_vocabulary(tmp_path):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["</s>"] = 70_000
    big = tmp_path / "big.json"
    big.write_text(Tokenizer(models.WordLevel(vocab, unk_token="w0")).to_str())
    tok = load_tokenizer(str(big))
    assert tok.vocab_size == 70_001 and tok.eod_id == 70_000 and tok.dtype == np.uint32
