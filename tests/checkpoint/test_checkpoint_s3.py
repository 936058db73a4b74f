"""S3: the same code path against a real S3-compatible server (moto) started here on loopback."""

from __future__ import annotations

import pytest

from tests.s3_server import s3_server, s3_uri
from trainer.checkpoint import CheckpointReader, latest_checkpoint, verify

pytest.importorskip("moto.server")

BUCKET = "ckpt"


@pytest.fixture(scope="module")
def s3_endpoint():
    """host:port of a moto S3 server on 127.0.0.1 (an ephemeral port), stopped afterwards."""
    with s3_server(BUCKET) as endpoint:
        yield endpoint


def _uri(endpoint: str, prefix: str) -> str:
    return s3_uri(endpoint, BUCKET, prefix)


def test_reshard_round_trip_through_s3(s3_endpoint, tensors, ck):
    root = _uri(s3_endpoint, "reshard")
    path = ck.save_ranks(root, 3, tensors, world_size=3, block_bytes=64)
    assert path == _uri(s3_endpoint, "reshard/step_000000003")
    assert latest_checkpoint(root, log=pytest.fail) == path
    reader = CheckpointReader(path)
    for rank_ranges in ck.split(tensors, 2):  # load at 2 ranks
        for key, start, numel in rank_ranges:
            want = tensors[key].reshape(-1)[start : start + numel]
            assert ck.bitwise_equal(reader.read(key, start, numel), want)
    assert verify(path) == []


def test_s3_ranged_reads_and_retention(s3_endpoint, ck):
    import torch

    t = {"model/big": torch.arange(2048, dtype=torch.float32)}
    root = _uri(s3_endpoint, "retention")
    for step in (1, 2, 3):
        ck.save_ranks(root, step, t, world_size=1, block_bytes=512, keep=2)
    messages = []
    latest = latest_checkpoint(root, log=messages.append)
    assert latest == _uri(s3_endpoint, "retention/step_000000003") and messages == []
    from pyarrow import fs

    s3, base = fs.FileSystem.from_uri(root)
    left = sorted(i.base_name for i in s3.get_file_info(fs.FileSelector(base)))
    assert left == ["step_000000002", "step_000000003"]
    reader = CheckpointReader(latest)
    assert torch.equal(reader.read("model/big", 1000, 10), t["model/big"][1000:1010])
    assert reader.bytes_read == 512  # one block over HTTP range requests, not the whole object
