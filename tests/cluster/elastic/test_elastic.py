"""Elastic training end to end: the real CLI on a multi-node Ray cluster on this machine.

A head node and worker nodes of one logical CPU each (ray.cluster_utils.Cluster), one CPU per
worker; durable checkpoints every CHECKPOINT_EVERY steps (rarely) and an in-memory snapshot every
SNAPSHOT_EVERY, kept by a keeper actor on each node (each file on its writer's node and the
next). Every event falls at a random step (DRILL_SEED, printed, replays them). Two runs, each
compared step by step with the same config trained without Ray and without interruption, at the
same world sizes (tests/cluster/elastic/elastic_reference.py says why):

1. Fixed at 2 workers, with spare worker processes (cluster/elastic/spares.py). Rank 1 crashes
   (fault config): Ray restarts the group in the spares, and it resumes from the newest complete
   snapshot, losing at most the steps since it. Then rank 0 gets a
   SIGTERM: the group checkpoints the step it is at (durably) and leaves, and Ray restarts it
   from there. A second SIGTERM is the third failure with cluster.max_failures=2, so the run
   stops. Submitted again, it resumes from its last checkpoint and finishes.
2. Elastic, 1..3 workers on head, second and third. third is removed (its worker and keeper
   die with it): the run goes on at world size 2 from the newest snapshot. Ray is told second
   will be preempted: the group checkpoints the step it is at, and goes on at world size 1
   having lost no step; second lingers, drained, as a cloud's node does until its deadline.
   Two nodes are added: the group checkpoints the step it is at (drain on grow) and Ray grows
   it to 3, having lost no step. Both are removed at once: a snapshot shard loses both its
   copies, and the run falls back to the durable checkpoint at world size 1, and says so.

Every step's loss (MLflow keeps each step's first training; the retrained ones are in the run's
elastic records) equals the uninterrupted run's within 1e-5 relative; no step is missing.
Ray's clocks are shortened by env vars (elastic_cluster.FAST_RAY_TRAIN_ENV); the timeouts here
are generous because this 2-core machine is shared. The recovery times measured are printed.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from cluster.compose import register_schemas, to_job_config
from tests.cluster.elastic.elastic_reference import reference_losses
from tests.cluster.elastic_cluster import LocalCluster, attempts, start_cli, wait_until
from trainer.checkpoint import list_checkpoints
from trainer.data import prepare

REPO = Path(__file__).resolve().parents[3]
SMALL = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.ffn_dim=160",
    "data.seq_len=32",
    "data.max_bytes=300000",
    "train.global_batch_size=6",
    "optim.warmup_steps=2",
]
CRASH_STEPS = 170
ELASTIC_STEPS = 1000  # the preemption must reach a group with steps left: they take ~15 ms here
CHECKPOINT_EVERY = 50  # durable checkpoints: rarely (the drains' own are durable too)
SNAPSHOT_EVERY = 1
DRILL_SEED = int(os.environ.get("ELASTIC_DRILL_SEED") or random.SystemRandom().randrange(2**31))
"""The drills' events fall at random steps; ELASTIC_DRILL_SEED=<the seed printed> replays them."""
EVENTS = [("lose", 5, 40), ("preempt", 2, 10), ("add", 2, 10), ("lose_two", 4, 20)]
"""The node drill's events, each after a random number of steps (in [lo, hi]) of its group."""
RUN_TIMEOUT = 420.0
REL = 1e-5
NODES_SPARES = os.environ.get("ELASTIC_NODES_SPARES", "false")
"""The nodes drill runs in new processes (the CPU default); ELASTIC_NODES_SPARES=true measures
the same events with spare worker processes (the GPU default) for docs/elastic.md's table."""


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    """The token shards every run here reads (prepared once; the CLI finds them ready)."""
    cfg = job_config([], str(tmp_path_factory.mktemp("data") / "prepared"))
    prepare(cfg.data)
    return cfg.data.prepared_dir


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(head_cpus=1)
    c.second = c.add_node(1)
    yield c
    c.close()


def drill_rng(drill: str) -> random.Random:
    print(f"{drill} drill: ELASTIC_DRILL_SEED={DRILL_SEED}")
    return random.Random(f"{drill}-{DRILL_SEED}")


def job_config(overrides, prepared: str):
    """The JobConfig the CLI composes from the same overrides (Hydra, conf/)."""
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        dictcfg = compose("config", overrides=cli_overrides(prepared, *overrides))
    return to_job_config(dictcfg).validate()


def cli_overrides(prepared: str, *extra: str) -> list[str]:
    return [*SMALL, f"data.prepared_dir={prepared}", *extra]


def reference_for(steps: int, prepared: str, schedule, tmp: Path) -> dict[int, float]:
    """{step: loss} of the run's config trained at `schedule`'s world sizes without Ray."""
    return reference_losses(
        job_config([f"train.steps={steps}"], prepared), schedule, str(tmp / "ckpt")
    )


def reference_with_lost_branches(trained: list[dict], prepared: str, tmp_path_factory):
    """{step: loss} as MLflow holds them: each step's first training. The run's path trains each
    group up to where the next resumed (one whose steps were all lost left nothing); a group
    whose last steps were lost trained those first, on its own path: a branch, trained
    separately, gives them."""
    pairs = list(zip(trained, trained[1:]))

    def path(upto: int) -> list[tuple[int, int]]:
        return [
            (a["world_size"], b["start_step"])
            for a, b in pairs[:upto]
            if b["start_step"] > a["start_step"]
        ]

    cfg = job_config([f"train.steps={ELASTIC_STEPS}"], prepared)
    reference = reference_losses(
        cfg,
        path(len(pairs)) + [(trained[-1]["world_size"], None)],
        str(tmp_path_factory.mktemp("ref-elastic") / "ckpt"),
    )
    first = dict(reference)
    for i, (a, b) in reversed(list(enumerate(pairs))):  # an earlier group trained a step first
        if b["start_step"] <= a["last_step"]:
            branch = reference_losses(
                cfg,
                path(i) + [(a["world_size"], a["last_step"] + 1)],
                str(tmp_path_factory.mktemp("ref-branch") / "ckpt"),
                complete=False,
            )
            first.update((s, branch[s]) for s in range(b["start_step"], a["last_step"] + 1))
    return dict(path=reference, first=first)


def mlflow_runs(launch_dir: Path, experiment: str) -> list:
    client = MlflowClient(f"sqlite:///{launch_dir}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    return sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)


def history(launch_dir: Path, run, key: str) -> list[tuple[int, float]]:
    """(step index, value): MLflow's step N is N steps done, the elastic records and the reference
    count the index of the step trained (N - 1)."""
    client = MlflowClient(f"sqlite:///{launch_dir}/mlflow.db")
    return sorted((m.step - 1, m.value) for m in client.get_metric_history(run.info.run_id, key))


def assert_matches_reference(losses: dict[int, float], reference: dict[int, float], what: str):
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[int(step)], rel=REL), f"{what}: step {step}"


def recovery_summary(records: list[dict]) -> list[str]:
    out = []
    for r in records:
        rec = r.get("recovery")
        if rec and rec.get("recovery_s") is not None:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in rec["breakdown"].items())
            ray = ", ".join(f"{k} {v:.1f}" for k, v in (rec.get("ray_phases") or {}).items())
            out.append(
                f"world {r['world_size']} from step {r['start_step']}: "
                f"{rec['recovery_s']:.1f} s ({parts}), {rec['steps_lost']} steps lost"
                + (f"; ray restart: {ray}" if ray else "")
            )
    return out


# ---- 1. a crash, a drain, a resubmission ------------------------------------------------------


@pytest.fixture(scope="module")
def crash_then_drain(cluster, prepared, tmp_path_factory):
    rng = drill_rng("crash")
    # Late enough (~12 s here) that the spares asked for at step 1 have started, and newer than
    # the durable checkpoint of step 100, so that the group resumes from a snapshot.
    crash_at = rng.randint(105, 145)
    drain_after = [rng.randint(2, 6) for _ in range(2)]
    launch = tmp_path_factory.mktemp("crash")
    run_dir = launch / "runs" / "crash"
    args = cli_overrides(
        prepared,
        f"train.steps={CRASH_STEPS}",
        "cluster.num_workers=2",
        "cluster.run_name=crash",
        "tracking.experiment=crash",
        "cluster.max_failures=2",
        "fault.kill_rank=1",
        f"fault.at_step={crash_at}",
        "fault.kind=crash",
        f"train.checkpoint_every={CHECKPOINT_EVERY}",  # durable: rarely
        f"train.snapshot_every={SNAPSHOT_EVERY}",  # in the keepers' memory, on both nodes
        "cluster.spare_workers=true",  # off by default on CPU workers
    )
    first = start_cli(launch, cluster.address, *args)
    for group, after in zip((2, 3), drain_after):  # drain the group after the crash, then the next
        running = wait_until(
            lambda: (
                (a := attempts(run_dir))
                and len(a) >= group
                and a[-1]["start_step"] is not None
                and a[-1]["last_step"] >= a[-1]["start_step"] + after
                and a[-1]
            ),
            RUN_TIMEOUT,
            f"group {group} to train {after + 1} steps",
            first,
        )
        os.kill(running["pid"], signal.SIGTERM)  # its rank 0: a graceful drain
    first_rc = first.wait(RUN_TIMEOUT)
    first_out = first.output()
    records_before = attempts(run_dir)
    checkpoints_before = [
        c.step for c in list_checkpoints(str(run_dir / "checkpoints")) if not c.problem
    ]
    again = start_cli(launch, cluster.address, *args)  # the same command: the same run
    again_rc = again.wait(RUN_TIMEOUT)
    reference = reference_for(
        CRASH_STEPS, prepared, [(2, None)], tmp_path_factory.mktemp("ref-crash")
    )
    records = attempts(run_dir)
    print("\n".join(["crash/drain recoveries:", *recovery_summary(records)]))
    return dict(
        launch=launch,
        run_dir=run_dir,
        crash_at=crash_at,
        first_rc=first_rc,
        first_out=first_out,
        again_rc=again_rc,
        again_out=again.output(),
        records_before=records_before,
        records=records,
        checkpoints_before=checkpoints_before,
        reference=reference,
    )


def test_crashed_worker_is_replaced_and_its_group_resumes_from_the_newest_snapshot(
    crash_then_drain,
):
    r = crash_then_drain
    crash_at = r["crash_at"]
    crashed, restarted, _ = r["records_before"]
    marker = (r["run_dir"] / "elastic" / "fault.json").read_text()
    assert '"kind": "crash"' in marker and '"rank": 1' in marker
    assert f'"step": {crash_at}' in marker
    assert f"fault injection: crash of rank 1 before step {crash_at}" in r["first_out"]
    assert crashed["last_step"] == crash_at - 1
    assert restarted["world_size"] == 2
    lost = restarted["recovery"]["steps_lost"]
    assert restarted["start_step"] == crash_at - lost
    assert lost <= SNAPSHOT_EVERY + 1, (
        "a crash costs at most the steps since the newest snapshot (one may be in flight)"
    )
    assert restarted["recovery"]["recovery_s"] > 0
    assert restarted["recovery"]["spare"], "rank 0 restarted in the spare its node started"
    step = restarted["start_step"]
    assert re.search(rf"resumed from keeper://\S+/step_{step:09d} at step {step}\b", r["first_out"])


def test_drained_group_checkpoints_the_step_it_is_at_and_loses_nothing(crash_then_drain):
    r = crash_then_drain
    _, drained, drained_again = r["records_before"]
    for group in (drained, drained_again):
        left = group["left_at"]["step"]
        assert group["last_step"] == left - 1, "every trained step is in the drain's checkpoint"
        assert left in r["checkpoints_before"], "a drain's checkpoint is durable"
    assert drained_again["start_step"] == drained["left_at"]["step"]
    assert drained_again["recovery"]["steps_lost"] == 0
    assert drained_again["recovery"]["recovery_s"] > 0
    assert "SIGTERM: checkpointing the current step before leaving" in r["first_out"]
    assert r["first_rc"] != 0, "the second drain was the third failure with cluster.max_failures=2"
    first_run = mlflow_runs(r["launch"], "crash")[0]
    assert history(r["launch"], first_run, "elastic/steps_lost") == [
        (drained["start_step"], float(drained["recovery"]["steps_lost"])),
        (drained["left_at"]["step"], 0.0),
    ]


def test_run_submitted_again_after_it_stopped_resumes_from_its_last_checkpoint(crash_then_drain):
    r = crash_then_drain
    left = r["records_before"][-1]["left_at"]["step"]
    assert r["again_rc"] == 0, r["again_out"][-6000:]
    resumed = f"resumed from {r['run_dir']}/checkpoints/step_{left:09d} at step {left}"
    assert resumed in r["again_out"]
    assert "fault injection" not in r["again_out"], "a fault fires once per run"
    assert len(r["records"]) == 4 and r["records"][-1]["last_step"] == CRASH_STEPS - 1
    first_run, second_run = mlflow_runs(r["launch"], "crash")
    assert (first_run.info.status, second_run.info.status) == ("FAILED", "FINISHED")
    assert history(r["launch"], second_run, "elastic/steps_lost") == [(left, 0.0)]
    assert history(r["launch"], second_run, "elastic/recovery_s") == []


def test_crash_and_drain_losses_equal_an_uninterrupted_run_with_no_step_skipped(crash_then_drain):
    r = crash_then_drain
    runs = mlflow_runs(r["launch"], "crash")
    per_run = [dict(history(r["launch"], run, "train/loss")) for run in runs]
    steps = sorted(s for losses in per_run for s in losses)
    assert steps == list(range(CRASH_STEPS)), "each step logged exactly once across both launches"
    for losses in per_run:
        assert_matches_reference(losses, r["reference"], "first training")
    restarted = r["records"][1]
    retrained = restarted.get("retrained_losses", {})
    assert sorted(map(int, retrained)) == list(range(restarted["start_step"], r["crash_at"]))
    assert_matches_reference(retrained, r["reference"], "trained again after the crash")
    for step, loss in retrained.items():
        assert loss == pytest.approx(per_run[0][int(step)], rel=REL)
    assert len(history(r["launch"], runs[0], "elastic/recovery_s")) == 2
    assert r["reference"][CRASH_STEPS - 1] < r["reference"][0]


# ---- 2. the driver SIGKILLed, relaunched at once at another world size ------------------------

DRIVER_STEPS = 100


@pytest.fixture(scope="module")
def driver_killed(prepared, tmp_path_factory):
    """A RayJob's submitter dies (the head pod restarts): `python -m cluster.train` SIGKILLed
    mid-run at 2 workers, relaunched at once as an elastic run of up to 3 on a 3-node cluster of
    its own. The killed launch's resource request stays reserved in Ray's AutoscalingCoordinator
    for 180 s unless the relaunch releases it (elastic/cluster_view.py): without that, the
    relaunch started 1 worker of 3 (seen in CI)."""
    cluster = LocalCluster(head_cpus=1)
    try:
        cluster.add_nodes(2)
        yield from _driver_killed(cluster, prepared, tmp_path_factory)
    finally:
        cluster.close()


def _driver_killed(cluster, prepared, tmp_path_factory):
    kill_after = drill_rng("driver").randint(25, 55)
    launch = tmp_path_factory.mktemp("driver")
    run_dir = launch / "runs" / "driver"
    args = cli_overrides(
        prepared,
        f"train.steps={DRIVER_STEPS}",
        "cluster.run_name=driver",
        "tracking.experiment=driver",
        "train.checkpoint_every=20",
        f"train.snapshot_every={SNAPSHOT_EVERY}",
    )
    first = start_cli(launch, cluster.address, *args, "cluster.num_workers=2", name="first")
    wait_until(
        lambda: (a := attempts(run_dir)) and (a[-1]["last_step"] or -1) >= kill_after,
        RUN_TIMEOUT,
        f"{kill_after} steps at world size 2",
        first,
    )
    os.kill(first.proc.pid, signal.SIGKILL)  # the driver only: no release, no cleanup
    first.proc.wait()
    killed_at = time.time()
    trained_before = attempts(run_dir)[-1]["last_step"]
    elastic = ("cluster.min_workers=1", "cluster.max_workers=3")
    again = start_cli(launch, cluster.address, *args, *elastic, name="again")
    resumed = wait_until(
        lambda: (
            (a := attempts(run_dir))
            and a[-1]["launch"] != a[0]["launch"]
            and a[-1]["start_step"] is not None
            and a[-1]
        ),
        RUN_TIMEOUT,
        "the relaunch's first step",
        again,
    )
    first_step_s = time.time() - killed_at
    rc = again.wait(RUN_TIMEOUT)
    start = resumed["start_step"]
    reference = reference_for(
        DRIVER_STEPS,
        prepared,
        [(2, start), (resumed["world_size"], None)],
        tmp_path_factory.mktemp("ref-driver"),
    )
    print(
        f"driver killed after step {trained_before}: relaunch resumed at step {start}, "
        f"first step {first_step_s:.1f} s after the kill"
    )
    yield dict(
        launch=launch,
        world=resumed["world_size"],
        rc=rc,
        out=again.output(),
        start=start,
        trained_before=trained_before,
        first_step_s=first_step_s,
        reference=reference,
    )


def test_a_killed_driver_s_relaunch_takes_the_run_at_once_and_resumes_at_another_size(
    driver_killed,
):
    r = driver_killed
    assert r["rc"] == 0, r["out"][-6000:]
    assert re.search(r"run lease: taking over from .*: .*(gone|finished|dead)", r["out"]), (
        "the dead driver's lease is taken over at once, and the relaunch says so"
    )
    assert "is held by" not in r["out"]
    assert r["world"] == 3, "the relaunch has the whole cluster: the dead launch's reservation went"
    assert "elastic: released the resources the previous launch" in r["out"]
    # The dead launch's keepers (detached actors) outlived its driver with its newest snapshot,
    # and its workers, ended by Ray with their job, may have drained (a durable checkpoint of the
    # step they were at): the relaunch resumes from the newer of the two (a step or two lost, not
    # up to checkpoint_every), then stops those keepers once its own first snapshot is committed.
    assert "ended without stopping its keepers; the resume also reads their snapshots" in r["out"]
    resumed = re.search(rf"resumed from (\S+)/step_{r['start']:09d} at step", r["out"])
    assert resumed, r["out"][-4000:]
    assert resumed[1].startswith("keeper://") or resumed[1].endswith("/checkpoints"), resumed[1]
    assert r["trained_before"] - 5 <= r["start"] <= r["trained_before"] + 1, (
        r["trained_before"],
        r["start"],
    )
    stopped = r"snapshots: stopped the [1-9]\d* keeper\(s\) of the previous launch"
    assert re.search(stopped, r["out"]), "the inherited snapshots' memory is freed"
    assert r["first_step_s"] < 90, "the relaunch trains within one Ray job start"


def test_a_killed_driver_s_run_has_the_loss_curve_of_an_uninterrupted_one(driver_killed):
    r = driver_killed
    first_run, second_run = mlflow_runs(r["launch"], "driver")
    assert first_run.info.status == "KILLED", "the relaunch ended the dead launch's MLflow run"
    before = dict(history(r["launch"], first_run, "train/loss"))
    after = dict(history(r["launch"], second_run, "train/loss"))
    assert sorted(after) == list(range(r["start"], DRIVER_STEPS))
    assert_matches_reference(before, r["reference"], "before the kill (at world size 2)")
    assert_matches_reference(after, r["reference"], "after the relaunch (at world size 3)")
    assert r["reference"][DRIVER_STEPS - 1] < r["reference"][0]


# ---- 2. nodes lost, preempted, added ------------------------------------------------------------


@pytest.fixture(scope="module")
def nodes_come_and_go(cluster, prepared, tmp_path_factory):
    """head + second + third: third lost, second preempted, two nodes added, both lost at once."""
    rng = drill_rng("nodes")
    after = {event: rng.randint(lo, hi) for event, lo, hi in EVENTS}
    third = cluster.add_node(1)
    launch = tmp_path_factory.mktemp("elastic")
    run_dir = launch / "runs" / "elastic"
    args = cli_overrides(
        prepared,
        f"train.steps={ELASTIC_STEPS}",
        "cluster.min_workers=1",
        "cluster.max_workers=3",
        "cluster.elastic_resize_monitor_interval_s=1",
        "cluster.run_name=elastic",
        "tracking.experiment=elastic",
        f"train.checkpoint_every={CHECKPOINT_EVERY}",  # durable: rarely
        f"train.snapshot_every={SNAPSHOT_EVERY}",  # in the keepers' memory, on every node
        f"cluster.spare_workers={NODES_SPARES}",
    )
    run = start_cli(launch, cluster.address, *args)

    def trained(world: int, steps: int, what: str, since: float = 0.0) -> list[dict]:
        """Wait until the group at `world` workers started after `since` trained `steps`."""
        return wait_until(
            lambda: (
                (a := attempts(run_dir))
                and a[-1]["world_size"] == world
                and a[-1]["started"] > since
                and a[-1]["start_step"] is not None
                and (a[-1]["last_step"] or -1) >= a[-1]["start_step"] + steps - 1
                and a
            ),
            RUN_TIMEOUT,
            what,
            run,
        )

    trained(3, after["lose"], f"{after['lose']} steps at world size 3")
    cluster.remove_node(third)  # its worker and keeper die with it
    trained(2, after["preempt"], f"{after['preempt']} steps at world size 2")
    cluster.occupy(cluster.second)  # lives on after the drain, as a cloud's node until its end
    cluster.preempt_node(cluster.second)
    at_one = trained(1, after["add"], f"{after['add']} steps at world size 1")
    added_at = time.time()
    added = cluster.add_nodes(2)
    grown = trained(3, after["lose_two"], "the group grown to 3", since=added_at)
    durable_before = [c.step for c in list_checkpoints(str(run_dir / "checkpoints"))]
    cluster.remove_nodes(added)  # both at once: a snapshot shard loses both its copies
    rc = run.wait(RUN_TIMEOUT)
    records = attempts(run_dir)
    trained = [a for a in records if a["start_step"] is not None]  # (a grow may skip one)
    reference = reference_with_lost_branches(trained, prepared, tmp_path_factory)
    print("\n".join(["elastic recoveries:", *recovery_summary(records)]))
    return dict(
        launch=launch,
        run_dir=run_dir,
        rc=rc,
        out=run.output(),
        records=records,
        reference=reference,
        at_one=len(at_one),
        grown=len(grown),
        durable_before=durable_before,
    )


def test_run_goes_on_at_each_new_size_as_nodes_leave_and_join(nodes_come_and_go):
    r = nodes_come_and_go
    assert r["rc"] == 0, r["out"][-6000:]
    records = r["records"]
    sizes = [a["world_size"] for a in records]
    # Two nodes joining a second apart are one grow: the controller waits for the second
    # (cluster.grow_settle_s) while the group trains on, and grows from 1 to 3 in one restart.
    assert sizes == [3, 2, 1, 3, 1], (
        f"{sizes}: no other restart, none while the drained node lingered (Ray would grow onto it)"
    )
    assert "startup timed out" not in r["out"], "a restart asked for a node that had left"
    assert "cannot renew Ray's cluster view" not in r["out"]
    trained = [a for a in records if a["start_step"] is not None]
    skipped = [a for a in records if a["start_step"] is None]
    assert all(a["last_step"] >= a["start_step"] for a in trained), "every group trained"
    assert all(a["world_size"] == 2 and a["left_at"] for a in skipped), (
        "only a group of the grow drained before its first step"
    )
    assert records[-1]["last_step"] == ELASTIC_STEPS - 1
    for restart in trained[1:]:
        lost = restart["recovery"]["steps_lost"]
        assert restart["recovery"]["recovery_s"] > 0
        assert lost == len(restart.get("retrained_losses", {})), (
            "the steps lost are the steps trained again"
        )
    (run,) = mlflow_runs(r["launch"], "elastic")
    history_sizes = history(r["launch"], run, "elastic/world_size")
    changes = [history_sizes[0][1]] + [
        v for (_, a), (_, v) in zip(history_sizes, history_sizes[1:]) if v != a
    ]
    assert changes == [float(a["world_size"]) for a in trained]
    restarts = len(records) - 1
    assert history(r["launch"], run, "elastic/restarts")[-1] == (ELASTIC_STEPS - 1, restarts)
    # One point per resume step: MLflow keeps a step's first value (two groups resumed at the
    # step of the grow's drain when the two lost nodes took the snapshot with them).
    resumed_at = {a["start_step"] for a in trained[1:]}
    assert len(history(r["launch"], run, "elastic/recovery_s")) == len(resumed_at)


def test_a_lost_node_costs_at_most_the_steps_since_the_newest_snapshot(nodes_come_and_go):
    r = nodes_come_and_go
    after_loss = r["records"][1]
    assert after_loss["world_size"] == 2
    assert after_loss["recovery"]["steps_lost"] <= SNAPSHOT_EVERY + 1, (
        "a node's death costs at most the steps since the newest snapshot (one may be in flight)"
    )
    step = after_loss["start_step"]
    assert re.search(rf"resumed from keeper://\S+/step_{step:09d} at step {step}\b", r["out"])


def test_preempted_node_checkpoints_the_step_it_is_at_and_loses_nothing(nodes_come_and_go):
    r = nodes_come_and_go
    preempted, after = r["records"][1:3]
    assert (preempted["world_size"], after["world_size"]) == (2, 1)
    assert "Ray preemption notice for ranks" in r["out"]
    assert preempted["left_at"]["step"] == preempted["last_step"] + 1 == after["start_step"]
    assert after["recovery"]["steps_lost"] == 0 and "retrained_losses" not in after


def test_joined_nodes_grow_the_group_after_it_checkpointed_the_step_it_was_at(nodes_come_and_go):
    """Drain on grow (cluster/elastic/grow.py): before Ray tears the running group down to
    grow it, the group commits a checkpoint of the step it is at, so a join loses no step."""
    r = nodes_come_and_go
    records = r["records"]
    grows = range(r["at_one"], r["grown"])  # the groups started by the joins
    assert grows, "the two nodes grew the group"
    at = None
    for k in grows:
        before, grown = records[k - 1], records[k]
        assert grown["world_size"] > before["world_size"]
        left = before["left_at"]["step"]  # drained: every step it trained is in its checkpoint
        if before["start_step"] is not None:
            assert left == before["last_step"] + 1
        else:  # drained before its first step, where it had resumed
            assert left == at
        assert f"elastic: drained at step {left}" in r["out"]
        at = left
        if grown["start_step"] is not None:  # (the next drain may come before its first step)
            assert grown["start_step"] == at
            assert grown["recovery"]["steps_lost"] == 0 and "retrained_losses" not in grown
    assert records[r["grown"] - 1]["start_step"] == at


def test_two_nodes_lost_at_once_fall_back_to_the_durable_checkpoint_and_say_so(
    nodes_come_and_go,
):
    r = nodes_come_and_go
    lost_two, after = r["records"][-2:]
    assert (lost_two["world_size"], after["world_size"]) == (3, 1)
    durable = after["start_step"]
    assert durable in r["durable_before"] or durable == lost_two["start_step"]
    assert (
        f"no complete in-memory snapshot newer than the durable checkpoint of step {durable}: "
        "resuming from that checkpoint"
    ) in r["out"]
    assert (
        f"resumed from {r['run_dir']}/checkpoints/step_{durable:09d} at step {durable}"
        in (r["out"])
    )
    assert after["recovery"]["steps_lost"] == lost_two["last_step"] + 1 - durable


def test_resized_run_losses_equal_an_uninterrupted_run_with_no_step_skipped(nodes_come_and_go):
    r = nodes_come_and_go
    (run,) = mlflow_runs(r["launch"], "elastic")
    losses = dict(history(r["launch"], run, "train/loss"))
    assert sorted(losses) == list(range(ELASTIC_STEPS))
    assert_matches_reference(losses, r["reference"]["first"], "first training")
    for record in r["records"][1:]:
        retrained = record.get("retrained_losses", {})
        assert_matches_reference(
            retrained, r["reference"]["path"], f"trained again at world {record['world_size']}"
        )  # (first and again differ where the first was at another world size: a branch)
