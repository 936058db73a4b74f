"""Checkpointing for the training loop: when to save, the save in flight and the report of its
commit, and resume with the all-ranks fallback.

    storage = LaunchStorage(root, on_commit=report, may_write=lease)   # launch_storage.py
    ckpt = Checkpointer(cfg, storage, model, optimizer, scaler, rank=r, world_size=w, device=d,
                        control=control_group)
    step = ckpt.resume()        # 0, or the step of the newest checkpoint every rank can load
    ...                         # train a step; `step` steps are done, then:
    if ckpt.save_due(step):     # every train.checkpoint_every steps
        ckpt.save(step, loss=last_loss)          # once the state is known to be finite
    else:
        ckpt.after_step(step)   # reports a save that committed; snapshots when one is due
    if ckpt.save_due(step, closing=True):        # the last step trained, unless saved
        ckpt.save(step, loss=last_loss)
    last = ckpt.close(step)     # waits for the last save, reports it, stops the writer

What is saved (DESIGN.md invariants 2-4): each original parameter's fp32 element ranges and its
AdamW state (trainer/fsdp/state.py names them, trainer/checkpoint/keys.py turns the names into
keys), and the TrainerState (trainer_state.py): the step (which IS the data position), the RNG,
the loss scaler. Saves are asynchronous: the loop waits only for the copy to host memory. Step N
is reported (LaunchStorage.on_commit: Ray's checkpoint report under Ray) once its manifest is
committed, at the first step boundary after that, on every rank together: the ranks agree that
the save is done with one small all-reduce on `control` (gloo, CPU: no device sync) per step
while a save is in flight. The writer's barrier runs on a group of its own, created here: it
runs on the writer's background thread, and two threads must never issue collectives on one
group (gloo matches them by order).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from trainer.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    TensorChunk,
    list_checkpoints,
)
from trainer.checkpoint.keys import MODEL, OPTIM, optim_key, param_key
from trainer.checkpoint.launch_storage import LaunchStorage
from trainer.checkpoint.optim_state import load_optimizer
from trainer.checkpoint.resume import check_resumable
from trainer.checkpoint.snapshots import Snapshots
from trainer.checkpoint.trainer_state import TrainerState, cpu_rng_state, model_digest
from trainer.config import TrainerConfig
from trainer.fsdp import FSDPModel
from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.fsdp.state import load_params, optim_pieces, param_pieces
from trainer.optim import lr_at
from trainer.shell import python_m


def state_chunks(model: FSDPModel, optimizer: torch.optim.Optimizer) -> list[TensorChunk]:
    """This rank's named element ranges of parameters and optimizer state. Replicas (NO_SHARD,
    HYBRID_SHARD across groups; each unit by its own placement) hold identical bytes: only the
    first replica writes them (a rank that is no unit's first replica writes an empty shard)."""
    out = [  # in the master's dtype (fp32, or bf16 with sharding.master_dtype)
        TensorChunk(param_key(fqn), shape, t.dtype, start, t)
        for fqn, shape, start, t in param_pieces(model, primary=True)
    ]
    out += [
        TensorChunk(optim_key(fqn, name), shape, t.dtype, start, t)
        for fqn, name, shape, start, t in optim_pieces(model, optimizer, primary=True)
    ]
    return out


def load_state(
    model: FSDPModel,
    optimizer: Optional[torch.optim.Optimizer],
    reader: CheckpointReader,
    optim_step: float,
    device: torch.device,
) -> list[str]:
    """Fill this rank's shards (and optimizer state, when the checkpoint has some: an imported
    one has none) from a checkpoint of any layout, reading only the element ranges this rank
    holds. Each tensor converts to the dtype this run keeps it in (the chunk table records the
    saved one); returns a note for each kind that changed dtype, and for parameters frozen or
    unfrozen since the save (optim_state.py: their state is dropped, or starts at zero), for
    the log."""
    notes = precision_changes(model, optimizer, reader)
    load_params(model, lambda fqn, start, n: reader.read(param_key(fqn), start, n).to(device))
    if optimizer is not None and any(k.startswith(OPTIM) for k in reader.keys()):
        notes += load_optimizer(model, optimizer, reader, optim_step, device)
    return notes


def precision_changes(
    model: FSDPModel, optimizer: Optional[torch.optim.Optimizer], reader: CheckpointReader
) -> list[str]:
    """What changes dtype at this load, said plainly. fp32 -> bf16 master: each weight rounds to
    the nearest bf16 (the switch the memory levers make at a resume). bf16 -> fp32 master:
    allowed, and said: the bf16 values are exact in fp32, but the precision they lost is not
    recovered (the run continues from bf16-rounded weights). Moments convert either way."""
    keys = reader.keys()
    notes = []
    saved = {reader.dtype(k) for k in keys if k.startswith(MODEL)}
    now = model.master_dtype
    for dtype in sorted(saved - {now}, key=str):
        way = (
            "each weight rounded to the nearest bf16"
            if now == torch.bfloat16
            else "upcast exactly; the precision bf16 lost is not recovered"
        )
        notes.append(f"master weights: {_name(dtype)} in the checkpoint, {_name(now)} now ({way})")
    if optimizer is not None:
        saved = {reader.dtype(k) for k in keys if k.startswith(OPTIM)}
        now = getattr(optimizer, "state_dtype", now)
        for dtype in sorted(saved - {now}, key=str):
            notes.append(f"AdamW moments: {_name(dtype)} in the checkpoint, {_name(now)} now")
    return notes


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def trainer_state(
    cfg: TrainerConfig,
    step: int,
    world_size: int,
    optimizer: torch.optim.Optimizer,
    scaler: ShardedGradScaler,
    data: dict,
    tokenizer: Optional[dict] = None,
    loss: Optional[float] = None,
    hf_special_ids: Optional[dict] = None,
) -> TrainerState:
    """The state of a run at `step`, as a save records it (a loss that is not finite: None)."""
    steps_taken = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return TrainerState(
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
        rng_cpu=cpu_rng_state(),
        data=data,
        tokenizer=tokenizer,
        loss=float(loss) if loss is not None and math.isfinite(loss) else None,
        tokens_seen=step * cfg.train.global_batch_size * cfg.data.seq_len,
        hf_special_ids=hf_special_ids,
    )


class RunTakenOver(CheckpointError):
    """Another launch owns the run folder now: this one must not write into it."""


class Checkpointer:
    """One rank's checkpointing of one run: cadence, async save, commit report, resume."""

    def __init__(
        self,
        cfg: TrainerConfig,
        storage: LaunchStorage,
        model: FSDPModel,
        optimizer: torch.optim.Optimizer,
        scaler: ShardedGradScaler,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        control: Optional[dist.ProcessGroup] = None,
        log=print,
        data_identity: Optional[dict] = None,
        tokenizer: Optional[dict] = None,
    ):
        """`storage`: where this launch reads and writes (launch_storage.py): the checkpoint
        root, the snapshots, an older launch's, who hears of a commit, whether it may still
        write (asked before each save on every rank together, and by rank 0's writer again
        right before it commits). `control`: a gloo group of all ranks for the agreements, used
        from this (the training) thread only; the save barrier gets a gloo group of its own
        (both None with one rank). `log`: prints on rank 0 (the loop's print0).
        `data_identity`: what the sample order depends on (resume.data_identity); a checkpoint
        of another one is refused. `tokenizer`: the data's tokenizer, recorded with every
        checkpoint for exports."""
        self.cfg, self.storage, self.root = cfg, storage, storage.root
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.rank, self.world, self.device, self.control = rank, world_size, device, control
        # Collective: every rank creates it, in the same order as its other groups.
        barrier_group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.log, self.data_identity, self.tokenizer = log, data_identity or {}, tokenizer
        self.hf_special_ids: Optional[dict] = None  # an import's, carried from the resumed state
        self.every, self.total = cfg.train.checkpoint_every, cfg.train.steps
        self.writer = CheckpointWriter(
            storage.root,
            keep=cfg.train.keep_checkpoints,
            group=barrier_group,
            commit_guard=storage.may_write,
        )
        self.snapshots = Snapshots.of_launch(storage, cfg.train, world_size, log)
        self._release_inherited = storage.release_inherited if storage.inherited_snapshots else None
        self.start_step = 0
        self.resumed_from: Optional[str] = None
        self.last_committed: Optional[str] = None
        self._in_flight: Optional[int] = None  # the step being saved, until reported
        self._saved_step: Optional[int] = None
        self._loss: Optional[float] = None  # the last save's: recorded with snapshots too

    # ---- saving ------------------------------------------------------------------------------
    def save_due(self, step: int, closing: bool = False) -> bool:
        """A durable save of `step` is due: on the cadence (every train.checkpoint_every steps,
        before the last), or, `closing`, of the last step trained unless it is saved already."""
        if closing:
            return step > self.start_step and self._saved_step != step
        return bool(self.every) and step % self.every == 0 and step < self.total

    def after_step(self, step: int) -> None:
        """`step` steps are done: report a save that committed meanwhile; save if one is due
        (the loop saves those itself, with the loss: save_due, save); else snapshot if due."""
        if self._in_flight is not None and not self._any(self.writer.in_flight()):
            self._report()
        if self.save_due(step):
            self.save(step)
        elif self.snapshots is not None and step < self.total:
            t0 = time.perf_counter()  # what the training thread waits: the agreement + the copy
            busy = self._any(self.snapshots.writer.in_flight())
            if self.snapshots.due(step, busy):
                self.snapshots.save(
                    step, self._state(step), state_chunks(self.model, self.optimizer), self.rank
                )
            self.snapshots.blocked_ms = (time.perf_counter() - t0) * 1000.0
        self._maybe_release_inherited()

    def _maybe_release_inherited(self) -> None:
        """Once this launch's own state is committed somewhere (a snapshot or a durable
        checkpoint since the resume), the inherited snapshots are not needed any more."""
        if self._release_inherited is None:
            return
        own_snapshot = self.snapshots is not None and self.snapshots.last_step is not None
        if not own_snapshot and self.last_committed is None:
            return
        release, self._release_inherited = self._release_inherited, None
        try:
            release()
        except Exception as e:  # they are freed at the launch's end anyway
            self.log(f"snapshots: could not free the inherited ones ({type(e).__name__}: {e})")

    def save(self, step: int, loss: Optional[float] = None) -> None:
        """Start an asynchronous save of `step`, recording `loss` (the mean token loss of the
        last step trained; None: unknown); the previous save is waited for and reported. The
        caller has checked that the state is finite (the loop's divergence guard)."""
        self.check_may_write(f"saving step {step}")
        self._report()
        self._loss = loss
        self.writer.save(
            step,
            self.rank,
            self.world,
            state_chunks(self.model, self.optimizer),
            self._state(step).to_json(),
        )
        self._in_flight = self._saved_step = step

    def _state(self, step: int) -> TrainerState:
        live = (self.optimizer, self.scaler, self.data_identity, self.tokenizer, self._loss)
        return trainer_state(self.cfg, step, self.world, *live, self.hf_special_ids)

    def close(self, step: int) -> Optional[str]:
        """Save `step` unless saved already or nothing was trained (the loop saves it itself,
        with the loss: save_due(step, closing=True), save); wait; report; stop the writer.
        Returns the last committed checkpoint's path."""
        if self.save_due(step, closing=True):
            self.save(step)
        self._report()
        self.writer.close()
        if self.snapshots is not None:
            self.snapshots.close()
        self._maybe_release_inherited()
        return self.last_committed

    def check_may_write(self, doing: str) -> None:
        """RunTakenOver on every rank (they agree) when this run may no longer write."""
        may_write = self.storage.may_write
        reason = may_write() if may_write is not None else None
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
        if self.storage.on_commit is not None:
            self.storage.on_commit(path, step)

    # ---- resuming ----------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest checkpoint that every rank can read whole; older ones are the fallback.
        Returns the step to start at (0 when there is nothing to resume).

        Listing checks are cheap (manifest, sizes); a flipped byte inside a shard only shows when
        its block is read. A rank that hits one tells the others (MAX all-reduce), and all ranks
        move to the next older checkpoint together: never a mix of two."""
        if self.storage.resume_from:
            candidates = [self.storage.resume_from]
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
                f"({', '.join(candidates)}); run `{python_m('trainer.checkpoint')} verify PATH` on "
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
            check_resumable(reader.state, self.cfg, self.data_identity, path)
            state = TrainerState.from_json(reader.state)
            for note in load_state(
                self.model, self.optimizer, reader, state.optim_step, self.device
            ):
                self.log(f"{path}: {note}")
        except CheckpointError as e:
            return str(e), None
        except OSError as e:
            if not self._is_snapshot(path):
                raise
            return f"{type(e).__name__}: {e}", None
        return None, state

    def _is_snapshot(self, path: str) -> bool:
        return self.snapshots is not None and self.snapshots.holds(path)

    def _adopt(self, path: str, state: TrainerState) -> int:
        """Every rank loaded `path`: take its step, RNG and scaler, and never delete it."""
        state.restore_rng()
        if state.grad_scaler:
            self.scaler.load_state_dict(state.grad_scaler)
        self.start_step = int(state.step)
        self.hf_special_ids = state.hf_special_ids
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
