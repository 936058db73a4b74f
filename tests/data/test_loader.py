"""trainer/data/loader.py and dataset.py: a rank's batches are its part of the global batch, read
by byte range across shard boundaries, prefetched in order, and the memory does not grow with
the dataset."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import ConfigError
from trainer.data import Batches, DataError, Loader, PreparedData

REPO = Path(__file__).resolve().parents[2]


def tokens_for(num_samples: int, seq_len: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_samples * seq_len + 1, dtype=np.uint16)


def step_samples(batches: Batches, step: int, world: int, n_micro: int = 2):
    """(sample ids in rank-then-micro order, stacked inputs) of the weighted samples of a step."""
    ids, inputs = [], []
    for rank in range(world):
        mbs = batches.micro_batches(step, rank, world, n_micro)
        assert len(mbs) == n_micro
        for mb in mbs:
            if mb.weight:
                ids.append(mb.sample_ids)
                inputs.append(mb.inputs)
    return np.concatenate(ids), torch.cat(inputs)


@pytest.fixture
def small(tmp_path, dh):
    """40 samples of 16 tokens in shards of 23 tokens: windows cross shard boundaries."""
    tokens = tokens_for(40, 16)
    return tokens, PreparedData.open(dh.make_dataset(tmp_path / "small", [tokens], shard_tokens=23))


def test_a_read_across_shards_equals_the_stream(small):
    tokens, data = small
    stream = data.stream(0)
    assert len(stream) == len(tokens) and len(stream.shards) == -(-len(tokens) // 23)
    for start, count in [(0, 5), (20, 10), (22, 1), (23, 0), (100, 300), (len(tokens) - 3, 3)]:
        np.testing.assert_array_equal(stream.read(start, count), tokens[start : start + count])
    with pytest.raises(DataError, match="outside the stream"):
        stream.read(len(tokens) - 1, 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_union_over_ranks_equals_the_single_process_batch_at_any_world_size(small, world):
    _, data = small
    batches = Batches(data, seq_len=16, seed=1, global_batch=7)
    for step in (0, 3, 5, 6):  # step 5 crosses into epoch 1
        single_ids, single_inputs = step_samples(batches, step, 1)
        ids, inputs = step_samples(batches, step, world)
        np.testing.assert_array_equal(ids, single_ids)
        assert torch.equal(inputs, single_inputs)
        np.testing.assert_array_equal(
            ids, batches.order.lookup(np.arange(7 * step, 7 * step + 7))[1]
        )


def test_micro_batch_holds_the_sample_windows_shifted_by_one(small):
    tokens, data = small
    seq_len = 16
    mb = Batches(data, seq_len, seed=0, global_batch=6).micro_batches(2, 1, 2, 1)[0]
    assert mb.inputs.dtype == torch.int64 and mb.inputs.shape == (3, seq_len)
    for row, i in enumerate(mb.sample_ids):
        window = torch.from_numpy(tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64))
        assert torch.equal(mb.inputs[row], window[:-1]) and torch.equal(mb.targets[row], window[1:])


def test_every_sample_is_consumed_once_per_epoch_across_resizes(tmp_path, dh):
    data = PreparedData.open(dh.make_dataset(tmp_path / "d", [tokens_for(50, 8)], shard_tokens=50))
    batches = Batches(data, seq_len=8, seed=7, global_batch=7)
    schedule = [(0, 4), (1, 4), (2, 4), (3, 3), (4, 3), (5, 3), (6, 2), (7, 2), (8, 2)]
    stream = np.concatenate([step_samples(batches, s, w)[0] for s, w in schedule])
    assert len(stream) == 63
    np.testing.assert_array_equal(np.sort(stream[:50]), np.arange(50))  # epoch 0: each once
    assert len(set(stream[50:])) == 13  # epoch 1 so far: no repeats


def test_ranks_with_too_few_samples_get_weight_zero_padding_micro_batches(tmp_path, dh):
    data = PreparedData.open(dh.make_dataset(tmp_path / "d", [tokens_for(30, 8)]))
    batches = Batches(data, seq_len=8, seed=0, global_batch=5)
    first = batches.order.lookup(np.array([5 * 4]))[1]
    per_rank = [batches.micro_batches(4, rank, 3, n_micro=2) for rank in range(3)]
    assert [[mb.weight for mb in mbs] for mbs in per_rank] == [[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]
    pad = per_rank[2][1]
    assert pad.inputs.shape == (1, 8)
    np.testing.assert_array_equal(pad.sample_ids, first)
    mbs = batches.micro_batches(4, 0, 1, n_micro=8)  # more micro-batches than samples
    assert [mb.weight for mb in mbs] == [1.0] * 5 + [0.0] * 3


def test_too_short_a_split_is_a_config_error_naming_seq_len(tmp_path, dh):
    data = PreparedData.open(dh.make_dataset(tmp_path / "d", [np.zeros(20, np.uint16)]))
    with pytest.raises(ConfigError, match=r"data\.seq_len=64.*holds 20 tokens"):
        Batches(data, seq_len=64, seed=0, global_batch=2)


def test_the_loader_hands_out_each_step_in_order_and_equal_to_a_direct_read(small):
    _, data = small
    batches = Batches(data, seq_len=16, seed=2, global_batch=6)
    loader = Loader(batches, rank=1, world=2, micro_batches=2, start=3, stop=9, depth=2)
    try:
        for step in range(3, 9):
            got = loader.next(step)
            want = batches.micro_batches(step, 1, 2, 2)
            assert [torch.equal(a.inputs, b.inputs) for a, b in zip(got, want)] == [True, True]
        with pytest.raises(RuntimeError, match="step 3 asked, step 9 is next"):
            loader.next(3)
    finally:
        loader.close()


def test_a_read_error_in_the_loader_thread_reaches_the_training_step(small):
    _, data = small
    batches = Batches(data, seq_len=16, seed=2, global_batch=6)
    for shard in data.stream(0).shards:  # the data vanish under the loader
        (Path(str(data.root)) / shard.name).unlink()
    batches.streams[0].close()
    loader = Loader(batches, rank=0, world=1, micro_batches=1, start=0, stop=5, depth=2)
    try:
        with pytest.raises(DataError, match="missing; prepare the data again"):
            loader.next(0)
    finally:
        loader.close()


STREAM_ALL = textwrap.dedent("""
    import json, sys
    from trainer.data import Batches, Loader, PreparedData

    def rss(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    path, seq_len, batch, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    before = rss("VmRSS")
    data = PreparedData.open(path)
    batches = Batches(data, seq_len, 0, batch)
    steps = batches.num_samples[0] // batch  # one whole epoch: every token is read once
    loader = Loader(batches, 0, 1, 1, 0, steps, depth)
    read = 0
    for step in range(steps):
        read += sum(mb.inputs.numel() for mb in loader.next(step))
    loader.close()
    print(json.dumps({"growth": rss("VmHWM") - before, "tokens_read": read,
                      "bytes_read": data.stream(0).bytes_read + batches.streams[0].bytes_read}))
""")


def _stream_all(path: str, seq_len: int, batch: int, depth: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", STREAM_ALL, path, str(seq_len), str(batch), str(depth)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_memory_stays_bounded_while_streaming_a_corpus_far_larger_than_the_window(tmp_path, dh):
    """Fresh processes (peak RSS only grows) stream one epoch of a 1.5M-token and of a 24M-token
    (48 MB) dataset through a window of 2 steps x 16 x 1025 tokens (~730x the window for the
    large one): the peak memory is the same for both, a few MB, whatever the dataset's size."""
    seq_len, batch, depth = 1024, 16, 2
    window = depth * batch * (seq_len + 1)
    growth = {}
    for name, n in (("small", 3 * 2**19), ("large", 24 * 2**20)):
        tokens = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint16)
        path = dh.make_dataset(tmp_path / name, [tokens], shard_tokens=4 * 2**20)
        del tokens
        r = _stream_all(path, seq_len, batch, depth)
        assert r["tokens_read"] > 0.98 * n  # every token of the epoch went through the loader
        growth[name] = r["growth"]
        print(
            f"{name}: {n * 2 / 2**20:.0f} MiB dataset, {r['tokens_read'] / window:.0f}x the "
            f"window streamed; peak RSS grew {r['growth'] / 2**20:.1f} MiB"
        )
    assert 24 * 2**20 >= 20 * window * 20  # the large one is far beyond 20x the window
    assert growth["large"] < growth["small"] + 4 * 2**20, growth  # flat in the dataset's size
    assert growth["large"] < 32 * 2**20, growth  # and small in absolute terms
