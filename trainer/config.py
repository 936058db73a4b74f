"""Typed configuration for one training job.

Plain dataclasses, no Hydra and no Ray: the Hydra entry point (cluster/train.py) turns the
DictConfig into a `JobConfig` with `OmegaConf.to_object` and everything below takes these.
Every field has a docstring-comment; `validate()` raises `ConfigError` naming the key, the value
given and what would be valid, before any worker starts.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Optional


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key, the value and what is valid."""


def _fail(key: str, value, valid: str) -> None:
    raise ConfigError(f"invalid config: {key}={value!r}; valid: {valid}")


class ShardingStrategy(str, enum.Enum):
    """How parameters, gradients and optimizer state are spread over ranks (names as in FSDP)."""

    FULL_SHARD = "FULL_SHARD"  # shard everything; free gathered params after forward
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # shard everything; keep gathered params until backward ends
    NO_SHARD = "NO_SHARD"  # replicate params; all-reduce gradients (DDP)
    HYBRID_SHARD = "HYBRID_SHARD"  # FULL_SHARD inside a node-sized group, replicate across groups

    @classmethod
    def parse(cls, value: str, key: str = "sharding.strategy") -> "ShardingStrategy":
        if isinstance(value, cls):
            return value
        name = str(value).upper()
        if name not in cls.__members__:
            _fail(key, value, ", ".join(cls.__members__))
        return cls[name]


DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder (trainer/model.py)."""

    name: str = "tiny"
    """Preset name, for the record (tiny, 125m, 1b, 8b)."""
    vocab_size: int = 256
    """Vocabulary size; byte-level data needs at least 256."""
    dim: int = 256
    """Model width (hidden size)."""
    n_layers: int = 4
    """Number of transformer blocks (one engine unit each)."""
    n_heads: int = 4
    """Attention heads."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention; None means n_heads."""
    ffn_dim: int = 768
    """Hidden size of the SwiGLU feed-forward."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables are built for."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of matrices."""

    def validate(self) -> None:
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            v = getattr(self, key)
            if not isinstance(v, int) or v <= 0:
                _fail(f"model.{key}", v, "a positive integer")
        if self.vocab_size < 256:
            _fail("model.vocab_size", self.vocab_size, "at least 256 (byte-level tokens)")
        if self.dim % self.n_heads:
            _fail("model.n_heads", self.n_heads, f"a divisor of model.dim={self.dim}")
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            _fail("model.n_kv_heads", self.n_kv_heads, f"a divisor of model.n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            _fail("model.n_heads", self.n_heads, "a value giving an even head dim (rotary pairs)")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


@dataclass
class ShardingConfig:
    """The engine (trainer/fsdp): strategy, precision, overlap and activation checkpointing."""

    strategy: str = "FULL_SHARD"
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD."""
    param_dtype: str = "float32"
    """Compute dtype of gathered parameters: float32, bfloat16 or float16."""
    reduce_dtype: str = "float32"
    """Dtype gradients are reduced in: float32, bfloat16 or float16."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (non-reentrant)."""
    forward_prefetch: bool = True
    """Issue the next unit's all-gather before the current unit computes."""
    backward_prefetch: bool = True
    """Issue the previous unit's all-gather before the current unit's backward."""
    max_gathers_in_flight: int = 2
    """Bound on all-gathers issued but not yet consumed (caps gathered-parameter memory)."""
    max_reductions_in_flight: int = 2
    """Bound on gradient reductions issued but not yet folded into the fp32 gradient shards: the
    oldest is waited for when a newer one is issued, so unsharded gradients never pile up."""
    hybrid_shard_group_size: int = 0
    """HYBRID_SHARD shard-group size; 0 takes LOCAL_WORLD_SIZE (ranks per node)."""
    trace: bool = False
    """Record issue/wait of every collective and start/end of every unit (for schedule tests)."""

    def validate(self) -> None:
        ShardingStrategy.parse(self.strategy)
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(self, key) not in DTYPES:
                _fail(f"sharding.{key}", getattr(self, key), ", ".join(DTYPES))
        if not isinstance(self.max_gathers_in_flight, int) or self.max_gathers_in_flight < 1:
            _fail("sharding.max_gathers_in_flight", self.max_gathers_in_flight, "an integer >= 1")
        if not isinstance(self.max_reductions_in_flight, int) or self.max_reductions_in_flight < 1:
            _fail("sharding.max_reductions_in_flight", self.max_reductions_in_flight, "an integer >= 1")
        if self.hybrid_shard_group_size < 0:
            _fail("sharding.hybrid_shard_group_size", self.hybrid_shard_group_size,
                  "0 (ranks per node) or a positive divisor of the world size")


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay; weight decay on matrices only."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms, biases or embeddings' gains)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (the norm is still computed)."""

    def validate(self) -> None:
        if not self.lr > 0:
            _fail("optim.lr", self.lr, "a positive number")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail("optim.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        if self.warmup_steps < 0:
            _fail("optim.warmup_steps", self.warmup_steps, "an integer >= 0")
        if self.weight_decay < 0:
            _fail("optim.weight_decay", self.weight_decay, "a number >= 0")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                _fail(f"optim.{key}", getattr(self, key), "a number in [0, 1)")
        if self.grad_clip < 0:
            _fail("optim.grad_clip", self.grad_clip, "a number >= 0 (0 disables clipping)")


@dataclass
class DataConfig:
    """Byte-level token data: text files turned once into Parquet token shards."""

    source: str = "stdlib"
    """'stdlib' (the Python standard library's source files) or a text file / folder path."""
    prepared_dir: str = "data/prepared"
    """Where the Parquet token shards are written and read (a path or pyarrow.fs URI)."""
    max_bytes: int = 64 * 2**20
    """Cap on the bytes of text taken from the source when preparing (0 = no cap)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    seed: int = 0
    """Seed of the global sample order (a function of seed and epoch only)."""

    def validate(self) -> None:
        if self.seq_len <= 0:
            _fail("data.seq_len", self.seq_len, "a positive integer")
        if self.max_bytes < 0:
            _fail("data.max_bytes", self.max_bytes, "an integer >= 0 (0 = no cap)")


@dataclass
class TrainConfig:
    """The loop: steps, the global batch, checkpoints and logging."""

    steps: int = 60
    """Optimizer steps to train in total."""
    global_batch_size: int = 8
    """Sequences per optimizer step, constant at any world size (split across ranks)."""
    micro_batches: int = 1
    """Gradient-accumulation micro-batches per rank per step (reduce on the last)."""
    seed: int = 0
    """Seed of the model initialisation."""
    log_every: int = 1
    """Print and log metrics every this many steps."""
    checkpoint_every: int = 20
    """Save a sharded checkpoint every this many steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = 3
    """Newest checkpoints to keep."""
    checkpoint_dir: str = "runs/checkpoints"
    """Where checkpoints go when no Ray storage is set (a path or pyarrow.fs URI)."""
    device: str = "auto"
    """'auto' (cuda if the worker has a GPU), 'cpu' or 'cuda'."""

    def validate(self) -> None:
        for key in ("steps", "global_batch_size", "micro_batches", "log_every"):
            v = getattr(self, key)
            if not isinstance(v, int) or v <= 0:
                _fail(f"train.{key}", v, "a positive integer")
        if self.checkpoint_every < 0:
            _fail("train.checkpoint_every", self.checkpoint_every, "an integer >= 0")
        if self.keep_checkpoints < 1:
            _fail("train.keep_checkpoints", self.keep_checkpoints, "an integer >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            _fail("train.device", self.device, "auto, cpu or cuda")


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
    """Ray Train storage: a local path or a pyarrow.fs URI (s3://, gs://)."""
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
    elastic_resize_monitor_interval_s: float = 60.0
    """How often Ray Train checks whether an elastic run can grow (ScalingConfig field)."""

    def validate(self) -> None:
        if self.num_workers <= 0:
            _fail("cluster.num_workers", self.num_workers, "a positive integer")
        if (self.min_workers is None) != (self.max_workers is None):
            _fail("cluster.min_workers/max_workers", (self.min_workers, self.max_workers),
                  "both set (elastic) or both null (fixed num_workers)")
        if self.min_workers is not None and not 1 <= self.min_workers <= self.max_workers:
            _fail("cluster.min_workers", self.min_workers, f"1 <= min_workers <= max_workers={self.max_workers}")
        if self.device_memory_gb is not None and self.device_memory_gb <= 0:
            _fail("cluster.device_memory_gb", self.device_memory_gb, "null or a positive number of GiB")
        if self.cpus_per_worker <= 0:
            _fail("cluster.cpus_per_worker", self.cpus_per_worker, "a positive number")
        if self.max_failures < -1:
            _fail("cluster.max_failures", self.max_failures, "-1 (unlimited) or an integer >= 0")

    @property
    def world_sizes(self) -> tuple[int, int]:
        """(smallest, largest) world size the run may have."""
        if self.min_workers is None:
            return self.num_workers, self.num_workers
        return self.min_workers, self.max_workers


FAULT_KINDS = ("crash", "drain")


@dataclass
class FaultConfig:
    """Fault injection for tests and drills: each fault fires once per run, never again on resume."""

    kill_rank: int = -1
    """Rank to hit; -1 disables fault injection."""
    at_step: int = -1
    """Step before which the fault fires."""
    kind: str = "crash"
    """crash: the worker process dies at once (os._exit); drain: SIGTERM, a graceful leave."""

    def validate(self) -> None:
        if self.kind not in FAULT_KINDS:
            _fail("fault.kind", self.kind, ", ".join(FAULT_KINDS))
        if self.kill_rank >= 0 and self.at_step < 0:
            _fail("fault.at_step", self.at_step, "a step >= 0 when fault.kill_rank is set")

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

    def validate(self) -> None:
        if not self.experiment:
            _fail("tracking.experiment", self.experiment, "a non-empty experiment name")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def validate(self) -> "JobConfig":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        lo, hi = self.cluster.world_sizes
        if self.train.global_batch_size < hi:
            _fail("train.global_batch_size", self.train.global_batch_size,
                  f"at least the largest world size ({hi}), so every rank gets a sequence")
        if self.fault.enabled and self.fault.kill_rank >= lo:
            _fail("fault.kill_rank", self.fault.kill_rank, f"a rank below the smallest world size ({lo})")
        if self.data.seq_len > self.model.max_seq_len:
            _fail("data.seq_len", self.data.seq_len, f"at most model.max_seq_len={self.model.max_seq_len}")
        return self


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """Dataclass tree -> {'train.steps': 60, ...}: MLflow params and digests use this."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
