"""Checkpointing for the training loop: when to save, the save in flight and the report of its
commit, resume with the all-ranks fallback, and the trainer state stored with every checkpoint.

    ckpt = Checkpointer(cfg, root, model, optimizer, scaler, rank=r, world_size=w, device=d,
                        control=control_group, on_commit=report)
    step = ckpt.resume()        # 0, or the step of the newest checkpoint every rank can load
    ...                         # train step `step`, then:
    ckpt.after_step(step + 1)   # saves every train.checkpoint_every steps; reports commits
    last = ckpt.close(step)     # saves the last step trained, waits for it, reports it

What is saved (DESIGN.md invariants 2-4): each original parameter's fp32 element ranges and its
AdamW state (trainer/fsdp/state.py names them, trainer/checkpoint/keys.py turns the names into
keys), and `TrainerState`: the step (which IS the data position), the RNG, the loss scaler. Saves
are asynchronous: the loop waits only for the copy to host memory. Step N is reported
(`on_commit`, Ray's checkpoint report under Ray) once its manifest is committed, at the first step
boundary after that, on every rank together: the ranks agree that the save is done with one
small all-reduce on `control` (gloo, CPU: no device sync) per step while a save is in flight.
The writer's barrier runs on a group of its own, created here: it runs on the writer's background
thread, and two threads must never issue collectives on one group (gloo matches them by order).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from trainer.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    TensorChunk,
    list_checkpoints,
)
from trainer.checkpoint.keys import OPTIM, optim_key, param_key
from trainer.config import ConfigError, ModelConfig, TrainerConfig
from trainer.fsdp import FSDPModel
from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.fsdp.state import load_optim, load_params, optim_pieces, param_pieces
from trainer.optim import lr_at


def model_digest(model: ModelConfig) -> str:
    """A checkpoint only loads into the same model shape (where a Hugging Face model came from
    is not part of its shape)."""
    shape = {k: v for k, v in dataclasses.asdict(model).items() if k != "hf_path"}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class TrainerState:
    """What a checkpoint holds besides tensors (the manifest's JSON `state`)."""

    step: int
    """Optimizer steps done; the next step to train. Also the data position: step s consumes
    global samples [s * B, (s + 1) * B)."""
    consumed_samples: int
    global_batch_size: int
    """The data position depends on it: a checkpoint only resumes with the same global batch."""
    optim_step: float
    """AdamW's step count (bias correction), restored into every shard's state."""
    lr: float
    """The learning rate of the last step trained (for the record)."""
    world_size: int
    strategy: str
    model_config: dict
    model_digest: str
    grad_scaler: dict
    rng_cpu: str
    """torch's CPU RNG state, base64."""
    data: dict
    """What the sample order depends on besides the step (trainer.loop.data_identity): the
    prepared dataset's digest, seq_len, seed and the mix weights."""
    tokenizer: Optional[dict] = None
    """The data's tokenizer (name: 'byte' or its tokenizer.json, vocab_size, eod_id, eod_token):
    what an export hands over with the weights."""
    imported_from: Optional[str] = None
    """A Hugging Face checkpoint this step-0 checkpoint was imported from (trainer/hf.py)."""
    loss: Optional[float] = None
    """The mean token loss of the last step trained (for `inspect`; None when unknown)."""
    tokens_seen: Optional[int] = None
    """Training tokens consumed up to this step: step x global batch x sequence length."""

    @classmethod
    def of(
        cls,
        cfg: TrainerConfig,
        step: int,
        world_size: int,
        optimizer: torch.optim.Optimizer,
        scaler: ShardedGradScaler,
        data: dict,
        tokenizer: Optional[dict] = None,
        loss: Optional[float] = None,
    ) -> "TrainerState":
        steps_taken = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
        finite = loss is not None and loss == loss and abs(loss) != float("inf")
        return cls(
            step=step,
            consumed_samples=step * cfg.train.global_batch_size,
            global_batch_size=cfg.train.global_batch_size,
            optim_step=max(steps_taken, default=0.0),
            lr=lr_at(cfg.optim, cfg.train.steps, max(step - 1, 0)),
            world_size=world_size,
            strategy=str(cfg.sharding.strategy),
            model_config=dataclasses.asdict(cfg.model),
            model_digest=model_digest(cfg.model),
            grad_scaler=scaler.state_dict(),
            rng_cpu=base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
            data=data,
            tokenizer=tokenizer,
            loss=float(loss) if finite else None,
            tokens_seen=step * cfg.train.global_batch_size * cfg.data.seq_len,
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def restore_rng(self) -> None:
        if self.rng_cpu is None:  # an imported checkpoint: nothing was drawn yet
            return
        torch.set_rng_state(
            torch.frombuffer(bytearray(base64.b64decode(self.rng_cpu)), dtype=torch.uint8)
        )


def state_chunks(model: FSDPModel, optimizer: torch.optim.Optimizer) -> list[TensorChunk]:
    """This rank's named element ranges of parameters and optimizer state. Replicas (NO_SHARD,
    HYBRID_SHARD across groups) hold identical bytes: only the first replica writes them, the
    others write an empty shard."""
    if model.mesh.replicate_rank != 0:
        return []
    out = [
        TensorChunk(param_key(fqn), shape, torch.float32, start, t)
        for fqn, shape, start, t in param_pieces(model)
    ]
    out += [
        TensorChunk(optim_key(fqn, name), shape, t.dtype, start, t)
        for fqn, name, shape, start, t in optim_pieces(model, optimizer)
    ]
    return out


def load_state(
    model: FSDPModel,
    optimizer: Optional[torch.optim.Optimizer],
    reader: CheckpointReader,
    optim_step: float,
    device: torch.device,
) -> None:
    """Fill this rank's shards (and optimizer state, when the checkpoint has some: an imported
    one has none) from a checkpoint of any layout, reading only the element ranges this rank
    holds."""
    load_params(model, lambda fqn, start, n: reader.read(param_key(fqn), start, n).to(device))
    if optimizer is not None and any(k.startswith(OPTIM) for k in reader.keys()):
        load_optim(
            model,
            optimizer,
            lambda fqn, name, start, n: reader.read(optim_key(fqn, name), start, n).to(device),
            step=optim_step,
        )


def data_identity(cfg: TrainerConfig, digest: str) -> dict:
    """What the sample order depends on besides the step: a run resumes only on the same."""
    return {
        "digest": digest,
        "seq_len": cfg.data.seq_len,
        "seed": cfg.data.seed,
        "weights": [s.weight for s in cfg.data.sources()],
    }


def has_checkpoint(root: str) -> bool:
    """A committed checkpoint exists under `root`: a resume will load one (or fail loudly)."""
    return any(info.problem is None for info in list_checkpoints(root))


def preflight_resume(root: str, cfg: TrainerConfig, data: dict) -> Optional[str]:
    """Before any worker starts: ConfigError if the newest committed checkpoint under `root`
    cannot continue this config (check_resumable); its path, or None when there is none."""
    for info in list_checkpoints(root):
        if info.problem:
            continue
        try:
            state = CheckpointReader(info.path).state
        except CheckpointError:
            continue  # the workers fall back past it, as they do at resume
        check_resumable(state, cfg, data, info.path)
        return info.path
    return None


def check_resumable(state: dict, cfg: TrainerConfig, data: dict, path: str) -> None:
    """ConfigError, saying what differs and what to do, when the checkpoint at `path` (its
    `state`) cannot continue this config: another model shape, global batch or data order.
    The driver calls it before any worker starts; every worker again before loading."""
    if state.get("model_digest") != model_digest(cfg.model):
        raise ConfigError(
            f"invalid config: the checkpoint at {path} was written for model "
            f"{state.get('model_config')}, not {dataclasses.asdict(cfg.model)}; "
            "valid: the same model config, or a new cluster.run_name"
        )
    if state.get("imported_from"):  # a step-0 import: no data position, any batch, any data
        return
    if state.get("global_batch_size") != cfg.train.global_batch_size:
        raise ConfigError(
            f"invalid config: train.global_batch_size={cfg.train.global_batch_size} "
            f"but the checkpoint at {path} was trained with {state.get('global_batch_size')}; "
            "valid: the same global batch (the data position depends on it)"
        )
    saved = state.get("data") or {}
    changed = sorted(k for k in set(saved) | set(data) if saved.get(k) != data.get(k))
    if data and changed:
        what = ", ".join(f"{k}: {saved.get(k)!r} then, {data.get(k)!r} now" for k in changed)
        raise ConfigError(
            f"invalid config: the checkpoint at {path} was trained on other data ({what}); "
            "resuming would repeat and skip samples. valid: the same data.* settings and "
            "unchanged source files (a prepared dataset is named by the digest of its files, "
            "tokenizer and settings), or a new cluster.run_name"
        )


class RunTakenOver(CheckpointError):
    """Another launch owns the run folder now: this one must not write into it."""


class Checkpointer:
    """One rank's checkpointing of one run: cadence, async save, commit report, resume."""

    def __init__(
        self,
        cfg: TrainerConfig,
        root: str,
        model: FSDPModel,
        optimizer: torch.optim.Optimizer,
        scaler: ShardedGradScaler,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        control: Optional[dist.ProcessGroup] = None,
        resume_from: Optional[str] = None,
        snapshot_root: Optional[str] = None,
        on_commit: Optional[Callable[[str, int], None]] = None,
        log=print,
        data_identity: Optional[dict] = None,
        tokenizer: Optional[dict] = None,
    ):
        """`root`: this run's checkpoint folder (a path or pyarrow.fs URI). `control`: a gloo
        group of all ranks for the agreements, used from this (the training) thread only; the
        save barrier gets a gloo group of its own (both None with one rank).
        `resume_from`: a checkpoint to resume from instead of the newest valid one under root.
        `snapshot_root`: where in-memory snapshots go (Snapshots below), or None.
        `on_commit(path, step)`: called on every rank once step's checkpoint is committed.
        `log`: prints on rank 0 (the loop's print0). `data_identity`: what the sample order
        depends on (data_identity); a checkpoint of another one is refused. `tokenizer`: the
        data's tokenizer, recorded with every checkpoint for exports."""
        self.cfg, self.root = cfg, root
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.rank, self.world, self.device, self.control = rank, world_size, device, control
        # Collective: every rank creates it, in the same order as its other groups.
        barrier_group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.resume_from, self.on_commit, self.log = resume_from, on_commit, log
        self.data_identity = data_identity or {}
        self.tokenizer = tokenizer
        self.every, self.total = cfg.train.checkpoint_every, cfg.train.steps
        self.writer = CheckpointWriter(
            root, keep=cfg.train.keep_checkpoints, async_save=True, group=barrier_group
        )
        self.writer.commit_guard = lambda: self.may_write() if self.may_write else None
        self.snapshots = (
            Snapshots(snapshot_root, cfg.train.snapshot_every, world_size, log)
            if snapshot_root and cfg.train.snapshot_every != 0
            else None
        )
        self.start_step = 0
        self.resumed_from: Optional[str] = None
        self.last_committed: Optional[str] = None
        self._in_flight: Optional[int] = None  # the step being saved, until reported
        self._saved_step: Optional[int] = None
        self.last_loss: Optional[float] = None
        """The mean token loss of the last step trained, recorded with each save (the loop sets
        it when it reads the losses back before a save)."""
        self.before_save: Optional[Callable[[int], None]] = None
        """Called with the step on every rank before each save; raises to refuse it (the loop's
        check that the state is finite)."""
        self.may_write: Optional[Callable[[], Optional[str]]] = None
        """None when this run may still write its checkpoints, else why not (the cluster layer's
        run lease: another launch took the run over). Asked before each save, on every rank
        together, and by rank 0 again right before it commits."""

    # ---- saving ------------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        """`step` steps are done: report a save that committed meanwhile; save if one is due;
        else snapshot if one is due."""
        if self._in_flight is not None and not self._any(self.writer.in_flight()):
            self._report()
        if self.every and step % self.every == 0 and step < self.total:
            self.save(step)
        elif self.snapshots is not None and step < self.total:
            t0 = time.perf_counter()  # what the training thread waits: the agreement + the copy
            busy = self._any(self.snapshots.writer.in_flight())
            if self.snapshots.due(step, busy):
                self.snapshots.save(
                    step, self._state(step), state_chunks(self.model, self.optimizer), self.rank
                )
            self.snapshots.blocked_ms = (time.perf_counter() - t0) * 1000.0

    def save(self, step: int) -> None:
        """Start an asynchronous save of `step`; the previous one is waited for and reported."""
        if self.before_save is not None:
            self.before_save(step)
        self.check_may_write(f"saving step {step}")
        self._report()
        self.writer.save(
            step,
            self.rank,
            self.world,
            state_chunks(self.model, self.optimizer),
            self._state(step).to_json(),
        )
        self._in_flight = self._saved_step = step

    def _state(self, step: int) -> TrainerState:
        return TrainerState.of(
            self.cfg,
            step,
            self.world,
            self.optimizer,
            self.scaler,
            self.data_identity,
            self.tokenizer,
            self.last_loss,
        )

    def close(self, step: int) -> Optional[str]:
        """Save `step` unless saved already or nothing was trained; wait; report; stop the
        writer. Returns the last committed checkpoint's path."""
        if step > self.start_step and self._saved_step != step:
            self.save(step)
        self._report()
        self.writer.close()
        if self.snapshots is not None:
            self.snapshots.close()
        return self.last_committed

    def check_may_write(self, doing: str) -> None:
        """RunTakenOver on every rank (they agree) when this run may no longer write."""
        reason = self.may_write() if self.may_write is not None else None
        if self._any(reason is not None):
            raise RunTakenOver(
                f"not {doing}: {reason or 'another rank found the run taken over'}; this launch "
                "writes nothing more into the run folder"
            )

    def abandon(self) -> None:
        """Stop without saving: the save in flight (started before anything went wrong) is
        waited for and reported, then the writer stops. Safe after a partial close()."""
        try:
            self._report()
        finally:
            self.writer.close()
            if self.snapshots is not None:
                self.snapshots.close()

    def last_good_step(self) -> int:
        """The newest step saved (or being saved) by this run, else the step it resumed at."""
        return self._saved_step if self._saved_step is not None else self.start_step

    def _report(self) -> None:
        """Wait for the save in flight (re-raising its failure) and report it as committed."""
        if self._in_flight is None:
            return
        path = self.writer.wait()
        step, self._in_flight = self._in_flight, None
        self.last_committed = path
        if self.on_commit is not None:
            self.on_commit(path, step)

    # ---- resuming ----------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest checkpoint that every rank can read whole; older ones are the fallback.
        Returns the step to start at (0 when there is nothing to resume).

        Listing checks are cheap (manifest, sizes); a flipped byte inside a shard only shows when
        its block is read. A rank that hits one tells the others (MAX all-reduce), and all ranks
        move to the next older checkpoint together: never a mix of two."""
        if self.resume_from:
            candidates = [self.resume_from]
        else:
            infos = list_checkpoints(self.root)
            for info in infos:
                if info.problem:
                    self.log(f"skipping checkpoint {info.path}: {info.problem}")
            candidates = [info.path for info in infos if not info.problem]
            if self.snapshots is not None:
                durable = next((i.step for i in infos if not i.problem), 0)
                candidates = (
                    self.snapshots.newer_than(durable, self.rank, self.control) + candidates
                )
        for path in candidates:
            error, state = self._try_load(path)
            if not self._any(error is not None):
                return self._adopt(path, state)
            if error is not None:
                print(f"rank {self.rank}: checkpoint {path} is unusable: {error}", flush=True)
            self.log(f"checkpoint {path} failed to load on some rank: falling back to an older one")
        if candidates:  # committed checkpoints exist and none loads: starting over would lose them
            raise CheckpointError(
                f"none of the committed checkpoints under {self.root} can be loaded "
                f"({', '.join(candidates)}); run `python -m trainer.checkpoint verify PATH` on "
                "them, or start a new run (cluster.run_name)"
            )
        return 0

    def _try_load(self, path: str) -> tuple[Optional[str], Optional[TrainerState]]:
        """Load `path` into this rank's shards: (None, its state), or (the error text, None).
        A snapshot that cannot be read any more (OSError: the keepers holding a file died
        after rank 0 listed it complete) is unusable like a corrupt checkpoint, and the ranks
        move on together; a durable checkpoint's I/O error is raised (the storage may be back
        at the next restart, and falling back would retrain steps it holds)."""
        try:
            reader = CheckpointReader(path)
            st = reader.state
            check_resumable(st, self.cfg, self.data_identity, path)
            load_state(self.model, self.optimizer, reader, st["optim_step"], self.device)
        except CheckpointError as e:
            return str(e), None
        except OSError as e:
            if not self._is_snapshot(path):
                raise
            return f"{type(e).__name__}: {e}", None
        known = {f.name for f in dataclasses.fields(TrainerState)}
        return None, TrainerState(**{k: st.get(k) for k in known})

    def _is_snapshot(self, path: str) -> bool:
        return self.snapshots is not None and path.startswith(self.snapshots.root.rstrip("/") + "/")

    def _adopt(self, path: str, state: TrainerState) -> int:
        """Every rank loaded `path`: take its step, RNG and scaler, and never delete it."""
        state.restore_rng()
        if state.grad_scaler:
            self.scaler.load_state_dict(state.grad_scaler)
        self.start_step = int(state.step)
        self.resumed_from = path
        self.writer.protect(path)
        self.log(
            f"resumed from {path} at step {self.start_step} "
            f"(saved at world size {state.world_size}, now {self.world})"
        )
        return self.start_step

    def metrics(self) -> dict[str, float]:
        """snapshot/* of the last snapshot (see Snapshots.metrics); {} without snapshots."""
        return self.snapshots.metrics() if self.snapshots is not None else {}

    # ---- agreement ---------------------------------------------------------------------------
    def _any(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any rank."""
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())


class Snapshots:
    """In-memory snapshots: the checkpoint format, written to `root` (the launcher's peers'
    memory, cluster/elastic/snapshots.py: keeper://), two generations kept.

    A snapshot is a checkpoint of its own writer (its own gloo barrier group: created on every
    rank, in the same order), asynchronous like the durable one: the loop waits only for the
    copy of its shard state to host memory; sending it on happens on the writer's thread.
    `every`: None -> at every step where the previous snapshot has been sent (all ranks agree:
    the busy flag is all-reduced), so the copy always hides behind compute; N -> every N steps
    (waiting for the previous one if it is still being sent). A snapshot that fails (a keeper
    gone with its node) is reported and the next one is tried: snapshots never stop training.
    Resuming, `newer_than` offers the complete snapshots newer than the newest durable
    checkpoint, newest first, as rank 0 lists them (all ranks try the same ones, in order)."""

    KEEP = 2

    def __init__(self, root: str, every: Optional[int], world_size: int, log=print):
        self.root, self.every, self.log = root, every, log
        group = dist.new_group(backend="gloo") if world_size > 1 else None
        if group is not None:  # gloo connects a group at its first collective: not mid-snapshot
            dist.barrier(group=group)
        self.writer = CheckpointWriter(
            root,
            keep=self.KEEP,
            async_save=True,
            group=group,
            retention_log_level=logging.DEBUG,
            check_finite=True,  # on the host copy, on the writer's thread: no device sync
        )
        self.world = world_size
        self._in_flight: Optional[int] = None
        self.last_step: Optional[int] = None
        self.blocked_ms: Optional[float] = None
        self.bytes: int = 0
        self.taken = 0  # snapshots started by this rank

    def due(self, step: int, busy: bool) -> bool:
        if self.every is None:
            if busy:
                return False
        elif step % self.every:
            return False
        self._collect()
        return True

    def save(self, step: int, state: TrainerState, chunks: list[TensorChunk], rank: int) -> None:
        self.writer.save(step, rank, self.world, chunks, state.to_json())
        self.bytes = sum(c.data.numel() * c.data.element_size() for c in chunks)
        self._in_flight = step
        self.taken += 1

    def _collect(self) -> None:
        """The previous snapshot's outcome (it is done or being waited for)."""
        if self._in_flight is None:
            return
        step, self._in_flight = self._in_flight, None
        try:
            self.writer.wait()
            self.last_step = step
        except Exception as e:  # a keeper gone: the next snapshot is tried
            self.log(f"snapshot of step {step} failed ({type(e).__name__}: {e}); trying again")

    def metrics(self) -> dict[str, float]:
        """snapshot/step (the newest sent), snapshot/blocked_ms (the training thread's wait at
        the last step: agreeing whether one is due, and the copy to host memory when it was),
        mem/snapshot_bytes (this rank's shard state in
        one snapshot; the keepers hold 2 copies x 2 generations of it)."""
        m = {"mem/snapshot_bytes": float(self.bytes)} if self.bytes else {}
        if self.last_step is not None:
            m["snapshot/step"] = float(self.last_step)
        if self.blocked_ms is not None:
            m["snapshot/blocked_ms"] = self.blocked_ms
        return m

    def newer_than(self, durable_step: int, rank: int, control) -> list[str]:
        """Complete snapshots newer than `durable_step`, newest first, as rank 0 sees them."""
        paths: list = [None]
        if rank == 0:
            try:
                infos = list_checkpoints(self.root)
            except Exception as e:  # the keepers unreachable: the durable checkpoint it is
                infos = []
                self.log(f"snapshots: cannot list {self.root} ({type(e).__name__}: {e})")
            newer = [i for i in infos if i.step > durable_step]
            good = [i.path for i in newer if not i.problem]
            for i in newer:
                if i.problem:
                    self.log(f"snapshot of step {i.step} is incomplete: {i.problem}")
            if newer and not good:
                self.log(
                    "no complete in-memory snapshot newer than the durable checkpoint of step "
                    f"{durable_step}: resuming from that checkpoint"
                )
            paths = [good]
        if self.world > 1:
            dist.broadcast_object_list(paths, src=0, group=control)
        return paths[0]

    def close(self) -> None:
        try:
            self._collect()
        finally:
            self.writer.close()
