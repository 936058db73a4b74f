"""A doc's sandbox: the directory its commands run in (one per doc, so a doc's blocks build on
each other as a reader's commands do), the environment they get, and the processes they run.

Training commands join one Ray head started for the docs test (RAY_ADDRESS: cluster=local joins
it instead of starting and stopping a Ray of its own: a smoke-sized run took 16 s instead of 33 s
here); the rest run without it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tests.deploy.local_ray_head import SCRUBBED_ENV
from tests.docs import rewrite, standins
from tests.docs.blocks import REPO

COMMAND_TIMEOUT_S = 300.0
SERVER_TIMEOUT_S = 90.0
# Ray Train's poll, shortened as the other CLI tests do: a run's end is seen within 0.2 s.
FAST_RAY_TRAIN = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}


@dataclass
class Ran:
    command: list[str]
    returncode: int
    output: str
    seconds: float

    def report(self) -> str:
        return f"`{shlex.join(self.command)}` exited {self.returncode}:\n{self.output[-6000:]}"


@dataclass
class Sandbox:
    root: Path
    ray_env: Callable[[], dict[str, str]]  # the shared head's client environment, started once
    ran: list[Ran] = field(default_factory=list)
    done: set[str] = field(default_factory=set)  # ids of the blocks run here

    def env(self, ray: bool) -> dict[str, str]:
        """No other cluster's address, token or tracking server; the checkout importable as
        from the repository root (`python -m` puts the cwd first: benchmarks/ is not installed)."""
        if ray:
            env = {**self.ray_env(), **FAST_RAY_TRAIN}
        else:
            env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
        return {**env, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO)}

    def prepared(self, argv: list[str], run_name: str) -> list[str]:
        """The command as run here (rewrite.py's table), its stand-ins built."""
        if argv[0] == "make":
            argv = rewrite.make_to_python(argv) or argv
        argv = rewrite.in_sandbox(argv, self.root)
        standins.provide(argv, self.root, self.python)
        argv = rewrite.newest_steps(argv, self.root)
        return rewrite.smoke_sized(rewrite.with_tool(argv), run_name)

    def composable(self, argv: list[str]) -> list[str]:
        """A command not run here, as its `--cfg job` check runs it: paths as prepared() makes
        them, no smoke sizes (nothing trains)."""
        argv = rewrite.in_sandbox(argv, self.root)
        standins.provide(argv, self.root, self.python)
        return rewrite.with_tool(rewrite.newest_steps(argv, self.root))

    def run(self, argv: list[str], timeout: float = COMMAND_TIMEOUT_S) -> Ran:
        """Run `argv` here in its own process group (on a timeout the whole group goes)."""
        start = time.monotonic()
        proc = self._start(argv, rewrite.is_training(argv), subprocess.PIPE)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate()[0] + f"\n(killed after {timeout:.0f} s)"
        return self._ran(Ran(argv, proc.returncode, output, time.monotonic() - start))

    def _start(self, argv: list[str], ray: bool, out) -> subprocess.Popen:
        return subprocess.Popen(
            argv,
            cwd=self.root,
            env=self.env(ray),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )

    def _ran(self, ran: Ran) -> Ran:
        self.ran.append(ran)
        return ran

    def python(self, args: list[str]) -> None:
        """The venv's python with `args`, here, exiting 0 (how a stand-in is made)."""
        ran = self.run([str(rewrite.VENV_BIN / "python"), *args])
        assert ran.returncode == 0, ran.report()

    def serve(self, argv: list[str]) -> Ran:
        """Start a server command on a free port, wait until it answers HTTP, stop it (its
        output goes to a file: a pipe nobody reads would stall it)."""
        argv = [*argv, *rewrite.SERVER_ARGS, str(free_port())]
        log = self.root / f"server-{len(self.ran)}.log"
        start = time.monotonic()
        with open(log, "w") as out:
            proc = self._start(argv, False, out)
            try:
                answered = wait_for_http(f"http://127.0.0.1:{argv[-1]}/", proc, SERVER_TIMEOUT_S)
            finally:
                stop_group(proc)
        seconds = time.monotonic() - start
        return self._ran(Ran(argv, 0 if answered else 1, log.read_text(), seconds))


def stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the process group `proc` leads, SIGKILL to what is left of it after `grace`
    seconds (or once the leader is gone: a server's workers are in its group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """True once `url` answers 200; False when the server exits first or the time is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.5)
    return False
