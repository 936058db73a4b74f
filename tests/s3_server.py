"""A real S3-compatible server (moto) on loopback for the tests that read and write object stores.

with s3_server("bucket") as endpoint:                        # host:port
    uri = s3_uri(endpoint, "bucket", "corpus/part-0.parquet")
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextlib.contextmanager
def s3_server(*buckets: str) -> Iterator[str]:
    """host:port of a moto S3 server on 127.0.0.1 (an ephemeral port) holding `buckets`;
    stopped, and the environment restored, on exit."""
    moto_server = pytest.importorskip("moto.server")
    mp = pytest.MonkeyPatch()
    for k, v in CREDENTIALS.items():
        mp.setenv(k, v)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        fs = s3_filesystem(f"{host}:{port}")
        for bucket in buckets:
            fs.create_dir(bucket)
        yield f"{host}:{port}"
    finally:
        server.stop()
        mp.undo()


def s3_filesystem(endpoint: str):
    from pyarrow import fs

    return fs.S3FileSystem(
        endpoint_override=endpoint,
        scheme="http",
        region="us-east-1",
        access_key="testing",
        secret_key="testing",
        allow_bucket_creation=True,
    )


def s3_uri(endpoint: str, bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}?endpoint_override={endpoint}&scheme=http&region=us-east-1"
