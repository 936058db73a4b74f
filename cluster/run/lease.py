"""A run owns its name: a lease in the run's folder, so two launches never write into each other.

    lease = RunLease.acquire(run_dir, takeover=cfg.cluster.takeover)   # or LeaseHeld
    lease.start_heartbeat()
    ...                                                                 # train
    lease.release()

The lease is a sequence of generation files, <run folder>/lease/gen-000001.json, -000002, ...;
the highest one names the holder: its launch id, host, pid, start, last heartbeat and MLflow run.
Taking the lease is creating the next generation's file exclusively (O_EXCL on local and shared
filesystems, a conditional PUT on S3: trainer.storage.create_exclusive), so of two launches that
start together exactly one creates it and the other is refused, naming the winner. Nothing ever
needs a compare-and-swap: only the holder rewrites its own file (the heartbeat, every ttl / 4),
and a newer generation appearing tells it that it lost the lease.

A launch may take the lease when the holder released it (its run ended), when its heartbeat is
older than the ttl (the holder is gone: a crashed driver), or when the user says so
(cluster.takeover=true). A live holder refuses everyone else. Heartbeats compare the writer's
clock with the reader's: hosts are assumed to agree within a fraction of the ttl.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Optional

from cluster.config import LEASE_DIR
from trainer import storage
from trainer.storage import Location

log = logging.getLogger(__name__)

_GEN = re.compile(r"^gen-(\d{6,})\.json$")


UNREADABLE = "unknown (lease file being written)"


class LeaseHeld(RuntimeError):
    """Another live launch holds the run name; the message names it and the ways forward."""


class LeaseLost(RuntimeError):
    """This launch's lease was taken over by another launch."""


@dataclass
class Holder:
    launch_id: str
    host: str
    pid: int
    started_unix: float
    heartbeat_unix: float
    ttl_s: float
    released: bool = False
    mlflow_run_id: Optional[str] = None
    job_id: Optional[str] = None  # Ray job submission id, when sent with `ray job submit`

    def expired(self, now: float) -> bool:
        return now - self.heartbeat_unix > self.ttl_s

    def describe(self, now: float) -> str:
        job = f", Ray job {self.job_id}" if self.job_id else ""
        mlflow = f", MLflow run {self.mlflow_run_id}" if self.mlflow_run_id else ""
        return (
            f"launch {self.launch_id} (host {self.host}, pid {self.pid}{job}{mlflow}; started "
            f"{_ago(now - self.started_unix)} ago, last heartbeat {_ago(now - self.heartbeat_unix)}"
            f" ago)"
        )


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def new_launch_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


class RunLease:
    def __init__(self, folder: Location, gen: int, holder: Holder, previous: Optional[Holder]):
        self.folder, self.gen, self.holder, self.previous = folder, gen, holder, previous
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost: Optional[str] = None
        """Set (with the new holder) when a heartbeat found the lease taken over."""

    # ---- taking ------------------------------------------------------------------------------
    @classmethod
    def acquire(
        cls,
        run_dir: str,
        *,
        takeover: bool = False,
        ttl_s: float = 120.0,
        launch_id: Optional[str] = None,
    ) -> "RunLease":
        """Take the run's lease or raise LeaseHeld naming the live holder."""
        folder = storage.resolve(run_dir).child(LEASE_DIR)
        if folder.is_local:
            os.makedirs(folder.path, exist_ok=True)
        now = time.time()
        me = Holder(
            launch_id=launch_id or new_launch_id(),
            host=socket.gethostname(),
            pid=os.getpid(),
            started_unix=now,
            heartbeat_unix=now,
            ttl_s=ttl_s,
            job_id=os.environ.get("RAY_JOB_SUBMISSION_ID"),
        )
        gen, current = _newest(folder)
        if current is not None and not current.released and not current.expired(now):
            if not takeover:
                raise LeaseHeld(_held_message(run_dir, current, now))
            log.warning("run lease: taking over from live %s", current.describe(now))
        if not _create(_gen_file(folder, gen + 1), _encode(me)):
            _, winner = _newest(folder)
            who = winner.describe(time.time()) if winner else "another launch"
            raise LeaseHeld(
                f"run folder {run_dir} was claimed at the same moment by {who}; this launch "
                "stops (two launches with one cluster.run_name would write into each other)"
            )
        lease = cls(folder, gen + 1, me, current)
        lease._forget_older()
        return lease

    # ---- holding -----------------------------------------------------------------------------
    def renew(self, **updates) -> None:
        """Rewrite this launch's heartbeat (and any `updates`, e.g. mlflow_run_id). Raises
        LeaseLost if a newer generation exists."""
        gen, newer = _newest(self.folder)
        if gen > self.gen:
            raise LeaseLost(
                f"the run lease under {self.folder} was taken over by "
                f"{newer.describe(time.time()) if newer else 'another launch'}"
            )
        for k, v in updates.items():
            setattr(self.holder, k, v)
        self.holder.heartbeat_unix = time.time()
        storage.write_atomic(_gen_file(self.folder, self.gen), _encode(self.holder))

    def start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(self.holder.ttl_s / 4):
                try:
                    self.renew()
                except LeaseLost as e:
                    self.lost = str(e)
                    log.error("%s: this launch no longer owns its run name", e)
                    return
                except OSError as e:  # a storage hiccup: the next beat retries
                    log.warning("run lease heartbeat failed (retrying): %s", e)

        self._thread = threading.Thread(target=beat, name="run-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """The run ended (well or not): the next launch of this name may take the lease at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.lost:
            return
        try:
            self.renew(released=True)
        except (LeaseLost, OSError) as e:
            log.warning("run lease not released (it expires by itself): %s", e)

    def _forget_older(self) -> None:
        """Older generations are history: best effort, the newest alone decides."""
        for name in storage.list_dir(self.folder):
            m = _GEN.match(name)
            if m and int(m.group(1)) < self.gen:
                try:
                    storage.delete_file(self.folder.child(name))
                except OSError:
                    pass


class LeaseGuard:
    """For the workers: None while `launch_id` holds the run's lease, else who took it over. One
    LIST and one small read per call (the loop asks before each save)."""

    def __init__(self, run: Location, launch_id: str):
        """`run`: the run folder (a worker's: cluster/run/folder.py ray_run_folder)."""
        self.folder, self.launch_id = run.child(LEASE_DIR), launch_id

    def __call__(self) -> Optional[str]:
        _, holder = _newest(self.folder)
        if holder is None or holder.launch_id in (self.launch_id, UNREADABLE):
            return None  # no lease (a run without the driver: tests, tools), or not yet readable
        return f"the run was taken over by {holder.describe(time.time())}"


def _create(loc: Location, data: bytes) -> bool:
    """Exclusive create; where the filesystem has none (gs://, hdfs://), check-then-write and
    read back: it keeps a second launch out unless both start within one round trip."""
    try:
        return storage.create_exclusive(loc, data)
    except storage.StorageError as e:
        log.warning("run lease: %s; falling back to check-then-write (not race-free)", e)
    if storage.exists(loc):
        return False
    storage.write_bytes(loc, data)
    return storage.read_bytes(loc) == data


def _gen_file(folder: Location, gen: int) -> Location:
    return folder.child(f"gen-{gen:06d}.json")


def _encode(h: Holder) -> bytes:
    return json.dumps(asdict(h), indent=1).encode()


def _newest(folder: Location) -> tuple[int, Optional[Holder]]:
    """(highest generation, its holder); a generation file still being written (or torn) reads
    as a live holder that started now, so it is never taken over before its ttl."""
    gens = sorted(
        (int(m.group(1)) for m in (_GEN.match(n) for n in storage.list_dir(folder)) if m),
        reverse=True,
    )
    if not gens:
        return 0, None
    try:
        raw = json.loads(storage.read_bytes(_gen_file(folder, gens[0])))
        return gens[0], Holder(**raw)
    except (ValueError, TypeError, OSError):
        now = time.time()
        return gens[0], Holder(UNREADABLE, "?", 0, now, now, 120.0)


def _held_message(run_dir: str, h: Holder, now: float) -> str:
    left = max(0.0, h.ttl_s - (now - h.heartbeat_unix))
    return (
        f"cluster.run_name is in use: {run_dir} is held by {h.describe(now)}. Two launches "
        f"with one run name would write into each other's checkpoints. Use another "
        f"cluster.run_name; or wait for that launch to end (if it is gone, its lease expires in "
        f"{left:.0f} s and a new launch then resumes the run); or, if you are sure it is gone, "
        f"pass cluster.takeover=true"
    )
