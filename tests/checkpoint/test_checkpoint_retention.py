"""Retention: the newest K committed checkpoints stay, the protected one (resumed from) always."""

from __future__ import annotations

import os

import pytest
import torch

from trainer.checkpoint import CheckpointError, CheckpointWriter


def _steps(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_"))


def _save(w, step, ck):
    t = {"model/w": torch.full((16,), float(step))}
    w.save(step, 0, 1, ck.chunks_for(t, ck.split(t, 1)[0]), {}, lambda: None)
    w.wait()


def test_keeps_the_newest_k(tmp_path, ck):
    with CheckpointWriter(str(tmp_path), keep=2) as w:
        for step in range(1, 6):
            _save(w, step, ck)
            assert _steps(tmp_path) == list(range(max(1, step - 1), step + 1))


def test_never_deletes_the_protected_checkpoint(tmp_path, ck):
    with CheckpointWriter(str(tmp_path), keep=3) as w:
        _save(w, 1, ck)
    with CheckpointWriter(str(tmp_path), keep=1) as w:  # a resumed run
        w.protect(str(tmp_path / "step_000000001"))
        for step in (2, 3, 4):
            _save(w, step, ck)
        assert _steps(tmp_path) == [1, 4]


def test_refuses_to_save_over_the_protected_checkpoint(tmp_path, ck):
    with CheckpointWriter(str(tmp_path)) as w:
        _save(w, 1, ck)
        w.protect(str(tmp_path / "step_000000001") + "/")
        with pytest.raises(CheckpointError, match="protected"):
            _save(w, 1, ck)


def test_torn_leftovers_older_than_the_commit_go_newer_ones_stay(tmp_path, ck):
    os.makedirs(tmp_path / "step_000000002")  # torn: no manifest
    os.makedirs(tmp_path / "step_000000009")  # torn, from a run that got further
    with CheckpointWriter(str(tmp_path), keep=5) as w:
        _save(w, 5, ck)
    assert _steps(tmp_path) == [5, 9]


def test_resaving_a_step_replaces_a_torn_save_at_another_world_size(tmp_path, tensors, ck):
    ck.save_ranks(str(tmp_path), 7, tensors, world_size=3)
    os.remove(tmp_path / "step_000000007" / "manifest.json")  # torn
    ck.save_ranks(str(tmp_path), 7, tensors, world_size=2)
    names = sorted(os.listdir(tmp_path / "step_000000007"))
    assert names == [
        "chunks.arrow",
        "manifest.json",
        "rank-00000-of-00002.bin",
        "rank-00001-of-00002.bin",
    ]


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(CheckpointError, match="keep=0"):
        CheckpointWriter(str(tmp_path), keep=0)


def test_newer_checkpoints_of_an_abandoned_timeline_do_not_evict_the_new_one(tmp_path, ck):
    """A run got to step 9, then resumed from 3 (9 was found corrupt): saving 5 with keep=1
    must keep 5, and leaves 9 for the save of step 9 to replace."""
    with CheckpointWriter(str(tmp_path), keep=3) as w:
        for step in (3, 9):
            _save(w, step, ck)
    with CheckpointWriter(str(tmp_path), keep=1) as w:
        w.protect(str(tmp_path / "step_000000003"))
        _save(w, 5, ck)
        assert _steps(tmp_path) == [3, 5, 9]
        _save(w, 7, ck)
        assert _steps(tmp_path) == [3, 7, 9]
