"""One rank's training loop. Ray-free: it is handed rank, world size and callbacks.

Runs under Ray Train (cluster/worker.py) and under plain torch.multiprocessing + gloo in tests:

    dist.init_process_group("gloo", rank=r, world_size=w)
    result = run_training(cfg, WorkerContext(rank=r, world_size=w, checkpoint_root="/tmp/ckpt"))

The story of a run: build the engine around the model (trainer/fsdp.parallelize), resume from the
newest checkpoint every rank can load, train step after step, save on the checkpoint cadence,
close (the last save committed and reported). The invariants that make it elastic
(shared/DESIGN.md):
- the global batch is constant: rank r takes its share of step s's samples, the loss of every
  micro-batch is a token-loss SUM divided by the GLOBAL token count, gradients are summed;
- the data position is the step: step s consumes global samples [s*B, (s+1)*B);
- the checkpoint stores the step and named element ranges, so any world size resumes from it;
- nothing non-finite is applied or saved: a step whose loss or gradient norm is not finite is
  skipped on every rank, train.max_bad_steps of them in a row (or non-finite parameters or
  optimizer state found before a save) stop the run with DivergenceError, and the checkpoints
  already committed stay the last good state.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from trainer.build import build
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.launch_storage import LaunchStorage
from trainer.checkpoint.resume import data_identity, has_checkpoint
from trainer.config import TrainerConfig
from trainer.data import (
    EVAL_TAG,
    Batches,
    Loader,
    PreparedData,
    check_vocab,
    find_dataset,
    global_tokens_per_step,
)
from trainer.device import resolve_device
from trainer.fsdp import NO_INIT, build_mesh
from trainer.fsdp.state import load_params
from trainer.generate import eval_prompts, sample_text
from trainer.guard import DivergenceError, DivergenceGuard  # noqa: F401 -- DivergenceError: the loop's error
from trainer.hf import HFWeights, resolve_model
from trainer.inputs import model_inputs
from trainer.loss import resolve_chunk_tokens
from trainer.metrics import MetricsLogger, NullLogger, print0
from trainer.model import flops_per_token, initializer
from trainer.optim import lr_at
from trainer.progress import StepReport, moe_metrics
from trainer.step import micro_batch_loss, train_step


@dataclass
class WorkerContext:
    """What the launcher tells one rank: who it is, where the run's checkpoints live, and hooks."""

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    checkpoint_root: str = "runs/checkpoints"
    """Where this run's checkpoints live (a path or pyarrow.fs URI)."""
    data_dir: Optional[str] = None
    """The prepared dataset (the launcher passes the one it prepared); None -> the only
    preparation under cfg.data.prepared_dir."""
    resume_from: Optional[str] = None
    """A checkpoint to resume from; None -> the newest valid one in checkpoint_root."""
    snapshot_root: Optional[str] = None
    """Where in-memory snapshots go (a pyarrow.fs URI, e.g. the cluster layer's keeper:// on
    peers' memory; cfg.train.snapshot_every says how often); None -> no snapshots."""
    inherited_snapshots: Optional[str] = None
    """A previous launch's snapshot root that resume also looks in (read only): the run's last
    launch died without ending, and its snapshots may be newer than the durable checkpoint."""
    release_inherited: Optional[Callable[[], None]] = None
    """Called once on this rank when the inherited snapshots are not needed any more (this
    launch's own first snapshot or checkpoint committed): the launcher frees their memory."""
    on_checkpoint: Optional[Callable[[str, int], None]] = None
    """(checkpoint path, step), called on every rank once that step's checkpoint is committed."""
    should_stop: Optional[Callable[[], bool]] = None
    """Polled every step; True on any rank -> save a checkpoint now and return (graceful drain)."""
    logger: Optional[MetricsLogger] = None
    """trainer.metrics.MetricsLogger on rank 0; None elsewhere."""
    device: Optional[torch.device] = None
    """The device the launcher assigned to this rank; None -> resolved from cfg.train.device."""
    before_step: Optional[Callable[[int], None]] = None
    """Called on every rank with the step number before each step (the cluster layer's fault
    drills and elastic tracker)."""
    after_step: Optional[Callable[[int, dict], Optional[dict]]] = None
    """Called on every rank after each logged step with (step, metrics); a returned dict is merged
    into the metrics that rank 0 logs (the cluster layer adds elastic/* this way)."""
    may_write: Optional[Callable[[], Optional[str]]] = None
    """None while this launch may write into the run's folder, else why not (the cluster layer's
    run lease, taken over by another launch): checked before training and before every save."""
    record_samples: bool = False
    """Keep (step, source, sample id) of every sequence this rank trained on, in the result (for
    audits and the exactly-once tests; costs memory proportional to the run)."""

    @property
    def storage(self) -> LaunchStorage:
        """Where this launch reads and writes, as the Checkpointer takes it (one value)."""
        return LaunchStorage(
            root=self.checkpoint_root,
            resume_from=self.resume_from,
            snapshot_root=self.snapshot_root,
            inherited_snapshots=self.inherited_snapshots,
            release_inherited=self.release_inherited,
            on_commit=self.on_checkpoint,
            may_write=self.may_write,
        )


@dataclass
class TrainResult:
    steps_done: int
    final_loss: float
    losses: list = field(default_factory=list)  # (step, loss) trained by this invocation
    last_checkpoint: Optional[str] = None
    resumed_from: Optional[str] = None
    start_step: int = 0
    samples: list = field(default_factory=list)
    """(step, source, sample id) trained by this rank, when WorkerContext.record_samples."""
    eval_losses: list = field(default_factory=list)  # (step, eval loss)
    bad_steps: list = field(default_factory=list)  # steps skipped: non-finite loss or grad norm


class Trainer:
    """One rank's run: the data, the wrapped model, the optimizer and checkpointing."""

    def __init__(self, cfg: TrainerConfig, ctx: WorkerContext):
        cfg = dataclasses.replace(cfg, model=resolve_model(cfg.model))  # model=hf: its config.json
        self.cfg, self.ctx = cfg, ctx
        self.rank, self.world = ctx.rank, ctx.world_size
        self.log = ctx.logger or NullLogger()
        self.device = resolve_device(cfg.train.device, ctx.local_rank, ctx.device)
        d, t = cfg.data, cfg.train
        self.data = PreparedData.open(ctx.data_dir or find_dataset(d.prepared_dir))
        check_vocab(cfg, self.data.vocab_size, self.data.manifest.tokenizer["name"])  # early
        weights = [s.weight for s in d.sources()]
        self.batches = Batches(
            self.data, d.seq_len, d.seed, t.global_batch_size, weights,
            document_mask=d.document_mask,
        )  # fmt: skip
        self.eval_batches = None
        self._sample_prompts: Optional[list[list[int]]] = None  # the eval samples' prompts
        if t.eval_every:
            self.eval_batches = Batches(
                self.data, d.seq_len, d.seed, d.eval_sequences, weights, "eval", EVAL_TAG,
                document_mask=d.document_mask,
            )  # fmt: skip
        if self.device.type == "cuda":  # the engine is built with what fits (cfg from here on)
            cfg = self.cfg = fit_device_memory(cfg, self.world, self.device, ctx.local_world_size)
        # A gloo group of all ranks besides the engine's, for the per-step agreements (stop,
        # save committed): on the CPU, so they cost no device sync.
        self.control = dist.new_group(backend="gloo") if self.world > 1 else None
        per_node = ranks_per_node(ctx.local_world_size, self.control)
        experts, context = cfg.model.moe_experts, t.context_parallel
        self.mesh = build_mesh(cfg.sharding, self.rank, self.world, per_node, experts, context)
        print0(f"mesh: {self.mesh.describe()}")
        # Weights that a checkpoint or a Hugging Face model will overwrite are not initialised.
        self.resuming = bool(ctx.resume_from) or has_checkpoint(ctx.checkpoint_root)
        fills = self.resuming or bool(cfg.model.hf_path)
        built = build(cfg, self.mesh, self.device, NO_INIT if fills else initializer(t.seed))
        self.model, self.optimizer, self.scaler = built.model, built.optimizer, built.scaler
        self.speed = built.speed  # what train.compile / train.float8 did (trainer/speed.py)
        if built.frozen is not None:  # train.freeze: what it froze, in counts
            print0(built.frozen.describe())
        self.global_tokens = global_tokens_per_step(t.global_batch_size, d.seq_len)
        # A mixture of experts counts the real tokens of its routing (padding left out).
        self.pad_id = self.data.eod_id if cfg.model.moe_experts else None
        self.flops_per_token = flops_per_token(cfg.model, d.seq_len)
        # The head and the loss a chunk of tokens at a time: the [tokens, vocab] fp32 logits of
        # a large vocabulary never exist whole (trainer/loss.py; 0 = from the whole logits).
        self.loss_chunk_tokens = resolve_chunk_tokens(t.loss_chunk_tokens, cfg.model.vocab_size)
        self.checkpointer = Checkpointer(
            cfg,
            ctx.storage,
            self.model,
            self.optimizer,
            self.scaler,
            rank=self.rank,
            world_size=self.world,
            device=self.device,
            control=self.control,
            log=print0,
            data_identity=data_identity(cfg, self.data.digest),
            tokenizer=self.data.tokenizer_info(),
        )
        self.step = 0
        self.routing: tuple = (None, None)  # the last step's aux loss and expert loads
        self.loader: Optional[Loader] = None
        self.result = TrainResult(0, float("nan"))
        self.guard = DivergenceGuard(
            t.max_bad_steps, self.result, self.checkpointer.last_good_step, log=print0
        )
        self.report = StepReport(
            cfg, self.world, self.device, self.log, self.global_tokens, self.flops_per_token
        )

    def load_hf_weights(self) -> None:
        """Start from the Hugging Face checkpoint at model.hf_path: each rank reads the byte
        ranges of its own shards, converted to the fp32 master weights."""
        t0 = time.perf_counter()
        weights = HFWeights(self.cfg.model.hf_path, self.cfg.model)
        load_params(self.model, lambda fqn, start, n: weights.read(fqn, start, n).to(self.device))
        print0(
            f"initialised from {self.cfg.model.hf_path} in {time.perf_counter() - t0:.1f} s "
            f"({weights.bytes_read / 2**20:,.1f} MiB read by rank 0)"
        )

    def run(self) -> TrainResult:
        r = self.result
        r.start_step = self.step = self.checkpointer.resume()
        if self.checkpointer.resumed_from is None and self.cfg.model.hf_path:
            self.load_hf_weights()
        self.loader = self.make_loader()
        self.report.start(self.step)
        try:
            self._train()
            self.guard.read()
            if self.checkpointer.save_due(self.step, closing=True):  # the last step trained
                self.checkpointer.save(self.step, loss=self.check_finite_state(self.step))
            r.last_checkpoint = self.checkpointer.close(self.step)
        except DivergenceError:
            self.checkpointer.abandon()  # the save in flight (a finite state) commits; no more
            raise
        finally:
            self.loader.close()
        r.steps_done, r.resumed_from = self.step, self.checkpointer.resumed_from
        return r

    def _train(self) -> None:
        self.checkpointer.check_may_write("training")
        while self.step < self.cfg.train.steps:
            if self.stop_requested():
                print0(f"stop requested at step {self.step}: saving a checkpoint before leaving")
                break
            if self.ctx.before_step is not None:
                self.ctx.before_step(self.step)
            loss, norm, bad = self.train_step()
            if self.speed is not None and self.step == self.result.start_step + 1:
                print0(self.speed.describe())  # compiling happened in this first step
            self.guard.push(self.step - 1, loss, bad)
            if self.report.due(self.step, self.eval_due()):
                self.log_step(norm)
            if self.checkpointer.save_due(self.step):  # once the state is known finite
                self.checkpointer.save(self.step, loss=self.check_finite_state(self.step))
            else:
                self.checkpointer.after_step(self.step)  # reports a commit; snapshots if due

    def make_loader(self) -> Loader:
        """This rank's micro-batches from the current step on, prepared ahead in a background
        thread (in pinned memory on a GPU)."""
        return Loader(  # the ranks of a context group read the same samples
            self.batches,
            self.mesh.data_rank,
            self.mesh.data_size,
            self.cfg.train.micro_batches,
            self.step,
            self.cfg.train.steps,
            self.cfg.data.prefetch_steps,
            pin=self.device.type == "cuda",
        )

    # ---- one step ----------------------------------------------------------------------------
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's micro-batches of the step through trainer/step.py's one recipe. Returns
        (mean token loss, grad norm, bad) as device scalars: nothing in the step waits for the
        device (batches come from pinned memory with non_blocking copies; only an fp16 overflow
        check reads a flag back). They are read on logging steps. `bad`: the loss or the norm is
        not finite (both are global, so every rank agrees) and the update was not applied."""
        out = train_step(
            self.model,
            self.optimizer,
            self._micro_batches(),
            global_tokens=self.batches.loss_tokens(self.step),  # fine-tuning: its loss tokens
            grad_clip=self.cfg.optim.grad_clip,
            scaler=self.scaler,
            world=self.world,
            device=self.device,
            lr=lr_at(self.cfg.optim, self.cfg.train.steps, self.step),
            loss_chunk_tokens=self.loss_chunk_tokens,
        )
        self.step += 1
        self.routing = out.aux, out.load  # a mixture's load balance (None, None: dense)
        return out.loss, out.norm, out.bad

    def _micro_batches(self):
        """(inputs, targets, weight, positions) of this rank's micro-batches of the step, on the
        device: weight is the loss mask where the data has one (fine-tuning), and positions
        restart at each packed document (None for plain pre-training windows)."""
        for mb in self.loader.next(self.step):
            if self.ctx.record_samples and mb.weight:
                self.result.samples += [
                    (self.step, int(s), int(i)) for s, i in zip(mb.sources, mb.sample_ids)
                ]
            yield model_inputs(mb.to(self.device, non_blocking=True), self.pad_id)

    def eval_due(self) -> bool:
        every = self.cfg.train.eval_every
        return bool(every) and (self.step % every == 0 or self.step == self.cfg.train.steps)

    def maybe_evaluate(self) -> Optional[float]:
        """The loss on the fixed held-out sequences, every train.eval_every steps and at the end."""
        if not self.eval_due():
            return None
        loss = evaluate(
            self.model, self.eval_batches, self.mesh.data_rank, self.mesh.data_size,
            self.eval_rows(), self.device,
            self.loss_chunk_tokens,
        )  # fmt: skip
        self.result.eval_losses.append((self.step - 1, loss))
        return loss

    def log_samples(self) -> None:
        """What the model says, at each evaluation: greedy generations from the first
        train.sample_prompts eval windows' prompts, on every rank (each forward is collective),
        logged by rank 0 as the MLflow text artifact samples/step_N.txt."""
        count = self.cfg.train.sample_prompts
        if not count or self.eval_batches is None:
            return
        if self._sample_prompts is None:
            self._sample_prompts = eval_prompts(self.eval_batches, count)
        text = sample_text(
            self.model, self.data.tokenizer_info(), self._sample_prompts,
            self.cfg.train.sample_tokens, world=self.world, step=self.step,
        )  # fmt: skip
        self.log.log_text(text, f"samples/step_{self.step}.txt")

    def eval_rows(self) -> int:
        """Sequences per evaluation forward: the training micro-batch's, so memory is as trained."""
        per_rank = -(-self.cfg.train.global_batch_size // self.mesh.data_size)
        return max(1, -(-per_rank // self.cfg.train.micro_batches))

    def stop_requested(self) -> bool:
        """Any rank asked to stop (a drain reaches one node first): all ranks agree, or they
        deadlock."""
        if self.ctx.should_stop is None:
            return False
        flag = torch.tensor([1.0 if self.ctx.should_stop() else 0.0])
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return bool(flag.item())

    def check_finite_state(self, step: int) -> float:
        """Before saving `step`: the bad-step flags are read (a streak raises) and the parameter
        shards and optimizer state must be finite on every rank (trainer/guard.py), else
        DivergenceError and nothing is saved. Returns the loss the checkpoint records."""
        tensors = [f.shard for f in self.model.flats()]
        tensors += [
            v
            for st in self.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.is_floating_point() and v.numel() > 1
        ]
        self.guard.check_finite(step, tensors, self.device, self.world, self.control)
        return self.result.final_loss

    def log_step(self, norm: torch.Tensor) -> None:
        """The step line on rank 0 and the step's metrics to MLflow (trainer/progress.py). The
        losses are read back first: the host waits for the device here, on logging steps only,
        so the time per step is right on a GPU too. Evaluation is not counted as a train step."""
        self.guard.read()
        seconds = self.report.seconds_per_step(self.step)
        eval_loss = self.maybe_evaluate()
        if eval_loss is not None:
            self.log_samples()
        m = self.model.metrics(self.optimizer)
        m.update(self.checkpointer.metrics())  # snapshot/*: the last in-memory snapshot
        m["train/bad_steps"] = float(len(self.result.bad_steps))  # skipped, non-finite, so far
        m.update(moe_metrics(self.cfg.model, *self.routing))
        self.report.log(
            self.step, self.result.final_loss, float(norm), seconds, m, eval_loss,
            self.ctx.after_step,
        )  # fmt: skip


def fit_device_memory(
    cfg: TrainerConfig, world: int, device: torch.device, local_world_size: int
) -> TrainerConfig:
    """Fail before allocating, with the planner's breakdown, if the job cannot fit: the step's
    peak against the device's memory less the planner's headroom (the CUDA context, NCCL
    buffers and fragmentation margin, trainer/plan/headroom.py). Returns the config to train
    with: with sharded gradient accumulation when only that makes it fit."""
    from trainer.plan import check_fits  # noqa: PLC0415 -- the planner's tracing: CUDA only

    torch.cuda.set_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    p = check_fits(cfg, world, total, local_world_size, headroom=True)
    if p.sharded_grad_accumulation and not cfg.sharding.sharded_grad_accumulation:
        print0(
            f"memory: {cfg.train.micro_batches} micro-batches of unsharded gradients do "
            "not fit; reducing every micro-batch into the gradient shards instead "
            "(sharding.sharded_grad_accumulation=true)"
        )
        sharding = dataclasses.replace(cfg.sharding, sharded_grad_accumulation=True)
        cfg = dataclasses.replace(cfg, sharding=sharding)
    return cfg


def ranks_per_node(local_world_size: int, control: Optional[dist.ProcessGroup]) -> int:
    """The fewest ranks any node holds (HYBRID_SHARD's default shard group): after a resize
    nodes may hold different numbers of workers, and every rank must cut the mesh alike."""
    if control is None:
        return local_world_size
    least = torch.tensor([local_world_size])
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=control)
    return int(least)


def evaluate(
    model,
    batches: Batches,
    rank: int,
    world: int,
    rows: int,
    device: torch.device,
    loss_chunk_tokens: int = 0,
) -> float:
    """Mean token loss over batches' first global_batch positions, all ranks together (every rank
    runs the same number of forwards: the engine gathers parameters collectively); the loss
    `loss_chunk_tokens` at a time as in training (0: from the whole logits). `rank` and `world`
    split the samples (the mesh's data_rank and data_size: a context group reads the same ones
    and sums its chunks' losses); the sums are all-reduced over every rank."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for mb in batches.fixed_micro_batches(batches.global_batch, rank, world, rows):
            mb = model_inputs(mb.to(device, non_blocking=True))
            inputs, targets, weight, positions = mb[:4]
            images = mb[5] if len(mb) > 5 else None
            s, n = micro_batch_loss(
                model, inputs, targets, weight, positions, loss_chunk_tokens, images=images
            )
            n = torch.as_tensor(n, dtype=torch.float64, device=device)
            total += torch.stack([s.double(), n])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return float(total[0] / total[1])


def run_training(cfg: TrainerConfig, ctx: WorkerContext) -> TrainResult:
    """Train `cfg` on this rank until cfg.train.steps (or a stop request); resume if possible."""
    return Trainer(cfg, ctx).run()
