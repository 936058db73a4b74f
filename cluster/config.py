"""The job's config: its schema, its checks, the trip to the workers. The ground floor of
cluster/: it imports nothing of cluster/ but the run folder's layout (run/layout.py, which
imports nothing of cluster/ itself), and every other module of cluster/ may import it.

    cfg = checked_config(dictcfg, launch_dir)          # cluster/preflight.py: typed, validated
    trainer = build_trainer(cfg, {"job": job_to_dict(cfg)})
    cfg = job_from_dict(config["job"])                 # in each worker

`JobConfig` is the training job (trainer.config.TrainerConfig: model, sharding, optim, data,
train) plus what only the Ray layer knows: where the workers run (`cluster`), MLflow
(`tracking`) and fault drills (`fault`). Hydra composes it (cluster/compose.py: the schema in
its ConfigStore, the model presets, model=hf's resolver) and hands it over as these dataclasses.

A run's files live in its Ray run folder, <cluster.storage_path>/<cluster.run_name>, laid out
as cluster/run/layout.py says (its checkpoints in checkpoints/).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Optional

from cluster.run.layout import checkpoint_root
from trainer.config import (
    ConfigError,  # noqa: F401 -- cluster/ takes the config's error from here
    ShardingConfig,
    ShardingStrategy,
    TrainConfig,
    TrainerConfig,
    fail,
)

# ---- value checks: every number finite and in range (NaN passes `x <= 0`) ------------------------

MAX_FAILURES = "-1 (unlimited) or an integer >= 0"
RUN_NAME_FORBIDDEN = "/\\?#"
RUN_NAME_VALID = (
    "one path component: not empty, not starting with '.', without '/', '\\', '?', '#' or "
    "control characters (e.g. 'elastic-fsdp' or 'llama-1b.v2'); it names the folder "
    "<cluster.storage_path>/<run_name>"
)


def check_count(key: str, value, minimum: int, valid: str = "") -> None:
    """An integer >= minimum (a bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        fail(key, value, valid or f"an integer >= {minimum}")


def check_positive(key: str, value, valid: str) -> None:
    """A finite number > 0: NaN and inf are refused (NaN compares False with everything)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        fail(key, value, valid)


def check_run_name(name: str) -> None:
    """The run's folder is <storage_path>/<run_name>: a name that is not exactly one path
    component would write outside the storage root ('..', '/') or into a hidden folder."""
    safe = (
        bool(name)
        and not name.startswith(".")
        and not any(c in RUN_NAME_FORBIDDEN for c in name)
        and name.isprintable()
    )
    if not safe:
        fail("cluster.run_name", name, RUN_NAME_VALID)


@dataclass
class ClusterConfig:
    """Where the workers run: a local Ray instance or a Ray cluster."""

    address: Optional[str] = None
    """Ray address; None uses RAY_ADDRESS if set, else starts a local Ray instance."""
    num_workers: int = 2
    """Workers (one GPU each on GPU clusters) when not elastic."""
    min_workers: Optional[int] = None
    """Elastic lower bound; set with max_workers to let the run resize."""
    max_workers: Optional[int] = None
    """Elastic upper bound."""
    use_gpu: bool = False
    """One GPU per worker actor (NCCL) instead of CPU (gloo)."""
    cpus_per_worker: float = 1.0
    """CPUs reserved for each worker actor."""
    storage_path: str = "runs"
    """Ray Train storage: a local path or a pyarrow.fs URI (s3://, gs://). The run's checkpoints
    go to <storage_path>/<run_name>/checkpoints."""
    run_name: str = "elastic-fsdp"
    """Stable run name: resubmitting the same name resumes from its last checkpoint."""
    max_failures: int = 3
    """Worker-group restarts allowed after failures (-1 = unlimited)."""
    pg_timeout_s: float = 600.0
    """Process-group (collective) timeout in seconds."""
    device_memory_gb: Optional[float] = None
    """GiB of one worker's device. When set, the memory planner (trainer/plan) checks before any
    worker starts that the job fits at the smallest world size, and fails with the breakdown and a
    recommendation if it does not. On CUDA workers the device's real size is checked regardless."""
    host_memory_gb: Optional[float] = None
    """GiB of host memory per node, shared by its workers (offloaded state, pinned gradient
    staging, in-memory snapshots, ~2 GiB per worker process). On GPU workers with
    device_memory_gb set, checked with it before any worker starts; null: 1024
    (trainer/plan/levers.py DEFAULT_HOST_MEMORY_GB)."""
    elastic_resize_monitor_interval_s: float = 60.0
    """How often Ray Train checks whether an elastic run can grow (ScalingConfig field)."""
    drain_on_grow_timeout_s: float = 120.0
    """When Ray grows a running elastic group (a node joined), the group first checkpoints the
    step it is at (cluster/elastic/grow.py), so the join loses no step; Ray waits at most this
    long for it (a step and a checkpoint), then grows it anyway. Ray's controller does nothing
    else meanwhile: a group that dies during the drain is restarted only after this long.
    0: no drain on grow."""
    grow_settle_s: float = 5.0
    """Before Ray grows a running elastic group, wait up to this long for more nodes (the nodes of
    one scale-up join seconds apart) and grow onto all of them at once, up to max_workers: one
    restart instead of one per node. The group trains on meanwhile. 0: grow at once."""
    grow_spares_wait_s: float = 20.0
    """Where spares are on: before growing onto nodes that joined, the controller has each of
    them start its spare worker processes and waits up to this long (the group trains on) until
    they have preloaded, so the bigger group starts in warm processes there too. 0: no wait."""
    health_check_interval_s: float = 1.0
    """How often Ray Train's controller polls the workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S,
    Ray's default 2 s): a worker that died is noticed within this long, which is part of every
    crash's recovery (2.3 s here with spares). Each poll is a call to every worker: at a
    thousand workers, 1 s means a thousand calls a second on the controller. The environment
    variable, when you set it, wins."""
    spare_workers: Optional[bool] = None
    """After each group's first step, every worker has its node start a spare worker process,
    which imports torch, Ray Train and MLflow while it waits: a restarted group starts in the
    spares instead of in new processes (cluster/elastic/spares.py; a worker crash recovered in 2.3 s
    instead of 10 on the 2-CPU test machine). A spare holds ~0.54 GiB of host memory, and its
    imports take CPU once (~5 s of a core; the run's 2-core CPU workers slowed meanwhile).
    null: on for GPU workers (use_gpu), off for CPU workers, whose steps would compete with the
    spares' imports for the cores; true or false: always or never."""
    takeover: bool = False
    """Take the run name's lease from a launch that still holds it (cluster/run/lease.py). Only for
    a holder you know is gone: two live launches of one name write into each other's run."""
    lease_ttl_s: float = 120.0
    """The run lease expires this long after its holder's last heartbeat (every ttl / 4): a
    crashed driver's run can be resumed by a new launch after at most this long (at once when
    the holder is known dead: its pid gone on this host, or its Ray job finished)."""
    wait_for_lease_s: float = 0.0
    """A launch whose run name is held by a live launch waits up to this long for it to end
    (schedulers that retry, a RayJob resubmitting) instead of failing at once; 0: no wait."""
    verbose: bool = False
    """Also print the libraries' INFO chatter (cluster/logs.py): Ray Train's lines (a line per
    report per rank, the worker group's start), Ray's token-auth note, MLflow's system-metrics
    monitor and database set-up, matplotlib's font manager. Off: a healthy run prints only its
    own progress, notes and any warnings and errors."""

    @property
    def spares_on(self) -> bool:
        """spare_workers, with null resolved (on for GPU workers)."""
        return self.use_gpu if self.spare_workers is None else self.spare_workers

    def validate(self) -> None:
        for key in ("num_workers",) + (("min_workers", "max_workers") if self.elastic else ()):
            check_count(f"cluster.{key}", getattr(self, key), minimum=1)
        if (self.min_workers is None) != (self.max_workers is None):
            fail(
                "cluster.min_workers/max_workers",
                (self.min_workers, self.max_workers),
                "both set (elastic) or both null (fixed num_workers)",
            )
        if self.elastic and self.min_workers > self.max_workers:
            fail(
                "cluster.min_workers",
                self.min_workers,
                f"1 <= min_workers <= max_workers={self.max_workers}",
            )
        check_count("cluster.max_failures", self.max_failures, minimum=-1, valid=MAX_FAILURES)
        check_positive("cluster.cpus_per_worker", self.cpus_per_worker, "a positive number")
        check_positive("cluster.pg_timeout_s", self.pg_timeout_s, "a positive number of seconds")
        check_positive(
            "cluster.elastic_resize_monitor_interval_s",
            self.elastic_resize_monitor_interval_s,
            "a positive number of seconds",
        )
        if self.host_memory_gb is not None:
            check_positive(
                "cluster.host_memory_gb", self.host_memory_gb, "null or a positive number of GiB"
            )
        if self.device_memory_gb is not None:
            check_positive(
                "cluster.device_memory_gb",
                self.device_memory_gb,
                "null or a positive number of GiB",
            )
        if not self.storage_path:
            fail("cluster.storage_path", self.storage_path, "a local path or a pyarrow.fs URI")
        check_run_name(self.run_name)
        check_positive("cluster.lease_ttl_s", self.lease_ttl_s, "a positive number of seconds")
        if not (math.isfinite(self.wait_for_lease_s) and self.wait_for_lease_s >= 0):
            fail("cluster.wait_for_lease_s", self.wait_for_lease_s, "seconds >= 0 (0: no wait)")
        timeout = self.drain_on_grow_timeout_s
        if not (math.isfinite(timeout) and timeout >= 0):
            fail(
                "cluster.drain_on_grow_timeout_s",
                timeout,
                "0 (no drain on grow) or a positive number of seconds",
            )
        settle = self.grow_settle_s
        if not (math.isfinite(settle) and settle >= 0):
            fail(
                "cluster.grow_settle_s", settle, "0 (grow at once) or a positive number of seconds"
            )
        check_positive(
            "cluster.health_check_interval_s",
            self.health_check_interval_s,
            "a positive number of seconds",
        )

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.max_workers is not None

    @property
    def world_sizes(self) -> tuple[int, int]:
        """(smallest, largest) world size the run may have."""
        if self.min_workers is None:
            return self.num_workers, self.num_workers
        return self.min_workers, self.max_workers


FAULT_KINDS = ("crash", "drain")


@dataclass
class FaultConfig:
    """Fault injection for tests and drills: each fault fires once per run, never again on
    resume."""

    kill_rank: int = -1
    """Rank to hit; -1 disables fault injection."""
    at_step: int = -1
    """Step before which the fault fires."""
    kind: str = "crash"
    """crash: the worker process dies at once (os._exit); drain: SIGTERM, a graceful leave."""

    def validate(self) -> None:
        if self.kind not in FAULT_KINDS:
            fail("fault.kind", self.kind, ", ".join(FAULT_KINDS))
        if self.kill_rank >= 0 and self.at_step < 0:
            fail("fault.at_step", self.at_step, "a step >= 0 when fault.kill_rank is set")

    @property
    def enabled(self) -> bool:
        return self.kill_rank >= 0


@dataclass
class TrackingConfig:
    """MLflow tracking."""

    tracking_uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI; a relative sqlite path is made absolute at launch.
    MLFLOW_TRACKING_URI in the environment overrides it."""
    experiment: str = "elastic-fsdp"
    """MLflow experiment name."""
    enabled: bool = True
    """Log to MLflow at all."""
    system_metrics_interval_s: Optional[float] = None
    """Seconds between system metric samples (CPU, memory, disk, network, GPUs) per node; null
    picks it from the run's remaining time at step 2 (about 30 samples, 1-30 s apart, none when
    fewer than 10 fit); 0 turns them off."""

    def validate(self) -> None:
        if not self.experiment:
            fail("tracking.experiment", self.experiment, "a non-empty experiment name")
        interval = self.system_metrics_interval_s
        if interval is not None and not (interval >= 0 and math.isfinite(interval)):
            fail(
                "tracking.system_metrics_interval_s",
                interval,
                "null (chosen from the run's length), 0 (off) or seconds > 0",
            )


@dataclass
class JobConfig(TrainerConfig):
    """One training job: the trainer's config plus the Ray layer's sections."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def validate(self) -> "JobConfig":
        super().validate()
        lo, hi = self.cluster.world_sizes
        if self.train.global_batch_size < hi:
            fail(
                "train.global_batch_size",
                self.train.global_batch_size,
                f"at least the largest world size ({hi}), so every rank gets a sequence",
            )
        if self.fault.enabled and self.fault.kill_rank >= lo:
            fail(
                "fault.kill_rank",
                self.fault.kill_rank,
                f"a rank below the smallest world size ({lo})",
            )
        group = self.sharding.hybrid_shard_group_size
        hybrid = self.sharding.strategy is ShardingStrategy.HYBRID_SHARD
        if hybrid and group and lo == hi and lo % group:
            # A fixed size: a group that does not divide it is a typo. An elastic run re-plans
            # at a size it does not divide (trainer/fsdp/mesh.py hybrid_group_size, logged).
            divisors = ", ".join(str(d) for d in range(1, lo + 1) if lo % d == 0)
            fail(
                "sharding.hybrid_shard_group_size",
                group,
                f"a divisor of the world size {lo} ({divisors}), or 0 (ranks per node)",
            )
        self._check_expert_degree(lo, hi)
        self._check_context_degree(lo, hi)
        return self

    def _check_expert_degree(self, lo: int, hi: int) -> None:
        """A fixed size: sharding.expert_parallel must divide the ranks the expert axis is cut
        from. An elastic run re-plans at a size it does not divide (trainer/fsdp/mesh.py
        expert_degree, logged), as HYBRID_SHARD's groups do."""
        from trainer.fsdp.mesh import mesh_shape  # noqa: PLC0415 -- torch: only for a mixture

        ep, experts = self.sharding.expert_parallel, self.model.moe_experts
        if ep == 1 or lo != hi:
            return
        whole = mesh_shape(dataclasses.replace(self.sharding, expert_parallel=1), lo, lo)
        group = whole["shard"] if whole["shard"] > 1 else whole["replicate"]
        if group % ep:
            valid = [d for d in range(1, group + 1) if group % d == 0 and experts % d == 0]
            fail(
                "sharding.expert_parallel",
                ep,
                f"a divisor of both the {experts} experts and the {group} ranks the expert axis "
                f"is cut from at {lo} workers ({', '.join(map(str, valid))})",
            )

    def splits_context(self, world_size: int) -> bool:
        """Whether train.context_parallel splits a world of `world_size` (context_splits)."""
        return context_splits(self.sharding, self.train.context_parallel, world_size)

    def _check_context_degree(self, lo: int, hi: int) -> None:
        """train.context_parallel must split every world the run may start at: a fixed size, or
        both ends of an elastic range. Unlike the expert axis it is never re-planned (another
        degree splits every sequence another way): an elastic run starts groups only at the
        sizes between min and max that it splits (cluster/elastic/cluster_view.py), and an end
        it does not split would be a size it could never start at."""
        cp = self.train.context_parallel
        if self.splits_context(lo) and self.splits_context(hi):
            return
        if lo == hi:
            from trainer.fsdp.mesh import context_problem  # noqa: PLC0415 -- torch, as below

            raise ConfigError(context_problem(self.sharding, lo, cp, lo))
        ends = (lo, hi)
        degrees = [d for d in range(1, lo + 1) if all(context_splits(self.sharding, d, n)
                                                      for n in ends)]  # fmt: skip
        sizes = [n for n in range(1, hi + 2 * cp + 1) if self.splits_context(n)][:6]
        fail(
            "train.context_parallel",
            cp,
            f"a degree that splits both ends of cluster.min_workers..max_workers={lo}..{hi} "
            f"({', '.join(map(str, degrees))}), or min_workers and max_workers among the world "
            f"sizes {cp} splits ({', '.join(map(str, sizes))}, ...): an elastic run starts its "
            "groups only at those",
        )

    @property
    def checkpoint_root(self) -> str:
        """The run's checkpoints: inside Ray's run folder, so one run name means one checkpoint
        history, and a resubmitted run finds its checkpoints again."""
        return checkpoint_root(self.cluster.storage_path, self.cluster.run_name)


def context_splits(sharding: ShardingConfig, context: int, world_size: int) -> bool:
    """Whether train.context_parallel=`context` splits a world of `world_size`: it divides the
    world (under HYBRID_SHARD the shard group, the ranks per node taken as the whole world: a
    node's count the driver cannot know is checked again by each worker's mesh). The one test of
    a world size: the refusal at submit and the elastic layer's choice of the next group's size
    (cluster/elastic/cluster_view.py) both ask here."""
    if context == 1:
        return True
    from trainer.fsdp.mesh import context_problem  # noqa: PLC0415 -- torch: only for context

    return context_problem(sharding, world_size, context, world_size) is None


def snapshots_on(cfg: JobConfig) -> bool:
    """Whether the job's workers keep in-memory snapshots: train.snapshot_every, given whether
    they are GPU workers (TrainConfig.snapshots_on decides; the memory planner asks it too)."""
    return TrainConfig.snapshots_on(cfg.train, gpu_workers=cfg.cluster.use_gpu)


# ---- the trip to the workers --------------------------------------------------------------------


def job_to_dict(cfg: JobConfig) -> dict:
    """The form Ray ships to each worker (train_loop_config): builtins and our enums, which pickle
    the same under any Ray version and show readably in Ray's dashboard."""
    return dataclasses.asdict(cfg)


def job_from_dict(data: dict) -> JobConfig:
    """Inverse of job_to_dict; an unknown section or key raises TypeError naming it."""
    sections = typing.get_type_hints(JobConfig)
    unknown = set(data) - set(sections)
    if unknown:
        raise TypeError(f"unknown JobConfig sections {sorted(unknown)}; valid: {sorted(sections)}")
    return JobConfig(**{name: sections[name](**data[name]) for name in data})


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """Dataclass tree -> {'train.steps': 60, ...}: the MLflow params of a run."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
