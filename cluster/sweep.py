"""Hydra multirun over any key: every job checked before anything starts, one Ray, one parent run.

    python -m cluster.train -m sharding=full_shard,shard_grad_op,no_shard,hybrid_shard
    python -m cluster.train -m sharding=full_shard,no_shard sharding.param_dtype=float32,bfloat16 \
        hydra.sweep.dir=/mnt/cluster_storage/sweeps/dtype  # the sweep's outputs on shared storage

Hydra's basic launcher runs the jobs one after another in this process; `SweepCallback`
(conf/config.yaml, hydra.callbacks) wraps them:
- before the first job, every job's config is composed exactly as Hydra will compose it and put
  through the same checks as a single run (cluster.preflight.checked_config): one bad value in any
  job stops the sweep before Ray or MLflow start, naming the job, the key, the value and what is
  valid;
- Ray is started (or joined) once, sized for the largest job, and every job reuses it;
- one MLflow parent run per sweep; each job's run is its child (cluster/train.py reads the
  parent's id from PARENT_RUN_ENV) and is named after the job's swept values;
- after the last job, the comparison report (cluster/report.py) is printed and logged to the
  parent: its description holds the table and the verdict (the fastest only when the numbers
  can tell it, else "no ranking: <why>"; the least memory); only a told fastest is tagged
  sweep/winner. The parent is ended FINISHED, or FAILED if a job failed.

Repeats, in rotation, so that whatever else loads the machine is spread over every strategy
instead of landing on whichever ran at that moment:

    python -m cluster.train -m sharding=full_shard,no_shard +sweep.repeats=3
    # jobs: full_shard, no_shard, full_shard, no_shard, full_shard, no_shard

`+sweep.repeats=K` runs every job K times; `+sweep.interleave=true` alone means 3 repeats.
They run in rotation (Hydra's basic launcher runs its job list in order: the callback, before
the sweeper reads the overrides, rewrites the first swept list `a,b` into `a,b,a,b,a,b`, whose
product with the other swept lists is K rounds of every job); `+sweep.interleave=false` runs
each job's repeats back to back instead (the last swept list becomes `a,a,a,b,b,b`). The
`sweep.*` overrides are taken out of the jobs' overrides (no job sees them): sweep_repeats.py.
The report ranks configurations by the median of their repeats' medians, and calls two apart
only when the ranges of those medians do not overlap.

Each job of a sweep gets its own Ray run name (`sweep_run_name`, job_slot.py: where a job sits
in the sweep, told to it through the environment), so its checkpoints never mix with another
job's: a job never resumes from its neighbour's checkpoint. Launching the same sweep again
with the same hydra.sweep.dir resumes each job from its own checkpoints.
"""

from __future__ import annotations

import atexit
import copy
import os
import sys
from pathlib import Path
from typing import Any, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobStatus
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from cluster.address import joins_cluster
from cluster.config import ConfigError, JobConfig, flatten
from cluster.job_slot import (
    PARENT_RUN_ENV,
    SWEEP_JOBS_ENV,
    SWEEP_REPEAT_ENV,
    SWEEP_VARIED_ENV,
    SWEPT_KEYS_ENV,
    JobSlot,
    job_label,
    sweep_run_name,
)
from cluster.launch import connect_for_jobs
from cluster.logs import quiet_libraries
from cluster.preflight import checked_config, preflight
from cluster.report import write_report
from cluster.sweep_repeats import Repeats, apply_repeats, repeat_indices, repeats_of
from cluster.tracking.runs import (
    compared_params,
    create_sweep_run,
    end_run,
    experiment_of,
    run_tags,
    ui_command,
    ui_url,
)
from trainer.metrics import MLflowLogger
from trainer.shell import python_m

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


# ---- the whole sweep, before its first job ----------------------------------------------------


def planned_jobs(config: DictConfig) -> Optional[list[list[str]]]:
    """Each job's overrides, exactly as Hydra's BasicSweeper will launch them; None for another
    sweeper (its jobs are known only as it runs them)."""
    if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None
    batches = BasicSweeper.split_arguments(_parsed_overrides(config), None)
    return [list(job) for batch in batches for job in batch]


def swept_keys(config: DictConfig) -> list[str]:
    """The keys the sweep varies (`sharding` in sharding=a,b), in command-line order."""
    return [o.get_key_element() for o in _parsed_overrides(config) if o.is_sweep_override()]


def sweep_arguments(config: DictConfig) -> list[str]:
    """The sweeping overrides as typed (`sharding=a,b`): the parent run's name."""
    return [o.input_line for o in _parsed_overrides(config) if o.is_sweep_override()]


def _parsed_overrides(config: DictConfig) -> list:
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()]
    arguments += list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    return parser.parse_overrides(arguments)


def checked_jobs(
    config: DictConfig, jobs: list[list[str]], launch_dir: str, keys: list[str]
) -> list[JobConfig]:
    """Every job's JobConfig, or exit 2 listing every job that is invalid: nothing has started.
    Each job trains under its own run name (`sweep_run_name`)."""
    loader = GlobalHydra.instance().config_loader()
    sweep_dir = os.path.abspath(config.hydra.sweep.dir)
    cfgs, errors = [], []
    for num, overrides in enumerate(jobs):
        slot = JobSlot(num, sweep_dir, job_label(overrides, keys), total=len(jobs))
        try:
            composed = task_config(loader.load_sweep_config(config, list(overrides)))
            run_name = sweep_run_name(composed.cluster.run_name, slot)
            cfgs.append(checked_config(composed, launch_dir, run_name))
        except (ConfigError, HydraException, OmegaConfBaseException) as e:
            # Hydra's config search path is noise here
            message = str(e).split("\nConfig search path:")[0].rstrip()
            errors.append(f"sweep {slot.name} ({slot.label or ' '.join(overrides)}): {message}")
    if errors:
        print("error: " + "\n\nerror: ".join(errors), file=sys.stderr)
        print(
            f"\nnothing was started: {len(errors)} of {len(jobs)} jobs are invalid", file=sys.stderr
        )
        sys.exit(2)
    return cfgs


def checked_jobs_of(dictcfgs: list[DictConfig], launch_dir: str) -> list[JobConfig]:
    """JobConfigs of composed configs (no sweep slot), or exit 2 with the first error."""
    try:
        return [checked_config(d, launch_dir) for d in dictcfgs]
    except (ConfigError, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def preflight_all(cfgs: list[JobConfig]) -> None:
    """Every job's preflight (the data intact, the storage writable: a probe write), or exit 2
    with the first error: nothing has started."""
    try:
        for cfg in cfgs:
            preflight(cfg, log=lambda *_: None)
    except (ConfigError, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def task_config(config: DictConfig) -> DictConfig:
    """A composed config as the task function receives it: without the hydra node
    (as hydra.core.utils.run_job does)."""
    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return task


def check_one_tracking(cfgs: list[JobConfig]) -> None:
    """One parent run per sweep: every job must track to the same place (exit 2 otherwise)."""
    for key in ("enabled", "tracking_uri", "experiment"):
        values = sorted({str(getattr(c.tracking, key)) for c in cfgs})
        if len(values) > 1:
            print(
                f"error: invalid config: tracking.{key} differs between the jobs of the sweep "
                f"({', '.join(values)}); valid: one value for every job (one parent run per "
                "sweep). Sweep experiments as separate launches.",
                file=sys.stderr,
            )
            sys.exit(2)


def shared_params(cfgs: list[JobConfig]) -> dict[str, object]:
    """The compared params (cluster/tracking/runs.py) every job has in common: the parent run's
    params."""
    flat = [compared_params(c) for c in cfgs]
    return {k: v for k, v in flat[0].items() if all(f.get(k) == v for f in flat[1:])}


def varied_keys(cfgs: list[JobConfig]) -> list[str]:
    """The flattened config keys whose values differ between the jobs (cluster.run_name always
    does: each job has its own), in config order."""
    flat = [flatten(c) for c in cfgs]
    return [
        k
        for k, v in flat[0].items()
        if k != "cluster.run_name" and any(f.get(k) != v for f in flat[1:])
    ]


def sweep_tags(config: DictConfig, cfgs: list[JobConfig], keys: list[str]) -> dict[str, str]:
    """The parent run's tags: the sweep's folder, keys and jobs, and the job tags every job
    shares."""
    tags = {
        "sweep.dir": os.path.abspath(config.hydra.sweep.dir),
        "sweep.keys": ",".join(keys),
        "sweep.jobs": str(len(cfgs)),
        "sweep.overrides": " ".join(OmegaConf.to_container(config.hydra.overrides.task)),
    }
    per_job = [run_tags(c) for c in cfgs]
    for key in ("strategy", "world_size", "device", "model"):  # where every job agrees
        if len({t[key] for t in per_job}) == 1:
            tags[key] = per_job[0][key]
    return tags


# ---- the Hydra callback ----------------------------------------------------------------------


class SweepCallback(Callback):
    """Registered in conf/config.yaml (hydra.callbacks.sweep); does nothing in a plain run.

    Hydra turns an exception raised in a callback into a warning, so a refusal here exits
    (SystemExit passes through) and every other step reports its own failure."""

    def __init__(self) -> None:
        self.parent_run_id: Optional[str] = None
        self.tracking_uri = ""
        self.sweep_dir = ""
        self.expected_jobs: Optional[int] = None
        self.ended_jobs = 0
        self.failed_jobs: list[int] = []
        self.arguments: list[str] = []
        self.repeats = Repeats()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launch_dir = os.getcwd()  # hydra.job.chdir is false: where the user launched
        self.arguments = sweep_arguments(config)  # as typed, before repeats rewrite them
        self.repeats = repeats_of(config)
        apply_repeats(config, self.repeats)  # before the sweeper reads the overrides
        keys = swept_keys(config)
        jobs = planned_jobs(config)
        if jobs is None:
            sweeper = OmegaConf.select(config, "hydra.sweeper._target_")
            print(
                f"sweep: {sweeper} chooses its jobs as it goes: each job is checked as it "
                "starts, and the parent run takes the tracking settings of the command line"
            )
            cfgs = checked_jobs_of([task_config(config)], launch_dir)
        else:
            cfgs = checked_jobs(config, jobs, launch_dir, keys)
            self.expected_jobs = len(jobs)
            os.environ[SWEEP_REPEAT_ENV] = ",".join(map(str, repeat_indices(jobs, keys)))
            repeated = f", {self.repeats.describe()}" if self.repeats.count > 1 else ""
            print(
                f"sweep: {len(jobs)} jobs checked ({', '.join(keys) or 'no key'} swept{repeated})",
                flush=True,
            )
        check_one_tracking(cfgs)
        quiet_libraries(cfgs[0].cluster.verbose)  # before the parent run: MLflow's set-up lines
        # A cluster is checked for room before anything is written; a local Ray starts after
        # every check that writes nothing, so a refused sweep leaves no file either way.
        joins = joins_cluster(cfgs[0].cluster)
        if joins:
            connect_for_jobs(cfgs)
        preflight_all(cfgs)
        if not joins:
            connect_for_jobs(cfgs)
        os.environ[SWEPT_KEYS_ENV] = ",".join(keys)
        os.environ[SWEEP_JOBS_ENV] = str(self.expected_jobs or "")
        os.environ[SWEEP_VARIED_ENV] = ",".join(varied_keys(cfgs))
        self.sweep_dir = os.path.abspath(config.hydra.sweep.dir)
        if cfgs[0].tracking.enabled:
            self.start_parent(config, cfgs, keys)

    def start_parent(self, config: DictConfig, cfgs: list[JobConfig], keys: list[str]) -> None:
        tracking = cfgs[0].tracking
        name = "sweep " + (" ".join(self.arguments) or Path(self.sweep_dir).name)
        if self.repeats.count > 1:
            name += f" x{self.repeats.count}"
        self.tracking_uri = tracking.tracking_uri
        self.parent_run_id = create_sweep_run(
            tracking.tracking_uri,
            tracking.experiment,
            name,
            shared_params(cfgs),
            {**sweep_tags(config, cfgs, keys), "sweep.repeats": self.repeats.describe()},
        )
        os.environ[PARENT_RUN_ENV] = self.parent_run_id
        atexit.register(self.abandon)
        print(
            f"mlflow: sweep parent run {self.parent_run_id} in experiment "
            f"'{tracking.experiment}' at {tracking.tracking_uri}",
            flush=True,
        )

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self.parent_run_id is None:
            return
        self.ended_jobs += 1
        if job_return.status == JobStatus.FAILED:
            num = int(config.hydra.job.num)
            self.failed_jobs.append(num)
            error = job_return._return_value  # .return_value would raise it here
            first_line = (str(error).strip().splitlines() or [""])[0]
            name = JobSlot(num, "", "", total=self.expected_jobs).name
            print(
                f"sweep: {name} failed: {type(error).__name__}: {first_line}",
                file=sys.stderr,
                flush=True,
            )
        # Hydra raises a failed job's error only after the last job ends, and then never calls
        # on_multirun_end: the sweep is summed up after its last job, here.
        if self.expected_jobs is not None and self.ended_jobs == self.expected_jobs:
            self.finish()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.finish()
        for env in (SWEPT_KEYS_ENV, SWEEP_JOBS_ENV, SWEEP_REPEAT_ENV, SWEEP_VARIED_ENV):
            os.environ.pop(env, None)

    def finish(self) -> None:
        """Print and log the comparison report, then end the parent run (once)."""
        if self.parent_run_id is None:
            return
        run_id, self.parent_run_id = self.parent_run_id, None
        os.environ.pop(PARENT_RUN_ENV, None)
        try:
            multirun_yaml = Path(self.sweep_dir) / "multirun.yaml"
            if multirun_yaml.exists():
                MLflowLogger(self.tracking_uri, run_id).log_artifact(str(multirun_yaml))
            print()
            write_report(self.tracking_uri, run_id, str(Path(self.sweep_dir) / "report"))
        except Exception as e:  # the runs are in MLflow whatever the report does: say why not
            print(
                f"sweep: the comparison report failed ({type(e).__name__}: {e}); run "
                f"`{python_m('cluster.report')} {run_id} --tracking-uri {self.tracking_uri}`",
                file=sys.stderr,
                flush=True,
            )
        finally:
            end_run(self.tracking_uri, run_id, ok=not self.failed_jobs)
        state = f"FAILED (jobs {self.failed_jobs} failed)" if self.failed_jobs else "FINISHED"
        print(
            f"mlflow: sweep parent run {run_id} {state}; compare its runs with: "
            f"{ui_command(self.tracking_uri)}, then "
            f"{ui_url(self.tracking_uri, experiment_of(self.tracking_uri, run_id))}",
            flush=True,
        )

    def abandon(self) -> None:
        """At exit with the parent still open (interrupted, or a job exited the process)."""
        if self.parent_run_id is None:
            return
        end_run(self.tracking_uri, self.parent_run_id, ok=False, status="KILLED")
        self.parent_run_id = None
