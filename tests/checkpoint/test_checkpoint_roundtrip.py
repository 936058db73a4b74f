"""Round trips and resharding: whatever N ranks saved, any M ranks read back bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from trainer.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    TensorChunk,
    latest_checkpoint,
)


def test_fp32_bf16_int64_and_0d_tensors_round_trip_bitwise(tmp_path, tensors, ck):
    path = ck.save_ranks(str(tmp_path), 3, tensors, world_size=2, block_bytes=64)
    reader = CheckpointReader(path)
    assert reader.keys() == sorted(tensors)
    for key, t in tensors.items():
        assert reader.shape(key) == tuple(t.shape) and reader.dtype(key) == t.dtype
        assert ck.bitwise_equal(reader.read_full(key), t), key


@pytest.mark.parametrize("saved_at", [1, 2, 3, 4])
def test_save_at_n_ranks_reads_bitwise_at_every_m_from_1_to_4(tmp_path, tensors, ck, saved_at):
    path = ck.save_ranks(str(tmp_path), 10, tensors, world_size=saved_at, block_bytes=128)
    reader = CheckpointReader(path)
    assert reader.world_size == saved_at
    for load_at in (1, 2, 3, 4):
        for rank_ranges in ck.split(tensors, load_at):
            for key, start, numel in rank_ranges:
                want = tensors[key].reshape(-1)[start : start + numel]
                assert ck.bitwise_equal(reader.read(key, start, numel), want), (load_at, key, start)


def test_arbitrary_ranges_spanning_several_chunks_and_blocks(tmp_path, tensors, ck):
    path = ck.save_ranks(str(tmp_path), 1, tensors, world_size=3, block_bytes=32)
    reader = CheckpointReader(path)
    g = torch.Generator().manual_seed(1)
    key = "data/token_counts"
    flat = tensors[key]
    for _ in range(200):
        a, b = sorted(torch.randint(0, flat.numel() + 1, (2,), generator=g).tolist())
        assert ck.bitwise_equal(reader.read(key, a, b - a), flat[a:b]), (a, b)


def test_state_is_stored_in_the_manifest_from_rank_0(tmp_path, tensors, ck):
    state = {
        "step": 42,
        "consumed_samples": 336,
        "rng": {"torch": "AAEC"},
        "strategy": "NO_SHARD",
        "model_config_digest": "abc",
        "world_size": 2,
    }
    path = ck.save_ranks(str(tmp_path), 42, tensors, world_size=2, state=state)
    reader = CheckpointReader(path)
    assert reader.state == state and reader.step == 42


def test_ranged_read_fetches_only_the_overlapping_blocks(tmp_path, ck):
    t = {"model/big": torch.arange(4096, dtype=torch.float32)}  # 16 KiB, one rank, 64 blocks
    path = ck.save_ranks(str(tmp_path), 1, t, world_size=1, block_bytes=256)
    reader = CheckpointReader(path)
    # Elements [70, 90) are bytes [280, 360): blocks 1 (256..512) only.
    assert torch.equal(reader.read("model/big", 70, 20), t["model/big"][70:90])
    assert reader.bytes_read == 256
    # Spanning blocks 1 and 2 (bytes [480, 560)): two blocks.
    reader.read("model/big", 120, 20)
    assert reader.bytes_read == 256 + 512


def test_corrupt_block_outside_the_range_does_not_affect_a_ranged_read(tmp_path, ck):
    t = {"model/big": torch.arange(4096, dtype=torch.float32)}
    path = ck.save_ranks(str(tmp_path), 1, t, world_size=1, block_bytes=256)
    shard = tmp_path / "step_000000001" / "rank-00000-of-00001.bin"
    data = bytearray(shard.read_bytes())
    data[256 * 40 + 3] ^= 0xFF  # inside block 40 (elements 2560..2623)
    shard.write_bytes(bytes(data))
    reader = CheckpointReader(path)
    assert torch.equal(reader.read("model/big", 0, 2560), t["model/big"][:2560])
    with pytest.raises(CheckpointError, match="block 40"):
        reader.read("model/big", 2600, 1)


def test_replicated_chunks_from_several_ranks_are_read_once(tmp_path, tensors, ck):
    """NO_SHARD-like: every rank writes the whole tensor; any copy may serve a read."""
    full = [(k, 0, t.numel()) for k, t in tensors.items()]
    writers = [CheckpointWriter(str(tmp_path)) for _ in range(2)]
    barrier = threading.Barrier(2)
    for rank in range(2):
        writers[rank].save(1, rank, 2, ck.chunks_for(tensors, full), {}, barrier.wait)
    path = [w.wait() for w in writers][0]
    reader = CheckpointReader(path)
    for key, t in tensors.items():
        assert ck.bitwise_equal(reader.read_full(key), t)
    assert reader.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())


def test_uncovered_elements_are_never_committed(tmp_path, tensors, ck):
    ranges = ck.split(tensors, 2)
    ranges[1] = ranges[1][1:]  # rank 1 forgets its first range
    writers = [CheckpointWriter(str(tmp_path)) for _ in range(2)]
    barrier = threading.Barrier(2)
    for rank in range(2):
        writers[rank].save(1, rank, 2, ck.chunks_for(tensors, ranges[rank]), {}, barrier.wait)
    with pytest.raises(CheckpointError, match=r"elements are in no chunk"):
        writers[0].wait()
    writers[1].wait()
    assert latest_checkpoint(str(tmp_path), log=lambda m: None) is None


@pytest.mark.parametrize(
    "bad, match",
    [
        (TensorChunk("k", (4,), torch.float32, 0, torch.zeros(4, dtype=torch.float64)), "dtype"),
        (TensorChunk("k", (4,), torch.float32, 2, torch.zeros(3)), r"outside the tensor"),
        (TensorChunk("k", (4,), torch.float32, 0, torch.zeros(2, 2)), "1-D"),
        (TensorChunk("", (4,), torch.float32, 0, torch.zeros(4)), "key"),
        (
            TensorChunk("k", (4,), torch.complex64, 0, torch.zeros(4, dtype=torch.complex64)),
            "cannot be stored",
        ),
    ],
)
def test_invalid_chunks_are_rejected_before_anything_is_written(tmp_path, bad, match):
    with CheckpointWriter(str(tmp_path)) as w:
        with pytest.raises(CheckpointError, match=match):
            w.save(1, 0, 1, [bad], {}, lambda: None)
    assert not (tmp_path / "step_000000001").exists()


def test_reads_outside_the_tensor_or_of_unknown_keys_name_the_key(tmp_path, tensors, ck):
    reader = CheckpointReader(ck.save_ranks(str(tmp_path), 1, tensors, world_size=1))
    with pytest.raises(CheckpointError, match=r"model/norm.weight.*outside"):
        reader.read("model/norm.weight", 20, 10)
    with pytest.raises(CheckpointError, match=r"did you mean 'model/norm.weight'"):
        reader.read_full("model/norm.weights")


def test_state_that_is_not_json_is_rejected_at_save(tmp_path, tensors, ck):
    with CheckpointWriter(str(tmp_path)) as w:
        with pytest.raises(CheckpointError, match="JSON"):
            w.save(
                1,
                0,
                1,
                ck.chunks_for(tensors, ck.split(tensors, 1)[0]),
                {"rng": torch.get_rng_state()},
                lambda: None,
            )


def test_read_into_fills_a_slice_of_a_flat_buffer_in_place(tmp_path, tensors, ck):
    """What a loader does: read a parameter's range straight into its flat shard."""
    reader = CheckpointReader(
        ck.save_ranks(str(tmp_path), 1, tensors, world_size=3, block_bytes=64)
    )
    key = "model/layers.0.attention.wq.weight"
    flat = torch.zeros(1000)
    out = reader.read_into(key, 100, flat[200:700])
    assert out.data_ptr() == flat[200:700].data_ptr()
    assert ck.bitwise_equal(flat[200:700], tensors[key].reshape(-1)[100:600])
    assert torch.count_nonzero(flat[:200]) == 0 and torch.count_nonzero(flat[700:]) == 0
    with pytest.raises(CheckpointError, match="contiguous 1-D torch.float32"):
        reader.read_into(key, 0, torch.zeros(10, dtype=torch.float64))


def test_an_explicit_filesystem_and_path_work_like_a_uri(tmp_path, tensors, ck):
    """Ray hands over (filesystem, path) pairs; a SubTreeFileSystem also takes the non-rename
    (object-store style) commit path, here on local disk."""
    from pyarrow import fs

    sub = fs.SubTreeFileSystem(str(tmp_path), fs.LocalFileSystem())
    path = ck.save_ranks("ckpts", 4, tensors, world_size=2, filesystem=sub)
    assert path == "ckpts/step_000000004"
    assert latest_checkpoint("ckpts", log=pytest.fail, filesystem=sub) == path
    reader = CheckpointReader(path, filesystem=sub)
    assert all(ck.bitwise_equal(reader.read_full(k), t) for k, t in tensors.items())
    assert (tmp_path / "ckpts" / "step_000000004" / "manifest.json").exists()
