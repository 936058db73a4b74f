"""A run owns its name: of launches that start together exactly one takes the lease, on a local
folder and on S3 (moto on loopback); a live holder refuses the rest, naming itself; a released or
expired lease passes on; a takeover is noticed by the holder it displaced."""

import json
import multiprocessing as mp
import os
import signal
import time
import types

import pytest

from cluster.run.lease import LeaseHeld, LeaseLost, RunLease
from cluster.train import died_before
from tests.cluster.test_preflight import assert_stopped_at_driver, corpus, run_preflight  # noqa: F401
from tests.s3_server import s3_server, s3_uri

LOCAL_RAY_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "60"}
"""start_cli's fast Ray Train settings suit a running cluster; a local Ray starting beside a busy
test run gets Ray's usual minute to start its workers."""


def _contend(run_dir: str, start, results, done, i: int) -> None:
    start.wait()
    try:
        lease = RunLease.acquire(run_dir, launch_id=f"launch-{i}")
        results.put((i, "won", lease.holder.launch_id))
    except LeaseHeld as e:
        results.put((i, "refused", str(e)))
    done.wait(60)  # alive until every launch has tried: a dead winner is rightly taken over


def _race(run_dir: str, n: int) -> list:
    """n processes, released together, each trying to take the lease of one run folder."""
    ctx = mp.get_context("fork")
    start, results, done = ctx.Event(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_contend, args=(run_dir, start, results, done, i)) for i in range(n)
    ]
    for p in procs:
        p.start()
    start.set()
    out = sorted(results.get(timeout=60) for _ in procs)
    done.set()
    for p in procs:
        p.join(timeout=30)
    return out


def _check_one_winner(out: list) -> None:
    won = [o for o in out if o[1] == "won"]
    assert len(won) == 1, out
    winner = won[0][2]
    for _, status, message in out:
        if status == "refused":  # the loser names the winner (or, racing, that someone won)
            assert "cluster.run_name" in message or "claimed at the same moment" in message
            assert winner in message or "another launch" in message, message


def test_of_launches_started_together_exactly_one_takes_a_local_run(tmp_path):
    for trial in range(3):
        _check_one_winner(_race(str(tmp_path / f"run{trial}"), 4))


def test_of_launches_started_together_exactly_one_takes_an_s3_run():
    with s3_server("bucket") as endpoint:
        for trial in range(2):
            _check_one_winner(_race(s3_uri(endpoint, "bucket", f"runs/r{trial}"), 3))


def _rewrite(lease: RunLease, **fields) -> None:
    """Edit the holder's file as a crashed (or slow) holder would have left it."""
    path = lease.folder.child(f"gen-{lease.gen:06d}.json").path
    doc = json.loads(open(path).read())
    doc.update(fields)
    open(path, "w").write(json.dumps(doc))


def test_a_live_holder_refuses_a_second_launch_naming_itself(tmp_path):
    run = str(tmp_path / "run")
    first = RunLease.acquire(run, launch_id="first")
    with pytest.raises(LeaseHeld) as e:
        RunLease.acquire(run, launch_id="second")
    msg = str(e.value)
    assert "held by launch first" in msg and f"pid {first.holder.pid}" in msg
    assert "cluster.takeover=true" in msg and "expires in" in msg


def test_a_released_lease_passes_on_and_an_expired_one_is_taken_over(tmp_path):
    run = str(tmp_path / "run")
    first = RunLease.acquire(run, launch_id="first")
    first.release()
    second = RunLease.acquire(run, launch_id="second")  # the run ended: a new launch resumes it
    assert second.previous.launch_id == "first" and second.previous.released
    _rewrite(second, heartbeat_unix=time.time() - 3600)  # its driver died an hour ago
    third = RunLease.acquire(run, launch_id="third")
    assert third.previous.launch_id == "second" and not third.previous.released
    # Only the newest generation is kept.
    assert [p.name for p in (tmp_path / "run" / "lease").iterdir()] == ["gen-000003.json"]


def test_a_takeover_is_noticed_by_the_displaced_holder(tmp_path):
    run = str(tmp_path / "run")
    first = RunLease.acquire(run, launch_id="first")
    first.renew(mlflow_run_id="abc")  # a heartbeat, carrying the MLflow run
    second = RunLease.acquire(run, launch_id="second", takeover=True)
    assert second.previous.mlflow_run_id == "abc"
    with pytest.raises(LeaseLost, match="taken over by launch second"):
        first.renew()
    first.release()  # says nothing to storage: the lease is not its own any more
    with pytest.raises(LeaseHeld, match="held by launch second"):
        RunLease.acquire(run, launch_id="third")


def _hold_then_die(run_dir: str, held, release_now, die: bool) -> None:
    lease = RunLease.acquire(run_dir, launch_id="holder")
    held.set()
    if die:
        os.kill(os.getpid(), signal.SIGKILL)  # a driver SIGKILLed: no release, a fresh heartbeat
    release_now.wait(60)
    lease.release()


def _holder(run_dir: str, die: bool):
    ctx = mp.get_context("fork")
    held, release_now = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_then_die, args=(run_dir, held, release_now, die))
    proc.start()
    assert held.wait(30)
    return proc, release_now


def test_a_holder_whose_process_is_gone_on_this_host_is_taken_over_at_once(tmp_path):
    run = str(tmp_path / "run")
    proc, _ = _holder(run, die=True)
    proc.join(30)
    said = []
    started = time.monotonic()
    second = RunLease.acquire(run, launch_id="relaunch", log_to=said.append)
    assert time.monotonic() - started < 5  # not the ttl (120 s)
    assert second.previous.launch_id == "holder" and not second.previous.released
    assert not second.previous.expired(time.time())  # its heartbeat was recent
    assert said and f"its process {proc.pid} on this host is gone" in said[0], said
    # Its snapshot keepers outlived it: the relaunch reads them, then stops them (train.py).
    assert died_before(second) == "holder"


def test_only_a_launch_that_never_released_its_lease_leaves_keepers_behind(tmp_path):
    run = str(tmp_path / "run")
    first = RunLease.acquire(run, launch_id="first")
    assert died_before(first) is None, "no launch before it"
    first.release()
    second = RunLease.acquire(run, launch_id="second")
    assert died_before(second) is None, "a launch that ended stopped its own keepers"
    _rewrite(second, heartbeat_unix=time.time() - 3600)  # its driver died an hour ago
    assert died_before(RunLease.acquire(run, launch_id="third")) == "second"


def test_a_pid_that_names_another_process_now_is_not_the_holder(tmp_path):
    run = str(tmp_path / "run")
    first = RunLease.acquire(run, launch_id="first")
    _rewrite(first, pid_start=(first.holder.pid_start or 0) + 1)  # this pid, another start time
    said = []
    RunLease.acquire(run, launch_id="second", log_to=said.append)
    assert "names another process now" in said[0], said


def test_a_relaunch_may_wait_for_a_live_holder_to_end(tmp_path):
    run = str(tmp_path / "run")
    proc, release_now = _holder(run, die=False)
    said = []

    def log_to(line):  # the holder ends once the relaunch is seen waiting for it
        said.append(line)
        release_now.set()

    try:
        second = RunLease.acquire(run, launch_id="relaunch", wait_s=60, log_to=log_to)
    finally:
        release_now.set()
        proc.join(30)
    assert "waiting up to 60 s" in said[0] and second.previous.released
    # Without a wait, a live holder still refuses.
    with pytest.raises(LeaseHeld, match="held by launch relaunch"):
        RunLease.acquire(run, launch_id="third")


# ---- the driver --------------------------------------------------------------------------------


def test_a_second_launch_of_a_live_run_is_refused_before_ray_starts(launch_dir, corpus):  # noqa: F811
    holder = RunLease.acquire(str(launch_dir / "runs" / "elastic-fsdp"), launch_id="the-first")
    result = run_preflight(launch_dir, corpus)
    line = assert_stopped_at_driver(
        result, launch_dir, "cluster.run_name is in use", "held by launch the-first"
    )
    assert "cluster.takeover=true" in line
    holder.renew()  # still its own: the refused launch took nothing
    assert [p.name for p in (launch_dir / "runs" / "elastic-fsdp" / "lease").iterdir()] == [
        "gen-000001.json"
    ]


def test_a_launch_after_a_dead_one_ends_its_running_mlflow_run_as_killed(tmp_path):
    from mlflow.tracking import MlflowClient

    from cluster.train import adopt_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    dead_run = client.create_run(exp).info.run_id  # RUNNING, as its crashed driver left it
    run = str(tmp_path / "runs" / "r")
    dead = RunLease.acquire(run, launch_id="dead")
    dead.renew(mlflow_run_id=dead_run)
    _rewrite(dead, heartbeat_unix=time.time() - 3600)
    new = RunLease.acquire(run, launch_id="new")
    cfg = types.SimpleNamespace(tracking=types.SimpleNamespace(tracking_uri=uri))
    new_run = client.create_run(exp).info.run_id
    adopt_run(cfg, new, new_run)
    assert client.get_run(dead_run).info.status == "KILLED"
    assert client.get_run(dead_run).data.tags["ended_by_launch"] == "new"
    assert client.get_run(new_run).info.status == "RUNNING"  # its own run is left alone
    assert (
        json.loads((tmp_path / "runs" / "r" / "lease" / "gen-000002.json").read_text())[
            "mlflow_run_id"
        ]
        == new_run
    )


def test_a_run_taken_over_while_it_trains_stops_writing_and_says_by_whom(launch_dir):
    """The real CLI (local Ray, 2 workers) trains; the test takes its lease over (as a second
    launch with cluster.takeover=true would): the running launch stops at its next save without
    committing, is not retried, exits 1 naming the new holder, and leaves the lease alone."""
    from tests.cluster.elastic_cluster import attempts, start_cli, wait_until
    from trainer.checkpoint import list_checkpoints

    run_dir = launch_dir / "runs" / "taken"
    run = start_cli(
        launch_dir,
        None,  # a local Ray of its own
        "train.steps=2000",
        "train.checkpoint_every=2",
        "train.global_batch_size=4",
        "data.max_bytes=200000",
        "data.seq_len=32",
        "cluster.num_workers=2",
        "cluster.max_failures=2",
        "cluster.run_name=taken",
        "tracking.experiment=taken",
        env=LOCAL_RAY_ENV,
    )
    try:
        wait_until(
            lambda: (a := attempts(run_dir)) and (a[-1].get("last_step") or 0) >= 6,
            180,
            "the run to train 6 steps",
            run,
        )
        before = {c.step for c in list_checkpoints(str(run_dir / "checkpoints"))}
        thief = RunLease.acquire(str(run_dir), launch_id="thief", takeover=True)
        rc = run.wait(120)
    finally:
        run.kill()
    out = run.output()
    assert rc == 1, out[-6000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors and "RunTakenOver" in errors[-1] and "launch thief" in errors[-1], out[-6000:]
    assert len(attempts(run_dir)) == 1  # not retried
    after = {c.step for c in list_checkpoints(str(run_dir / "checkpoints"))}
    assert len(after - before) <= 1, (before, after)  # at most the save already past its check
    thief.renew()  # the displaced launch's exit released nothing of the thief's


def test_two_launches_of_one_name_started_together_one_trains_the_other_is_refused(launch_dir):
    """Two real CLIs at once, one run name: one exits 2 before Ray (naming the other), the other
    trains to the end with its checkpoints and its MLflow history whole."""
    from mlflow.tracking import MlflowClient

    from tests.cluster.elastic_cluster import start_cli
    from trainer.checkpoint import list_checkpoints

    overrides = [
        "train.steps=6",
        "train.checkpoint_every=2",
        "train.global_batch_size=4",
        "data.max_bytes=200000",
        "data.seq_len=32",
        "cluster.num_workers=2",
        "cluster.run_name=twice",
        "tracking.experiment=twice",
    ]
    runs = [
        start_cli(launch_dir, None, *overrides, env=LOCAL_RAY_ENV, name=f"cli{i}") for i in range(2)
    ]
    try:
        rcs = [run.wait(240) for run in runs]
    finally:
        for run in runs:
            run.kill()
    outs = [run.output() for run in runs]
    assert sorted(rcs) == [0, 2], outs
    loser = outs[rcs.index(2)]
    assert "cluster.run_name is in use" in loser or "claimed at the same moment" in loser, loser
    assert "started a local Ray for this job" not in loser
    checkpoints = list_checkpoints(str(launch_dir / "runs" / "twice" / "checkpoints"))
    assert sorted(c.step for c in checkpoints) == [2, 4, 6]
    assert all(c.problem is None for c in checkpoints)
    client = MlflowClient(f"sqlite:///{launch_dir}/mlflow.db")
    (tracked,) = client.search_runs([client.get_experiment_by_name("twice").experiment_id])
    assert tracked.info.status == "FINISHED"
    losses = client.get_metric_history(tracked.info.run_id, "train/loss")
    assert [m.step for m in losses] == list(range(1, 7))
