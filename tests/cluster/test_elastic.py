"""Elastic training end to end: the real CLI on a multi-node Ray cluster on this machine.

A head node and a second node of one logical CPU each (ray.cluster_utils.Cluster), one CPU per
worker. Two runs, each compared step by step with the same config trained without Ray and without
interruption, at the same world sizes (tests/cluster/elastic_reference.py says why):

1. Fixed at 2 workers, durable checkpoints only (every 3 steps, no snapshots). Rank 1 crashes
   before step 5 (fault config); Ray restarts the group, which resumes from the checkpoint of
   step 3. Then rank 0 gets a SIGTERM: the group checkpoints the step it is at and leaves, and
   Ray restarts it from there. A second SIGTERM is the third failure with
   cluster.max_failures=2, so the run stops. Submitted again, it resumes from the last
   checkpoint and finishes.
2. Elastic, 1..2 workers, a durable checkpoint only every 500 steps but an in-memory snapshot
   every step, kept by a keeper actor on each node (each file on its writer's node and the
   other). The second node is removed mid-run (its worker and keeper die with it): the run goes
   on at world size 1 from the newest snapshot, losing at most the steps since it. A node is
   added: the group checkpoints the step it is at (drain on grow) and Ray grows it back to 2,
   having lost no step. Ray is then told that node will be preempted: the group checkpoints
   the step it is at, the node leaves, and the run goes on at world size 1 having lost no step.

Every step's loss (MLflow keeps each step's first training; the retrained ones are in the run's
elastic records) equals the uninterrupted run's within 1e-5 relative; no step is missing.
Ray's clocks are shortened by env vars (elastic_cluster.FAST_RAY_TRAIN_ENV); the timeouts here
are generous because this 2-core machine is shared. The recovery times measured are printed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from cluster.config import register_schemas, to_job_config
from tests.cluster.elastic_cluster import LocalCluster, attempts, start_cli, wait_until
from tests.cluster.elastic_reference import reference_losses
from trainer.checkpoint import list_checkpoints
from trainer.data import prepare

REPO = Path(__file__).resolve().parents[2]
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
CRASH_STEPS = 80
ELASTIC_STEPS = 1000  # the preemption must reach a group with steps left: they take ~15 ms here
SNAPSHOT_EVERY = 1
RUN_TIMEOUT = 420.0
REL = 1e-5


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
            out.append(
                f"world {r['world_size']} from step {r['start_step']}: "
                f"{rec['recovery_s']:.1f} s ({parts}), {rec['steps_lost']} steps lost"
            )
    return out


# ---- 1. a crash, a drain, a resubmission ------------------------------------------------------


@pytest.fixture(scope="module")
def crash_then_drain(cluster, prepared, tmp_path_factory):
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
        "fault.at_step=5",
        "fault.kind=crash",
        "train.checkpoint_every=3",
        "train.snapshot_every=0",  # this drill: durable checkpoints only
    )
    first = start_cli(launch, cluster.address, *args)
    for group in (2, 3):  # drain the group restarted after the crash, then the one after that
        running = wait_until(
            lambda: (
                (a := attempts(run_dir))
                and len(a) >= group
                and a[-1]["start_step"] is not None
                and a[-1]["last_step"] >= a[-1]["start_step"] + 4
                and a[-1]
            ),
            RUN_TIMEOUT,
            f"group {group} to train 5 steps",
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
        first_rc=first_rc,
        first_out=first_out,
        again_rc=again_rc,
        again_out=again.output(),
        records_before=records_before,
        records=records,
        checkpoints_before=checkpoints_before,
        reference=reference,
    )


def test_crashed_worker_is_replaced_and_its_group_resumes_from_the_last_checkpoint(
    crash_then_drain,
):
    r = crash_then_drain
    crashed, restarted, _ = r["records_before"]
    marker = (r["run_dir"] / "elastic" / "fault.json").read_text()
    assert '"kind": "crash"' in marker and '"rank": 1' in marker and '"step": 5' in marker
    assert "fault injection: crash of rank 1 before step 5" in r["first_out"]
    assert crashed["last_step"] == 4 and restarted["start_step"] == 3  # checkpoint of step 3
    assert restarted["world_size"] == 2
    assert restarted["recovery"]["steps_lost"] == 2 and restarted["recovery"]["recovery_s"] > 0
    assert f"resumed from {r['run_dir']}/checkpoints/step_000000003 at step 3" in r["first_out"]


def test_drained_group_checkpoints_the_step_it_is_at_and_loses_nothing(crash_then_drain):
    r = crash_then_drain
    _, drained, drained_again = r["records_before"]
    for group in (drained, drained_again):
        left = group["left_at"]["step"]
        assert group["last_step"] == left - 1, "every trained step is in the drain's checkpoint"
        assert left in r["checkpoints_before"]
    assert drained_again["start_step"] == drained["left_at"]["step"]
    assert drained_again["recovery"]["steps_lost"] == 0
    assert drained_again["recovery"]["recovery_s"] > 0
    assert "SIGTERM: checkpointing the current step before leaving" in r["first_out"]
    assert r["first_rc"] != 0, "the second drain was the third failure with cluster.max_failures=2"
    first_run = mlflow_runs(r["launch"], "crash")[0]
    assert history(r["launch"], first_run, "elastic/steps_lost") == [
        (3, 2.0),
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
    retrained = r["records"][1]["retrained_losses"]
    assert sorted(map(int, retrained)) == [3, 4]
    assert_matches_reference(retrained, r["reference"], "trained again after the crash")
    for step, loss in retrained.items():
        assert loss == pytest.approx(per_run[0][int(step)], rel=REL)
    assert len(history(r["launch"], runs[0], "elastic/recovery_s")) == 2
    assert r["reference"][CRASH_STEPS - 1] < r["reference"][0]


# ---- 2. a node lost, a node added ---------------------------------------------------------------


@pytest.fixture(scope="module")
def node_lost_then_added(cluster, prepared, tmp_path_factory):
    launch = tmp_path_factory.mktemp("elastic")
    run_dir = launch / "runs" / "elastic"
    args = cli_overrides(
        prepared,
        f"train.steps={ELASTIC_STEPS}",
        "cluster.min_workers=1",
        "cluster.max_workers=2",
        "cluster.elastic_resize_monitor_interval_s=1",
        "cluster.run_name=elastic",
        "tracking.experiment=elastic",
        f"train.checkpoint_every={ELASTIC_STEPS // 2}",  # durable: once mid-run, and at the end
        f"train.snapshot_every={SNAPSHOT_EVERY}",  # in the keepers' memory, on both nodes
    )
    run = start_cli(launch, cluster.address, *args)
    wait_until(
        lambda: (
            (a := attempts(run_dir)) and a[-1]["world_size"] == 2 and (a[-1]["last_step"] or 0) >= 7
        ),
        RUN_TIMEOUT,
        "step 7 at world size 2",
        run,
    )
    cluster.remove_node(cluster.second)  # its worker process dies with it
    wait_until(
        lambda: (
            (a := attempts(run_dir))
            and a[-1]["world_size"] == 1
            and (a[-1]["last_step"] or -1) >= a[-2]["last_step"] + 2
        ),
        RUN_TIMEOUT,
        "two new steps at world size 1",
        run,
    )
    added_at = time.time()
    added = cluster.add_node(1)
    wait_until(
        lambda: (
            (a := attempts(run_dir))
            and a[-1]["world_size"] == 2
            and a[-1]["started"] > added_at
            and (a[-1]["last_step"] or -1) >= (a[-1]["start_step"] or 0) + 4
        ),
        RUN_TIMEOUT,
        "the group grown back to 2 to train 5 steps",
        run,
    )
    cluster.occupy(added)  # lives on after the drain, as a cloud's preempted node until its end
    cluster.preempt_node(added)
    rc = run.wait(RUN_TIMEOUT)
    records = attempts(run_dir)
    schedule = [(a["world_size"], b["start_step"]) for a, b in zip(records, records[1:])]
    reference = reference_for(
        ELASTIC_STEPS,
        prepared,
        schedule + [(records[-1]["world_size"], None)],
        tmp_path_factory.mktemp("ref-elastic"),
    )
    print("\n".join(["elastic recoveries:", *recovery_summary(records)]))
    return dict(launch=launch, rc=rc, out=run.output(), records=records, reference=reference)


def test_run_goes_on_at_the_smaller_size_when_a_node_is_lost_and_grows_when_one_is_added(
    node_lost_then_added,
):
    r = node_lost_then_added
    assert r["rc"] == 0, r["out"][-6000:]
    records = r["records"]
    assert [a["world_size"] for a in records] == [2, 1, 2, 1], (
        "no other restart: none while the drained node lingered (Ray would grow onto it)"
    )
    assert "startup timed out" not in r["out"], (
        "the restart after the node loss asked for the lost node"
    )
    assert "cannot renew Ray's cluster view" not in r["out"]
    assert all(a["last_step"] >= a["start_step"] for a in records), "every group trained"
    assert records[-1]["last_step"] == ELASTIC_STEPS - 1
    lost_node = records[1]
    assert lost_node["recovery"]["steps_lost"] <= SNAPSHOT_EVERY + 1, (
        "a node's death costs at most the steps since the newest snapshot (one may be in flight)"
    )
    assert "resumed from keeper://" in r["out"]
    for restart in records[1:]:
        lost = restart["recovery"]["steps_lost"]
        assert restart["recovery"]["recovery_s"] > 0
        assert lost == len(restart.get("retrained_losses", {})), (
            "the steps lost are the steps trained again"
        )
    (run,) = mlflow_runs(r["launch"], "elastic")
    sizes = history(r["launch"], run, "elastic/world_size")
    changes = [sizes[0][1]] + [v for (_, a), (_, v) in zip(sizes, sizes[1:]) if v != a]
    assert changes == [2.0, 1.0, 2.0, 1.0]
    assert history(r["launch"], run, "elastic/restarts")[-1] == (ELASTIC_STEPS - 1, 3.0)
    assert len(history(r["launch"], run, "elastic/recovery_s")) == 3


def test_a_joined_node_grows_the_group_after_it_checkpointed_the_step_it_was_at(
    node_lost_then_added,
):
    """Drain on grow (cluster/elastic/grow.py): before Ray tears the running group down to
    grow it, the group commits a checkpoint of the step it is at, so the join loses no step."""
    r = node_lost_then_added
    before, grown = r["records"][1:3]
    assert (before["world_size"], grown["world_size"]) == (1, 2)
    assert before["left_at"]["step"] == before["last_step"] + 1 == grown["start_step"]
    assert grown["recovery"]["steps_lost"] == 0 and "retrained_losses" not in grown
    assert f"elastic: drained at step {grown['start_step']}" in r["out"]


def test_preempted_node_checkpoints_the_step_it_is_at_and_loses_nothing(node_lost_then_added):
    r = node_lost_then_added
    preempted, after = r["records"][2:]
    assert "Ray preemption notice for ranks" in r["out"]
    assert preempted["left_at"]["step"] == preempted["last_step"] + 1 == after["start_step"]
    assert after["recovery"]["steps_lost"] == 0 and "retrained_losses" not in after


def test_resized_run_losses_equal_an_uninterrupted_run_with_no_step_skipped(node_lost_then_added):
    r = node_lost_then_added
    (run,) = mlflow_runs(r["launch"], "elastic")
    losses = dict(history(r["launch"], run, "train/loss"))
    assert sorted(losses) == list(range(ELASTIC_STEPS))
    assert_matches_reference(losses, r["reference"], "first training")
    for record in r["records"][1:]:
        retrained = record.get("retrained_losses", {})
        assert_matches_reference(
            retrained, r["reference"], f"trained again at world {record['world_size']}"
        )
        for step, loss in retrained.items():
            assert loss == pytest.approx(losses[int(step)], rel=REL), f"step {step}: first vs again"
