"""In-memory snapshots (trainer/checkpoint/snapshots.py) under plain torch.multiprocessing.

The snapshot root here is a local folder standing in for the peers' memory (the cluster layer's
keeper:// filesystem, tests/cluster/snapshots/test_snapshots.py): the format, the cadence, the
resume and the fallback are the trainer's and are the same on either. A run crashes (an exception
out of the loop, then its processes are killed, as a dead node's are) long before its next
durable checkpoint; the group that replaces it, at another world size, resumes from the newest
complete snapshot and trains the same loss curve as a run that never crashed (1e-5 relative,
fp32)."""

import contextlib
import io
import os
import shutil
import time

import pytest
import torch

from tests.dist_utils import fresh_ranks, run_distributed
from trainer.checkpoint import list_checkpoints
from trainer.checkpoint.format import data_file_name
from trainer.config import TrainerConfig
from trainer.data import prepare

STEPS = 10


class Crash(RuntimeError):
    pass


def _train(rank, world, cfg, root, snapshots, crash_at, settle=False, context=None):
    """`settle`: before crashing, wait (30 s at most) until a snapshot has committed, so a test of
    the cadence does not depend on how fast this machine sends one. `context`: more
    WorkerContext fields."""
    from trainer.loop import WorkerContext, run_training

    def fault(step):
        if crash_at is not None and step == crash_at:
            deadline = time.monotonic() + 30
            while (
                settle
                and time.monotonic() < deadline
                and not any(not i.problem for i in list_checkpoints(snapshots))
            ):
                time.sleep(0.05)  # the writer's thread commits; nothing to wait on from here
            raise Crash(f"crash before step {step + 1}")

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            r = run_training(
                cfg,
                WorkerContext(
                    rank=rank,
                    world_size=world,
                    checkpoint_root=root,
                    snapshot_root=snapshots,
                    before_step=fault,
                    **(context or {}),
                ),
            )
        except Crash:
            return dict(crashed=True, printed=out.getvalue())
    return dict(losses=r.losses, start=r.start_step, printed=out.getvalue(), crashed=False)


def _train_losing_a_snapshot(rank, world, cfg, root, snapshots):
    """Rank 1 cannot read the snapshots (OSError), as when the keepers holding its files died
    after rank 0 listed them complete."""
    import trainer.checkpoint.checkpointer as checkpointer

    real = checkpointer.load_state

    def load_state(model, optimizer, reader, *args, **kwargs):
        if rank == 1 and reader.location.path.startswith(snapshots):
            raise OSError(f"{reader.location.path}: no live keeper holds it any more")
        return real(model, optimizer, reader, *args, **kwargs)

    checkpointer.load_state = load_state
    try:
        return _train(rank, world, cfg, root, snapshots, None)
    finally:
        checkpointer.load_state = real


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    c = TrainerConfig()
    c.model.dim, c.model.n_layers, c.model.n_heads, c.model.ffn_dim = 64, 2, 4, 160
    c.data.max_bytes, c.data.prepared_dir, c.data.seq_len = 300_000, str(d / "prep"), 32
    c.train.steps, c.train.global_batch_size, c.train.checkpoint_every = STEPS, 6, 50
    c.optim.warmup_steps = 2
    c.validate()
    prepare(c.data)
    return c


@pytest.fixture(scope="module")
def uninterrupted(cfg, tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    return dict(run_distributed(_train, 2, cfg, str(root / "ckpt"), None, None)[0]["losses"])


def crashed_run(cfg, tmp_path, world, crash_at, every, settle=False):
    cfg.train.snapshot_every = every
    root, snaps = str(tmp_path / "ckpt"), str(tmp_path / "snapshots")
    first = run_distributed(_train, world, cfg, root, snaps, crash_at, settle)
    fresh_ranks(world)  # the crashed group's processes die, a snapshot in flight with them
    assert all(r["crashed"] for r in first)
    assert list_checkpoints(root) == [], "no durable checkpoint before step 50"
    return root, snaps


@pytest.mark.parametrize("world, resume_world", [(2, 3), (3, 1)])
def test_a_crash_loses_at_most_snapshot_every_steps_at_any_new_world_size(
    cfg, uninterrupted, tmp_path, world, resume_world
):
    root, snaps = crashed_run(cfg, tmp_path, world, crash_at=7, every=2)
    steps = [i.step for i in list_checkpoints(snaps) if not i.problem]
    assert steps == [6, 4], "two generations, every 2 steps"
    second = run_distributed(_train, resume_world, cfg, root, snaps, None)[0]
    assert second["start"] == 6, second["printed"][-2000:]
    assert f"resumed from {snaps}/step_000000006" in second["printed"]
    assert [s for s, _ in second["losses"]] == list(range(6, STEPS))
    for step, loss in second["losses"]:
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5), step


def test_snapshots_as_often_as_they_hide_keep_the_newest_two(cfg, uninterrupted, tmp_path):
    """snapshot_every=null: a snapshot at every step where the previous one has been written
    (here a 20 ms step against a write with fsyncs to this disk: one every few steps)."""
    root, snaps = crashed_run(cfg, tmp_path, 2, crash_at=9, every=None, settle=True)
    steps = [i.step for i in list_checkpoints(snaps) if not i.problem]
    assert 1 <= len(steps) <= 2 and steps[0] >= 1, steps
    second = run_distributed(_train, 2, cfg, root, snaps, None)[0]
    assert second["start"] == steps[0]
    for step, loss in second["losses"]:
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5), step


def resume_after_a_crash_at_7(cfg, tmp_path, damage, train=_train, *args):
    """Two ranks with a durable checkpoint at step 4 and snapshots at steps 2 and 6 crash before
    step 8; `damage(snaps)` runs between; the group that resumes: its per-rank results."""
    cfg.train.checkpoint_every = 4
    try:
        root, snaps = str(tmp_path / "ckpt"), str(tmp_path / "snapshots")
        cfg.train.snapshot_every = 2
        run_distributed(_train, 2, cfg, root, snaps, 7)
        fresh_ranks(2)
        damage(snaps)
        return root, snaps, run_distributed(train, 2, cfg, root, snaps, *args)
    finally:
        cfg.train.checkpoint_every = 50


def test_incomplete_snapshots_fall_back_to_the_durable_checkpoint_and_say_so(cfg, tmp_path):
    def lose_a_shard(snaps):  # a node lost with both copies of a shard
        for info in list_checkpoints(snaps):
            os.remove(os.path.join(info.path, data_file_name(1, 2)))

    root, snaps, ranks = resume_after_a_crash_at_7(cfg, tmp_path, lose_a_shard, _train, None)
    second = ranks[0]
    assert second["start"] == 4
    assert "snapshot of step 6 is incomplete" in second["printed"]
    assert (
        "no complete in-memory snapshot newer than the durable checkpoint of step 4"
        in (second["printed"])
    )
    assert f"resumed from {root}/step_000000004" in second["printed"]
    shutil.rmtree(snaps)


def test_a_snapshot_one_rank_cannot_read_falls_back_on_every_rank_together(cfg, tmp_path):
    root, snaps, second = resume_after_a_crash_at_7(
        cfg, tmp_path, lambda snaps: None, _train_losing_a_snapshot
    )
    assert [r["start"] for r in second] == [4, 4]
    assert f"checkpoint {snaps}/step_000000006 is unusable: OSError: " in second[1]["printed"]
    assert "failed to load on some rank: falling back to an older one" in second[0]["printed"]
    assert f"resumed from {root}/step_000000004" in second[0]["printed"]


# ---- a relaunch after a killed driver: the previous launch's snapshots ---------------------------


def _train_inheriting(rank, world, cfg, root, snapshots, inherited, marks):
    """A new launch of the run (its own snapshot root) after one that died without ending:
    `inherited` is the dead launch's root. Each rank's release call leaves a mark recording
    which of this launch's own snapshots were committed when it came."""

    def release():
        own = [i.step for i in list_checkpoints(snapshots) if not i.problem]
        with open(os.path.join(marks, f"released-{rank}-{time.monotonic_ns()}"), "w") as f:
            f.write(",".join(map(str, own)))

    context = dict(inherited_snapshots=inherited, release_inherited=release if rank == 0 else None)
    return _train(rank, world, cfg, root, snapshots, None, False, context)


def test_a_relaunch_resumes_from_the_dead_launch_s_snapshot_then_releases_it_once(
    cfg, uninterrupted, tmp_path
):
    """Its driver killed, a launch leaves snapshots (steps 6 and 4) and no durable checkpoint;
    the relaunch, at another world size, resumes from the dead launch's step 6 instead of
    starting over, trains the uninterrupted curve, and releases the inherited snapshots once,
    only after its own first snapshot is committed."""
    root, dead = crashed_run(cfg, tmp_path, 2, crash_at=7, every=2)
    mine, marks = str(tmp_path / "relaunch-snapshots"), tmp_path / "marks"
    marks.mkdir()
    second = run_distributed(_train_inheriting, 3, cfg, root, mine, dead, str(marks))
    assert second[0]["start"] == 6, second[0]["printed"][-2000:]
    assert f"resumed from {dead}/step_000000006" in second[0]["printed"]
    for step, loss in second[0]["losses"]:
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5), step
    released = sorted(os.listdir(marks))
    assert len(released) == 1 and released[0].startswith("released-0-"), released
    own = (marks / released[0]).read_text().split(",")
    assert own != [""] and all(int(s) > 6 for s in own), own
    assert list_checkpoints(dead)[0].step == 6, "the relaunch never writes the dead launch's root"


def _snapshot(root: str, step: int) -> None:
    """A committed one-rank checkpoint of `step` under `root` (what a snapshot is)."""
    from trainer.checkpoint import CheckpointWriter, TensorChunk

    t = torch.arange(4, dtype=torch.float32)
    with CheckpointWriter(root, keep=10, async_save=False) as writer:
        writer.save(step, 0, 1, [TensorChunk("model/w", (4,), t.dtype, 0, t)], {"step": step})
        writer.wait()


def test_resume_offers_both_roots_newest_first_this_launch_s_first_at_equal_steps(tmp_path):
    """A group restart within the relaunch: its own snapshots (6, 4) and the dead launch's (8, 2,
    and a 4 of its own) are offered newest first, above the durable checkpoint (step 3): the
    inherited 8, then its own 6, its own 4 before the inherited 4; never the 2."""
    from trainer.checkpoint.snapshots import Snapshots

    mine, dead = str(tmp_path / "mine"), str(tmp_path / "dead")
    for root, step in [(mine, 6), (mine, 4), (dead, 8), (dead, 4), (dead, 2)]:
        _snapshot(root, step)
    snaps = Snapshots(mine, None, 1, log=lambda *_: None, inherited=dead)
    try:
        offered = snaps.newer_than(3, rank=0, control=None)
    finally:
        snaps.close()
    assert offered == [
        f"{dead}/step_000000008",
        f"{mine}/step_000000006",
        f"{mine}/step_000000004",
        f"{dead}/step_000000004",
    ]
    assert snaps.holds(offered[0]) and snaps.holds(offered[1])
    assert not snaps.holds(str(tmp_path / "ckpt" / "step_000000003"))
    lone = Snapshots(mine, None, 1, log=lambda *_: None, inherited=mine)  # its own root: once
    try:
        assert lone.newer_than(0, rank=0, control=None) == [
            f"{mine}/step_000000006",
            f"{mine}/step_000000004",
        ]
    finally:
        lone.close()
