"""Registered URI schemes: `storage.resolve` hands 'scheme://...' to the registered factory, so
the checkpoint code runs unchanged on a filesystem pyarrow cannot build from a URI.

The filesystem here is pyarrow's in-memory one (the same kind of thing as the snapshot keepers,
without Ray); a plain directory under tmp_path stands in where pyarrow lacks it.
"""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest
import torch

from trainer import storage
from trainer.checkpoint import CheckpointReader, CheckpointWriter, TensorChunk, list_checkpoints
from trainer.storage import StorageError

SCHEME = "memtest"


@pytest.fixture
def memfs(tmp_path):
    """One in-memory filesystem behind 'memtest://', registered for the test and removed after."""
    try:
        from pyarrow.fs import _MockFileSystem

        fs = _MockFileSystem()
    except ImportError:  # a pyarrow without the mock: a directory, reached the same way
        fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    calls = []

    def factory(uri: str):
        calls.append(uri)
        rest = uri.split("://", 1)[1].partition("?")[0]
        return fs, rest.strip("/")

    storage.register_scheme(SCHEME, factory)
    yield fs, calls
    storage.unregister_scheme(SCHEME)


def test_registered_scheme_resolves_through_its_factory_keeping_the_spelling(memfs):
    fs, calls = memfs
    loc = storage.resolve(f"{SCHEME}://bucket/run/ckpt/?token=abc")
    assert loc.fs is fs and loc.path == "bucket/run/ckpt"
    assert calls == [f"{SCHEME}://bucket/run/ckpt/?token=abc"]  # the whole URI, query included
    assert loc.display == f"{SCHEME}://bucket/run/ckpt" and loc.query == "?token=abc"
    assert (
        str(loc.child("step_000000001")) == f"{SCHEME}://bucket/run/ckpt/step_000000001?token=abc"
    )
    assert not loc.is_local


def test_scheme_lookup_ignores_case_as_uris_do(memfs):
    fs, _ = memfs
    assert storage.resolve("MemTest://bucket/x").fs is fs


def test_storage_helpers_write_read_list_and_delete_through_a_registered_scheme(memfs):
    root = storage.resolve(f"{SCHEME}://bucket/run")
    root.fs.create_dir(root.child("sub").path, recursive=True)  # as the checkpoint writer does
    storage.write_atomic(root.child("a.json"), b'{"a": 1}')
    storage.write_bytes(root.child("sub").child("b.bin"), b"\x00\x01")
    assert storage.read_bytes(root.child("a.json")) == b'{"a": 1}'
    listing = storage.list_dir(root)
    assert sorted(listing) == ["a.json", "sub"]
    assert listing["sub"].type == pafs.FileType.Directory
    storage.delete_dir(root.child("sub"))
    storage.delete_file(root.child("a.json"))
    assert storage.list_dir(root) == {}


def test_unregistered_scheme_still_goes_to_pyarrow(memfs):
    assert storage.resolve("file:///tmp/x").fs.type_name == "local"
    with pytest.raises(StorageError, match="cannot open storage 'nosuchscheme://x'"):
        storage.resolve("nosuchscheme://x")


def test_unregister_sends_the_scheme_back_to_pyarrow(memfs):
    def other(uri):
        raise AssertionError("never called")

    storage.register_scheme("memtest2", other)
    storage.unregister_scheme("memtest2")
    with pytest.raises(StorageError, match="cannot open storage 'memtest2://x'"):
        storage.resolve("memtest2://x")
    with pytest.raises(StorageError, match=r"\('memtest2'\): not registered; registered: memtest$"):
        storage.unregister_scheme("memtest2")


@pytest.mark.parametrize("bad", ["", "Keeper", "keeper://", "1abc", "a b", None])
def test_register_scheme_rejects_a_malformed_scheme_naming_it(bad):
    with pytest.raises(StorageError, match=f"register_scheme scheme={bad!r}; valid: a lower-case"):
        storage.register_scheme(bad, lambda uri: None)


def test_register_scheme_rejects_a_factory_that_is_not_callable():
    with pytest.raises(StorageError, match="factory='nope'; valid: a callable"):
        storage.register_scheme("memtest3", "nope")


def test_a_failing_factory_becomes_a_storage_error_naming_the_uri():
    def broken(uri):
        raise ValueError("no such run")

    storage.register_scheme("memtest4", broken)
    try:
        with pytest.raises(StorageError, match="cannot open storage 'memtest4://r/x': no such run"):
            storage.resolve("memtest4://r/x")
    finally:
        storage.unregister_scheme("memtest4")


def test_a_factory_returning_no_filesystem_is_refused():
    storage.register_scheme("memtest5", lambda uri: ("not a filesystem", "/x"))
    try:
        with pytest.raises(StorageError, match=r"returned \(str, str\); valid: \(pyarrow.fs"):
            storage.resolve("memtest5://x")
    finally:
        storage.unregister_scheme("memtest5")


def test_checkpoint_save_list_and_read_round_trip_through_a_registered_scheme(memfs):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model/w": torch.randn(37, 29, generator=g),
        "model/norm": torch.randn(29, generator=g).to(torch.bfloat16),
        "optim/step": torch.tensor(7, dtype=torch.int64),
    }
    chunks = [TensorChunk(k, tuple(t.shape), t.dtype, 0, t.reshape(-1)) for k, t in tensors.items()]
    root = f"{SCHEME}://bucket/run/checkpoints?token=abc"
    with CheckpointWriter(root, keep=2, async_save=False, block_bytes=256) as writer:
        for step in (1, 2, 3):
            writer.save(step, 0, 1, chunks, {"step": step})
    infos = list_checkpoints(root)
    assert [(i.step, i.problem) for i in infos] == [(3, None), (2, None)]  # keep=2 deleted step 1
    assert infos[0].path == f"{SCHEME}://bucket/run/checkpoints/step_000000003?token=abc"
    with CheckpointReader(infos[0].path) as reader:
        assert reader.state == {"step": 3} and reader.keys() == sorted(tensors)
        for key, t in tensors.items():
            got = reader.read_full(key)
            assert got.dtype == t.dtype and got.shape == t.shape, key
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
        # A ranged read inside one checksum block reads that block only.
        assert torch.equal(reader.read("model/w", 70, 20), tensors["model/w"].view(-1)[70:90])
