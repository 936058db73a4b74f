"""The elastic/* metrics: one record per worker-group start, and what the next start learns from it.

Rank 0 keeps the record; from the records come elastic/restarts, elastic/recovery_s (the failure
to the first step after the resume) and elastic/steps_lost, and a line saying where the recovery
time went.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from cluster.elastic.clock import CLOCK, ray_phases
from cluster.elastic.faults import FAULT_MARKER
from cluster.run.folder import RunFolder

ATTEMPTS_DIR = "attempts"


class ElasticTracker:
    """Rank 0's record of this worker-group start, and the elastic/* metrics derived from it.

    The record is created at the start of the training function (`entered`), learns the start
    step at the first `before_step` (after the loop resumed), and its progress (last step
    trained, when) at every step. The next group start reads it to know what was lost:

        steps_lost  = last step the previous group trained + 1 - the step this group resumes at
        recovery_s  = first step done after the resume - the failure, where the failure is the
                      fired fault's time, or else the end of the previous group's last step
                      (an upper bound by at most one step for deaths nobody announced)

    A group that died before reporting its own recovery passes it on to the next one, so the
    figures span a failed restart. restarts counts the group starts of this launch (one
    `python -m cluster.train`); recovery_s is only reported within a launch, steps_lost also
    across a resubmission.

    On a local or shared disk the record is rewritten every step (a rename, well under a
    millisecond). On an object store each write is a PUT of tens of milliseconds, so progress
    is written at most every PROGRESS_EVERY_S there: steps_lost can then miss the steps of the
    last such interval before an unannounced death.
    """

    PROGRESS_EVERY_S = 1.0

    def __init__(
        self,
        folder: RunFolder,
        rank: int,
        world_size: int,
        launch_id: str,
        times: dict[str, Optional[float]],
        clock: Callable[[], float] = time.time,
        startup: Optional[dict] = None,
        process: Optional[dict] = None,
    ):
        """`times`: 'context' (Ray created the worker, SigtermCallback), 'entered' (the training
        function started: Ray's backend set up the process group in between), 'imported' (the
        training stack is imported and the logger attached). `startup`: the driver's phases
        (LaunchInfo.startup), for the start-up line of the launch's first group. `process`:
        when this process started and preloaded (elastic/spares.py this_process; None where
        spares are off)."""
        self.folder, self.clock = folder, clock
        self.startup = startup
        self.active = rank == 0
        self.name = f"{ATTEMPTS_DIR}/{time.time_ns():020d}.json"
        entered = times["entered"]
        self.record = {
            "launch": launch_id,
            "world_size": world_size,
            "pid": os.getpid(),
            "started": entered,
            "context": times.get("context") or entered,
            "imported": times.get("imported") or entered,
            "start_step": None,
            "last_step": None,
            "last_step_time": None,
            "pending": None,
            "process": process,
        }
        self.previous: Optional[dict] = None
        self.trained_before = -1
        """The last step any earlier group trained: steps up to it are trained again here."""
        self.restarts = 0
        self._save_every_s = 0.0 if folder.is_local else self.PROGRESS_EVERY_S
        self._saved_at = float("-inf")
        if self.active:
            self._load_history()
            self._save()

    def _load_history(self) -> None:
        earlier = [d for d in (self.folder.read(n) for n in self.folder.names(ATTEMPTS_DIR)) if d]
        self.restarts = sum(d.get("launch") == self.record["launch"] for d in earlier)
        begun = [d for d in earlier if d.get("start_step") is not None]
        self.previous = begun[-1] if begun else None
        self.trained_before = max((d["last_step"] for d in begun), default=-1)

    def _save(self, progress_only: bool = False) -> None:
        now = time.monotonic()
        if progress_only and now - self._saved_at < self._save_every_s:
            return
        self.folder.write(self.name, self.record)
        self._saved_at = now

    # -- callbacks ----------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        """Chained into WorkerContext.before_step: called before every step with its number."""
        if not self.active:
            return
        if self.record["start_step"] is None:
            self._begin(step)
        elif step - 1 > self.record["last_step"]:
            self._progress(step - 1)

    def on_step(self, step: int, metrics: dict) -> Optional[dict]:
        """WorkerContext.after_step: progress, and the elastic/* metrics for rank 0 to log."""
        if not self.active:
            return None
        if step <= self.trained_before and "train/loss" in metrics:
            # Kept to compare with the first training of the step (MLflow keeps only that one).
            self.record.setdefault("retrained_losses", {})[str(step)] = float(metrics["train/loss"])
        self._progress(step, save=False)
        out = {"elastic/restarts": float(self.restarts)}
        pending = self.record["pending"]
        if pending is not None:
            out["elastic/steps_lost"] = float(pending["steps_lost"])
            if pending.get("recovery_s") is not None:
                out["elastic/recovery_s"] = pending["recovery_s"]
            self.record["recovery"], self.record["pending"] = pending, None
        self._save(progress_only=pending is None)
        return out

    def left(self, step: int) -> None:
        """The loop returned early (a drain): note where, for the record."""
        if self.active:
            self.record["left_at"] = {"step": step, "time": self.clock()}
            self._save()

    # -- bookkeeping --------------------------------------------------------------------------
    def _begin(self, step: int) -> None:
        r = self.record
        r["start_step"], r["ready"], r["last_step"] = step, self.clock(), step - 1
        if self.previous is not None:
            r["pending"] = self._recovery_from(self.previous, step)
        self._save()

    def _progress(self, step: int, save: bool = True) -> None:
        r = self.record
        if r["start_step"] is None:
            self._begin(step)
        now = self.clock()
        r["last_step"], r["last_step_time"] = step, now
        pending = r["pending"]
        first_done = pending is not None and pending.get("first_step") is None
        if first_done:
            pending["first_step"] = now
            self._finish_recovery(pending)
        if self.startup is not None and self.restarts == 0 and step >= r["start_step"]:
            print(startup_line(self.startup, r, now), flush=True)
            self.startup = None  # once
        if save:
            self._save(progress_only=not first_done)

    def _recovery_from(self, prev: dict, start_step: int) -> dict:
        carried = prev.get("pending") or {}
        lost = carried.get("steps_lost", 0) + max(0, prev["last_step"] + 1 - start_step)
        failure = carried.get("failure")
        if failure is None:
            failure = self._failure_time(prev)
        same_launch = prev.get("launch") == self.record["launch"]
        return {
            "steps_lost": lost,
            "failure": failure if same_launch else None,
            "resumed_at": start_step,
            "first_step": None,
        }

    def _failure_time(self, prev: dict) -> float:
        marker = self.folder.read(FAULT_MARKER)
        if marker and marker["time"] >= prev["started"]:
            return marker["time"]
        return prev.get("last_step_time") or prev.get("ready") or prev["started"]

    def _finish_recovery(self, pending: dict) -> None:
        """Where the time from the failure to the first step went, and one line saying so."""
        r, failure = self.record, pending["failure"]
        lost = f"{pending['steps_lost']} step{'s' if pending['steps_lost'] != 1 else ''} lost"
        if failure is None:
            pending["recovery_s"] = None
            print(
                f"elastic: resumed at step {pending['resumed_at']} at world size "
                f"{r['world_size']} (a new launch of this run); {lost}",
                flush=True,
            )
            return
        pending["recovery_s"] = pending["first_step"] - failure
        pending["breakdown"] = {
            "ray_restart_s": r["context"] - failure,  # detection, teardown, placement, new actors
            "process_group_s": r["started"] - r["context"],  # Ray's backend setup: the torch group
            "imports_s": r["imported"] - r["started"],  # torch, the trainer, MLflow
            "build_and_load_s": r["ready"] - r["imported"],  # model, data, checkpoint load
            "first_step_s": pending["first_step"] - r["ready"],
        }
        ray = ray_phases(self.folder.read(CLOCK), r["launch"], failure, r["context"])
        if ray is not None:
            pending["ray_phases"] = ray
        process = r.get("process") or {}
        started = process.get("started")
        pending["spare"] = started is not None and started < failure
        print(
            f"elastic: restart {self.restarts} at world size {r['world_size']}, resumed at step "
            f"{pending['resumed_at']}; {lost}; recovery {pending['recovery_s']:.1f} s "
            f"({_phases(pending['breakdown'])})"
            + (f"; ray restart: {_phases(ray)}" if ray else "")
            + f"; rank 0 {_process_note(pending['spare'], started, failure)}",
            flush=True,
        )


def _process_note(spare: bool, started: Optional[float], failure: float) -> str:
    if not spare:
        return "in a new process"
    return f"in a spare process (started {failure - started:.1f} s before the failure)"


def _phases(seconds: dict[str, float]) -> str:
    return ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in seconds.items())


def startup_line(driver: dict, record: dict, first_step_done: float) -> str:
    """`start-up 21.3 s: config 0.4 s | Ray 3.9 s | ... | first step 1.2 s`: the driver's phases
    (cluster/train.py Startup), then the workers' from the tracker's record: Ray Train's
    controller and the worker actors (from the trainer's start to the worker's context), the
    torch process group, the imports, the model, data and checkpoint load, the first step."""
    r = record
    phases = [(name, seconds) for name, seconds in driver["phases"]] + [
        ("workers up", r["context"] - driver["fit_at"]),
        ("process group", r["started"] - r["context"]),
        ("imports", r["imported"] - r["started"]),
        ("model + data + resume", r["ready"] - r["imported"]),
        ("first step", first_step_done - r["ready"]),
    ]
    parts = " | ".join(f"{name} {max(seconds, 0.0):.1f} s" for name, seconds in phases)
    return f"start-up {first_step_done - driver['began']:.1f} s: {parts}"


def chain(*hooks: Optional[Callable[[int], None]]) -> Callable[[int], None]:
    """One WorkerContext.before_step from several before-step hooks, called in order."""
    active = [h for h in hooks if h is not None]

    def before_step(step: int) -> None:
        for hook in active:
            hook(step)

    return before_step
