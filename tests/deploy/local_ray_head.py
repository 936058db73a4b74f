"""A throwaway Ray head on loopback for one test: its own temp dir, ports and auth token.

    with local_ray_head(num_cpus=3) as head:
        subprocess.run([RAY, "job", "submit", "--address", head.dashboard_url, ...],
                       env=head.client_env())
    assert head.processes() == []

Why not `ray start --head` + `ray stop`: `ray stop` kills every Ray on the host, including another
test's or the user's. This head runs as `ray start --head --block` in its own session (process
group), every process of it carries RAY_AUTH_TOKEN_PATH=<its temp dir>/auth_token in its
environment or its temp dir on its command line, and stopping it signals exactly those.

Token authentication (Ray 2.60): the head and every client get RAY_AUTH_MODE=token and
RAY_AUTH_TOKEN_PATH pointing at a fresh token inside the head's temp dir, so the user's
~/.ray/auth_token is neither read nor written, and a client without this token is refused.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
# Environment a test must not hand to Ray: another cluster's address or token, a tracking
# server, or a PYTHONPATH that would let a job import the checkout instead of its upload.
SCRUBBED_ENV = (
    "RAY_ADDRESS",
    "RAY_API_SERVER_ADDRESS",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
    "RAY_AUTH_MODE",
    "MLFLOW_TRACKING_URI",
    "PYTHONPATH",
)
# On Linux Ray replaces --node-ip-address 127.0.0.1 by the host's routable address; this switch
# (meant for single-node macOS/Windows) makes every process of the cluster use loopback instead.
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray 2.60's `ray start --block` drains the node for up to 30 s on SIGTERM (for Serve); a test
# head has nothing left to drain once its job is over, so it shuts down at once.
NO_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
READY_LINE = "Ray runtime started"
# Every port `ray start --head` would otherwise take at a fixed default (6379, 8265, 10001,
# 52365) or pick itself: all chosen here, so two heads on one host never meet.
PORT_FLAGS = (
    "port",
    "dashboard-port",
    "ray-client-server-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
    "node-manager-port",
    "object-manager-port",
)
WORKER_PORTS = 200  # job supervisor, driver, Train controller, workers and their restarts


@dataclass
class RayHead:
    """A running head: where to reach it, what a client needs, and what its stop left behind."""

    temp_dir: Path
    token_path: Path
    gcs_address: str
    dashboard_url: str
    process: subprocess.Popen
    output: list[str] = field(default_factory=list)  # `ray start` stdout+stderr, line by line
    killed: list[str] = field(default_factory=list)  # set by stop(): processes that needed SIGKILL

    @property
    def token(self) -> str:
        return self.token_path.read_text()

    def client_env(self) -> dict[str, str]:
        """The environment of a `ray job ...` command aimed at this head (and only this head)."""
        return auth_env(self.token_path)

    def processes(self) -> list[int]:
        """Pids of every process of this head still running (driver and workers included)."""
        return marked_processes(self.token_path, self.temp_dir)

    def session_dir(self) -> Path:
        """<temp_dir>/session_latest, resolved: logs, sockets, unpacked runtime envs."""
        return (self.temp_dir / "session_latest").resolve()


def auth_env(token_path: Path) -> dict[str, str]:
    """os.environ without other clusters' settings, with token auth on and this head's token."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_path),
        RAY_USAGE_STATS_ENABLED="0",
        **LOOPBACK_ONLY,
        **NO_DRAIN,
        PATH=os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")]),
    )
    return env


def write_token(directory: Path) -> Path:
    """A fresh 256-bit token (Ray's own format: 64 hex digits), readable by the owner only."""
    path = directory / "auth_token"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


def free_ports(n: int) -> list[int]:
    """n distinct ports the kernel says are free now (all bound at once, so no repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def free_port_range(size: int) -> tuple[int, int]:
    """`size` consecutive free ports below the kernel's ephemeral range (so the OS does not hand
    them out meanwhile) and above Ray's default worker range 10002-19999 (another Ray's)."""
    rng = secrets.SystemRandom()
    for _ in range(50):
        lo = rng.randrange(20000, 32000 - size)
        if all(_is_free(p) for p in range(lo, lo + size)):
            return lo, lo + size - 1
    raise RuntimeError(f"no {size} consecutive free ports found in 20000-32000")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def head_command(temp_dir: Path, num_cpus: int, ports: dict[str, int]) -> list[str]:
    lo, hi = free_port_range(WORKER_PORTS)
    return [
        RAY,
        "start",
        "--head",
        "--block",
        "--temp-dir",
        str(temp_dir),
        "--node-ip-address",
        "127.0.0.1",
        "--num-cpus",
        str(num_cpus),
        "--num-gpus",
        "0",
        "--object-store-memory",
        str(200 * 2**20),
        "--include-dashboard",
        "true",
        "--dashboard-host",
        "127.0.0.1",
        "--disable-usage-stats",
        *[a for flag, port in ports.items() for a in (f"--{flag}", str(port))],
        "--min-worker-port",
        str(lo),
        "--max-worker-port",
        str(hi),
    ]


def _read_until_ready(proc: subprocess.Popen, output: list[str], ready: threading.Event) -> None:
    """Collect `ray start` output; set `ready` at its start-up line or when it exits."""
    for line in proc.stdout:
        output.append(line.rstrip("\n"))
        if READY_LINE in line:
            ready.set()
    ready.set()


def marked_processes(token_path: Path, temp_dir: Path) -> list[int]:
    """This head's pids: those that inherited RAY_AUTH_TOKEN_PATH=<its token> from the head, or
    name its temp dir on their command line (Ray's own processes all do)."""
    marker = f"RAY_AUTH_TOKEN_PATH={token_path}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:  # gone meanwhile, or another user's
            continue
        if marker in environ or str(temp_dir) in cmdline:
            found.append(int(entry))
    return found


def describe(pid: int) -> str:
    """'pid command line' (cut short), for messages about processes that would not go."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid} " + f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return f"{pid} (exited)"


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Block until these processes exit (pidfd readiness, no sleeping); the pids still alive."""
    fds = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds[os.pidfd_open(pid)] = pid
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        pending, deadline = set(fds), time.monotonic() + timeout
        while pending and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                pending.discard(fd)
                poller.unregister(fd)
        return sorted(fds[fd] for fd in pending)
    finally:
        for fd in fds:
            os.close(fd)


def start(temp_dir: Path, num_cpus: int, timeout: float) -> RayHead:
    token_path = write_token(temp_dir)
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
    proc = subprocess.Popen(
        head_command(temp_dir, num_cpus, ports),
        env=auth_env(token_path),
        cwd=temp_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    head = RayHead(
        temp_dir,
        token_path,
        f"127.0.0.1:{ports['port']}",
        f"http://127.0.0.1:{ports['dashboard-port']}",
        proc,
    )
    ready = threading.Event()
    threading.Thread(target=_read_until_ready, args=(proc, head.output, ready), daemon=True).start()
    if not ready.wait(timeout) or proc.poll() is not None:
        stop(head)
        raise RuntimeError(
            f"`ray start --head` was not up within {timeout}s (exit code "
            f"{proc.returncode}):\n" + "\n".join(head.output[-60:])
        )
    return head


def stop(head: RayHead, grace: float = 30.0) -> None:
    """Stop this head and nothing else; afterwards none of its processes runs.

    SIGTERM goes to `ray start --block` alone: it stops its processes itself, raylet first (a
    SIGTERM to all of them at once leaves the GCS lingering for ~30 s). Whatever of this head is
    still there after `grace` seconds, or was orphaned by a crashed `ray start`, gets SIGKILL and
    is named in head.killed.
    """
    if head.process.poll() is None:
        head.process.terminate()
    else:
        signal_all(head.processes(), signal.SIGTERM)
    wait_gone(head.processes(), grace)
    stragglers = head.processes()
    head.killed = [describe(pid) for pid in stragglers]
    signal_all(stragglers, signal.SIGKILL)
    wait_gone(stragglers, grace)
    if head.process.returncode is None:  # not reaped yet, so its group id is still its own
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.process.pid, signal.SIGKILL)  # anything that lost both markers
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.process.wait(timeout=grace)


@contextlib.contextmanager
def local_ray_head(num_cpus: int = 3, timeout: float = 180.0) -> Iterator[RayHead]:
    """Start a head, yield it, and always stop it and remove its temp dir, even on failure.

    The temp dir is short and under /tmp: Ray puts Unix sockets in it (108-byte path limit).
    """
    temp_dir = Path(tempfile.mkdtemp(prefix="rjs-", dir="/tmp"))
    head = None
    try:
        head = start(temp_dir, num_cpus, timeout)
        yield head
    finally:
        if head is not None:
            stop(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
