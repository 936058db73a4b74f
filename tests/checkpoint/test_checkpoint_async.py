"""Asynchronous save: the loop waits only for the host copy; saves are serialised; a failure in
the background is raised by the next call, never lost. Gated with Events, not sleeps."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from trainer.checkpoint import CheckpointError, CheckpointReader, CheckpointWriter


def _one_rank(tensors, ck):
    return ck.chunks_for(tensors, ck.split(tensors, 1)[0])


def test_save_returns_before_the_background_write_commits(tmp_path, tensors, ck):
    gate, entered = threading.Event(), threading.Event()
    expected = {k: t.clone() for k, t in tensors.items()}

    def barrier():
        entered.set()
        gate.wait()

    with CheckpointWriter(str(tmp_path)) as w:
        chunks = _one_rank(tensors, ck)
        w.save(1, 0, 1, chunks, {}, barrier)
        entered.wait()  # the background thread has written the shard and sits in the barrier
        step_dir = tmp_path / "step_000000001"
        assert not (step_dir / "manifest.json").exists()
        # The save already holds its own copy: changing the tensors now cannot leak into it.
        for c in chunks:
            c.data.zero_()
        gate.set()
        assert w.wait() == str(step_dir)
        assert (step_dir / "manifest.json").exists()
    reader = CheckpointReader(str(step_dir))
    assert all(ck.bitwise_equal(reader.read_full(k), t) for k, t in expected.items())


def test_next_save_waits_for_the_previous_one(tmp_path, ck):
    t1 = {"model/w": torch.ones(64)}
    t2 = {"model/w": torch.full((64,), 2.0)}
    gate, events = threading.Event(), []

    def gated_barrier():
        gate.wait()
        events.append("save 1 passed its barrier")

    w = CheckpointWriter(str(tmp_path))
    w.save(1, 0, 1, _one_rank(t1, ck), {}, gated_barrier)

    def second_save():
        w.save(2, 0, 1, _one_rank(t2, ck), {}, lambda: None)
        events.append("save 2 returned")

    t = threading.Thread(target=second_save)
    t.start()
    t.join(timeout=0.5)  # a bounded check that something does NOT happen while the gate is shut
    assert t.is_alive() and events == []
    gate.set()
    t.join()
    assert events == ["save 1 passed its barrier", "save 2 returned"]
    assert w.wait().endswith("step_000000002")
    w.close()
    assert torch.equal(
        CheckpointReader(str(tmp_path / "step_000000001")).read_full("model/w"), t1["model/w"]
    )


def test_failed_background_write_is_raised_by_the_next_save_once(tmp_path, tensors, ck):
    root = tmp_path / "root"
    root.write_text("a file where the checkpoint directory should go")
    w = CheckpointWriter(str(root))
    w.save(1, 0, 1, _one_rank(tensors, ck), {}, lambda: None)  # fails in the background
    with pytest.raises(CheckpointError, match=r"save of step 1 .* failed"):
        w.save(2, 0, 1, _one_rank(tensors, ck), {}, lambda: None)
    # Reported once: the writer is usable again after the caller fixes the cause.
    root.unlink()
    w.save(3, 0, 1, _one_rank(tensors, ck), {}, lambda: None)
    assert w.wait().endswith("step_000000003")
    w.close()


@pytest.mark.parametrize("how", ["wait", "close"])
def test_failed_background_write_is_raised_by_wait_and_close(tmp_path, tensors, ck, how):
    def broken_barrier():
        raise RuntimeError("peer rank died")

    w = CheckpointWriter(str(tmp_path))
    w.save(1, 0, 1, _one_rank(tensors, ck), {}, broken_barrier)
    with pytest.raises(CheckpointError, match="peer rank died"):
        getattr(w, how)()
    w.close()
    assert not (tmp_path / "step_000000001" / "manifest.json").exists()


def test_a_rank_whose_write_fails_still_enters_the_barrier_and_nothing_is_committed(
    tmp_path, tensors, ck
):
    """If rank 1 skipped the barrier, rank 0 would hang; if rank 0 did not check, it would
    commit."""
    ranges = ck.split(tensors, 2)
    barrier = threading.Barrier(2, timeout=60)
    writers = [CheckpointWriter(str(tmp_path)) for _ in range(2)]
    bad = ck.chunks_for(tensors, ranges[1])
    writers[0].save(1, 0, 2, ck.chunks_for(tensors, ranges[0]), {}, barrier.wait)
    # Rank 1 cannot create its data file: a directory is in the way.
    os.makedirs(tmp_path / "step_000000001" / "rank-00001-of-00002.bin")
    writers[1].save(1, 1, 2, bad, {}, barrier.wait)
    with pytest.raises(CheckpointError, match="rank 1 of 2 wrote no index"):
        writers[0].wait()
    with pytest.raises(CheckpointError, match="rank 1"):
        writers[1].wait()
    assert not (tmp_path / "step_000000001" / "manifest.json").exists()


def test_sync_save_commits_before_returning(tmp_path, tensors, ck):
    ranges = ck.split(tensors, 2)
    barrier = threading.Barrier(2, timeout=60)
    writers = [CheckpointWriter(str(tmp_path), async_save=False) for _ in range(2)]
    threads = [
        threading.Thread(
            target=writers[r].save,
            args=(4, r, 2, ck.chunks_for(tensors, ranges[r]), {}, barrier.wait),
        )
        for r in (1, 0)
    ]
    for t in threads:
        t.start()
    threads[1].join()  # rank 0 returned: committed
    assert (tmp_path / "step_000000004" / "manifest.json").exists()
    threads[0].join()
    assert writers[0].wait() == str(tmp_path / "step_000000004")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chunks_are_staged_in_pinned_memory_and_round_trip(tmp_path, tensors, ck):
    on_gpu = {k: v.cuda() for k, v in tensors.items()}
    with CheckpointWriter(str(tmp_path)) as w:
        w.save(1, 0, 1, ck.chunks_for(on_gpu, ck.split(on_gpu, 1)[0]), {}, lambda: None)
        assert w._staging.is_pinned()
        path = w.wait()
    reader = CheckpointReader(path)
    assert all(ck.bitwise_equal(reader.read_full(k), t) for k, t in tensors.items())
