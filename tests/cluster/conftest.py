"""Running the real entry point (`python -m cluster.train`) in a subprocess, in a tmp launch dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass
class CliResult:
    returncode: int
    output: str  # stdout and stderr together, in order


def run_cli(
    launch_dir: Path,
    *overrides: str,
    timeout: float = 60.0,
    env: dict | None = None,
    run_dir: bool = True,
) -> CliResult:
    """`python -m cluster.train overrides...` launched from `launch_dir`, outputs under it.

    Runs in its own process group: on a timeout the whole group (a local Ray it started
    included) is killed, so a hung test leaves nothing behind.
    """
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")
    }
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    full_env.update(PYTHONPATH=pythonpath, RAY_USAGE_STATS_ENABLED="0", **(env or {}))
    # hydra.run.dir goes first, where Hydra's parser would not take a later `-m`: multiruns pass
    # run_dir=False (their outputs go to hydra.sweep.dir).
    args = [
        sys.executable,
        "-m",
        "cluster.train",
        *([f"hydra.run.dir={launch_dir}/outputs"] if run_dir else []),
        *overrides,
    ]
    proc = subprocess.Popen(
        args,
        cwd=launch_dir,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"cluster.train did not finish in {timeout}s; output:\n{output[-8000:]}")
    return CliResult(proc.returncode, output)


@pytest.fixture
def launch_dir(tmp_path: Path) -> Path:
    d = tmp_path / "launch"
    d.mkdir()
    return d
