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

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from trainer.checkpointing import Checkpointer, data_identity, has_checkpoint
from trainer.config import DType, TrainerConfig
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
from trainer.fsdp import NO_INIT, build_mesh, parallelize
from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.fsdp.state import load_params
from trainer.hf import HFWeights, resolve_model
from trainer.metrics import MetricsLogger, NullLogger, step_metrics
from trainer.model import build_model, flops_per_token, initializer, loss_sum
from trainer.optim import build_optimizer, guarded_step, lr_at, set_lr


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


class DivergenceError(RuntimeError):
    """The run diverged: train.max_bad_steps steps in a row had a non-finite loss or gradient
    norm, or the parameters or optimizer state are non-finite. Restarting from the last
    checkpoint with the same configuration would repeat it, so it is not a failure to retry."""


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
        self.batches = Batches(self.data, d.seq_len, d.seed, t.global_batch_size, weights)
        self.eval_batches = None
        if t.eval_every:
            self.eval_batches = Batches(
                self.data, d.seq_len, d.seed, d.eval_sequences, weights, "eval", EVAL_TAG
            )
        if self.device.type == "cuda":
            self._check_device_memory()
        self.mesh = build_mesh(cfg.sharding, self.rank, self.world, ctx.local_world_size)
        # Weights that a checkpoint or a Hugging Face model will overwrite are not initialised.
        self.resuming = bool(ctx.resume_from) or has_checkpoint(ctx.checkpoint_root)
        fills = self.resuming or bool(cfg.model.hf_path)
        self.model = parallelize(
            build_model(cfg.model, device="meta"),
            cfg.sharding,
            self.mesh,
            self.device,
            init_fn=NO_INIT if fills else initializer(t.seed),
        )
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scaler = ShardedGradScaler(enabled=cfg.sharding.param_dtype is DType.float16)
        self.global_tokens = global_tokens_per_step(t.global_batch_size, d.seq_len)
        self.flops_per_token = flops_per_token(cfg.model, d.seq_len)
        # A gloo group of all ranks besides the engine's, for the per-step agreements (stop,
        # save committed): on the CPU, so they cost no device sync.
        self.control = dist.new_group(backend="gloo") if self.world > 1 else None
        self.checkpointer = Checkpointer(
            cfg,
            ctx.checkpoint_root,
            self.model,
            self.optimizer,
            self.scaler,
            rank=self.rank,
            world_size=self.world,
            device=self.device,
            control=self.control,
            resume_from=ctx.resume_from,
            snapshot_root=ctx.snapshot_root,
            on_commit=ctx.on_checkpoint,
            log=self.print0,
            data_identity=data_identity(cfg, self.data.digest),
            tokenizer=self.data.tokenizer_info(),
        )
        self.step = 0
        self.loader: Optional[Loader] = None
        self.result = TrainResult(0, float("nan"))
        self._unread: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, bad)
        self._bad_streak = 0  # non-finite steps in a row, as read back
        self._since = (time.perf_counter(), 0)  # (time, step) of the last logged step

    def load_hf_weights(self) -> None:
        """Start from the Hugging Face checkpoint at model.hf_path: each rank reads the byte
        ranges of its own shards, converted to the fp32 master weights."""
        t0 = time.perf_counter()
        weights = HFWeights(self.cfg.model.hf_path, self.cfg.model)
        load_params(self.model, lambda fqn, start, n: weights.read(fqn, start, n).to(self.device))
        self.print0(
            f"initialised from {self.cfg.model.hf_path} in {time.perf_counter() - t0:.1f} s "
            f"({weights.bytes_read / 2**20:,.1f} MiB read by rank 0)"
        )

    def _check_device_memory(self) -> None:
        """Fail before allocating, with the planner's breakdown, if the job cannot fit: the step's
        peak against the device's memory less the planner's headroom (the CUDA context, NCCL
        buffers and fragmentation margin, trainer/plan/headroom.py)."""
        from trainer.plan import check_fits  # noqa: PLC0415 -- the planner's tracing: CUDA only

        torch.cuda.set_device(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        p = check_fits(self.cfg, self.world, total, self.ctx.local_world_size, headroom=True)
        if p.sharded_grad_accumulation and not self.cfg.sharding.sharded_grad_accumulation:
            self.print0(
                f"memory: {self.cfg.train.micro_batches} micro-batches of unsharded gradients do "
                "not fit; reducing every micro-batch into the gradient shards instead "
                "(sharding.sharded_grad_accumulation=true)"
            )
            sharding = dataclasses.replace(self.cfg.sharding, sharded_grad_accumulation=True)
            self.cfg = dataclasses.replace(self.cfg, sharding=sharding)

    def run(self) -> TrainResult:
        r = self.result
        r.start_step = self.step = self.checkpointer.resume()
        if self.checkpointer.resumed_from is None and self.cfg.model.hf_path:
            self.load_hf_weights()
        self.loader = self.make_loader()
        self._since = (time.perf_counter(), self.step)  # the clock of the next logged step
        self._started = (self._since[0], self.step)  # elapsed time and the ETA's rate
        self.checkpointer.before_save = self.check_finite_state
        self.checkpointer.may_write = self.ctx.may_write
        try:
            self._train()
            self.read_losses()
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
                self.print0(
                    f"stop requested at step {self.step}: saving a checkpoint before leaving"
                )
                break
            if self.ctx.before_step is not None:
                self.ctx.before_step(self.step)
            loss, norm, bad = self.train_step()
            self._unread.append((self.step - 1, loss, bad))
            if self.is_log_step():
                seconds = self.step_seconds()  # before evaluating: eval is not a train step
                self.log_step(norm, seconds, self.maybe_evaluate())
                self._since = (time.perf_counter(), self.step)
            self.checkpointer.after_step(self.step)

    def make_loader(self) -> Loader:
        """This rank's micro-batches from the current step on, prepared ahead in a background
        thread (in pinned memory on a GPU)."""
        return Loader(
            self.batches,
            self.rank,
            self.world,
            self.cfg.train.micro_batches,
            self.step,
            self.cfg.train.steps,
            self.cfg.data.prefetch_steps,
            pin=self.device.type == "cuda",
        )

    # ---- one step ----------------------------------------------------------------------------
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward/backward over this rank's micro-batches, clip, optimizer step. Returns (mean
        token loss, grad norm, bad) as device scalars: nothing in the step waits for the device
        (batches come from pinned memory with non_blocking copies; only an fp16 overflow check
        reads a flag back). They are read on logging steps. `bad`: the loss or the norm is not
        finite (both are global, so every rank agrees) and the update was not applied."""
        n_micro = self.cfg.train.micro_batches
        set_lr(self.optimizer, lr_at(self.cfg.optim, self.cfg.train.steps, self.step))
        loss_total = torch.zeros((), dtype=torch.float32, device=self.device)
        for k, mb in enumerate(self.loader.next(self.step)):
            if self.ctx.record_samples and mb.weight:
                self.result.samples += [
                    (self.step, int(s), int(i)) for s, i in zip(mb.sources, mb.sample_ids)
                ]
            mb = mb.to(self.device, non_blocking=True)
            sync = k == n_micro - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                s, _ = loss_sum(self.model(mb.inputs), mb.targets, mb.weight)
                self.scaler.scale_loss(s / self.global_tokens).backward()
            loss_total += s.detach()
        found_inf = self.scaler.unscale_and_check(self.model.grad_shards(), self.world, self.device)
        norm = self.model.clip_grad_norm_(self.cfg.optim.grad_clip)
        if self.world > 1:
            dist.all_reduce(loss_total)
        bad = ~(torch.isfinite(loss_total) & torch.isfinite(norm))
        if found_inf:  # fp16 overflow on any rank: every rank skips this step, the scale drops
            bad = torch.zeros_like(bad)  # the scaler's business, not a divergence
        else:
            guarded_step(self.optimizer, bad)
        self.scaler.update(found_inf)
        self.model.zero_grad()
        self.step += 1
        return loss_total / self.global_tokens, norm, bad

    def eval_due(self) -> bool:
        every = self.cfg.train.eval_every
        return bool(every) and (self.step % every == 0 or self.step == self.cfg.train.steps)

    def maybe_evaluate(self) -> Optional[float]:
        """The loss on the fixed held-out sequences, every train.eval_every steps and at the end."""
        if not self.eval_due():
            return None
        loss = evaluate(
            self.model, self.eval_batches, self.rank, self.world, self.eval_rows(), self.device
        )
        self.result.eval_losses.append((self.step - 1, loss))
        return loss

    def eval_rows(self) -> int:
        """Sequences per evaluation forward: the training micro-batch's, so memory is as trained."""
        per_rank = -(-self.cfg.train.global_batch_size // self.world)
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

    def read_losses(self) -> float:
        """Bring the losses and bad-step flags of the steps since the last read to the host (one
        device sync); raise DivergenceError at train.max_bad_steps bad steps in a row (every
        rank reads the same flags at the same steps, so all raise together)."""
        unread, self._unread = self._unread, []
        if not unread:
            return self.result.final_loss
        values = torch.stack([t.float() for _, t, _ in unread]).tolist()
        flags = torch.stack([b for _, _, b in unread]).tolist()
        limit = self.cfg.train.max_bad_steps
        for (step, _, _), value, bad in zip(unread, values, flags):
            self.result.losses.append((step, value))
            self.result.final_loss = value
            if not bad:
                self._bad_streak = 0
                continue
            self._bad_streak += 1
            self.result.bad_steps.append(step)
            self.print0(
                f"step {step + 1}: loss {value} or its gradient norm is not finite: update not "
                f"applied ({self._bad_streak} of train.max_bad_steps={limit} in a row)"
            )
            if self._bad_streak >= limit:
                raise DivergenceError(
                    f"training diverged: {limit} steps in a row (steps {step - limit + 2} to "
                    f"{step + 1}) "
                    f"had a non-finite loss or gradient norm (last loss {value}); none was "
                    f"applied and nothing after step {self.checkpointer.last_good_step()} was "
                    "saved. Lower optim.lr, raise optim.warmup_steps or check the data, then "
                    "resume (the newest checkpoint is the last good state)"
                )
        return self.result.final_loss

    def check_finite_state(self, step: int) -> None:
        """Before saving `step`: the bad-step flags are read (a streak raises), and the
        parameters and optimizer state must be finite on every rank, else DivergenceError and
        nothing is saved. min/max reductions (a NaN propagates, an inf is an extreme): no
        temporary the size of a tensor."""
        self.read_losses()
        self.checkpointer.last_loss = self.result.final_loss
        tensors = [f.shard for f in self.model.flats()]
        tensors += [
            v
            for st in self.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.is_floating_point() and v.numel() > 1
        ]
        ok = torch.ones((), dtype=torch.float32, device=self.device)
        for t in tensors:
            if t.numel():
                lo, hi = torch.aminmax(t.detach())
                ok = ok * (torch.isfinite(lo) & torch.isfinite(hi)).to(ok.device, torch.float32)
        if self.world > 1:
            flag = ok.cpu()
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.control)
            ok = flag
        if not bool(ok):
            raise DivergenceError(
                f"not saving step {step}: the parameters or optimizer state are not finite on "
                f"at least one rank (the last update overflowed, though its loss and gradient "
                f"norm were finite). Nothing after step {self.checkpointer.last_good_step()} was "
                "saved; lower optim.lr or raise optim.warmup_steps, then resume"
            )

    def is_log_step(self) -> bool:
        """Every train.log_every steps, the last step and every evaluation step."""
        step = self.step - 1  # the step just trained
        return (
            step % self.cfg.train.log_every == 0
            or self.step == self.cfg.train.steps
            or self.eval_due()
        )

    def step_seconds(self) -> float:
        """Seconds per step since the last logged one. The host waits for the device here (and
        on logging steps only): the losses come back, so every step up to this one has finished
        and the wall time is right on a GPU, where a step's kernels finish long after the host
        queued them. Checkpoint snapshots taken meanwhile are part of it; evaluations are not."""
        self.read_losses()
        return (time.perf_counter() - self._since[0]) / max(1, self.step - self._since[1])

    def log_step(self, norm: torch.Tensor, seconds: float, eval_loss: Optional[float]) -> None:
        """One line on rank 0, metrics to MLflow."""
        step = self.step - 1  # the step just trained
        loss, norm = self.result.final_loss, float(norm)
        m = step_metrics(
            loss=loss,
            lr=lr_at(self.cfg.optim, self.cfg.train.steps, step),
            grad_norm=norm,
            seconds=seconds,
            tokens=self.global_tokens,
            flops_per_token=self.flops_per_token,
            world_size=self.world,
            device=self.device,
            param_dtype=self.cfg.sharding.param_dtype,
        )
        m.update(self.model.metrics(self.optimizer))
        m.update(self.checkpointer.metrics())  # snapshot/*: the last in-memory snapshot
        m["train/bad_steps"] = float(len(self.result.bad_steps))  # skipped, non-finite, so far
        evaluated = ""
        if eval_loss is not None:
            m["eval/loss"], m["eval/perplexity"] = eval_loss, math.exp(min(eval_loss, 80.0))
            evaluated = f" | eval {eval_loss:.4f}"
        if self.ctx.after_step is not None:
            m.update(self.ctx.after_step(step, m) or {})
        m.update(memory_metrics(self.device))
        self.print0(self.step_line(loss, norm, m, evaluated))
        self.log.log_metrics(m, step=self.step)  # "step N": N optimizer steps done, everywhere

    def step_line(self, loss: float, norm: float, m: dict, evaluated: str) -> str:
        """`step 120/2000 | loss | lr | gnorm | tok/s | ms | TFLOPs (MFU) | memory | elapsed, ETA
        | world`: the figures a person watching the run wants, on one line. Step N is N optimizer
        steps done, as in MLflow, the checkpoint directory names and Ray's reports."""
        total, done = self.cfg.train.steps, self.step
        elapsed = time.perf_counter() - self._started[0]
        eta = m["perf/step_ms"] / 1000 * (total - done)  # at the latest rate
        mfu = f" MFU {m['perf/mfu']:.1%}" if "perf/mfu" in m else ""
        return (
            f"step {done:{len(str(total))}d}/{total} | loss {loss:.4f}{evaluated} | "
            f"lr {m['train/lr']:.2e} | "
            f"gnorm {norm:.3f} | {m['perf/tokens_per_s']:,.0f} tok/s | "
            f"{m['perf/step_ms']:.1f} ms | {m['perf/tflops_per_worker']:.3g} TFLOPs/worker{mfu} | "
            f"mem {memory_text(m)} | {_clock(elapsed)} elapsed, ETA "
            f"{_clock(eta)} | world {self.world}"
        )

    def print0(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)


def memory_metrics(device: torch.device) -> dict[str, float]:
    """The measured peak of this worker: the device's max_memory_allocated (and its size) on
    CUDA; on a CPU, the process's resident-set high-water mark (everything the process holds:
    Python, torch, the data loader), not only tensors."""
    if device.type == "cuda":
        return {
            "mem/device_max_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
            "mem/device_total_bytes": float(torch.cuda.get_device_properties(device).total_memory),
        }
    import resource  # noqa: PLC0415 -- POSIX only; a CPU worker

    return {"mem/rss_peak_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}


def memory_text(m: dict) -> str:
    if "mem/device_max_allocated_bytes" in m:
        used, total = m["mem/device_max_allocated_bytes"], m["mem/device_total_bytes"]
        return f"{used / 2**30:.2f} GiB ({used / total:.0%} of {total / 2**30:.0f})"
    return f"{m['mem/rss_peak_bytes'] / 2**30:.2f} GiB RSS peak"


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def evaluate(
    model, batches: Batches, rank: int, world: int, rows: int, device: torch.device
) -> float:
    """Mean token loss over batches' first global_batch positions, all ranks together (every rank
    runs the same number of forwards: the engine gathers parameters collectively)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for mb in batches.fixed_micro_batches(batches.global_batch, rank, world, rows):
            mb = mb.to(device, non_blocking=True)
            s, n = loss_sum(model(mb.inputs), mb.targets, mb.weight)
            total += torch.stack(
                [s.double(), torch.tensor(float(n), dtype=torch.float64, device=device)]
            )
    if world > 1:
        dist.all_reduce(total)
    return float(total[0] / total[1])


def run_training(cfg: TrainerConfig, ctx: WorkerContext) -> TrainResult:
    """Train `cfg` on this rank until cfg.train.steps (or a stop request); resume if possible."""
    return Trainer(cfg, ctx).run()
