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
older than the ttl (the holder is gone: a crashed driver), when the holder is known dead though
its heartbeat is recent (its pid is gone on this very host, or the Ray cluster this launch joined
reports the holder's Ray job finished: a head pod restarted, a RayJob retrying its submitter), or
when the user says so (cluster.takeover=true). A live holder refuses everyone else, or is waited
for (cluster.wait_for_lease_s, for schedulers that retry). Heartbeats compare the writer's clock
with the reader's: hosts are assumed to agree within a fraction of the ttl.
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

from cluster.run.layout import LEASE_DIR
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
    pid_start: Optional[int] = None
    """The holder process's start time (/proc/<pid>/stat, clock ticks since boot): a pid that a
    new process reused is not the holder."""
    ray_job_id: Optional[str] = None
    """The Ray job (hex id) of the holder's driver once it joined Ray: a cluster reports it dead
    when the driver died."""
    ray_cluster: Optional[str] = None
    """`<GCS address>|<session name>` of the Ray that job ran on: job ids count from 1 in every
    cluster, so only the same cluster's job table can speak of it."""

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
        wait_s: float = 0.0,
        log_to=print,
    ) -> "RunLease":
        """Take the run's lease or raise LeaseHeld naming the live holder (after waiting up to
        `wait_s` for it to end). A holder known dead is taken over at once, and `log_to` says
        so."""
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
            pid_start=process_start(os.getpid()),
        )
        gen, current = _wait_for_holder(folder, wait_s, log_to)
        now = time.time()
        if current is not None and not current.released and not current.expired(now):
            if takeover:
                log.warning("run lease: taking over from live %s", current.describe(now))
            elif gone := holder_gone(current):
                log_to(f"run lease: taking over from {current.describe(now)}: {gone}")
            else:
                raise LeaseHeld(_held_message(run_dir, current, now))
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


def _live(h: Optional[Holder], now: float) -> bool:
    return h is not None and not h.released and not h.expired(now) and not holder_gone(h)


def _wait_for_holder(folder: Location, wait_s: float, log_to) -> tuple[int, Optional[Holder]]:
    """The newest generation and its holder, once that holder is no longer live or `wait_s`
    has passed (a file on storage has no event to wait on: polled every few seconds)."""
    gen, current = _newest(folder)
    deadline = time.time() + wait_s
    if wait_s > 0 and _live(current, time.time()):
        log_to(
            f"run lease: held by {current.describe(time.time())}; waiting up to {wait_s:.0f} s "
            "for it to end (cluster.wait_for_lease_s)"
        )
    while wait_s > 0 and _live(current, time.time()) and time.time() < deadline:
        time.sleep(min(2.0, current.ttl_s / 8, max(0.0, deadline - time.time())))
        gen, current = _newest(folder)
    return gen, current


def process_start(pid: int) -> Optional[int]:
    """Start time of process `pid` in clock ticks since boot (/proc/<pid>/stat field 22); None
    where /proc does not say (not Linux, or no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # fields after the command's ")"


def holder_gone(h: Holder) -> Optional[str]:
    """Why a holder whose heartbeat is still recent is known dead, or None when it may live:
    its process is gone on this very host (or its pid now names a younger process), or the Ray
    cluster this process joined reports the holder's driver job finished."""
    if h.host == socket.gethostname() and h.pid > 0 and h.launch_id != UNREADABLE:
        start = process_start(h.pid)
        if not _pid_exists(h.pid):
            return f"its process {h.pid} on this host is gone"
        if h.pid_start is not None and start is not None and start != h.pid_start:
            return f"its process {h.pid} on this host is gone (the pid names another process now)"
    if h.ray_job_id and h.ray_cluster:
        return _ray_job_gone(h.ray_job_id, h.ray_cluster)
    return None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def ray_identity() -> dict:
    """This driver's Ray job and cluster, for its lease (`renew(**ray_identity())`); {} when not
    connected to Ray."""
    import ray  # noqa: PLC0415 -- called once connected: imported already

    if not ray.is_initialized():
        return {}
    cluster = _connected_cluster()
    job = ray.get_runtime_context().get_job_id()
    return {"ray_job_id": job, "ray_cluster": cluster} if cluster else {}


def _connected_cluster() -> Optional[str]:
    """`<GCS address>|<session name>` of the Ray this process is connected to, or None."""
    import ray  # noqa: PLC0415 -- only once connected

    try:
        address = ray.get_runtime_context().gcs_address
        session = ray._private.worker.global_worker.node.session_name  # no public accessor
    except Exception:  # a Ray Client connection: no node of its own
        return None
    return f"{address}|{session}" if address and session else None


def _ray_job_gone(job_id: str, cluster: str) -> Optional[str]:
    """Why the holder's driver job is known gone, from the Ray this process joined: that
    cluster restarted since (same GCS address, another session), or its job table says the job
    is dead. None when this process is not on that cluster, or the table does not say."""
    import ray  # noqa: PLC0415 -- only when a holder recorded a Ray job

    if not ray.is_initialized():
        return None
    here = _connected_cluster()
    if here is None or here.split("|")[0] != cluster.split("|")[0]:
        return None  # another cluster's job ids mean nothing here
    if here != cluster:
        return f"its Ray cluster at {cluster.split('|')[0]} restarted since (its job is gone)"
    try:
        from ray._private.state import state  # noqa: PLC0415 -- the GCS job table (no public API)

        jobs = state.job_table()
    except Exception as e:  # say nothing rather than guess
        log.debug("run lease: cannot read Ray's job table: %s", e)
        return None
    if any(j.get("JobID") == job_id and j.get("IsDead") for j in jobs):
        return f"Ray reports its driver's job {job_id} finished"
    return None


class LeaseGuard:
    """For the workers: None while `launch_id` holds the run's lease, else who took it over. One
    LIST and one small read per call (the loop asks before each save)."""

    def __init__(self, run: Location, launch_id: str):
        """`run`: the run folder (a worker's: cluster/run/layout.py ray_run_folder)."""
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
