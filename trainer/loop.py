"""One rank's training loop. Ray-free: it is handed rank, world size and callbacks.

Runs under Ray Train (cluster/worker.py) and under plain torch.multiprocessing + gloo in tests:

    dist.init_process_group("gloo", rank=r, world_size=w)
    result = run_training(cfg, WorkerContext(rank=r, world_size=w, checkpoint_root="/tmp/ckpt"))

The invariants that make it elastic (shared/DESIGN.md):
- the global batch is constant: rank r takes its share of step s's samples, the loss of every
  micro-batch is a token-loss SUM divided by the GLOBAL token count, gradients are summed;
- the data position is the step: step s consumes global samples [s*B, (s+1)*B);
- the checkpoint stores the step and named element ranges, so any world size resumes from it.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from trainer.checkpoint import CheckpointError, CheckpointReader, CheckpointWriter, TensorChunk, list_checkpoints
from trainer.config import ConfigError, JobConfig, ShardingStrategy
from trainer.data import Batcher, global_tokens_per_step, load_tokens
from trainer.fsdp import FSDPModel, build_mesh
from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.metrics import NullLogger
from trainer.model import build_model, flops_per_token, init_parameters, loss_sum


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    checkpoint_root: str = "runs/checkpoints"
    """Where this run's checkpoints live (a path or pyarrow.fs URI)."""
    resume_from: Optional[str] = None
    """A checkpoint to resume from; None -> the newest valid one in checkpoint_root."""
    on_checkpoint: Optional[Callable[[str, int], None]] = None
    """(checkpoint path, step), called on every rank after a checkpoint is committed."""
    should_stop: Optional[Callable[[], bool]] = None
    """Polled every step; True -> save a checkpoint now and return (graceful drain)."""
    logger: Optional[object] = None
    """trainer.metrics.MetricsLogger on rank 0; None elsewhere."""
    device: Optional[torch.device] = None
    """None -> from cfg.train.device."""
    fault: Optional[Callable[[int], None]] = None
    """Called with the step number before each step (fault injection in tests and drills)."""
    on_step: Optional[Callable[[int, dict], Optional[dict]]] = None
    """Called on every rank after each step with (step, metrics); a returned dict is merged into
    the metrics that rank 0 logs (the cluster layer adds elastic/* this way)."""


@dataclass
class TrainResult:
    steps_done: int
    final_loss: float
    losses: list = field(default_factory=list)  # (step, loss) trained by this invocation
    last_checkpoint: Optional[str] = None
    resumed_from: Optional[str] = None
    start_step: int = 0


def model_digest(cfg: JobConfig) -> str:
    """A checkpoint only loads into the same model shape."""
    return hashlib.sha256(json.dumps(dataclasses.asdict(cfg.model), sort_keys=True).encode()).hexdigest()[:16]


def lr_at(cfg: JobConfig, step: int) -> float:
    """Linear warmup to optim.lr, then cosine decay to lr * min_lr_ratio at train.steps."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def resolve_device(cfg: JobConfig, ctx: WorkerContext) -> torch.device:
    if ctx.device is not None:
        return torch.device(ctx.device)
    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", ctx.local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


# Dense peak FLOP/s of one device by name and compute dtype (vendor datasheets, no sparsity).
PEAK_FLOPS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 30e12},
    "A10G": {"bfloat16": 125e12, "float16": 125e12, "float32": 31e12},
}


def peak_flops(device: torch.device, dtype: str) -> Optional[float]:
    """The device's peak FLOP/s for `dtype`, or None when unknown (CPUs: no MFU is reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_FLOPS.items():
        if key in name:
            return table.get(dtype)
    return None


class Trainer:
    """State of one rank's run: the wrapped model, optimizer, data and checkpoint writer."""

    def __init__(self, cfg: JobConfig, ctx: WorkerContext):
        self.cfg, self.ctx = cfg, ctx
        self.rank, self.world = ctx.rank, ctx.world_size
        self.log = ctx.logger or NullLogger()
        self.device = resolve_device(cfg, ctx)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            from trainer.plan import check_fits  # fail before allocating, with the breakdown

            check_fits(cfg, self.world, torch.cuda.get_device_properties(self.device).total_memory,
                       ctx.local_world_size)
        strategy = ShardingStrategy.parse(cfg.sharding.strategy)
        self.mesh = build_mesh(strategy, self.rank, self.world, cfg.sharding.hybrid_shard_group_size,
                               ctx.local_world_size)
        seed = cfg.train.seed
        self.model = FSDPModel(build_model(cfg.model, device="meta"), cfg.sharding, self.mesh, self.device,
                               init_fn=lambda m, prefix: init_parameters(m, seed, prefix))
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.param_groups(o.weight_decay), lr=o.lr,
                                           betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
        self.scaler = ShardedGradScaler(enabled=cfg.sharding.param_dtype == "float16")
        tokens = load_tokens(cfg.data.prepared_dir)
        self.batcher = Batcher(tokens, cfg.data.seq_len, cfg.data.seed, cfg.train.global_batch_size)
        self.global_tokens = global_tokens_per_step(cfg.train.global_batch_size, cfg.data.seq_len)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        # Checkpoint commits wait on a barrier from a background thread: give it its own gloo group
        # so it never interleaves with the engine's collectives.
        self._ckpt_group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.writer = CheckpointWriter(ctx.checkpoint_root, keep=cfg.train.keep_checkpoints, async_save=True)
        self.step = 0
        self.resumed_from: Optional[str] = None
        self._pending_ckpt: Optional[int] = None
        self._saved_step: Optional[int] = None

    # ---- checkpoints ------------------------------------------------------------------------
    def barrier(self) -> None:
        if self._ckpt_group is not None:
            dist.barrier(group=self._ckpt_group)

    def chunks(self) -> list[TensorChunk]:
        """This rank's named element ranges. Replicas (NO_SHARD, HYBRID_SHARD across groups) hold
        identical bytes: only the first replica writes them, the others write an empty shard."""
        if self.mesh.replicate_rank != 0:
            return []
        out = [TensorChunk(f"model/{fqn}", shape, torch.float32, start, t)
               for fqn, shape, start, t in self.model.param_pieces()]
        out += [TensorChunk(f"optim/{fqn}/{name}", shape, t.dtype, start, t)
                for fqn, name, shape, start, t in self.model.optim_pieces(self.optimizer)]
        return out

    def trainer_state(self) -> dict:
        c = self.cfg
        steps_taken = [float(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        return {
            "step": self.step,
            "consumed_samples": self.step * c.train.global_batch_size,
            "global_batch_size": c.train.global_batch_size,
            "optim_step": max(steps_taken, default=0.0),
            "lr": lr_at(c, max(self.step - 1, 0)),
            "world_size": self.world,
            "strategy": c.sharding.strategy,
            "model_config": dataclasses.asdict(c.model),
            "model_digest": model_digest(c),
            "grad_scaler": self.scaler.state_dict(),
            "rng_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        }

    def save(self) -> None:
        """Start an asynchronous save of the current step; the previous one is reported first."""
        self.report_saved()
        self.writer.save(self.step, self.rank, self.world, self.chunks(), self.trainer_state(), self.barrier)
        self._pending_ckpt = self._saved_step = self.step

    def report_saved(self) -> Optional[str]:
        """Wait for the in-flight save; tell the caller (Ray) about the committed checkpoint."""
        if self._pending_ckpt is None:
            return None
        path = self.writer.wait()
        step, self._pending_ckpt = self._pending_ckpt, None
        if self.ctx.on_checkpoint is not None:
            self.ctx.on_checkpoint(path, step)
        return path

    def resume(self) -> None:
        """Load the newest checkpoint that every rank can read whole; older ones are the fallback.

        `latest_checkpoint`-style checks are cheap (manifest, sizes); a flipped byte inside a shard
        only shows when its block is read. A rank that hits one tells the others (MAX all-reduce),
        and all ranks move to the next older checkpoint together: never a mix of two."""
        if self.ctx.resume_from:
            candidates = [self.ctx.resume_from]
        else:
            infos = list_checkpoints(self.ctx.checkpoint_root)
            for info in infos:
                if info.problem:
                    self._print0(f"skipping checkpoint {info.path}: {info.problem}")
            candidates = [info.path for info in infos if not info.problem]
        for path in candidates:
            error, state = self._try_load(path)
            failed = torch.tensor([0.0 if error is None else 1.0], device=self.device)
            if self.world > 1:
                dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if not failed.item():
                self._adopt(path, state)
                return
            if error is not None:
                print(f"rank {self.rank}: checkpoint {path} is unusable: {error}", flush=True)
            self._print0(f"checkpoint {path} failed to load on some rank: falling back to an older one")
        if candidates:  # committed checkpoints exist and none loads: starting over would lose them
            raise CheckpointError(f"none of the committed checkpoints under {self.ctx.checkpoint_root} "
                                  f"can be loaded ({', '.join(candidates)}); run `python -m trainer.checkpoint "
                                  "verify PATH` on them, or start a new run (cluster.run_name)")

    def _try_load(self, path: str) -> tuple[Optional[str], Optional[dict]]:
        """Load `path` into this rank's shards: (None, trainer state), or (the error text, None)."""
        try:
            reader = CheckpointReader(path)
        except CheckpointError as e:
            return str(e), None
        st = reader.state
        if st.get("model_digest") != model_digest(self.cfg):
            raise ConfigError(f"invalid config: the checkpoint at {path} was written for model "
                              f"{st.get('model_config')}, not {dataclasses.asdict(self.cfg.model)}; "
                              "valid: the same model config, or a new cluster.run_name")
        if st["global_batch_size"] != self.cfg.train.global_batch_size:
            raise ConfigError(f"invalid config: train.global_batch_size={self.cfg.train.global_batch_size} "
                              f"but the checkpoint at {path} was trained with {st['global_batch_size']}; "
                              "valid: the same global batch (the data position depends on it)")
        try:
            self.model.load_pieces(lambda key, start, n: reader.read(key, start, n).to(self.device),
                                   self.optimizer, optim_step=st["optim_step"])
        except CheckpointError as e:
            return str(e), None
        return None, st

    def _adopt(self, path: str, st: dict) -> None:
        """Every rank loaded `path`: take its step, RNG and scaler, and never delete it."""
        rng = torch.frombuffer(bytearray(base64.b64decode(st["rng_cpu"])), dtype=torch.uint8)
        torch.set_rng_state(rng)
        if "grad_scaler" in st:
            self.scaler.load_state_dict(st["grad_scaler"])
        self.step = int(st["step"])
        self.resumed_from = path
        self.writer.protect(path)
        self._print0(f"resumed from {path} at step {self.step} "
                     f"(saved at world size {st['world_size']}, now {self.world})")

    # ---- one step ----------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        """Forward/backward over this rank's micro-batches, clip, optimizer step. (loss, grad norm)."""
        n_micro = self.cfg.train.micro_batches
        lr = lr_at(self.cfg, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.acct.reset_step()
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
        """Any rank asked to stop (a drain reaches one node first): all ranks agree, or they deadlock."""
        if self.ctx.should_stop is None:
            return False
        flag = torch.tensor([1.0 if self.ctx.should_stop() else 0.0], device=self.device)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _print0(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def metrics(self, loss: float, norm: float, dt: float) -> dict[str, float]:
        tokens_per_s = self.global_tokens / dt
        self.model.update_optim_accounting(self.optimizer)
        m = {"train/loss": loss, "train/lr": lr_at(self.cfg, self.step - 1), "train/grad_norm": norm,
             "perf/tokens_per_s": tokens_per_s, "perf/step_ms": dt * 1000.0,
             "perf/tflops_per_worker": self.flops_per_token * tokens_per_s / self.world / 1e12,
             "elastic/world_size": float(self.world)}
        m.update(self.model.acct.metrics())
        peak = peak_flops(self.device, self.cfg.sharding.param_dtype)
        if peak:
            m["perf/mfu"] = m["perf/tflops_per_worker"] * 1e12 / peak
        if self.device.type == "cuda":
            m["mem/device_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
        return m

    def run(self) -> TrainResult:
        self.resume()
        start, losses, loss = self.step, [], float("nan")
        total = self.cfg.train.steps
        every = self.cfg.train.checkpoint_every
        while self.step < total:
            if self.stop_requested():
                self._print0(f"stop requested at step {self.step}: saving a checkpoint before leaving")
                break
            if self.ctx.fault is not None:
                self.ctx.fault(self.step)
            t0 = time.perf_counter()
            loss, norm = self.train_step()
            dt = time.perf_counter() - t0
            losses.append((self.step - 1, loss))
            if (self.step - 1) % self.cfg.train.log_every == 0 or self.step == total:
                m = self.metrics(loss, norm, dt)
                if self.ctx.on_step is not None:
                    m.update(self.ctx.on_step(self.step - 1, m) or {})
                self._print0(f"step {self.step - 1:5d} | loss {loss:.4f} | lr {m['train/lr']:.2e} | "
                             f"gnorm {norm:.3f} | {m['perf/tokens_per_s']:8.0f} tok/s | "
                             f"{dt * 1000:7.1f} ms | world {self.world}")
                self.log.log_metrics(m, step=self.step - 1)
            if every and self.step % every == 0 and self.step < total:
                self.save()
        if self.step > start and self._saved_step != self.step:
            self.save()
        last = self.report_saved()
        self.writer.close()
        return TrainResult(self.step, loss, losses, last, self.resumed_from, start)


def run_training(cfg: JobConfig, ctx: WorkerContext) -> TrainResult:
    """Train `cfg` on this rank until cfg.train.steps (or a stop request); resume if possible."""
    return Trainer(cfg, ctx).run()
