"""Typed configuration of one rank's training: model, engine, optimizer, data and the loop.

Plain dataclasses, no Hydra and no Ray. The Ray layer's job config (cluster/config.py) extends
`TrainerConfig` with where the workers run, tracking and fault drills; Hydra types conf/ with it
and `OmegaConf.to_object` turns the composed config into these dataclasses, so everything below
takes them. Every field has a docstring; `validate()` raises `ConfigError` naming the key, the
value given and what would be valid, before any worker starts. The engine's own section,
`ShardingConfig`, lives with the engine (trainer/fsdp/config.py) and the model's, `ModelConfig`
with its presets (`model=8b` on the command line: `PRESETS`), with the model
(trainer/model/config.py); both are re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from trainer.fsdp.config import ConfigError, DType, ShardingConfig, ShardingStrategy, fail
from trainer.model.config import FAMILY_NAMES, PRESETS, ModelConfig, model_config
from trainer.numbers import finite, positive

from .combinations import check_combinations

__all__ = [
    "FAMILY_NAMES",
    "PRESETS",
    "ConfigError",
    "DType",
    "DataConfig",
    "ModelConfig",
    "SourceConfig",
    "OptimConfig",
    "ShardingConfig",
    "ShardingStrategy",
    "TrainConfig",
    "TrainerConfig",
    "fail",
    "model_config",
]


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
    """Decoupled weight decay on every tensor of two or more dimensions: the linear layers'
    weights and the token embedding (as nanoGPT and Hugging Face's Trainer do); none on the
    norms' gains and the biases (one dimension)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (the norm is still computed)."""
    state_dtype: str = "float32"
    """AdamW's two moments: float32 (8 bytes a parameter) or bfloat16 (4 bytes; trainer/optim.py's
    AdamW computes the update in fp32 and rounds the moments stochastically)."""

    def validate(self) -> None:
        """Every number finite: a NaN passes any `x < 0` check, and an infinite or NaN learning
        rate, decay or clip turns the first update into NaN parameters."""
        if not positive(self.lr):
            fail("optim.lr", self.lr, "a finite positive number")
        if not finite(self.min_lr_ratio) or not 0 <= self.min_lr_ratio <= 1:
            fail("optim.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            fail("optim.warmup_steps", self.warmup_steps, "an integer >= 0")
        if not finite(self.weight_decay) or self.weight_decay < 0:
            fail("optim.weight_decay", self.weight_decay, "a finite number >= 0")
        for key in ("beta1", "beta2"):
            v = getattr(self, key)
            if not finite(v) or not 0 <= v < 1:
                fail(f"optim.{key}", v, "a number in [0, 1)")
        if not positive(self.eps):
            fail("optim.eps", self.eps, "a finite positive number (AdamW divides by it)")
        if not finite(self.grad_clip) or self.grad_clip < 0:
            fail("optim.grad_clip", self.grad_clip, "a finite number >= 0 (0 disables clipping)")
        if self.state_dtype not in STATE_DTYPES:
            fail("optim.state_dtype", self.state_dtype, " or ".join(STATE_DTYPES))


STATE_DTYPES = ("float32", "bfloat16")


FORMATS = ("auto", "text", "jsonl", "parquet")
PREPARE_WITH = ("auto", "ray", "process")
KINDS = ("text", "chat")
TRAIN_ON = ("assistant", "last_assistant", "completion", "all")
OVERLONG = ("truncate", "drop")


@dataclass
class SourceConfig:
    """One source of documents in a weighted mix (data.mix)."""

    path: str = ""
    """'stdlib', a file, a folder, a glob or a pyarrow.fs URI (s3://bucket/corpus/*.parquet)."""
    weight: float = 1.0
    """Share of the training sequences drawn from this source (weights are normalised)."""
    format: str = "auto"
    """text (a file is a document), jsonl (a record is a document), parquet (a row is a
    document), or auto (by file extension)."""
    text_column: str = "text"
    """The document's text: the JSON field of a jsonl record or the column of a Parquet row."""

    def validate(self, key: str = "data.mix[]") -> None:
        if not self.path:
            fail(f"{key}.path", self.path, "a file, folder, glob or URI")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            fail(f"{key}.weight", self.weight, "a positive number")
        if self.format not in FORMATS:
            fail(f"{key}.format", self.format, ", ".join(FORMATS))
        if not self.text_column:
            fail(f"{key}.text_column", self.text_column, "a field or column name")


@dataclass
class DataConfig:
    """Documents from files or object storage, tokenized once into token shards, then streamed.

    python -m trainer.data inspect <prepared_dir> shows what a preparation holds."""

    source: str = "stdlib"
    """'stdlib' (the Python standard library's source files), a file, a folder, a glob or a
    pyarrow.fs URI (s3://, gs://, hdfs://); ignored when data.mix is set."""
    format: str = "auto"
    """text, jsonl, parquet, or auto (by file extension: .jsonl/.json(.gz|.zst), .parquet,
    anything else is text)."""
    text_column: str = "text"
    """The document's text: the JSON field of a jsonl record or the column of a Parquet row."""
    mix: list[SourceConfig] = field(default_factory=list)
    """Several sources with weights, instead of data.source."""
    tokenizer: str = "byte"
    """'byte' (256 byte values, end of document = 0) or a Hugging Face tokenizer.json (path or
    pyarrow.fs URI); `python -m trainer.data train-tokenizer` makes one. With model=hf, unset
    or 'byte' means model.hf_path's own tokenizer.json when it has one
    (trainer/data/run_defaults.py)."""
    eod_token: Optional[str] = None
    """The tokenizer's end-of-document token; None finds it by its usual names."""
    prepared_dir: str = "data/prepared"
    """Where the token shards and their manifest are written and read (a path or URI)."""
    max_bytes: int = 0
    """Cap on the input bytes taken from each source when preparing (0 = no cap)."""
    eval_fraction: Optional[float] = 0.0
    """Documents held out for evaluation, chosen by a hash of their content (0 = none). null
    (data=chat's): 0.01 when the run evaluates (train.eval_every > 0), none when it does not, so
    a run that never evaluates trains on every conversation (`for_run`; the preparation's digest
    holds the number used)."""
    eval_sequences: int = 64
    """Sequences of the held-out documents that train.eval_every evaluates (a fixed set)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    seed: int = 0
    """Seed of the global sample order (a function of seed, epoch and position only)."""
    prefetch_steps: int = 2
    """Steps of batches each worker reads ahead in the background (its memory bound)."""
    prepare_with: str = "auto"
    """ray (Ray Data tasks on the cluster's CPUs), process (this process), or auto: Ray Data
    when the sources hold more than 256 MiB."""
    kind: str = "text"
    """text (pre-training: documents back to back, windows cut across them) or chat
    (fine-tuning: conversations rendered with the chat template, loss on data.train_on, whole
    conversations packed into windows at preparation). data=chat sets it."""
    messages_column: str = "messages"
    """chat: the field or column holding a list of {role, content} messages."""
    prompt_column: str = "prompt"
    """chat: a record without data.messages_column may hold a prompt and a completion instead
    (rendered as one user and one assistant turn)."""
    completion_column: str = "completion"
    """chat: the completion of a prompt/completion record."""
    chat_template: Optional[str] = None
    """chat: a Jinja chat template (a file, a URI or the template itself); None takes the one
    saved beside data.tokenizer: chat_template.jinja (transformers 5 saves it there, and reads it
    first), else tokenizer_config.json's `chat_template`, else chat_template.json's."""
    eot_token: Optional[str] = None
    """chat: the token that ends an assistant turn (trained on, and where generation stops);
    None takes the tokenizer_config.json's eos_token."""
    train_on: str = "assistant"
    """chat: the loss tokens. assistant (every assistant turn and the end-of-turn token that
    closes it, never headers or prompts), last_assistant (the last assistant turn only),
    completion (the completion of prompt/completion records), all (every token but padding)."""
    pack: bool = True
    """chat: whole conversations packed into data.seq_len windows (attention does not cross
    them, positions restart in each); false: one conversation per window, padded."""
    overlong: str = "truncate"
    """chat: a conversation longer than a window is truncated to it, or dropped (counted)."""
    document_mask: bool = False
    """text: attention does not cross the end-of-document token inside a window and positions
    restart after it (chat windows always have it)."""

    def validate(self) -> None:
        if self.seq_len <= 0:
            fail("data.seq_len", self.seq_len, "a positive integer")
        if self.max_bytes < 0:
            fail("data.max_bytes", self.max_bytes, "an integer >= 0 (0 = no cap)")
        if self.eval_fraction is not None and (
            not finite(self.eval_fraction) or not 0 <= self.eval_fraction < 1
        ):
            fail(
                "data.eval_fraction",
                self.eval_fraction,
                "a number in [0, 1), or null (0.01 when the run evaluates, else none)",
            )
        if self.eval_sequences <= 0:
            fail("data.eval_sequences", self.eval_sequences, "a positive integer")
        if self.prefetch_steps <= 0:
            fail("data.prefetch_steps", self.prefetch_steps, "a positive integer")
        if self.prepare_with not in PREPARE_WITH:
            fail("data.prepare_with", self.prepare_with, ", ".join(PREPARE_WITH))
        if not self.mix and not self.source:
            fail("data.source", self.source, "'stdlib', a file, a folder, a glob or a URI")
        for i, source in enumerate(self.mix):
            source.validate(f"data.mix[{i}]")
        if not self.tokenizer:
            fail(
                "data.tokenizer",
                self.tokenizer,
                "'byte' or the path/URI of a tokenizer.json (the model's: "
                "data.tokenizer=/models/X/tokenizer.json; model=hf takes model.hf_path's own)",
            )
        if self.kind not in KINDS:
            fail("data.kind", self.kind, ", ".join(KINDS))
        if self.train_on not in TRAIN_ON:
            fail("data.train_on", self.train_on, ", ".join(TRAIN_ON))
        if self.overlong not in OVERLONG:
            fail("data.overlong", self.overlong, ", ".join(OVERLONG))
        if self.kind == "chat" and self.tokenizer == "byte":
            fail(
                "data.tokenizer",
                self.tokenizer,
                "with data.kind=chat, a tokenizer.json (its special tokens end the turns): "
                "the model's, e.g. data.tokenizer=/models/X/tokenizer.json",
            )
        for key in ("messages_column", "prompt_column", "completion_column"):
            if not getattr(self, key):
                fail(f"data.{key}", getattr(self, key), "a field or column name")

    def for_run(self, evaluating: bool) -> "DataConfig":
        """This data as a run reads it: eval_fraction null made 0.01 when the run evaluates
        (train.eval_every > 0) and 0 when it does not; a number stays as it is."""
        if self.eval_fraction is not None:
            return self
        return dataclasses.replace(self, eval_fraction=0.01 if evaluating else 0.0)

    @property
    def holdout(self) -> float:
        """The fraction a preparation holds out: eval_fraction, null read as none (a run that
        evaluates has made it a number: for_run)."""
        return self.eval_fraction or 0.0

    def sources(self) -> list[SourceConfig]:
        """The sources, as a mix: data.mix, or data.source alone with weight 1."""
        if self.mix:
            return list(self.mix)
        return [SourceConfig(self.source, 1.0, self.format, self.text_column)]


FLOAT8_RECIPES = ("tensorwise", "rowwise")


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
    """Save a sharded checkpoint every this many steps (and at the end); 0 = only at the end.
    Checkpoints go to <cluster.storage_path>/<cluster.run_name>/checkpoints."""
    keep_checkpoints: int = 3
    """Newest checkpoints to keep."""
    snapshot_every: Optional[int] = None
    """In-memory snapshots (the launcher says where: peers' memory under Ray; none without):
    every this many steps each rank hands a copy of its shard state (checkpoint format) to be
    kept off its node, two generations at most, so a crash loses at most this many steps and a
    restart resumes from memory, at any world size. null: as often as the copy hides behind
    compute (a snapshot at every step where the previous one has been sent), which under Ray
    means on GPU workers only (on CPU workers the copy competes with training for the CPUs:
    `snapshots_on`); 0: none."""
    eval_every: int = 0
    """Evaluate the loss on data.eval_sequences held-out sequences every this many steps and at
    the end (0 = never; needs data.eval_fraction > 0)."""
    device: str = "auto"
    """'auto' (cuda if the worker has a GPU), 'cpu' or 'cuda'."""
    sample_prompts: int = 2
    """At each evaluation, this many fixed prompts of the eval split are generated from (greedy)
    and logged to MLflow as samples/step_N.txt (0 = none)."""
    sample_tokens: int = 48
    """New tokens generated per sample prompt (fewer if it ends its turn)."""
    compile: bool = False
    """Compile each transformer block with torch.compile (the engine's hooks and collectives stay
    outside the compiled regions, so the next unit's all-gather still overlaps the block)."""
    loss_chunk_tokens: Optional[int] = None
    """Output projection + cross-entropy over chunks of this many tokens, each chunk's gradient
    computed at once, so the full [tokens, vocab] fp32 logits never exist (trainer/loss.py).
    null: on from a vocabulary of 16,384 up, in chunks of about 256 MiB of fp32 logits (512
    tokens at 128k); 0: off (the plain loss); N: chunks of N tokens."""
    float8: bool = False
    """torchao's Float8 linear layers inside the blocks (CUDA sm_89 or newer; on the CPU torchao's
    emulation, for tests; needs the `float8` extra: pip install 'elastic-fsdp[float8]')."""
    float8_recipe: str = "tensorwise"
    """Float8 scaling: tensorwise or rowwise."""
    context_parallel: int = 1
    """Ranks each sequence is split over (the mesh's `context` axis, for long sequences): the
    tokens of every sample go to N ranks that read the same samples, 2N chunks in causal balance
    (rank i holds chunks i and 2N-1-i), attention gathering the keys and values of the whole
    sequence per layer (docs/engine.md, "Long sequences"). Positions, document masks and the
    loss normalisation are those of the whole sequence, so any (data, context) split follows the
    same curve. N divides the world size (under HYBRID_SHARD the shard group); a data.seq_len
    that 2N does not divide is padded (the padding is no loss token). 1: off."""
    max_bad_steps: int = 3
    """A step whose loss or gradient norm is not finite (all ranks agree) is not applied; this
    many in a row stop the run with an error naming the step (a checkpoint holding a non-finite
    tensor is never written)."""
    freeze: list[str] = field(default_factory=list)
    """Parameters that do not train: fnmatch patterns (case-sensitive; `*` crosses dots) over
    parameter names or module names, a module's naming all its parameters: "visual.*" (a
    vision tower), "tok_embeddings", "layers.0.*". A frozen parameter has no gradient, no
    reduce-scatter and no optimizer state (the engine gives it a flat of its own; the planner
    prices it so) and its weights stay bitwise what they were loaded or initialised as, through
    every checkpoint and the export. A pattern that names no parameter is refused, listing the
    model's top-level modules. A resume may change the set: a parameter frozen now keeps its
    weights and drops its saved AdamW state, one trainable now that had none starts from zero
    moments (trainer/checkpoint/optim_state.py)."""

    def validate(self) -> None:
        for key in (
            "steps",
            "global_batch_size",
            "micro_batches",
            "log_every",
            "max_bad_steps",
            "context_parallel",
        ):
            v = getattr(self, key)
            if not isinstance(v, int) or v <= 0:
                fail(f"train.{key}", v, "a positive integer")
        if self.checkpoint_every < 0:
            fail("train.checkpoint_every", self.checkpoint_every, "an integer >= 0")
        if self.keep_checkpoints < 1:
            fail("train.keep_checkpoints", self.keep_checkpoints, "an integer >= 1")
        if self.snapshot_every is not None and (
            not isinstance(self.snapshot_every, int) or self.snapshot_every < 0
        ):
            fail(
                "train.snapshot_every",
                self.snapshot_every,
                "null (as often as the copy hides behind compute), 0 (none) or steps > 0",
            )
        if self.eval_every < 0:
            fail("train.eval_every", self.eval_every, "an integer >= 0 (0 = never)")
        for key in ("sample_prompts", "sample_tokens"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 0:
                fail(f"train.{key}", v, "an integer >= 0")
        if self.device not in ("auto", "cpu", "cuda"):
            fail("train.device", self.device, "auto, cpu or cuda")
        if self.loss_chunk_tokens is not None and (
            not isinstance(self.loss_chunk_tokens, int) or self.loss_chunk_tokens < 0
        ):
            fail(
                "train.loss_chunk_tokens",
                self.loss_chunk_tokens,
                "null (on for large vocabularies), 0 (off) or a positive number of tokens",
            )
        if self.float8_recipe not in FLOAT8_RECIPES:
            fail("train.float8_recipe", self.float8_recipe, " or ".join(FLOAT8_RECIPES))
        if not isinstance(self.freeze, (list, tuple)) or not all(
            isinstance(p, str) and p.strip() for p in self.freeze
        ):
            fail(
                "train.freeze",
                self.freeze,
                'a list of fnmatch patterns over parameter or module names, e.g. ["visual.*"]',
            )

    def snapshots_on(self, gpu_workers: bool) -> bool:
        """Whether in-memory snapshots are taken (where a launcher offers somewhere to keep
        them): snapshot_every N > 0 always, 0 never, null on GPU workers only. On CPU workers
        the training itself uses the CPUs the background copy would need (benchmarks.snapshots:
        1.44-1.47x the step time), so null means none there; set N to have them anyway."""
        every = self.snapshot_every
        return every != 0 and (every is not None or gpu_workers)


@dataclass
class TrainerConfig:
    """Everything one rank's training loop needs (trainer/loop.py)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self):
        """Every section, then the checks across them; returns self."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        if self.data.seq_len > self.model.max_seq_len:
            fail(
                "data.seq_len",
                self.data.seq_len,
                f"at most model.max_seq_len={self.model.max_seq_len}",
            )
        check_combinations(self)
        if self.train.eval_every and not self.data.eval_fraction:
            fail(
                "train.eval_every",
                self.train.eval_every,
                "0, or a positive number with data.eval_fraction > 0 (the held-out documents)",
            )
        return self
