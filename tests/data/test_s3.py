"""Object storage, for real: a Parquet corpus and a tokenizer.json in S3 (moto on loopback), a glob
over the bucket, the preparation written back to S3, and batches streamed from it by HTTP range
requests of just the samples' bytes: the same tokens as a local preparation of the same files."""

from __future__ import annotations

import numpy as np
import pytest

from tests.s3_server import s3_filesystem, s3_server, s3_uri
from trainer.config import DataConfig
from trainer.data import Batches, PreparedData, prepare

BUCKET = "corpus"


@pytest.fixture(scope="module")
def s3(parquet_corpus, tokenizer_json):
    with s3_server(BUCKET) as endpoint:
        fs = s3_filesystem(endpoint)
        for path in sorted(parquet_corpus.glob("*.parquet")):
            with fs.open_output_stream(f"{BUCKET}/docs/{path.name}") as f:
                f.write(path.read_bytes())
        with fs.open_output_stream(f"{BUCKET}/tok/tokenizer.json") as f:
            f.write(tokenizer_json.read_bytes())
        yield endpoint


def test_prepare_from_s3_into_s3_and_stream_from_it(s3, parquet_corpus, tokenizer_json, tmp_path):
    remote = DataConfig(
        source=s3_uri(s3, BUCKET, "docs/*.parquet"),
        tokenizer=s3_uri(s3, BUCKET, "tok/tokenizer.json"),
        prepared_dir=s3_uri(s3, BUCKET, "prepared"),
        eval_fraction=0.1,
    )
    info = prepare(remote)
    assert info.uri.startswith(f"s3://{BUCKET}/prepared/") and info.num_files == 3
    again = prepare(remote)  # idempotent on S3 too
    assert not again.created and again.uri == info.uri

    local = prepare(
        DataConfig(
            source=str(parquet_corpus),
            tokenizer=str(tokenizer_json),
            prepared_dir=str(tmp_path / "local"),
            eval_fraction=0.1,
        )
    )
    r, lo = PreparedData.open(info.uri), PreparedData.open(local.uri)
    for split in ("train", "eval"):
        assert r.tokens(split) == lo.tokens(split) > 0
    assert r.verify() == []

    seq_len, batch = 32, 6
    rb, lb = Batches(r, seq_len, 0, batch), Batches(lo, seq_len, 0, batch)
    for step in (0, 1, 7):
        for got, want in zip(rb.micro_batches(step, 1, 2, 2), lb.micro_batches(step, 1, 2, 2)):
            np.testing.assert_array_equal(got.inputs.numpy(), want.inputs.numpy())
    # Ranged reads: 3 steps x 3 samples of (seq_len + 1) uint16 tokens, plus at most one more
    # sample's worth where a window spans two shards.
    read = rb.streams[0].bytes_read
    assert 9 * (seq_len + 1) * 2 <= read <= 12 * (seq_len + 1) * 2, read
