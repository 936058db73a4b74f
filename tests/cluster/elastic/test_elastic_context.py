"""Context parallelism through the real CLI on an elastic Ray cluster that grows (issue 37).

The elastic layer starts groups only at world sizes train.context_parallel splits (it is never
re-planned): Ray's count of the workers that fit is lowered to the largest such size, and so is
every resize decision (cluster/elastic/cluster_view.py), so a node that joins alone under
context 2 grows nothing, two grow the group by a context group. Tested on Ray's own elastic
policy first (fast), then end to end:

A chat fine-tune with packing (every window's documents masked from each other) of a tiny model
runs through the CLI at train.context_parallel=2 on 2 workers (a local Ray): its losses follow
the context_parallel=1 curve of the same config trained without Ray at world size 2 to 1e-5
over 12 steps. Then (marked slow: ~3.5 min on 2 cores, ~80 s of it Ray starting worker groups
twice) on 2..4 workers of a ray.cluster_utils cluster:
it starts on 2 workers (one context group: each sequence over both), two nodes join (the group
drains the step it is at and grows to 4: two context groups, each reading its own samples).
Every step's loss equals the same config trained without Ray at the same world sizes
(tests/cluster/elastic/elastic_reference.py) to 1e-5, and the context_parallel=1 curve at those
world sizes to 1e-5 too: splitting the sequence changes nothing but the sums' grouping; no
step is lost or skipped.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from benchmarks.packing import write_chat_tokenizer
from cluster.compose import register_schemas, to_job_config
from cluster.config import ClusterConfig, JobConfig, job_to_dict
from cluster.elastic import cluster_view
from cluster.elastic.cluster_view import ClusterView
from tests.cluster.conftest import run_cli
from tests.cluster.elastic.elastic_reference import reference_losses
from tests.cluster.elastic_cluster import LocalCluster, attempts, start_cli, wait_until
from tests.cluster.test_finetune_e2e import write_lookup_corpus
from trainer.data import prepare

REPO = Path(__file__).resolve().parents[3]
STEPS = 100  # the grow: seen ~15 steps after the nodes joined; the group starts in ~40 s
FIXED_STEPS = 12
RUN_TIMEOUT = 300.0
REL = 1e-5


# ---- the size of the next group (cluster_view.py), on Ray's own elastic policy -----------------


def context_job(context: int, lo: int, hi: int) -> JobConfig:
    cfg = JobConfig(cluster=ClusterConfig(min_workers=lo, max_workers=hi))
    cfg.train = dataclasses.replace(cfg.train, context_parallel=context, global_batch_size=8)
    return cfg.validate()


def started_view(cfg: JobConfig, monkeypatch) -> ClusterView:
    """A ClusterView as the controller starts it: the job read from the run's train_loop_config,
    its rule installed in Ray's policy (in this process)."""
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    for attr in ("_count_possible_workers", "make_decision_for_running_worker_group"):
        monkeypatch.setattr(ElasticScalingPolicy, attr, getattr(ElasticScalingPolicy, attr))
    monkeypatch.setattr(ElasticScalingPolicy, "_startable", None, raising=False)
    lo, hi = cfg.cluster.world_sizes
    view = ClusterView(interval_s=1e9, min_workers=lo, max_workers=hi)
    monkeypatch.setattr(view, "_refresh", lambda: None)  # no Ray here
    view.after_controller_start(SimpleNamespace(train_loop_config={"job": job_to_dict(cfg)}))
    return view


def test_ray_starts_and_grows_groups_only_at_sizes_the_context_degree_splits(monkeypatch):
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    started_view(context_job(2, 2, 6), monkeypatch)
    nodes: list[str] = []
    monkeypatch.setattr(
        cluster_view.ray,
        "nodes",
        lambda: [{"NodeID": n, "Alive": True, "Resources": {"CPU": 1.0}} for n in nodes],
    )
    monkeypatch.setattr(cluster_view.ray._private.state.state, "get_draining_nodes", dict)
    policy = ElasticScalingPolicy(
        ScalingConfig(num_workers=(2, 6), elastic_resize_monitor_interval_s=0.0)
    )
    monkeypatch.setattr(policy, "_maybe_send_resource_request", lambda: None)
    monkeypatch.setattr(policy, "_get_reserved_resources", lambda: {n: {"CPU": 1.0} for n in nodes})

    def decide(running, count):
        nodes[:] = [f"n{i}" for i in range(count)]
        if running is None:
            return policy.make_decision_for_non_running_worker_group()
        group = SimpleNamespace(num_workers=running, start_time=float("-inf"))
        return policy.make_decision_for_running_worker_group(group, None)

    assert decide(None, 3).num_workers == 2  # 3 fit: the group starts at 2
    assert decide(None, 5).num_workers == 4
    assert isinstance(decide(2, 3), NoopDecision)  # one node joined: no restart at 2, none at 3
    grown = decide(2, 4)
    assert isinstance(grown, ResizeDecision) and grown.num_workers == 4
    assert isinstance(decide(None, 1), NoopDecision)  # below min_workers: Ray waits


def test_a_decision_the_degree_does_not_split_is_lowered_and_said(monkeypatch, capsys):
    view = started_view(context_job(2, 2, 6), monkeypatch)
    monkeypatch.setattr(cluster_view, "workers_that_fit", lambda per_worker: 5)
    decision = SimpleNamespace(num_workers=5, resources_per_worker={"CPU": 1.0})
    view.before_controller_execute_resize_decision(decision)
    assert decision.num_workers == 4
    assert (
        "elastic: Ray chose 5 workers, but train.context_parallel=2 does not split them: starting 4"
    ) in capsys.readouterr().out
    off = started_view(context_job(1, 2, 6), monkeypatch)  # context 1: Ray's decision stands
    decision.num_workers = 5
    off.before_controller_execute_resize_decision(decision)
    assert decision.num_workers == 5


# ---- end to end --------------------------------------------------------------------------------


def overrides(launch: Path, tokenizer: str, steps: int = STEPS) -> list[str]:
    return [
        "data=chat",
        f"data.source={launch}/sft.jsonl",
        f"data.tokenizer={tokenizer}",
        f"data.prepared_dir={launch}/prepared",
        "data.seq_len=64",
        "model.vocab_size=320",
        "model.dim=64",
        "model.n_layers=2",
        "model.ffn_dim=192",
        "train.global_batch_size=8",
        f"train.steps={steps}",
        "train.checkpoint_every=0",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
    ]


def job_config(args: list[str]) -> JobConfig:
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return to_job_config(compose("config", overrides=args)).validate()


def chat_launch(launch: Path, steps: int) -> list[str]:
    """The corpus, its tokenizer and the data prepared in `launch`; the run's overrides."""
    write_lookup_corpus(launch / "sft.jsonl")
    tokenizer = write_chat_tokenizer(str(launch), str(launch / "sft.jsonl"), 320)
    args = overrides(launch, tokenizer, steps)
    prepare(job_config(args).data)  # the CLI finds it ready, as the reference does
    return args


def test_a_chat_fine_tune_at_context_2_follows_the_context_1_curve(tmp_path):
    launch = tmp_path / "fixed"
    launch.mkdir()
    args = chat_launch(launch, FIXED_STEPS)
    result = run_cli(
        launch, *args, "train.context_parallel=2", "cluster.num_workers=2",
        "cluster.run_name=context", "tracking.experiment=context", timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.output[-6000:]
    assert "context 2 (FULL_SHARD over 2 ranks, each sequence over 2 ranks" in result.output
    whole = job_config(args + ["train.context_parallel=1"])
    unsplit = reference_losses(whole, [(2, None)], str(tmp_path / "ref"))
    logged = losses(launch)
    assert sorted(logged) == list(range(FIXED_STEPS))
    worst = max(abs(v / unsplit[s] - 1) for s, v in logged.items())
    print(f"max relative difference to context 1: {worst:.2e} over {FIXED_STEPS} steps")
    for step, loss in logged.items():
        assert loss == pytest.approx(unsplit[step], rel=REL), step
    assert logged[FIXED_STEPS - 1] < logged[0]


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    launch = tmp_path_factory.mktemp("context")
    args = chat_launch(launch, STEPS)
    t0 = time.monotonic()
    cluster = LocalCluster(head_cpus=1)
    try:
        cluster.add_node(1)
        run_dir = launch / "runs" / "context"
        run = start_cli(
            launch, cluster.address, *args, "train.context_parallel=2",
            "cluster.min_workers=2", "cluster.max_workers=4",
            "cluster.elastic_resize_monitor_interval_s=1", "cluster.grow_settle_s=0",
            "train.snapshot_every=1", "cluster.run_name=context", "tracking.experiment=context",
        )  # fmt: skip
        wait_until(
            lambda: (a := attempts(run_dir)) and a[-1]["world_size"] == 2
            and (a[-1]["last_step"] or -1) >= 10,
            RUN_TIMEOUT, "10 steps at world size 2", run,
        )  # fmt: skip
        cluster.add_nodes(2)
        rc = run.wait(RUN_TIMEOUT)
    finally:
        cluster.close()
    run_s = time.monotonic() - t0
    records = attempts(run_dir)
    trained = [a for a in records if a["start_step"] is not None]
    path = [(a["world_size"], b["start_step"]) for a, b in zip(trained, trained[1:])]
    schedule = path + [(trained[-1]["world_size"], None)]
    cfg = job_config(args + ["train.context_parallel=2"])
    t1 = time.monotonic()
    reference = reference_losses(cfg, schedule, str(tmp_path_factory.mktemp("ref2") / "ckpt"))
    whole = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, context_parallel=1))
    unsplit = reference_losses(whole, schedule, str(tmp_path_factory.mktemp("ref1") / "ckpt"))
    print(f"cli run {run_s:.1f} s, references {time.monotonic() - t1:.1f} s")
    return dict(launch=launch, rc=rc, out=run.output(), records=records, schedule=schedule,
                reference=reference, unsplit=unsplit)  # fmt: skip


def losses(launch: Path) -> dict[int, float]:
    client = MlflowClient(f"sqlite:///{launch}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("context").experiment_id])
    return {m.step - 1: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}


@pytest.mark.slow
def test_the_run_grows_from_one_context_group_to_two_and_loses_no_step(grown):
    assert grown["rc"] == 0, grown["out"][-6000:]
    sizes = [a["world_size"] for a in grown["records"] if a["start_step"] is not None]
    assert sizes == [2, 4], (sizes, grown["out"][-4000:])
    assert "each sequence over 2 ranks (train.context_parallel)" in grown["out"]
    for group in grown["records"][1:]:  # the join: drained, nothing lost
        assert group["recovery"]["steps_lost"] == 0, group


@pytest.mark.slow
def test_its_losses_are_the_context_1_curve_and_the_same_run_without_ray(grown):
    logged = losses(grown["launch"])
    assert sorted(logged) == list(range(STEPS))
    worst_ray = max(abs(v / grown["reference"][s] - 1) for s, v in logged.items())
    worst_split = max(abs(v / grown["unsplit"][s] - 1) for s, v in logged.items())
    print(f"max relative difference: to the reference {worst_ray:.2e}, to context 1 "
          f"{worst_split:.2e} over {STEPS} steps, schedule {grown['schedule']}")  # fmt: skip
    for step, loss in logged.items():
        assert loss == pytest.approx(grown["reference"][step], rel=REL), step
        assert loss == pytest.approx(grown["unsplit"][step], rel=REL), step
    assert logged[STEPS - 1] < 0.5 * logged[0]
