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
- the checkpoint stores the step and named element ranges, so any world size resumes from it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from trainer.checkpointing import Checkpointer
from trainer.config import DType, TrainerConfig
from trainer.data import Batcher, global_tokens_per_step, load_tokens
from trainer.device import resolve_device
from trainer.fsdp import build_mesh, parallelize
from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.metrics import MetricsLogger, NullLogger, step_metrics
from trainer.model import build_model, flops_per_token, initializer, loss_sum
from trainer.optim import build_optimizer, lr_at, set_lr


@dataclass
class WorkerContext:
    """What the launcher tells one rank: who it is, where the run's checkpoints live, and hooks."""

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    checkpoint_root: str = "runs/checkpoints"
    """Where this run's checkpoints live (a path or pyarrow.fs URI)."""
    resume_from: Optional[str] = None
    """A checkpoint to resume from; None -> the newest valid one in checkpoint_root."""
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


@dataclass
class TrainResult:
    steps_done: int
    final_loss: float
    losses: list = field(default_factory=list)  # (step, loss) trained by this invocation
    last_checkpoint: Optional[str] = None
    resumed_from: Optional[str] = None
    start_step: int = 0


class Trainer:
    """One rank's run: the wrapped model, optimizer, data and checkpointing."""

    def __init__(self, cfg: TrainerConfig, ctx: WorkerContext):
        self.cfg, self.ctx = cfg, ctx
        self.rank, self.world = ctx.rank, ctx.world_size
        self.log = ctx.logger or NullLogger()
        self.device = resolve_device(cfg.train.device, ctx.local_rank, ctx.device)
        if self.device.type == "cuda":
            self._check_device_memory()
        self.mesh = build_mesh(cfg.sharding, self.rank, self.world, ctx.local_world_size)
        self.model = parallelize(
            build_model(cfg.model, device="meta"),
            cfg.sharding,
            self.mesh,
            self.device,
            init_fn=initializer(cfg.train.seed),
        )
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scaler = ShardedGradScaler(enabled=cfg.sharding.param_dtype is DType.float16)
        self.batcher = Batcher(
            load_tokens(cfg.data.prepared_dir),
            cfg.data.seq_len,
            cfg.data.seed,
            cfg.train.global_batch_size,
        )
        self.global_tokens = global_tokens_per_step(cfg.train.global_batch_size, cfg.data.seq_len)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        # A gloo group of all ranks besides the engine's: the checkpoint barrier runs on a
        # background thread and must never interleave with the engine's collectives, and the
        # per-step agreements (stop, save committed) stay on the CPU.
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
            group=self.control,
            resume_from=ctx.resume_from,
            on_commit=ctx.on_checkpoint,
            log=self.print0,
        )
        self.step = 0

    def _check_device_memory(self) -> None:
        """Fail before allocating, with the planner's breakdown, if the job cannot fit."""
        from trainer.plan import check_fits  # noqa: PLC0415 -- the planner's tracing: CUDA only

        torch.cuda.set_device(self.device)
        check_fits(
            self.cfg,
            self.world,
            torch.cuda.get_device_properties(self.device).total_memory,
            self.ctx.local_world_size,
        )

    def run(self) -> TrainResult:
        start = self.step = self.checkpointer.resume()
        losses, loss = [], float("nan")
        while self.step < self.cfg.train.steps:
            if self.stop_requested():
                self.print0(
                    f"stop requested at step {self.step}: saving a checkpoint before leaving"
                )
                break
            if self.ctx.before_step is not None:
                self.ctx.before_step(self.step)
            t0 = time.perf_counter()
            loss, norm = self.train_step()
            losses.append((self.step - 1, loss))
            self.log_step(loss, norm, time.perf_counter() - t0)
            self.checkpointer.after_step(self.step)
        last = self.checkpointer.close(self.step)
        return TrainResult(self.step, loss, losses, last, self.checkpointer.resumed_from, start)

    # ---- one step ----------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        """Forward/backward over this rank's micro-batches, clip, optimizer step.
        Returns (loss, grad norm)."""
        n_micro = self.cfg.train.micro_batches
        set_lr(self.optimizer, lr_at(self.cfg.optim, self.cfg.train.steps, self.step))
        loss_total = torch.zeros((), dtype=torch.float32, device=self.device)
        micro = self.batcher.micro_batches(self.step, self.rank, self.world, n_micro)
        for k, mb in enumerate(micro):
            mb = mb.to(self.device)
            sync = k == n_micro - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                s, _ = loss_sum(self.model(mb.inputs), mb.targets, mb.weight)
                self.scaler.scale_loss(s / self.global_tokens).backward()
            loss_total += s.detach()
        found_inf = self.scaler.unscale_and_check(self.model.grad_shards(), self.world)
        norm = self.model.clip_grad_norm_(self.cfg.optim.grad_clip)
        if not found_inf:  # fp16 overflow on any rank: every rank skips this step
            self.optimizer.step()
        self.scaler.update(found_inf)
        self.model.zero_grad()
        if self.world > 1:
            dist.all_reduce(loss_total)
        self.step += 1
        return float(loss_total) / self.global_tokens, float(norm)

    def stop_requested(self) -> bool:
        """Any rank asked to stop (a drain reaches one node first): all ranks agree, or they
        deadlock."""
        if self.ctx.should_stop is None:
            return False
        flag = torch.tensor([1.0 if self.ctx.should_stop() else 0.0])
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return bool(flag.item())

    def log_step(self, loss: float, norm: float, seconds: float) -> None:
        """Every train.log_every steps (and the last): one line on rank 0, metrics to MLflow."""
        step = self.step - 1  # the step just trained
        if step % self.cfg.train.log_every and self.step != self.cfg.train.steps:
            return
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
        if self.ctx.after_step is not None:
            m.update(self.ctx.after_step(step, m) or {})
        self.print0(
            f"step {step:5d} | loss {loss:.4f} | lr {m['train/lr']:.2e} | "
            f"gnorm {norm:.3f} | {m['perf/tokens_per_s']:8.0f} tok/s | "
            f"{seconds * 1000:7.1f} ms | world {self.world}"
        )
        self.log.log_metrics(m, step=step)

    def print0(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)


def run_training(cfg: TrainerConfig, ctx: WorkerContext) -> TrainResult:
    """Train `cfg` on this rank until cfg.train.steps (or a stop request); resume if possible."""
    return Trainer(cfg, ctx).run()
