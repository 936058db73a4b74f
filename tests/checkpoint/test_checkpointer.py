"""trainer/checkpoint/checkpointer.py: the cadence, the report of a save when it commits (not at
the next save), and every committed save reported exactly once, in order, on every rank."""

import contextlib
import io

import pytest
import torch

from tests.dist_utils import run_distributed
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.launch_storage import LaunchStorage
from trainer.config import TrainerConfig
from trainer.data import prepare
from trainer.fsdp import build_mesh, parallelize
from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.model import build_model, initializer
from trainer.optim import build_optimizer


class FakeWriter:
    """Stands in for CheckpointWriter: a save stays in flight until the test says it committed."""

    def __init__(self):
        self.saved, self.committed = [], set()

    def save(self, step, rank, world, chunks, state, barrier=None):
        self.saved.append(step)

    def in_flight(self) -> bool:
        return bool(self.saved) and self.saved[-1] not in self.committed

    def wait(self) -> str:
        self.committed.add(self.saved[-1])
        return f"ckpt/step_{self.saved[-1]:09d}"

    def close(self):
        pass


def small_config(tmp_path=None) -> TrainerConfig:
    c = TrainerConfig()
    c.model.dim, c.model.n_layers, c.model.n_heads, c.model.ffn_dim = 32, 1, 2, 64
    c.train.steps, c.train.checkpoint_every = 10, 3
    if tmp_path is not None:
        c.data.max_bytes, c.data.prepared_dir, c.data.seq_len = 50_000, str(tmp_path / "prep"), 16
        c.train.global_batch_size = 4
    return c.validate()


def checkpointer(cfg: TrainerConfig, reports: list) -> Checkpointer:
    mesh = build_mesh(cfg.sharding, 0, 1)
    model = parallelize(build_model(cfg.model), cfg.sharding, mesh, "cpu", init_fn=initializer(0))
    ckpt = Checkpointer(
        cfg,
        LaunchStorage("unused", on_commit=lambda path, step: reports.append(step)),
        model,
        build_optimizer(model, cfg.optim),
        ShardedGradScaler(enabled=False),
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
    )
    ckpt.writer = FakeWriter()
    return ckpt


def test_a_save_is_reported_at_the_first_step_after_it_commits_not_at_the_next_save():
    reports = []
    ckpt = checkpointer(small_config(), reports)
    for step in (1, 2, 3):
        ckpt.after_step(step)
    assert ckpt.writer.saved == [3] and reports == []  # saved on cadence, still in flight
    ckpt.after_step(4)
    assert reports == []  # not committed yet: nothing to report, and the loop did not wait
    ckpt.writer.committed.add(3)
    ckpt.after_step(5)
    assert reports == [3]  # committed: reported at once, three steps before the next save
    ckpt.after_step(6)
    assert ckpt.writer.saved == [3, 6] and reports == [3]
    assert ckpt.close(7) == "ckpt/step_000000007"  # the last step is saved, waited for, reported
    assert ckpt.writer.saved == [3, 6, 7] and reports == [3, 6, 7]


def test_close_saves_nothing_when_the_last_step_is_saved_already():
    reports = []
    ckpt = checkpointer(small_config(), reports)
    for step in range(1, 7):
        ckpt.after_step(step)
    ckpt.close(6)
    assert ckpt.writer.saved == [3, 6] and reports == [3, 6]


def _train(rank, world, cfg, root):
    from trainer.loop import WorkerContext, run_training

    reports = []
    with contextlib.redirect_stdout(io.StringIO()):
        result = run_training(
            cfg,
            WorkerContext(
                rank=rank,
                world_size=world,
                checkpoint_root=root,
                on_checkpoint=lambda p, s: reports.append((s, p)),
            ),
        )
    return dict(reports=reports, last=result.last_checkpoint)


def test_every_committed_save_is_reported_once_in_order_on_every_rank(tmp_path):
    cfg = small_config(tmp_path)
    cfg.train.steps = 8
    prepare(cfg.data)
    results = run_distributed(_train, 2, cfg, str(tmp_path / "ckpt"))
    for r in results:
        assert [s for s, _ in r["reports"]] == [3, 6, 8]
        assert r["reports"][-1][1] == r["last"] and r["last"].endswith("step_000000008")
    assert results[0]["reports"] == results[1]["reports"]


@pytest.mark.parametrize("every,steps,saved", [(0, 4, [4]), (2, 4, [2, 4]), (5, 4, [4])])
def test_cadence(every, steps, saved):
    reports = []
    cfg = small_config()
    cfg.train.checkpoint_every, cfg.train.steps = every, steps
    ckpt = checkpointer(cfg, reports)
    for step in range(1, steps + 1):
        ckpt.after_step(step)
    ckpt.close(steps)
    assert ckpt.writer.saved == saved and reports == saved
