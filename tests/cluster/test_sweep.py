"""A Hydra sweep over sharding strategies through the real CLI, then MLflow and the report on it.

One sweep (module fixture): `python -m cluster.train -m sharding=full_shard,shard_grad_op,no_shard`
on the shrunk tiny model, 2 CPU workers, one local Ray for all three jobs. Most of its time is Ray
(start-up, then a TorchTrainer worker group per job); the training itself is a second a job.
The bad-value tests run no Ray at all: they must fail before anything starts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from cluster.compose import register_schemas
from cluster.config import JobConfig, job_from_dict
from cluster.report import REPORT_ARTIFACTS
from cluster.sweep import planned_jobs
from cluster.sweep_repeats import Repeats, apply_repeats, repeat_indices
from cluster.tracking.plots import PLOT_SIZE_PX
from cluster.tracking.runs import NOTE_TAG, VIEW_KEY, compared_params, create_run
from cluster.tracking.source import git_commit
from tests.cluster.conftest import REPO, CliResult, run_cli
from trainer.metrics import MLflowLogger, last_logged_steps, start_system_metrics

STEPS = 3
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")
EXPERIMENT = "sweep-test"
SHRUNK = (
    "model.n_layers=2",
    "model.dim=64",
    "model.ffn_dim=128",
    "data.max_bytes=300000",
    "data.seq_len=64",
    f"train.steps={STEPS}",
    "train.checkpoint_every=0",
    "optim.warmup_steps=1",
    "cluster.num_workers=2",
    f"tracking.experiment={EXPERIMENT}",
)
# What the loop logs every step on CPU (trainer/loop.py Trainer.metrics + the engine's accounting).
PER_STEP_METRICS = (
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "perf/tokens_per_s",
    "perf/step_ms",
    "perf/tflops_per_worker",
    "elastic/world_size",
    "comm/all_gather_bytes",
    "comm/reduce_scatter_bytes",
    "comm/all_reduce_bytes",
    "comm/total_bytes",
    "mem/sharded_params_bytes",
    "mem/sharded_grads_bytes",
    "mem/optim_state_bytes",
    "mem/peak_total_bytes",
)
NOTHING_STARTED_MARKERS = (
    "started a local Ray for this job",
    "mlflow: run",
    "mlflow: sweep parent",
)


def run_train(launch_dir: Path, *args: str, timeout: float) -> CliResult:
    """`python -m cluster.train ARGS` (a multirun: no hydra.run.dir) from launch_dir."""
    return run_cli(
        launch_dir,
        *args,
        timeout=timeout,
        run_dir=False,
        env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"},
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    launch_dir = tmp_path_factory.mktemp("sweep")
    result = run_train(
        launch_dir,
        "-m",
        f"sharding={','.join(STRATEGIES)}",
        f"hydra.sweep.dir={launch_dir}/shared/sweep",
        *SHRUNK,
        timeout=900,
    )
    assert result.returncode == 0, result.output[-8000:]
    client = MlflowClient(f"sqlite:///{launch_dir}/mlflow.db")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id])
    return launch_dir, result.output, client, runs


def parent_and_children(runs):
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return parents, sorted(children, key=lambda r: int(r.data.tags["sweep.job"]))


def test_sweep_is_one_parent_run_with_one_child_per_strategy(sweep):
    _, output, _, runs = sweep
    parents, children = parent_and_children(runs)
    assert len(parents) == 1 and len(children) == len(STRATEGIES), [r.info.run_name for r in runs]
    (parent,) = parents
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    assert [c.info.run_name for c in children] == [f"sharding={s}" for s in STRATEGIES]
    assert [c.data.tags["strategy"] for c in children] == [s.upper() for s in STRATEGIES]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert parent.data.tags["sweep.keys"] == "sharding"
    assert parent.data.params["model.n_layers"] == "2"  # shared by every job
    assert "sharding.strategy" not in parent.data.params  # swept: each child has its own
    assert output.count("started a local Ray for this job") == 1  # one Ray for the whole sweep


def test_every_line_of_a_job_says_which_job_it_is(sweep):
    """The workers' step lines (forwarded by Ray through the driver) and the driver's own lines
    of a job start with '[job k/n <swept values>]'; the sweep's own lines do not."""
    _, output, _, _ = sweep
    lines = output.splitlines()
    step_lines = [line for line in lines if re.search(r"step +\d+/\d+ \| loss", line)]
    assert len(step_lines) >= STEPS * len(STRATEGIES)
    for num, strategy in enumerate(STRATEGIES, start=1):
        prefix = f"[job {num}/{len(STRATEGIES)} sharding={strategy}] "
        mine = [line for line in step_lines if line.startswith(prefix)]
        assert any(f"step {STEPS}/{STEPS} |" in line for line in mine), (prefix, step_lines)
        assert prefix + "== done ==" in lines
    assert all(line.startswith("[job ") for line in step_lines), step_lines
    assert any(line.startswith("sweep: 3 jobs checked") for line in lines)


def test_each_childs_params_are_its_resolved_config(sweep, tmp_path):
    launch_dir, _, client, runs = sweep
    _, children = parent_and_children(runs)
    checkpoint_roots = set()
    for child, strategy in zip(children, STRATEGIES):
        local = client.download_artifacts(
            child.info.run_id, "resolved_config.yaml", str(tmp_path / strategy)
        )
        resolved = job_from_dict(OmegaConf.to_container(OmegaConf.load(local)))
        params = child.data.params
        # the params are what runs are compared by (and what the sweep varies), not all ~100 keys
        compared = {k: str(v) for k, v in compared_params(resolved).items()}
        assert compared.items() <= params.items() and len(params) <= len(compared) + 2
        assert params["sharding.strategy"] == strategy.upper()
        assert (params["model.n_layers"], params["model.dim"], params["train.steps"]) == (
            "2",
            "64",
            str(STEPS),
        )
        assert params["data.prepared_dir"] == f"{launch_dir}/data/prepared"
        checkpoint_roots.add(child.data.tags["checkpoint_root"])
    assert len(checkpoint_roots) == len(STRATEGIES)  # no job resumes from another job's checkpoint


def test_every_metric_has_one_value_per_logged_step(sweep):
    _, _, client, runs = sweep
    _, children = parent_and_children(runs)
    for child in children:
        run_id = child.info.run_id
        for key in PER_STEP_METRICS:
            steps = [m.step for m in client.get_metric_history(run_id, key)]
            # step N = N optimizer steps done, as the checkpoint directories count
            assert sorted(steps) == list(range(1, STEPS + 1)), (child.info.run_name, key, steps)
        for key in child.data.metrics:  # anything else logged (elastic/*, ...): never a step twice
            steps = [m.step for m in client.get_metric_history(run_id, key)]
            assert len(steps) == len(set(steps)), (child.info.run_name, key, steps)
        assert "perf/mfu" not in child.data.metrics  # no known peak FLOP rate on a CPU
        assert child.data.metrics["elastic/world_size"] == 2.0


def test_each_child_ends_with_its_summary_and_too_short_runs_name_no_winner(sweep):
    """finish_tracking logs Summary/* from the run's own history; 3 logged steps leave 1 out as
    warm-up, 2 measured: too short to rank, tagged so. So the report names no fastest, and the
    parent gets no sweep/winner."""
    _, output, client, runs = sweep
    (parent,), children = parent_and_children(runs)
    for child in children:
        run_id, metrics = child.info.run_id, child.data.metrics
        assert {
            "Summary/tokens_per_s_median",
            "Summary/tokens_per_s_p10",
            "Summary/tokens_per_s_p90",
            "Summary/step_ms_median",
            "Summary/step_ms_p10",
            "Summary/step_ms_p90",
            "Summary/tflops_median",
            "Summary/peak_memory_gib",
            "Summary/bytes_per_step_mib",
            "Summary/final_loss",
        } <= set(metrics), sorted(metrics)
        assert (metrics["Summary/steps_warmup"], metrics["Summary/steps_measured"]) == (1.0, 2.0)
        tokens = [
            m.value
            for m in sorted(
                client.get_metric_history(run_id, "perf/tokens_per_s"), key=lambda m: m.step
            )
        ]
        assert metrics["Summary/tokens_per_s_median"] == pytest.approx(sum(tokens[1:]) / 2)
        assert metrics["Summary/final_loss"] == metrics["train/loss"]
        assert metrics["Summary/peak_memory_gib"] * 2**30 == pytest.approx(
            max(m.value for m in client.get_metric_history(run_id, "mem/peak_total_bytes"))
        )
        assert child.data.tags["Summary/too_short"] == "true"
    tags = client.get_run(parent.info.run_id).data.tags  # tagged after the fixture's search
    assert "sweep/winner" not in tags
    assert tags["sweep/verdict"].startswith("no ranking: 3 runs are too short")
    assert tags["sweep/too_short"] == "true"
    assert "too short or too noisy to rank strategies" in output
    assert "no ranking: 3 runs are too short" in output and "fastest:" not in output


def test_each_childs_description_names_its_strategy_and_its_figures(sweep):
    _, _, client, runs = sweep
    _, children = parent_and_children(runs)
    for child, strategy in zip(children, STRATEGIES):
        note = child.data.tags[NOTE_TAG]
        assert note.startswith(f"**sharding={strategy}** (job ")
        assert f"**{strategy.upper()}** on 2 CPU workers, model tiny" in note
        assert "| tokens/s median (p10-p90) | step ms median (p10-p90) | peak MiB/rank |" in note
        median = child.data.metrics["Summary/tokens_per_s_median"]
        assert f"| {median:,.0f} (" in note
        assert "**Too short to rank strategies**: 2 steps measured" in note


def test_children_carry_git_commit_device_and_their_artifacts(sweep):
    _, _, client, runs = sweep
    _, children = parent_and_children(runs)
    for child in children:
        tags = child.data.tags
        assert tags["mlflow.source.git.commit"] == git_commit()
        assert (tags["world_size"], tags["device"]) == ("2", "cpu")
        artifacts = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert {"resolved_config.yaml", "loss_curve.png"} <= artifacts
        assert "memory_plan.txt" in artifacts


def test_sweep_ends_with_the_comparison_logged_to_the_parent(sweep):
    launch_dir, output, client, runs = sweep
    (parent,), _ = parent_and_children(runs)
    assert "tokens/s" in output and "peak mem MiB" in output
    for strategy in STRATEGIES:
        assert f"sharding={strategy}" in output
    logged = {a.path for a in client.list_artifacts(parent.info.run_id)}
    logged |= {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert set(REPORT_ARTIFACTS) <= logged  # the plots at the root, the table under report/
    note = client.get_run(parent.info.run_id).data.tags[NOTE_TAG]  # the Overview's description
    assert note.startswith("**no ranking (3 of 3 runs too short or noisy) · least memory: ")
    for strategy in STRATEGIES:
        assert f"\n| sharding={strategy} | {strategy.upper()} | 2 | " in note
    assert (launch_dir / "shared/sweep/report/loss_vs_step.png").is_file()  # under hydra.sweep.dir
    assert (launch_dir / "shared/sweep/multirun.yaml").is_file()


def test_report_cli_on_the_sweep_prints_the_table_and_writes_real_images(sweep, tmp_path):
    launch_dir, _, _, runs = sweep
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.report",
            EXPERIMENT,
            "--tracking-uri",
            f"sqlite:///{launch_dir}/mlflow.db",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run "))
    rows = lines[header + 2 : header + 2 + len(STRATEGIES)]
    assert [row.split()[:3] for row in rows] == [
        [f"sharding={s}", s.upper(), "2"] for s in STRATEGIES
    ]
    for name in ("loss_vs_step.png", "tokens_per_s_by_strategy.png", "memory_by_strategy.png"):
        image = matplotlib.image.imread(out / name)
        assert image.shape[:2] == (PLOT_SIZE_PX[1], PLOT_SIZE_PX[0]), name
        assert image[..., :3].std() > 0.05, f"{name} is blank"


# ---- bad values: refused before Ray, MLflow or any job starts ---------------------------------


def assert_nothing_started(result: CliResult, launch_dir: Path) -> None:
    assert result.returncode != 0, result.output
    for marker in NOTHING_STARTED_MARKERS:
        assert marker not in result.output, result.output
    assert not (launch_dir / "mlflow.db").exists()
    assert not (launch_dir / "runs").exists()


def test_misspelled_strategy_fails_before_anything_starts_listing_the_valid_ones(launch_dir):
    result = run_train(launch_dir, "-m", "sharding=full_shrad", timeout=120)
    assert_nothing_started(result, launch_dir)
    assert "Could not find 'sharding/full_shrad'" in result.output
    for name in ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard"):
        assert f"\t{name}" in result.output


def test_a_bad_value_in_a_later_job_fails_before_the_first_job_starts(launch_dir):
    result = run_train(
        launch_dir, "-m", "sharding=full_shard,full_shrad", "train.steps=3,0", timeout=120
    )
    assert_nothing_started(result, launch_dir)
    out = result.output
    assert (
        "sweep job 2/4 (sharding=full_shard train.steps=0): invalid config: train.steps=0; "
        "valid: a positive integer" in out
    )
    assert (
        "sweep job 3/4 (sharding=full_shrad train.steps=3): In 'config': Could not find "
        "'sharding/full_shrad'" in out
    )
    assert "\tshard_grad_op" in out
    assert "3 of 4 jobs are invalid" in out
    assert not (launch_dir / "multirun").exists()  # refused before Hydra's sweeper made its folder


def test_a_bad_repeat_count_fails_before_anything_starts_naming_the_key(launch_dir):
    result = run_train(
        launch_dir, "-m", "sharding=full_shard,no_shard", "+sweep.repeats=0", timeout=120
    )
    assert_nothing_started(result, launch_dir)
    assert "invalid config: sweep.repeats=0; valid: a positive integer" in result.output


def test_repeats_run_every_job_in_rotation_and_interleave_false_back_to_back():
    """What Hydra's basic sweeper will launch after the callback's rewrite (no Ray: the jobs'
    overrides only)."""

    def jobs(*overrides: str, repeats: Repeats) -> list[list[str]]:
        loader = GlobalHydra.instance().config_loader()
        config = loader.load_configuration("config", list(overrides), RunMode.MULTIRUN)
        apply_repeats(config, repeats)
        return [[o for o in job if "=" in o and o.split("=")[0] in ("sharding", "train.steps")]
                for job in planned_jobs(config)]  # fmt: skip

    register_schemas()  # as cluster/train.py does: the model presets and the job schema
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        rotated = jobs("sharding=full_shard,no_shard", "train.steps=5", repeats=Repeats(3))
        assert [j[0] for j in rotated] == ["sharding=full_shard", "sharding=no_shard"] * 3
        assert repeat_indices(rotated, ["sharding"]) == [0, 0, 1, 1, 2, 2]
        blocked = jobs("sharding=full_shard,no_shard", repeats=Repeats(2, interleave=False))
        assert [j[0] for j in blocked] == ["sharding=full_shard"] * 2 + ["sharding=no_shard"] * 2
        two_keys = jobs("sharding=full_shard,no_shard", "train.steps=3,4", repeats=Repeats(2))
        assert (
            two_keys
            == [
                ["sharding=full_shard", "train.steps=3"],
                ["sharding=full_shard", "train.steps=4"],
                ["sharding=no_shard", "train.steps=3"],
                ["sharding=no_shard", "train.steps=4"],
            ]
            * 2
        )  # rounds of every job


def test_sweeping_the_experiment_is_refused_one_parent_per_sweep(launch_dir):
    result = run_train(launch_dir, "-m", "tracking.experiment=a,b", timeout=120)
    assert_nothing_started(result, launch_dir)
    assert "tracking.experiment differs between the jobs of the sweep (a, b)" in result.output


# ---- what a restarted worker group logs ---------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One sqlite store for the logging tests (creating one runs MLflow's migrations: seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def test_a_restarted_worker_group_does_not_log_a_step_twice(store):
    """The loop resumes from its last checkpoint and trains the steps after it again; the new
    rank 0 logger skips the steps the run already holds, per metric, and logs the rest."""
    run_id = create_run(JobConfig(), store)
    first = MLflowLogger(store, run_id)
    for step in range(6):
        first.log_metrics({"train/loss": 10.0 - step, "perf/step_ms": 100.0}, step=step)
    restarted = MLflowLogger(store, run_id)  # a new worker group, resumed from step 3's checkpoint
    for step in range(3, 9):
        restarted.log_metrics(
            {"train/loss": 20.0 - step, "perf/step_ms": 50.0, "elastic/world_size": 3.0}, step=step
        )
    client = MlflowClient(store)
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    assert loss == [(s, 10.0 - s) for s in range(6)] + [(s, 20.0 - s) for s in range(6, 9)]
    world_sizes = client.get_metric_history(run_id, "elastic/world_size")
    assert [m.step for m in world_sizes] == list(range(3, 9))
    assert last_logged_steps(client, run_id) == {
        "train/loss": 8,
        "perf/step_ms": 8,
        "elastic/world_size": 8,
    }


def test_system_metrics_are_kept_apart_per_worker_node(store):
    """What cluster/worker.py starts on each node's local rank 0: MLflow's monitor, keyed by
    node."""
    run_id = create_run(JobConfig(), store)
    for node in ("10.0.0.1", "10.0.0.2"):
        monitor = start_system_metrics(store, run_id, node, interval_s=3600)
        monitor.finish()  # stop the sampling thread; sample and publish once, deterministically
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()
    metrics = MlflowClient(store).get_run(run_id).data.metrics
    for node in ("10.0.0.1", "10.0.0.2"):
        assert f"system/{node}/cpu_utilization_percentage" in metrics
        assert f"system/{node}/system_memory_usage_megabytes" in metrics


def test_experiments_open_as_model_training_and_the_printed_page_says_so(store):
    """MLflow 3's UI opens in its GenAI mode (no runs table) unless the experiment's kind or the
    URL says model training: the experiment is tagged, and the printed page asks for the mode."""
    from cluster.tracking.runs import experiment_of, ui_url  # noqa: PLC0415 -- next to its test

    run_id = create_run(JobConfig(), store)
    experiment = experiment_of(store, run_id)
    tags = MlflowClient(store).get_experiment(experiment).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    assert ui_url(store, experiment, run_id) == (
        f"http://127.0.0.1:5000/#/experiments/{experiment}/runs/{run_id}"
        "?workflowType=machine_learning"
    )
    assert ui_url("https://mlflow.example:8443/", "7") == (
        "https://mlflow.example:8443/#/experiments/7/runs?workflowType=machine_learning"
        f"&viewStateShareKey={VIEW_KEY}"  # the runs list with its loss and throughput columns
    )
