"""A dead driver's lease on a Ray cluster is taken over at once: the relaunch asks the cluster it
joined whether the holder's Ray job is finished (a RayJob retrying its submitter from another pod:
the pid check cannot tell there, so the lease file says the holder ran on another host).

Against a real Ray head (tests/deploy/local_ray_head.py: its own temp dir, ports and token,
stopped by pid). Both drivers are subprocesses, so this pytest process never joins that Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy"))
from local_ray_head import local_ray_head  # noqa: E402

REPO = Path(__file__).resolve().parents[3]

HOLD = """
import os, signal, sys, ray
from cluster.run.lease import RunLease, ray_identity
ray.init(address=sys.argv[2])
lease = RunLease.acquire(sys.argv[1], launch_id="driver-1")
lease.renew(**ray_identity(), host="submitter-pod-1")
print("held", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the submitter pod dies with its driver
"""

RELAUNCH = """
import sys, ray
from cluster.run.lease import LeaseHeld, RunLease
ray.init(address=sys.argv[2])
try:
    RunLease.acquire(sys.argv[1], launch_id="driver-2", wait_s=30, log_to=print)
    print("acquired", flush=True)
except LeaseHeld as e:
    print("refused:", e, flush=True)
"""


def _driver(script: str, run: str, head, timeout: float = 120) -> str:
    env = {**os.environ, **head.client_env(), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", script, run, head.gcs_address],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def head():
    with local_ray_head(num_cpus=1) as h:
        yield h


def test_a_relaunch_takes_over_at_once_when_ray_reports_the_holders_job_finished(head, tmp_path):
    run = str(tmp_path / "run")
    out = _driver(HOLD, run, head)
    assert "held" in out, out[-3000:]
    (lease,) = (tmp_path / "run" / "lease").iterdir()
    holder = json.loads(lease.read_text())
    assert holder["ray_job_id"] and time.time() - holder["heartbeat_unix"] < 60  # not expired
    assert holder["ray_cluster"].startswith(head.gcs_address + "|")
    out = _driver(RELAUNCH, run, head)
    assert "acquired" in out, out[-3000:]
    assert f"Ray reports its driver's job {holder['ray_job_id']} finished" in out, out[-3000:]


def test_a_job_id_of_another_ray_cluster_says_nothing(head, tmp_path):
    """Job ids count from 1 in every cluster: a holder that ran on another cluster (or this
    one's address with a session it never had) is not judged by this cluster's job table."""
    run = str(tmp_path / "run")
    out = _driver(HOLD, run, head)
    (lease,) = (tmp_path / "run" / "lease").iterdir()
    holder = json.loads(lease.read_text())
    holder["ray_cluster"] = "10.9.9.9:6379|session_other"
    lease.write_text(json.dumps(holder))
    out = _driver(RELAUNCH.replace("wait_s=30", "wait_s=0"), run, head)
    assert "refused:" in out and "held by launch driver-1" in out, out[-3000:]
