"""A launch terminated by SIGTERM (`ray job stop`, Kubernetes) ends its MLflow run KILLED and
releases its run lease, instead of dying with the run RUNNING.

One real `python -m cluster.train` (local Ray): SIGTERM as soon as its MLflow run exists (the
run is created while Ray starts, cluster/train.py TrackingStart), then the run's status.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from contextlib import suppress

from mlflow.tracking import MlflowClient

from tests.cluster.conftest import REPO

RUN_LINE = re.compile(r"^mlflow: run ([0-9a-f]{32}) ")


def test_sigterm_ends_the_launchs_mlflow_run_killed_and_frees_its_lease(launch_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    env.update(PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    args = ["data.max_bytes=200000", "data.seq_len=32", "tracking.experiment=sigterm"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.train", f"hydra.run.dir={launch_dir}/outputs", *args],
        cwd=launch_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines, run_id = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            match = RUN_LINE.match(line)
            if match:
                run_id = match.group(1)
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        proc.wait(timeout=120)
    finally:
        with suppress(ProcessLookupError):  # whatever of its local Ray outlived it
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines)
    assert run_id, output[-4000:]
    assert proc.returncode != 0, output[-4000:]
    client = MlflowClient(f"sqlite:///{launch_dir}/mlflow.db")
    assert client.get_run(run_id).info.status == "KILLED", output[-4000:]
    assert f"mlflow: run {run_id} marked KILLED" in output
    lease = sorted((launch_dir / "runs" / "elastic-fsdp" / "lease").iterdir())[-1].read_text()
    assert '"released": true' in lease, lease
