"""cluster/elastic/ without Ray: the fault drill, the drain watcher, SIGTERM, the elastic metrics.

The same parts run on a real multi-node Ray cluster in test_elastic.py; here each rule is pinned
down in milliseconds, with a fake clock where times matter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.config import FaultConfig
from cluster.elastic import clock as controller_clock
from cluster.elastic import cluster_view
from cluster.elastic.clock import RestartClock
from cluster.elastic.cluster_view import ClusterView, count_usable_nodes_only, workers_that_fit
from cluster.elastic.drain import DrainedError, DrainWatcher
from cluster.elastic.faults import FAULT_MARKER, FaultInjector
from cluster.elastic.grow import DrainRequests, GrowDrain
from cluster.elastic.leave import leave
from cluster.elastic.tracker import ATTEMPTS_DIR, ElasticTracker, chain
from cluster.run.folder import RunFolder

REPO = Path(__file__).resolve().parents[3]


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def folder(tmp_path) -> RunFolder:
    return RunFolder.at(str(tmp_path / "run" / "elastic"))


def start_group(folder, clock, launch="L1", world=2, rank=0, context_delay=1.0):
    """A worker group's rank-0 tracker, created as cluster/worker.py does at the group's start."""
    entered = clock()
    times = {"context": entered - context_delay, "entered": entered, "imported": entered + 0.5}
    return ElasticTracker(folder, rank, world, launch, times, clock=clock)


def train(tracker, clock, steps, step_s=0.1, loss=lambda s: 5.0 - 0.1 * s):
    """Drive the tracker as the loop drives its callbacks; the metrics each step returned."""
    out = []
    for step in steps:
        tracker.before_step(step)
        clock.t += step_s
        out.append(tracker.on_step(step, {"train/loss": loss(step)}) or {})
    return out


# ---- the run folder ---------------------------------------------------------------------------


def test_run_folder_reads_what_it_wrote_and_a_torn_document_as_missing(folder, tmp_path):
    folder.write("attempts/1.json", {"a": 1})
    folder.write("fault.json", {"b": 2}, durable=True)
    assert folder.read("attempts/1.json") == {"a": 1} and folder.read("fault.json") == {"b": 2}
    assert folder.names("attempts") == ["attempts/1.json"]
    assert folder.exists("fault.json") and not folder.exists("nothing.json")
    (tmp_path / "run" / "elastic" / "attempts" / "2.json").write_text('{"cut')
    assert folder.read("attempts/2.json") is None and folder.read("missing.json") is None


# ---- fault injection --------------------------------------------------------------------------


def test_crash_fires_once_per_run_on_its_rank_at_its_step(folder):
    exits = []
    fault = FaultConfig(kill_rank=1, at_step=5, kind="crash")
    on_rank_0 = FaultInjector(fault, 0, folder, exit_process=exits.append)
    on_rank_1 = FaultInjector(fault, 1, folder, exit_process=exits.append)
    for step in range(8):
        on_rank_0(step)
    assert exits == [] and not folder.exists(FAULT_MARKER)
    for step in range(8):
        on_rank_1(step)
    assert exits == [1]
    marker = folder.read(FAULT_MARKER)
    assert (marker["kind"], marker["rank"], marker["step"]) == ("crash", 1, 5)
    # The restarted group (a new injector, the same run folder) trains step 5 like any other.
    again = FaultInjector(fault, 1, folder, exit_process=exits.append)
    for step in range(3, 8):
        again(step)
    assert exits == [1]


def test_disabled_fault_never_fires(folder):
    exits = []
    injector = FaultInjector(FaultConfig(), 0, folder, exit_process=exits.append)
    for step in range(10):
        injector(step)
    assert exits == [] and not folder.exists(FAULT_MARKER)


# ---- graceful drain ---------------------------------------------------------------------------


def test_drain_watcher_stops_on_a_preemption_notice_and_polls_ray_every_time():
    calls = []
    notice = SimpleNamespace(preempted_ranks=[1], deadline_ms=123)

    def preemption_info():  # a barrier in Ray: every rank must call it once per poll
        calls.append(1)
        return notice if len(calls) >= 3 else None

    watcher = DrainWatcher(0, preemption_info=preemption_info)
    assert [watcher() for _ in range(5)] == [False, False, True, True, True]
    assert len(calls) == 5
    assert "preemption notice for ranks [1]" in watcher.reason


def test_only_the_ranks_a_preemption_names_leave_their_process_the_others_raise():
    notice = SimpleNamespace(preempted_ranks=[1], deadline_ms=None)
    exits = []
    for rank in (0, 1):
        watcher = DrainWatcher(rank, preemption_info=lambda: notice)
        assert watcher() and watcher.leaving == (rank == 1)
        if rank == 1:
            leave(watcher, "rank 1 left", exit_process=exits.append)
        else:
            with pytest.raises(DrainedError, match="rank 0 left"):
                leave(watcher, "rank 0 left", exit_process=exits.append)
    assert exits == [0]


def _agree_who_leaves(rank: int, world: int) -> list[bool]:
    """Rank 1's node is preempted; only rank 0 has Ray's notice when the group stops."""
    from cluster.elastic.leave import agree_who_leaves  # noqa: PLC0415 -- next to its test

    notice = SimpleNamespace(preempted_ranks=[1], deadline_ms=None)
    watcher = DrainWatcher(rank, preemption_info=lambda: notice if rank == 0 else None)
    stopped = watcher()
    before = watcher.leaving
    agree_who_leaves(watcher, rank, world)
    return [stopped, before, watcher.leaving]


def test_a_preempted_rank_that_stopped_on_another_ranks_notice_learns_it_must_go():
    """Ray hands the notice to each worker in turn: the group may stop on rank 0's copy before
    rank 1, the preempted one, has its own. Rank 1 must still leave (end its process, stop its
    node's keeper), not raise like a rank that stays."""
    from tests.dist_utils import run_distributed  # noqa: PLC0415 -- spawns processes

    ranks = run_distributed(_agree_who_leaves, 2)
    assert ranks == [[True, False, False], [False, False, True]]


def test_a_notice_that_came_after_the_stop_is_read_once_more_on_every_rank():
    seen = {"n": 0}
    notice = SimpleNamespace(preempted_ranks=[1], deadline_ms=None)

    def preemption_info():  # a barrier in Ray: each rank calls it as often as the others
        seen["n"] += 1
        return notice if seen["n"] > 1 else None

    watcher = DrainWatcher(1, preemption_info=preemption_info)
    assert not watcher() and not watcher.leaving  # the group stopped on another rank's word
    assert watcher.leaving_ranks() == [1] and watcher.leaving
    assert seen["n"] == 2


SIGTERM_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from cluster.config import FaultConfig
    from cluster.elastic.drain import DrainWatcher, install_sigterm_handler, training
    from cluster.elastic.faults import FaultInjector
    from cluster.run.folder import RunFolder

    install_sigterm_handler()
    watcher = DrainWatcher(0)
    folder = RunFolder.at(sys.argv[1])
    drill = FaultInjector(FaultConfig(kill_rank=0, at_step=2, kind="drain"), 0, folder)
    with training():
        for step in range(5):
            if watcher():
                print("stopped before step", step, "because", watcher.reason, "leaving",
                      watcher.leaving, flush=True)
                break
            drill(step)
    # Outside training a SIGTERM is not a drain: the previous handler (here the default) ends us.
    print("training over", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    print("still alive", flush=True)
""")


def test_drain_drill_sends_sigterm_which_stops_training_at_the_next_step_and_only_while_training(
    tmp_path,
):
    proc = subprocess.run(
        [sys.executable, "-c", SIGTERM_CHILD, str(tmp_path / "elastic")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert "fault injection: drain of rank 0 before step 2" in proc.stdout, proc.stderr
    assert "stopped before step 3 because SIGTERM leaving True" in proc.stdout, (
        proc.stdout + proc.stderr
    )
    assert "training over" in proc.stdout and "still alive" not in proc.stdout
    assert proc.returncode == -signal.SIGTERM
    assert json.loads((tmp_path / "elastic" / "fault.json").read_text())["kind"] == "drain"


# ---- elastic metrics --------------------------------------------------------------------------


def test_first_group_reports_no_restart_and_no_recovery(folder):
    clock = Clock()
    metrics = train(start_group(folder, clock), clock, range(4))
    assert metrics[0] == {"elastic/restarts": 0.0} and metrics[-1] == {"elastic/restarts": 0.0}


def test_the_first_group_prints_the_start_up_phases_once_and_a_restart_does_not(folder, capsys):
    clock = Clock()
    began = clock.t - 20.0
    driver = {
        "began": began,
        "phases": [["config", 0.5], ["Ray", 4.0], ["data", 0.25], ["MLflow", 1.0]],
        "fit_at": began + 7.0,
    }
    times = {"context": clock.t - 1.0, "entered": clock.t, "imported": clock.t + 2.0}
    tracker = ElasticTracker(folder, 0, 2, "L1", times, clock=clock, startup=driver)
    clock.t += 3.0  # model, data and checkpoint load: ready at +3
    train(tracker, clock, range(3), step_s=1.5)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("start-up")]
    assert line == (
        "start-up 24.5 s: config 0.5 s | Ray 4.0 s | data 0.2 s | MLflow 1.0 s | workers up "
        "12.0 s | process group 1.0 s | imports 2.0 s | model + data + resume 1.0 s | "
        "first step 1.5 s"
    )
    restarted = ElasticTracker(folder, 0, 2, "L1", times, clock=clock, startup=driver)
    train(restarted, clock, range(2, 4))
    assert "start-up" not in capsys.readouterr().out


def test_crash_recovery_counts_the_steps_since_the_checkpoint_and_times_from_the_fault(folder):
    clock = Clock()
    first = start_group(folder, clock)
    train(first, clock, range(5))  # steps 0..4; the checkpoint holds 3 steps
    folder.write(FAULT_MARKER, {"time": clock.t + 0.05})  # rank 1 died before step 5
    clock.t += 10.0
    second = start_group(folder, clock, world=2)  # the loop resumes at step 3
    clock.t += 2.0
    metrics = train(second, clock, range(3, 7), loss=lambda s: 5.0 - 0.1 * s)
    assert metrics[0]["elastic/restarts"] == 1.0
    assert metrics[0]["elastic/steps_lost"] == 2.0
    assert metrics[0]["elastic/recovery_s"] == pytest.approx(12.05, abs=1e-6)
    assert "elastic/steps_lost" not in metrics[1], "a recovery is reported once"
    record = folder.read(second.name)
    assert record["recovery"]["breakdown"]["ray_restart_s"] == pytest.approx(8.95, abs=1e-6)
    assert sum(record["recovery"]["breakdown"].values()) == pytest.approx(12.05, abs=1e-6)
    assert record["retrained_losses"] == {"3": pytest.approx(4.7), "4": pytest.approx(4.6)}


def test_the_controllers_clock_splits_rays_restart_and_a_stale_one_is_not_used(
    folder, capsys, monkeypatch
):
    """RestartClock's hooks, in the order Ray's controller calls them on a worker death, then the
    new group's tracker: its "ray restart" phase is split at those times and adds up to it."""
    clock = Clock()
    first = start_group(folder, clock)
    train(first, clock, range(5))
    died = clock.t + 0.05
    folder.write(FAULT_MARKER, {"time": died})
    controller = RestartClock(folder, "L1")
    at = {"t": died}

    def now_plus(dt):
        at["t"] += dt
        return at["t"]

    monkeypatch.setattr(controller_clock.time, "time", lambda: at["t"])
    now_plus(0.25)
    controller.before_controller_execute_failure_decision(object())
    now_plus(0.5)
    controller.before_worker_group_shutdown(None)
    now_plus(0.75)
    controller.after_worker_group_shutdown(None)
    now_plus(1.0)
    controller.before_controller_execute_resize_decision(object())  # the new size: not "decided"
    controller.before_worker_group_start(None)
    context = now_plus(5.0)
    clock.t = context + 0.5
    times = {"context": context, "entered": clock.t, "imported": clock.t}
    second = ElasticTracker(folder, 0, 2, "L1", times, clock=clock)
    train(second, clock, range(3, 5))
    recovery = folder.read(second.name)["recovery"]
    assert recovery["ray_phases"] == pytest.approx(
        {
            "detect_s": 0.25,
            "teardown_s": 1.25,
            "decide_s": 1.0,
            "start_workers_s": 5.0,
        }
    )
    assert sum(recovery["ray_phases"].values()) == pytest.approx(
        recovery["breakdown"]["ray_restart_s"]
    )
    assert "ray restart: detect 0.2 s, teardown 1.2 s, decide 1.0 s, start workers 5.0 s" in (
        capsys.readouterr().out
    )
    # The next failure finds the clock of the start before it: not this restart's, not used.
    folder.write(FAULT_MARKER, {"time": clock.t + 0.05})
    clock.t += 5.0
    third = start_group(folder, clock)
    train(third, clock, range(3, 5))
    assert "ray_phases" not in folder.read(third.name)["recovery"]
    assert "ray restart:" not in capsys.readouterr().out


def test_graceful_drain_loses_no_step_and_an_unannounced_death_times_from_the_last_step(folder):
    clock = Clock()
    first = start_group(folder, clock)
    train(first, clock, range(6))  # the last step ends at t=1000.6
    first.left(6)  # drained: checkpoint of step 6 committed, then the group left
    clock.t += 7.0
    metrics = train(start_group(folder, clock, world=1), clock, range(6, 8))
    assert metrics[0]["elastic/steps_lost"] == 0.0
    # the first step done at 1007.7
    assert metrics[0]["elastic/recovery_s"] == pytest.approx(7.1, abs=1e-6)
    assert folder.read(first.name)["left_at"]["step"] == 6


def test_a_group_that_died_before_its_first_step_passes_the_recovery_on(folder):
    clock = Clock()
    train(start_group(folder, clock), clock, range(5))  # died after step 4, at t=1000.5
    clock.t += 5.0
    doomed = start_group(folder, clock)
    doomed.before_step(3)  # resumed at 3, then died inside step 3
    clock.t += 5.0
    metrics = train(start_group(folder, clock), clock, range(3, 5))
    assert metrics[0]["elastic/restarts"] == 2.0
    assert metrics[0]["elastic/steps_lost"] == 2.0  # steps 3, 4: not counted twice
    assert metrics[0]["elastic/recovery_s"] == pytest.approx(10.1, abs=1e-6)  # 1000.5 -> 1010.6


def test_a_resubmitted_run_reports_steps_lost_but_no_recovery_time_and_counts_restarts_anew(folder):
    clock = Clock()
    first = start_group(folder, clock, launch="L1")
    train(first, clock, range(4))
    first.left(4)
    clock.t += 3600.0
    metrics = train(start_group(folder, clock, launch="L2"), clock, range(4, 6))
    assert metrics[0] == {"elastic/restarts": 0.0, "elastic/steps_lost": 0.0}


class CountingFolder(RunFolder):
    """A RunFolder that says it is on an object store, and counts its writes."""

    def __init__(self, inner: RunFolder, local: bool):
        super().__init__(inner.location)
        self.local, self.writes = local, 0

    @property
    def is_local(self) -> bool:
        return self.local

    def write(self, name, doc, durable=False):
        self.writes += 1
        super().write(name, doc, durable)


def test_progress_is_written_every_step_on_disk_but_at_most_once_a_second_on_an_object_store(
    folder,
):
    writes = {}
    for local in (True, False):
        counting = CountingFolder(folder, local)
        clock = Clock()
        train(start_group(counting, clock, launch=f"L-{local}"), clock, range(20))
        writes[local] = counting.writes
    assert writes[True] >= 21 and writes[False] <= 3, writes


def test_only_rank_0_keeps_a_record(folder):
    clock = Clock()
    tracker = start_group(folder, clock, rank=1)
    assert train(tracker, clock, range(3)) == [{}, {}, {}]
    assert folder.names(ATTEMPTS_DIR) == []


def test_chain_calls_every_hook_in_order():
    seen = []
    hook = chain(lambda s: seen.append(("a", s)), None, lambda s: seen.append(("b", s)))
    hook(7)
    assert seen == [("a", 7), ("b", 7)]


# ---- the controller's view of the cluster -----------------------------------------------------


def test_workers_that_fit_count_only_alive_nodes_not_being_drained():
    nodes = [
        {"NodeID": "a", "Alive": True, "Resources": {"CPU": 3.0, "GPU": 2.0}},
        {"NodeID": "b", "Alive": True, "Resources": {"CPU": 8.0}},
        {"NodeID": "c", "Alive": False, "Resources": {"CPU": 4.0, "GPU": 4.0}},
        {"NodeID": "d", "Alive": True, "Resources": {"CPU": 4.0, "GPU": 4.0}},
    ]
    assert workers_that_fit({"CPU": 1.0, "GPU": 1.0}, nodes, draining={"d"}) == 2
    assert workers_that_fit({"CPU": 2.0, "GPU": 0.0}, nodes, draining=set()) == 1 + 4 + 2


def test_rays_policy_counts_what_the_usable_nodes_hold(monkeypatch):
    """A preempted node's raylet lives on until its deadline, and Ray's coordinator counts it,
    even reserves one of the group's bundles on it. Unwrapped, each resize check of the group
    running without it "grows" onto it: a restart of the group at its own size every check. The
    count is capped, not filtered: a node that joined while the coordinator reserved the
    draining one instead is still grown onto."""
    from ray.train import ScalingConfig  # noqa: PLC0415 -- ray: seconds, only where needed
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    for method in ("_count_possible_workers", "make_decision_for_running_worker_group"):
        monkeypatch.setattr(  # restored after the test
            ElasticScalingPolicy, method, getattr(ElasticScalingPolicy, method)
        )
    cluster = {"nodes": [], "draining": []}
    monkeypatch.setattr(
        cluster_view.ray,
        "nodes",
        lambda: [{"NodeID": n, "Alive": True, "Resources": {"CPU": 1.0}} for n in cluster["nodes"]],
    )
    monkeypatch.setattr(
        cluster_view.ray._private.state.state,
        "get_draining_nodes",
        lambda: {n: 0 for n in cluster["draining"]},
    )

    def decide(running: int, reserved: list[str]):
        policy = ElasticScalingPolicy(
            ScalingConfig(num_workers=(1, 3), elastic_resize_monitor_interval_s=0.0)
        )
        monkeypatch.setattr(policy, "_maybe_send_resource_request", lambda: None)
        monkeypatch.setattr(
            policy, "_get_reserved_resources", lambda: {n: {"CPU": 1.0} for n in reserved}
        )
        group = SimpleNamespace(num_workers=running, start_time=float("-inf"))
        return policy.make_decision_for_running_worker_group(group, None)

    # Preempted, lingering: the group runs on head alone; Ray reserved a bundle on "leaving".
    cluster.update(nodes=["head", "leaving"], draining=["leaving"])
    assert isinstance(decide(1, ["head", "leaving"]), ResizeDecision)  # Ray alone: grow onto it
    assert count_usable_nodes_only() and count_usable_nodes_only()  # idempotent
    assert isinstance(decide(1, ["head", "leaving"]), NoopDecision)
    # Just told it will be preempted, the node still runs one of the 2 workers: no resize down
    # (it would tear the group down before its workers drain).
    assert isinstance(decide(2, ["head", "leaving"]), NoopDecision)
    policy = ElasticScalingPolicy(ScalingConfig(num_workers=(1, 3)))
    assert policy._count_possible_workers({"head": {"CPU": 1.0}, "leaving": {"CPU": 1.0}}) == 1
    # (a group started now, as after the drain, is sized without it)
    # A node lost: Ray's view still has it.
    cluster.update(nodes=["head"], draining=[])
    assert isinstance(decide(1, ["head", "gone"]), NoopDecision)
    # Two nodes joined; the coordinator reserved the lingering one and one of them.
    cluster.update(nodes=["head", "leaving", "c", "d"], draining=["leaving"])
    assert decide(2, ["head", "leaving", "c"]).num_workers == 3
    # Back in service: the group grows onto it.
    cluster.update(nodes=["head", "leaving"], draining=[])
    assert decide(1, ["head", "leaving"]).num_workers == 2
    assert not count_usable_nodes_only(None)


def test_cluster_view_lowers_a_decision_to_the_staying_nodes_but_never_below_min_or_above_ray(
    monkeypatch,
):
    view = ClusterView(interval_s=1.0, min_workers=2)
    for fits, decided, expected in [(2, 3, 2), (1, 3, 3), (4, 3, 3)]:
        monkeypatch.setattr(cluster_view, "workers_that_fit", lambda per_worker, fits=fits: fits)
        decision = SimpleNamespace(num_workers=decided, resources_per_worker={"CPU": 1.0})
        view.before_controller_execute_resize_decision(decision)
        assert decision.num_workers == expected, (fits, decided)


# ---- drain on grow (grow.py) -------------------------------------------------------------------


def test_a_grow_drain_request_stops_rank_0_which_acks_once_its_checkpoint_committed(folder):
    requests = DrainRequests(folder, "L1")
    watcher = DrainWatcher(0, requests=requests)
    assert not watcher()  # nothing asked yet
    grow = GrowDrain(folder, timeout_s=30, launch_id="L1", poll_s=0.01)
    answer = {}

    def controller():
        answer["ack"] = grow.drain("Ray is resizing the group to 3 workers")

    thread = threading.Thread(target=controller)
    thread.start()
    deadline = time.monotonic() + 30
    while not watcher() and time.monotonic() < deadline:  # the loop polls once per step
        time.sleep(0.01)
    assert watcher.reason == "drain requested (Ray is resizing the group to 3 workers)"
    assert not watcher.leaving  # the group restarts; no process has to go
    requests.acknowledge(step=17)  # cluster/worker.py, after the loop committed step 17
    thread.join(30)
    assert answer["ack"]["step"] == 17
    assert folder.read("drain_request.json")["id"] is None  # answered: no later group drains
    later = DrainWatcher(0, requests=DrainRequests(folder, "L1"))
    assert not later()


def test_a_group_that_does_not_answer_is_grown_anyway_after_the_timeout(folder):
    clock = Clock(0.0)

    def ticking() -> float:
        clock.t += 0.5
        return clock.t

    grow = GrowDrain(folder, timeout_s=2.0, launch_id="L1", poll_s=0.0)
    assert grow.drain("resize to 2", clock=ticking) is None
    assert folder.read("drain_request.json")["id"] is None
    assert GrowDrain(folder, timeout_s=0, launch_id="L1").drain("off") is None


def test_a_request_another_launch_left_open_is_not_this_ones(folder):
    folder.write("drain_request.json", {"id": "x", "reason": "old", "launch": "L0"})
    assert DrainRequests(folder, "L1")() is None
    assert DrainRequests(folder, "L0")() == "old"


def test_a_group_that_trained_to_the_end_answers_a_request_it_did_not_see(folder):
    requests = DrainRequests(folder, "L1", every_s=3600.0)
    assert requests() is None  # polled before the request: the next poll would be an hour later
    folder.write("drain_request.json", {"id": "late", "reason": "grow", "launch": "L1"})
    requests.finished(step=300)
    assert folder.read("drain_ack.json") == {"id": "late", "step": 300}


def test_an_object_store_is_asked_at_most_once_a_second(folder, monkeypatch):
    reads = []
    monkeypatch.setattr(folder, "read", lambda name: reads.append(name))
    requests = DrainRequests(folder, "L1", every_s=1.0)
    for _ in range(50):
        requests()
    assert len(reads) == 1


def test_the_controller_drains_a_running_group_only_before_growing_it(monkeypatch):
    """Ray also "resizes" a running group to its own size (a preempted node it still counts,
    clipped back by ClusterView): draining then would only stall the controller."""

    class Grow:
        timeout_s, calls = 30.0, []

        def drain(self, reason):
            self.calls.append(reason)
            return {"step": 5}

    grow = Grow()
    view = ClusterView(interval_s=1e9, min_workers=1, grow=grow)
    monkeypatch.setattr(view, "_refresh", lambda: None)
    fits = {"n": 1}
    monkeypatch.setattr(cluster_view, "workers_that_fit", lambda per_worker: fits["n"])
    state = {name: type(name, (), {})() for name in ("RunningState", "ResizingState")}

    def decide(n):
        decision = SimpleNamespace(num_workers=n, resources_per_worker={"CPU": 1.0})
        view.before_controller_execute_resize_decision(decision)
        return decision.num_workers

    assert decide(1) == 1 and grow.calls == []  # the first group: nothing runs yet
    view.after_controller_state_update(state["RunningState"], state["ResizingState"])
    assert decide(2) == 1 and grow.calls == []  # clipped to the running size: no drain
    fits["n"] = 2
    view.after_controller_state_update(state["RunningState"], state["ResizingState"])
    assert decide(2) == 2 and grow.calls == ["Ray is resizing the group to 2 workers"]
    assert decide(2) == 2 and len(grow.calls) == 1  # a restart at that size: not a grow


@pytest.mark.parametrize(
    "every, gpu, on",
    [(None, True, True), (None, False, False), (3, False, True), (3, True, True), (0, True, False)],
)
def test_snapshots_by_default_on_gpu_workers_only_and_always_when_asked(every, gpu, on):
    from cluster.config import snapshots_on  # noqa: PLC0415 -- next to its test

    cfg = SimpleNamespace(
        train=SimpleNamespace(snapshot_every=every), cluster=SimpleNamespace(use_gpu=gpu)
    )
    assert snapshots_on(cfg) is on


def test_a_process_started_after_a_trainer_was_built_still_starts_our_preemption_watcher(
    monkeypatch,
):
    """Building a trainer turns Ray's watcher off (for ours) in this process's environment; a
    CLI launched afterwards inherits that. It must still start ours; only a user's own
    RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0 means none (CI ran test_elastic's preemption drill
    without any watcher after test_config_schema had built a trainer)."""
    from cluster.elastic import preemption  # noqa: PLC0415 -- next to its test

    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)
    monkeypatch.delenv(preemption.REPLACED_ENV, raising=False)
    assert preemption.replace_rays_watcher() is not None
    child = "from cluster.elastic.preemption import replace_rays_watcher as r; print(r() is None)"
    run = subprocess.run(
        [sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert run.stdout.strip() == "False", run.stderr[-2000:]
    monkeypatch.delenv(preemption.REPLACED_ENV)  # the user's switch alone: no watcher
    assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert preemption.replace_rays_watcher() is None


def test_a_grow_waits_for_the_nodes_of_a_scale_up_and_grows_onto_all_of_them(monkeypatch):
    """Two nodes joined a second apart: Ray decides to grow onto the first; ClusterView waits
    (the group trains on) and starts the size both hold: one restart, not two."""
    view = ClusterView(interval_s=1e9, min_workers=1, max_workers=3, settle_s=5.0)
    fits = iter([2, 3])  # the settle's polls: the second node is up at the second
    monkeypatch.setattr(cluster_view, "workers_that_fit", lambda per_worker: next(fits))
    clock = Clock(0.0)
    slept = []

    def sleep(s):
        slept.append(s)
        clock.t += s

    decision = SimpleNamespace(num_workers=2, resources_per_worker={"CPU": 1.0})
    assert view._settle(decision, sleep=sleep, clock=lambda: clock.t) == 3
    assert slept and sum(slept) < 5.0, "it stops waiting once max_workers fit"

    # Nothing more joins: it waits settle_s and keeps Ray's decision.
    monkeypatch.setattr(cluster_view, "workers_that_fit", lambda per_worker: 2)
    slept.clear()
    assert view._settle(decision, sleep=sleep, clock=lambda: clock.t) == 2
    assert sum(slept) == pytest.approx(5.0)
    # Already at max_workers, or settling off: no wait at all.
    slept.clear()
    full = SimpleNamespace(num_workers=3, resources_per_worker={"CPU": 1.0})
    assert view._settle(full, sleep=sleep, clock=lambda: clock.t) == 3 and slept == []
    view.settle_s = 0.0
    assert view._settle(decision, sleep=sleep, clock=lambda: clock.t) == 2 and slept == []


def test_the_grow_the_controller_drains_for_is_the_settled_size(monkeypatch):
    class Grow:
        timeout_s, calls = 30.0, []

        def drain(self, reason):
            self.calls.append(reason)
            return {"step": 5}

    view = ClusterView(interval_s=1e9, min_workers=1, grow=Grow(), max_workers=3)
    view.settle_s = 5.0
    monkeypatch.setattr(view, "_refresh", lambda: None)
    monkeypatch.setattr(view, "_settle", lambda decision: 3)
    monkeypatch.setattr(cluster_view, "workers_that_fit", lambda per_worker: 2)
    state = {name: type(name, (), {})() for name in ("RunningState", "ResizingState")}
    first = SimpleNamespace(num_workers=1, resources_per_worker={"CPU": 1.0})
    view.before_controller_execute_resize_decision(first)
    view.after_controller_state_update(state["RunningState"], state["ResizingState"])
    grow = SimpleNamespace(num_workers=2, resources_per_worker={"CPU": 1.0})
    view.before_controller_execute_resize_decision(grow)
    assert grow.num_workers == 3
    assert view.grow.calls == ["Ray is resizing the group to 3 workers"]


def test_the_health_check_interval_is_ours_unless_the_user_set_it(monkeypatch):
    from cluster import launch as ray_launch

    monkeypatch.delenv(ray_launch.HEALTH_CHECK_ENV, raising=False)
    monkeypatch.delenv(ray_launch.HEALTH_CHECK_OURS, raising=False)
    assert ray_launch.set_health_check_interval(1.0) == "1"
    assert ray_launch.set_health_check_interval(0.5) == "0.5"  # ours: the next job's config
    # A child of this process inherits both: it applies its own config too.
    child = "from cluster.launch import set_health_check_interval as s; print(s(0.25))"
    run = subprocess.run(
        [sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert run.stdout.strip() == "0.25", run.stderr[-2000:]
    monkeypatch.setenv(ray_launch.HEALTH_CHECK_ENV, "3")  # the user's own setting wins,
    assert ray_launch.set_health_check_interval(1.0) == "3"  # even over an inherited marker
    monkeypatch.delenv(ray_launch.HEALTH_CHECK_OURS)
    assert ray_launch.set_health_check_interval(1.0) == "3"


def test_spares_are_started_on_the_joined_nodes_and_the_grow_waits_until_they_are_warm(tmp_path):
    """Before a grow onto joined nodes, each one's raylet is asked for as many spares as it will
    run workers, with the job and runtime env rank 0 recorded; the grow waits (bounded) until
    their markers say they preloaded, counting only markers left after the request."""
    from cluster.elastic import spares

    folder = RunFolder.at(str(tmp_path / "elastic"))
    folder.write(spares.SPARE_ENV, {"launch": "L", "job_id": "0a00", "runtime_env": "{}"})
    folder.write(f"{spares.MARKERS_DIR}/n2-1.json", {"node": "n2", "pid": 1, "warm": 1.0})  # old
    nodes = [
        {"NodeID": n, "NodeManagerAddress": "10.0.0.1", "NodeManagerPort": 7000 + i}
        for i, n in enumerate(["n1", "n2", "n3"])
    ]
    asked = []

    def start(raylet, job_id, runtime_env, count):
        asked.append((raylet, job_id, runtime_env, count))

    clock, polls = Clock(0.0), []

    def sleep(s):  # a spare of each node preloads at the second poll
        polls.append(s)
        clock.t += s
        if len(polls) == 2:
            for node in ("n2", "n3"):
                folder.write(
                    f"{spares.MARKERS_DIR}/{node}-9.json",
                    {"node": node, "pid": 9, "warm": time.time()},
                )

    line = spares.warm_joined_nodes(
        folder, "L", nodes, {"n2": 1, "n3": 1}, wait_s=20, clock=clock, sleep=sleep, start=start
    )
    assert asked == [("10.0.0.1:7001", "0a00", "{}", 1), ("10.0.0.1:7002", "0a00", "{}", 1)]
    assert len(polls) == 2 and line == "elastic: 2 spare(s) on the joined node(s) warm in 0.5 s"
    # Nothing warms: bounded, and it says so.
    line = spares.warm_joined_nodes(
        folder, "L", nodes, {"n2": 2}, wait_s=1.0, clock=clock, sleep=sleep, start=start
    )
    assert line.startswith("elastic: 0 of 2 spare(s) on the joined node(s) warm after 1.0 s")
    # Another launch's record: nothing asked.
    asked.clear()
    assert spares.warm_joined_nodes(folder, "M", nodes, {"n2": 1}, 1.0, start=start) is None
    assert asked == []


def test_the_controller_warms_only_the_nodes_that_joined_since_the_group_started(monkeypatch):
    seen = []
    view = ClusterView(
        interval_s=1e9, min_workers=1, max_workers=3, warm_joined=lambda n, p: seen.append(p)
    )
    monkeypatch.setattr(view, "_refresh", lambda: None)
    node = lambda i: {"NodeID": f"n{i}", "Alive": True, "Resources": {"CPU": 1.0}}  # noqa: E731
    present = [node(1)]
    monkeypatch.setattr(cluster_view, "usable_nodes", lambda: list(present))
    state = {name: type(name, (), {})() for name in ("RunningState", "ResizingState")}
    view.before_controller_execute_resize_decision(
        SimpleNamespace(num_workers=1, resources_per_worker={"CPU": 1.0})
    )
    present += [node(2), node(3)]
    view.after_controller_state_update(state["RunningState"], state["ResizingState"])
    view.before_controller_execute_resize_decision(
        SimpleNamespace(num_workers=3, resources_per_worker={"CPU": 1.0})
    )
    assert seen == [{"n2": 1, "n3": 1}]


def test_a_relaunch_releases_the_resources_a_killed_launch_had_reserved(tmp_path, monkeypatch):
    """A killed driver's Ray Train request stays in Ray's AutoscalingCoordinator for 180 s,
    reserving its workers' resources: the next launch of the run cancels it as its controller
    starts (it holds the run lease: the earlier launch is gone), then records its own; its own
    request, or another's record of this launch, is never cancelled."""
    cancelled, reserved = [], {"train-run1b": {"node-1": {"CPU": 1.0}}}

    class Coordinator:
        class cancel_request:  # noqa: N801 -- mimics an actor method handle
            @staticmethod
            def remote(requester_id):
                cancelled.append(requester_id)
                return requester_id

        class get_reserved_resources:  # noqa: N801
            @staticmethod
            def remote(requester_id):
                return reserved.get(requester_id, {})

    monkeypatch.setattr(cluster_view.ray, "get_actor", lambda name, namespace: Coordinator)
    monkeypatch.setattr(cluster_view.ray, "get", lambda ref, timeout=None: ref)
    folder = RunFolder.at(str(tmp_path / "elastic"))
    lines = []
    log = lambda line, **kw: lines.append(line)  # noqa: E731
    assert cluster_view.release_dead_launch_request(folder, "A", "run1", log) is None  # first
    assert folder.read(cluster_view.REQUEST_RECORD) == {"launch": "A", "requester": "train-run1"}
    # A restart of launch A's controller (same launch): nothing cancelled.
    assert cluster_view.release_dead_launch_request(folder, "A", "run1b", log) is None
    # Launch B after A was killed: A's request goes.
    assert cluster_view.release_dead_launch_request(folder, "B", "run2", log) == "train-run1b"
    assert cancelled == ["train-run1b"] and "previous launch A" in lines[-1]
    assert folder.read(cluster_view.REQUEST_RECORD)["requester"] == "train-run2"
    # B ended (its own end cancelled its request) or ran on another Ray: nothing to release,
    # nothing claimed.
    said = len(lines)
    assert cluster_view.release_dead_launch_request(folder, "C", "run3", log) is None
    assert cancelled[-1] == "train-run2" and len(lines) == said
    # Ray unreachable: logged, never raised.
    monkeypatch.setattr(cluster_view.ray, "get_actor", lambda *a, **k: 1 / 0)
    assert cluster_view.release_dead_launch_request(folder, "D", "run4", log) is None
    assert "expires within 180 s" in lines[-1]
