"""Faults: truncated, flipped, missing shard; torn save; corrupt metadata. Each is caught with an
error naming the file (and chunk), and resume falls back to the previous good checkpoint."""

from __future__ import annotations

import os

import pytest

from trainer.checkpoint import CheckpointError, CheckpointReader, latest_checkpoint, verify

SHARD = "rank-00001-of-00002.bin"


@pytest.fixture
def two_steps(tmp_path, tensors, ck):
    """Checkpoints at steps 10 and 20, saved by 2 ranks; returns (root, path10, path20)."""
    root = str(tmp_path)
    p10 = ck.save_ranks(root, 10, tensors, world_size=2, block_bytes=64)
    p20 = ck.save_ranks(root, 20, tensors, world_size=2, block_bytes=64)
    return root, p10, p20


def _fallback(root) -> tuple[str, list[str]]:
    messages = []
    return latest_checkpoint(root, log=messages.append), messages


def test_intact_checkpoints_resume_from_the_newest_silently(two_steps):
    root, _, p20 = two_steps
    assert _fallback(root) == (p20, [])
    assert verify(p20) == []


def test_truncated_shard_is_named_and_skipped(two_steps):
    root, p10, p20 = two_steps
    shard = f"{p20}/{SHARD}"
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=rf"{SHARD}: 100 bytes.*truncated"):
        CheckpointReader(p20)
    latest, messages = _fallback(root)
    assert latest == p10
    assert SHARD in messages[0] and "truncated" in messages[0]
    assert "falling back to" in messages[-1] and "step 10" in messages[-1]
    assert any("truncated" in p for p in verify(p20))


def test_flipped_byte_is_caught_on_read_naming_file_and_chunk(two_steps, tensors, ck):
    _, _, p20 = two_steps
    key, start, numel = ck.split(tensors, 2)[1][0]  # the first chunk in rank 1's file
    shard = f"{p20}/{SHARD}"
    with open(shard, "r+b") as f:
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0x10]))
    reader = CheckpointReader(p20)  # sizes intact: only a checksum pass can see it
    with pytest.raises(
        CheckpointError,
        match=rf"{SHARD}: checksum mismatch in block 0 .*chunk "
        rf"{key}\[{start}:{start + numel}\]",
    ):
        for key in tensors:
            reader.read_full(key)
    problems = verify(p20)
    assert len(problems) == 1 and "checksum mismatch" in problems[0] and SHARD in problems[0]


def test_missing_shard_is_named_and_skipped(two_steps):
    root, p10, p20 = two_steps
    os.remove(f"{p20}/{SHARD}")
    with pytest.raises(CheckpointError, match=rf"{SHARD}: missing"):
        CheckpointReader(p20)
    latest, messages = _fallback(root)
    assert latest == p10 and f"{SHARD}: missing" in messages[0]


def test_torn_save_without_manifest_is_skipped(two_steps):
    root, p10, p20 = two_steps
    os.remove(f"{p20}/manifest.json")
    with pytest.raises(CheckpointError, match="not committed"):
        CheckpointReader(p20)
    latest, messages = _fallback(root)
    assert latest == p10 and "not committed" in messages[0] and "step_000000020" in messages[0]
    assert "not committed" in verify(p20)[0]


@pytest.mark.parametrize(
    "victim, match",
    [
        ("manifest.json", "manifest checksum mismatch|not valid JSON"),
        ("chunks.arrow", "chunk table corrupt"),
    ],
)
def test_corrupt_metadata_is_caught_before_any_data_is_used(two_steps, victim, match):
    root, p10, p20 = two_steps
    path = f"{p20}/{victim}"
    data = bytearray(open(path, "rb").read())
    i = data.find(b'"step": 20') + 9 if victim == "manifest.json" else len(data) // 2
    data[i] ^= 0x01  # manifest: step 20 -> 21, still valid JSON; table: a byte in the middle
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=match):
        CheckpointReader(p20)
    assert _fallback(root)[0] == p10


def test_no_valid_checkpoint_means_none(tmp_path, tensors, ck):
    p = ck.save_ranks(str(tmp_path), 5, tensors, world_size=1)
    os.remove(f"{p}/manifest.json")
    latest, messages = _fallback(str(tmp_path))
    assert latest is None and len(messages) == 1
    assert latest_checkpoint(str(tmp_path / "nothing-here"), log=messages.append) is None
