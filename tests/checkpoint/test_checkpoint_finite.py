"""A writer asked to check finiteness (the in-memory snapshots' writer) refuses a state holding a
NaN or an infinity, checked on its host copy on the writer's thread: that rank writes nothing,
rank 0 does not commit, and the previous checkpoint stays the newest. The durable save checks on
the device instead (trainer.loop check_finite_state), and a plain writer saves any bits."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from trainer.checkpoint import CheckpointError, CheckpointWriter, latest_checkpoint
from trainer.checkpoint.snapshots import Snapshots


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model/w": torch.randn(64, generator=g),
        "model/norm": torch.randn(16, generator=g).to(torch.bfloat16),
        "optim/w/exp_avg_sq": torch.rand(64, generator=g),
        "data/counts": torch.randint(-(2**62), 2**62, (9,), generator=g, dtype=torch.int64),
    }


def save_two_ranks(root, step, tensors, ck) -> list[BaseException | str]:
    """Both ranks' saves (simulated: one writer each, a threading barrier); per rank, the
    committed path or the error its wait raised."""
    writers = [CheckpointWriter(str(root), check_finite=True) for _ in range(2)]
    barrier = threading.Barrier(2)
    for rank, ranges in enumerate(ck.split(tensors, 2)):
        writers[rank].save(step, rank, 2, ck.chunks_for(tensors, ranges), {"s": step}, barrier.wait)
    out = []
    for w in writers:
        try:
            out.append(w.wait())
        except CheckpointError as e:
            out.append(e)
        w.close()
    return out


@pytest.mark.parametrize(
    "key, index, value",
    [
        ("optim/w/exp_avg_sq", 60, float("inf")),  # on rank 1 of 2
        ("model/w", 3, float("nan")),  # on rank 0
        ("model/norm", 15, float("-inf")),  # bf16
    ],
)
def test_a_non_finite_state_is_not_committed_and_the_previous_checkpoint_stays(
    tmp_path, ck, key, index, value
):
    good = state()
    first = save_two_ranks(tmp_path, 1, good, ck)
    assert all(isinstance(p, str) for p in first), first
    bad = {k: t.clone() for k, t in good.items()}
    bad[key][index] = value
    results = save_two_ranks(tmp_path, 2, bad, ck)
    errors = [r for r in results if isinstance(r, CheckpointError)]
    assert errors, "a non-finite state was committed"
    assert any("not finite" in str(e) and key in str(e) for e in errors), errors
    assert latest_checkpoint(str(tmp_path), log=lambda m: None).endswith("step_000000001")


def test_integers_and_a_plain_writer_are_not_checked(tmp_path, ck):
    tensors = state()
    tensors["data/counts"][0] = 2**62  # any integer is fine
    assert all(isinstance(p, str) for p in save_two_ranks(tmp_path / "a", 1, tensors, ck))
    tensors["model/w"][0] = float("nan")  # a durable writer keeps the bits it is given
    assert ck.save_ranks(str(tmp_path / "b"), 1, tensors, 2).endswith("step_000000001")


def stub(step: int):
    """The TrainerState a snapshot writes: only its JSON is read (the manifest's state)."""
    return SimpleNamespace(to_json=lambda: {"step": step})


def test_a_snapshot_of_a_non_finite_state_is_reported_and_training_goes_on(tmp_path, ck):
    logs: list[str] = []
    snaps = Snapshots(str(tmp_path), every=1, world_size=1, log=logs.append)
    good = state()
    snaps.save(1, stub(1), ck.chunks_for(good, ck.split(good, 1)[0]), 0)
    assert snaps.due(2, busy=False)
    bad = {k: t.clone() for k, t in good.items()}
    bad["model/w"][7] = float("inf")
    snaps.save(2, stub(2), ck.chunks_for(bad, ck.split(bad, 1)[0]), 0)
    assert snaps.due(3, busy=False)  # collects the failed one; the next may be taken
    snaps.close()
    assert snaps.last_step == 1
    assert len(logs) == 1 and "snapshot of step 2 failed" in logs[0] and "not finite" in logs[0]
    assert latest_checkpoint(str(tmp_path), log=lambda m: None).endswith("step_000000001")
