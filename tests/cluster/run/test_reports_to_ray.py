"""Reports to Ray never block training, and a drain on grow is answered while Ray is not polling.

The case that hung (issue 26): Ray Train's `ray.train.report` puts a result on a queue of one that
the controller empties when it polls. The controller asks the running group to drain before a
grow and waits in our callback for the acknowledgement, not polling; a periodic checkpoint's
report made just before is still on the queue, so the drain checkpoint's own report blocked the
loop, the acknowledgement never came, and the grow waited out its 120 s timeout.

Here the controller is a test double with the same queue of one (`ResultQueue`) that stops
polling while it waits for the drain, exactly as Ray's controller does inside our callback. The
real loop (trainer.loop at world size 1, the tiny model), the real Reporter, DrainRequests,
GrowDrain and leave_gracefully. With reports from the loop's own thread (the old wiring) the
same double hangs until the drain's timeout: the negative control.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time

import pytest

from cluster.elastic.drain import DrainedError, DrainWatcher
from cluster.elastic.grow import DrainRequests, GrowDrain
from cluster.elastic.leave import leave_gracefully
from cluster.elastic.tracker import ElasticTracker
from cluster.run.folder import RunFolder
from cluster.run.reporter import Reporter
from trainer.checkpoint import list_checkpoints
from trainer.config import TrainerConfig
from trainer.data import prepare

DRAIN_BOUND_S = 20.0
"""The longest a drain may take here: a step, a checkpoint and the acknowledgement (< 2 s on
this machine); the drain's own timeout is the bound (the old wiring waited it out)."""


class ResultQueue:
    """Ray Train's per-worker result queue of one, and a controller that polls it: `hold()` stops
    the polling (the controller is inside a callback of ours), `release()` resumes it."""

    def __init__(self):
        self.item: list[int] = []  # at most one, as Ray's queue.Queue(maxsize=1)
        self.taken: list[int] = []
        self.polling, self.closed = True, False
        self.cv = threading.Condition()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def send(self, path: str, step: int) -> None:  # what ray.train.report does: put, blocking
        with self.cv:
            self.cv.wait_for(lambda: not self.item or self.closed)
            self.item.append(step)
            self.cv.notify_all()

    def hold(self) -> None:
        with self.cv:
            self.polling = False

    def release(self) -> None:
        with self.cv:
            self.polling = True
            self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = self.polling = True
            self.cv.notify_all()

    def _poll(self) -> None:
        with self.cv:
            while not self.closed:
                self.cv.wait_for(lambda: (self.polling and self.item) or self.closed)
                if self.item:
                    self.taken.append(self.item.pop())
                    self.cv.notify_all()


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    c = TrainerConfig()
    c.model.dim, c.model.n_layers, c.model.n_heads, c.model.ffn_dim = 64, 2, 4, 160
    c.data.max_bytes, c.data.prepared_dir, c.data.seq_len = 200_000, str(d / "prep"), 32
    c.train.steps, c.train.global_batch_size, c.train.checkpoint_every = 400, 4, 2
    c.train.keep_checkpoints = 2
    c.optim.warmup_steps = 2
    c.validate()
    prepare(c.data)
    return c


def drain_right_after_a_checkpoint(cfg, run_dir, controller: ResultQueue, on_checkpoint, timeout_s):
    """One group: train until a periodic checkpoint's report sits on the queue, then (within the
    same step, well inside one health-check interval) the controller requests a drain and waits
    for the ack without polling. Returns (ack or None, seconds the drain took, the loop's
    result, what the group printed)."""
    from trainer.loop import WorkerContext, run_training

    folder = RunFolder.at(str(run_dir / "elastic"))
    launch = "launch-1"
    requests = DrainRequests(folder, launch)
    drain = DrainWatcher(0, requests=requests)
    grow = GrowDrain(folder, timeout_s=timeout_s, launch_id=launch, poll_s=0.01)
    answer: dict = {}
    started = threading.Event()

    def control():
        started.wait()
        t0 = time.monotonic()
        answer["ack"] = grow.drain("a node joined")
        answer["took"] = time.monotonic() - t0
        controller.release()

    controller_thread = threading.Thread(target=control, daemon=True)
    controller_thread.start()
    reported = []

    def report(path: str, step: int) -> None:
        reported.append(step)
        if len(reported) == 2:  # in our callback from here: Ray polls no worker meanwhile,
            controller.hold()  # so this periodic checkpoint's report stays on the queue
        on_checkpoint(path, step)
        if len(reported) == 2:
            started.set()  # the controller asks for the drain, within the same step

    out = io.StringIO()
    tracker = ElasticTracker(folder, 0, 1, launch, {"entered": time.time()})
    with contextlib.redirect_stdout(out):
        result = run_training(
            cfg,
            WorkerContext(
                rank=0,
                world_size=1,
                checkpoint_root=str(run_dir / "checkpoints"),
                on_checkpoint=report,
                should_stop=drain,
                before_step=tracker.before_step,
                after_step=tracker.on_step,
            ),
        )
        with pytest.raises(DrainedError):
            leave_gracefully(
                drain, tracker, 0, 1, result.steps_done, cfg.train.steps, result.last_checkpoint
            )
    controller_thread.join(timeout_s + 10)
    return answer.get("ack"), answer.get("took"), result, out.getvalue()


def test_a_drain_right_after_a_checkpoint_is_answered_while_ray_takes_no_report(cfg, tmp_path):
    """The drill, 3 times in a row here (20 in the slow variant): every drain acknowledged well
    inside its bound, at the step the group stopped, its checkpoint committed, nothing lost."""
    drills(cfg, tmp_path, repeats=3)


@pytest.mark.slow
def test_the_drain_drill_passes_twenty_times_in_a_row(cfg, tmp_path):
    drills(cfg, tmp_path, repeats=20)


def drills(cfg, tmp_path, repeats: int) -> None:
    controller = ResultQueue()
    run_dir = tmp_path / "run"
    start = 0
    try:
        for i in range(repeats):
            reporter = Reporter(controller.send, slow_s=0.5, log=lambda line: None)
            ack, took, result, printed = drain_right_after_a_checkpoint(
                cfg, run_dir, controller, reporter.report, DRAIN_BOUND_S
            )
            reporter.drop()
            assert ack is not None, f"drill {i}: the drain was not acknowledged\n{printed}"
            assert took < DRAIN_BOUND_S
            assert ack["step"] == result.steps_done, "acknowledged at the step it stopped at"
            assert result.start_step == start, f"drill {i}: resumed where the last one drained"
            listed = list_checkpoints(str(run_dir / "checkpoints"))
            assert listed[0].step == ack["step"] and listed[0].path == result.last_checkpoint
            start = ack["step"]
    finally:
        controller.close()
    assert start >= 2 * repeats


def test_with_reports_from_the_loop_s_own_thread_the_same_drain_hangs_until_its_timeout(
    cfg, tmp_path
):
    """The negative control: the old wiring (the loop calls ray.train.report itself) against the
    same controller blocks on the drain checkpoint's report and never acknowledges in time."""
    controller = ResultQueue()
    try:
        ack, took, _, _ = drain_right_after_a_checkpoint(
            cfg, tmp_path / "run", controller, controller.send, timeout_s=3.0
        )
    finally:
        controller.close()
    assert ack is None and took >= 3.0


# ---- the Reporter itself --------------------------------------------------------------------


def test_reports_return_at_once_go_in_order_and_a_flush_waits_for_ray_to_take_them():
    gate = threading.Event()
    sent = []

    def send(path, step):
        gate.wait()
        sent.append(step)

    lines = []
    reporter = Reporter(send, slow_s=0.05, log=lines.append)
    t0 = time.monotonic()
    for step in (2, 4, 6):
        reporter.report(f"ckpt/{step}", step)
    assert time.monotonic() - t0 < 0.5, "report() never waits for Ray"
    assert not reporter.flush(0.1), "Ray has taken nothing yet"
    assert any("3 checkpoint report(s) not taken" in line for line in lines)
    gate.set()
    assert reporter.flush(5.0)
    assert sent == [2, 4, 6] == reporter.sent
    assert reporter.slow_reports == [2], "the report Ray held past slow_s is logged, once"
    assert any("has not taken the report of step 2" in line for line in lines)


def test_a_leave_drops_the_reports_not_yet_handed_to_ray():
    gate, sent = threading.Event(), []
    entered = threading.Event()

    def send(path, step):
        entered.set()
        gate.wait()
        sent.append(step)

    reporter = Reporter(send, slow_s=60, log=lambda line: None)
    reporter.report("a", 1)
    entered.wait(5)
    reporter.report("b", 2)
    reporter.drop()
    reporter.report("c", 3)  # after the drop: ignored
    gate.set()
    reporter._thread.join(5)
    assert sent == [1], "the one in Ray's hands completes; the queued one is not sent"


def test_a_failing_report_is_logged_and_training_goes_on():
    lines = []

    def send(path, step):
        raise RuntimeError("controller gone")

    reporter = Reporter(send, slow_s=60, log=lines.append)
    reporter.report("a", 1)
    assert reporter.flush(5.0)
    assert reporter.sent == [] and len(reporter.errors) == 1
    assert "reporting step 1 failed (RuntimeError: controller gone)" in lines[0]
