"""trainer/data.py: sources, one-time atomic preparation, and the world-size-invariant order."""

from __future__ import annotations

import os
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from trainer.config import ConfigError, DataConfig
from trainer.data import (
    MANIFEST,
    Batcher,
    GlobalSampler,
    global_tokens_per_step,
    load_tokens,
    prepare,
    rank_range,
    resolve_source,
)

# ----------------------------------------------------------------------------- sources, prepare


@pytest.fixture
def corpus(tmp_path):
    """A small folder: text files in two levels, a binary file and a hidden folder."""
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b" / "z.txt").write_bytes(b"zzz\n" * 50)
    (root / "a.md").write_bytes(b"# title\nsome text\n")
    (root / "b" / "c.py").write_bytes(b"print('hi')\n" * 40)
    (root / "blob.bin").write_bytes(bytes(range(256)))
    (root / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    return root


def expected_stream(files, max_bytes=0) -> np.ndarray:
    data = b"".join(open(f, "rb").read() + b"\0" for f in files)
    return np.frombuffer(data[:max_bytes] if max_bytes else data, dtype=np.uint8)


def test_resolve_source_lists_text_files_sorted_and_skips_binary_and_hidden(corpus):
    files = resolve_source(str(corpus))
    assert [os.path.relpath(f, corpus) for f in files] == ["a.md", "b/c.py", "b/z.txt"]
    assert resolve_source(str(corpus / "a.md")) == [str(corpus / "a.md")]


def test_resolve_stdlib_is_sorted_py_files_without_site_packages():
    files = resolve_source("stdlib")
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in files)
    assert files == resolve_source("stdlib")


def test_missing_source_is_a_config_error_naming_key_and_value(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"data\.source=.*nope.*valid: 'stdlib'"):
        resolve_source(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"data\.source=.*empty.*no text files"):
        resolve_source(str(tmp_path / "empty"))


def test_prepare_writes_the_capped_stream_in_several_shards(corpus, tmp_path):
    cfg = DataConfig(source=str(corpus), prepared_dir=str(tmp_path / "prep"), max_bytes=500)
    info = prepare(cfg, shard_tokens=128)
    want = expected_stream(resolve_source(str(corpus)), 500)
    assert info.created and info.num_tokens == 500 and len(info.shards) == 4
    np.testing.assert_array_equal(load_tokens(info.uri), want)
    table = pq.read_table(tmp_path / "prep" / info.shards[0])
    assert table.column_names == ["tokens"] and str(table.schema.field("tokens").type) == "uint8"


def test_prepare_reads_the_stdlib_up_to_max_bytes(tmp_path):
    cfg = DataConfig(source="stdlib", prepared_dir=str(tmp_path / "prep"), max_bytes=50_000)
    info = prepare(cfg)
    want = expected_stream(resolve_source("stdlib"), 50_000)
    np.testing.assert_array_equal(load_tokens(info.uri), want)


def test_prepare_is_idempotent_and_redoes_work_when_inputs_change(corpus, tmp_path, monkeypatch):
    cfg = DataConfig(source=str(corpus), prepared_dir=str(tmp_path / "prep"), max_bytes=0)
    first = prepare(cfg, shard_tokens=256)

    def no_writes(*args, **kwargs):
        raise AssertionError("prepare wrote a shard although the manifest matched")

    with monkeypatch.context() as m:
        m.setattr(pq, "write_table", no_writes)
        again = prepare(cfg, shard_tokens=256)
    assert not again.created and again.shards == first.shards
    (corpus / "a.md").write_bytes(b"# TITLE\nsome text\n")  # same size, new content
    os.utime(corpus / "a.md", ns=(1, 10**18))
    changed = prepare(cfg, shard_tokens=256)
    assert changed.created and changed.shards != first.shards
    want = expected_stream(resolve_source(str(corpus)))
    np.testing.assert_array_equal(load_tokens(changed.uri), want)


def test_a_crash_mid_prepare_leaves_nothing_loadable_and_a_rerun_completes(
    corpus, tmp_path, monkeypatch
):
    cfg = DataConfig(source=str(corpus), prepared_dir=str(tmp_path / "prep"), max_bytes=0)
    real_write, calls = pq.write_table, []

    def crash_on_second_shard(table, where, **kwargs):
        calls.append(where)
        if len(calls) == 2:  # half a file on disk, then the process "dies"
            real_write(table.slice(0, 10), where, **kwargs)
            raise OSError("simulated crash")
        real_write(table, where, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(pq, "write_table", crash_on_second_shard)
        with pytest.raises(OSError, match="simulated crash"):
            prepare(cfg, shard_tokens=128)
    assert not (tmp_path / "prep" / MANIFEST).exists()
    with pytest.raises(FileNotFoundError, match="run trainer.data.prepare"):
        load_tokens(str(tmp_path / "prep"))
    visible = [p for p in (tmp_path / "prep").iterdir() if not p.name.startswith(".tmp-")]
    assert [p.name.endswith("-00000.parquet") for p in visible] == [True]
    assert pq.read_table(visible[0]).num_rows == 128  # what is visible is complete
    info = prepare(cfg, shard_tokens=128)
    want = expected_stream(resolve_source(str(corpus)))
    np.testing.assert_array_equal(load_tokens(info.uri), want)


def test_concurrent_prepares_of_the_same_data_both_succeed(corpus, tmp_path):
    cfg = DataConfig(source=str(corpus), prepared_dir=str(tmp_path / "prep"), max_bytes=0)
    errors, barrier = [], threading.Barrier(3)

    def run():
        barrier.wait()
        try:
            prepare(cfg, shard_tokens=64)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    np.testing.assert_array_equal(
        load_tokens(str(tmp_path / "prep")), expected_stream(resolve_source(str(corpus)))
    )


def test_prepare_accepts_a_pyarrow_uri(corpus, tmp_path):
    uri = (tmp_path / "viauri").as_uri()
    info = prepare(DataConfig(source=str(corpus), prepared_dir=uri, max_bytes=300))
    assert info.uri == uri
    want = expected_stream(resolve_source(str(corpus)), 300)
    np.testing.assert_array_equal(load_tokens(uri), want)


# ----------------------------------------------------------------------------- order


def test_sampler_order_is_a_function_of_seed_and_epoch_only():
    a, b = GlobalSampler(50, seed=3), GlobalSampler(50, seed=3)
    late_first = b.sample_ids(100, 150)  # epoch 2 before anything else
    np.testing.assert_array_equal(a.sample_ids(0, 150)[100:], late_first)
    for epoch in range(3):
        epoch_ids = a.sample_ids(50 * epoch, 50 * (epoch + 1))
        np.testing.assert_array_equal(np.sort(epoch_ids), np.arange(50))
    assert not np.array_equal(a.sample_ids(0, 50), a.sample_ids(50, 100))
    assert not np.array_equal(a.sample_ids(0, 50), GlobalSampler(50, seed=4).sample_ids(0, 50))
    across = np.concatenate([a.sample_ids(45, 50), a.sample_ids(50, 55)])
    np.testing.assert_array_equal(a.sample_ids(45, 55), across)


@pytest.mark.parametrize("batch,world", [(7, 1), (7, 3), (7, 5), (8, 4), (5, 5)])
def test_rank_range_is_a_balanced_contiguous_split(batch, world):
    ranges = [rank_range(batch, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == batch
    assert all(ranges[r][1] == ranges[r + 1][0] for r in range(world - 1))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def tokens_for(num_samples: int, seq_len: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, num_samples * seq_len + 1, dtype=np.uint8)


def step_samples(batcher, step, world, n_micro=2):
    """(sample ids in rank-then-micro order, stacked inputs) of the weighted samples of a step."""
    ids, inputs = [], []
    for rank in range(world):
        mbs = batcher.micro_batches(step, rank, world, n_micro)
        assert len(mbs) == n_micro
        for mb in mbs:
            if mb.weight:
                ids.append(mb.sample_ids)
                inputs.append(mb.inputs)
    return np.concatenate(ids), torch.cat(inputs)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_union_over_ranks_equals_the_single_process_batch_at_any_world_size(world):
    batcher = Batcher(tokens_for(40, 16), seq_len=16, seed=1, global_batch=7)
    for step in (0, 3, 5, 6):  # step 5 crosses into epoch 1
        single_ids, single_inputs = step_samples(batcher, step, 1)
        ids, inputs = step_samples(batcher, step, world)
        np.testing.assert_array_equal(ids, single_ids)
        assert torch.equal(inputs, single_inputs)
        np.testing.assert_array_equal(ids, batcher.sampler.sample_ids(7 * step, 7 * step + 7))


def test_micro_batch_holds_the_sample_windows_shifted_by_one():
    seq_len, tokens = 16, tokens_for(40, 16)
    mb = Batcher(tokens, seq_len, seed=0, global_batch=6).micro_batches(2, 1, 2, 1)[0]
    assert mb.inputs.dtype == torch.int64 and mb.inputs.shape == (3, seq_len)
    for row, i in enumerate(mb.sample_ids):
        window = torch.from_numpy(tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64))
        assert torch.equal(mb.inputs[row], window[:-1]) and torch.equal(mb.targets[row], window[1:])


def test_every_sample_is_consumed_once_per_epoch_across_resizes():
    batcher = Batcher(tokens_for(50, 8), seq_len=8, seed=7, global_batch=7)
    schedule = [(0, 4), (1, 4), (2, 4), (3, 3), (4, 3), (5, 3), (6, 2), (7, 2), (8, 2)]
    stream = np.concatenate(
        [step_samples(batcher, step, world, n_micro=2)[0] for step, world in schedule]
    )
    assert len(stream) == 63
    np.testing.assert_array_equal(np.sort(stream[:50]), np.arange(50))  # epoch 0: each once
    assert len(set(stream[50:])) == 13  # epoch 1 so far: no repeats


def test_ranks_with_too_few_samples_get_weight_zero_padding_micro_batches():
    batcher = Batcher(tokens_for(30, 8), seq_len=8, seed=0, global_batch=5)
    first = batcher.sampler.sample_ids(5 * 4, 5 * 4 + 1)
    per_rank = [batcher.micro_batches(4, rank, 3, n_micro=2) for rank in range(3)]
    weights = [[mb.weight for mb in mbs] for mbs in per_rank]
    assert weights == [[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]
    pad = per_rank[2][1]
    assert pad.inputs.shape == (1, 8)
    np.testing.assert_array_equal(pad.sample_ids, first)
    mbs = batcher.micro_batches(4, 0, 1, n_micro=8)  # more micro-batches than samples
    assert [mb.weight for mb in mbs] == [1.0] * 5 + [0.0] * 3


def test_too_short_corpus_is_a_config_error_naming_seq_len():
    with pytest.raises(ConfigError, match=r"data\.seq_len=64.*20 tokens"):
        Batcher(np.zeros(20, np.uint8), seq_len=64, seed=0, global_batch=2)


def test_global_tokens_per_step_is_batch_times_seq_len():
    assert global_tokens_per_step(7, 128) == 896
